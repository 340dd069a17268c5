"""Outbox: sends messages on a pipe without ever blocking the sender.

A message larger than what the kernel buffers for a pipe (a few hundred KB)
blocks its sender until the peer reads it. Both ends of a worker's pipe read
only at set points (main reads an async batch's messages once the batch is
full; a worker reads a spilled action when it steps that env), so two large
messages crossing, or one sent before the command that makes the peer read
it, would wait on each other for ever. An ``Outbox`` writes what the socket
takes at once and hands the rest, in order, to a thread of its own that
finishes the write while its owner goes on.

The frames are ``multiprocessing.connection.Connection``'s, so the peer reads
them with ``recv_bytes``. Which thread may call: ``send`` and ``close`` from
one thread at a time (the worker's main thread, or main's).
"""

from __future__ import annotations

import os
import socket
import struct
import threading
from collections import deque
from typing import Any

__all__ = ["Outbox"]

#: How long ``close`` lets queued messages drain before it drops them (a peer
#: that stopped reading: the process is going away).
CLOSE_FLUSH_S = 1.0


def frame(data: bytes) -> bytes:
    """``data`` with ``Connection.send_bytes``'s length header."""
    n = len(data)
    header = struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!iQ", -1, n)
    return header + data


class Outbox:
    """Ordered, non-blocking sends on ``conn`` (a socket-backed ``Connection``;
    anything else, such as an in-process loopback pipe, is sent to directly)."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.sock: socket.socket | None = None
        self.queue: deque[memoryview] = deque()
        self.lock = threading.Condition()
        self.thread: threading.Thread | None = None
        self.failed: BaseException | None = None
        try:  # a socket of its own over the same connection: closing it leaves conn's fd
            fd = os.dup(conn.fileno())
        except (AttributeError, OSError, ValueError):
            return  # an in-process pipe: its sends never block
        try:
            self.sock = socket.socket(fileno=fd)
        except OSError:
            os.close(fd)  # not a socket (an os.pipe): sent to directly

    def send_bytes(self, data: bytes) -> None:
        """Sends ``data`` (one message), after every message sent before it."""
        if self.sock is None:
            self.conn.send_bytes(data)
            return
        view = memoryview(frame(data))
        with self.lock:
            if self.failed is not None:
                raise BrokenPipeError(f"the pipe's peer is gone: {self.failed!r}")
            if not self.queue:
                try:
                    view = view[self.sock.send(view, socket.MSG_DONTWAIT) :]
                except BlockingIOError:
                    pass
                if not view:
                    return
            self.queue.append(view)
            if self.thread is None:
                self.thread = threading.Thread(
                    target=self._drain, name="shmvec-outbox", daemon=True
                )
                self.thread.start()
            self.lock.notify()

    def _drain(self) -> None:
        """The outbox thread: writes queued messages, blocking as the peer reads."""
        sock = self.sock
        assert sock is not None
        while True:
            with self.lock:
                while not self.queue:
                    self.lock.wait()
                view = self.queue[0]
            try:
                sock.sendall(view)
            except OSError as exc:  # the peer died: its death is noticed elsewhere
                with self.lock:
                    self.failed = exc
                    self.queue.clear()
                    self.lock.notify_all()
                return
            with self.lock:
                self.queue.popleft()
                self.lock.notify_all()

    def close(self, flush_s: float = CLOSE_FLUSH_S) -> None:
        """Waits up to ``flush_s`` for queued messages to go, then closes its
        socket (the ``Connection`` keeps its own fd)."""
        with self.lock:
            self.lock.wait_for(lambda: not self.queue, timeout=flush_s)
        if self.sock is not None:
            self.sock.close()  # the thread, if any, is blocked on a peer that is gone
            self.sock = None
