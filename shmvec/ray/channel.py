"""The direct channel between a ClusterVectorEnv's driver and one node agent: a TCP
connection that the agent listens for and whose address it returns through Ray,
authenticated at connect by ``multiprocessing.connection``'s HMAC handshake (a key the
driver makes), then used as a plain socket of framed messages (``Channel``). Commands go
one way, rows the other, each one of the message types below; Ray stays for placement,
lifetime and calls that are not on the hot path.

Why not Ray calls: on one simulated node a Ray actor call costs the driver ~770 us of CPU
a message and a streaming generator ~400 us, a ``multiprocessing.connection`` ~37 us
(``dev/ray_channels.py``, docs/benchmarks/data/2026-12-02-2vcpu-ray-channels.txt).
Why frames of its own: a reader takes every message that is in with one ``recv`` (no poll
per message); the driver reads all its channels in one native thread (``_core.FrameReader``,
csrc/frame_reader.h) that wakes it once the rows its ``recv`` waits for are in, not once
per message (each message carries a row or two); and a step's rows and actions travel as
one packed buffer of columns beside their observations, not as a pickle of five arrays.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import struct
import threading
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, Listener
from typing import Any

import numpy as np

__all__ = ["AgentFailure", "Channel", "Reset", "Rows", "Step", "accept"]

#: A frame's header: the payload's length, its kind (below) and the rows it carries (a
#: ``Rows``' or ``Step``'s; 0 for the rest), as the driver's ``FrameReader`` reads it.
HEADER = struct.Struct("<QBI")
PICKLED, ROWS, STEP = 0, 1, 2
#: The most one ``recv`` reads.
RECV_BYTES = 1 << 20


@dataclass
class Reset:
    """Driver to agent: reset envs ``env_ids`` (the agent's own), ``seeds[i]`` and
    ``options[i]`` (or ``options`` for all) for env ``env_ids[i]``."""

    seeds: list
    options: Any
    env_ids: np.ndarray


@dataclass
class Step:
    """Driver to agent: ``actions[i]`` for env ``env_ids[i]``."""

    actions: Any
    env_ids: np.ndarray


@dataclass
class Rows:
    """Agent to driver: ``(obs, rewards, terminations, truncations, infos)`` with
    ``infos["env_id"]`` the agent's own ids, and each row's info as its env returned it
    (None when no row has one)."""

    batch: tuple
    row_infos: list[dict] | None


@dataclass
class AgentFailure:
    """Agent to driver: a command failed in the agent (the driver raises ``error``)."""

    error: BaseException


def encode(message: Any) -> bytes:
    """``message`` as one frame: ``Rows`` and ``Step`` with their ids, rewards and flags
    packed as columns (int64 ids, float64 rewards, bool flags), the rest pickled."""
    body: Any
    if isinstance(message, Rows):
        obs, rewards, terminations, truncations, infos = message.batch
        ids = infos["env_id"]
        columns = b"".join(
            np.ascontiguousarray(column, dtype).tobytes()
            for column, dtype in ((ids, np.int64), (rewards, np.float64),
                                  (terminations, np.bool_), (truncations, np.bool_))
        )  # fmt: skip
        kind, rows, body = ROWS, len(ids), (obs, len(ids), columns, message.row_infos)
    elif isinstance(message, Step):
        ids = np.asarray(message.env_ids, np.int64)
        kind, rows, body = STEP, len(ids), (message.actions, ids.tobytes())
    else:
        kind, rows, body = PICKLED, 0, message
    payload = pickle.dumps(body, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(payload), kind, rows) + payload


def decode(kind: int, payload: bytes | bytearray) -> Any:
    """The message of one frame (``encode``'s inverse; every array writable)."""
    body = pickle.loads(payload)
    if kind == ROWS:
        obs, n, columns, row_infos = body
        buffer = bytearray(columns)
        ids = np.frombuffer(buffer, np.int64, n, 0)
        rewards = np.frombuffer(buffer, np.float64, n, 8 * n)
        terminations = np.frombuffer(buffer, np.bool_, n, 16 * n)
        truncations = np.frombuffer(buffer, np.bool_, n, 17 * n)
        return Rows((obs, rewards, terminations, truncations, {"env_id": ids}), row_infos)
    if kind == STEP:
        actions, ids = body
        return Step(actions, np.frombuffer(bytearray(ids), np.int64))
    return body


class Channel:
    """One end of a channel over ``conn``'s socket (an authenticated
    ``multiprocessing.connection`` connection, which it takes over), ``TCP_NODELAY`` set:
    each message leaves at once. (With Nagle's algorithm a small message waits for the
    peer's delayed ACK, ~40 ms: a 5 ms step's latency rose from 18 to 43 ms p50.)

    One thread may send while another receives."""

    def __init__(self, conn: Connection) -> None:
        self.sock = socket.socket(fileno=os.dup(conn.fileno()))
        conn.close()
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buffer = bytearray()

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, message: Any) -> None:
        """Sends ``message``; OSError if the peer is gone."""
        self.sock.sendall(encode(message))

    def receive(self) -> list[Any]:
        """The messages that are in, in order, once one is whole (the agent's reader;
        the driver reads its channels with a ``FrameReader``). EOFError once the peer
        closed its end."""
        while True:
            chunk = self.sock.recv(RECV_BYTES)
            if not chunk:
                raise EOFError("the channel's peer closed it")
            self._buffer += chunk
            messages = self._frames()
            if messages:
                return messages

    def _frames(self) -> list[Any]:
        """Takes the whole frames off the front of the buffer."""
        buffer, start, messages = self._buffer, 0, []
        while len(buffer) - start >= HEADER.size:
            size, kind, _ = HEADER.unpack_from(buffer, start)
            end = start + HEADER.size + size
            if len(buffer) < end:
                break
            messages.append(decode(kind, buffer[start + HEADER.size : end]))  # one copy
            start = end
        del buffer[:start]
        return messages

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def accept(listener: Listener, closed: threading.Event) -> Channel | None:
    """The first connection to ``listener`` that passes its HMAC handshake, as a
    ``Channel``: a stranger (a wrong key, a connection dropped mid-handshake) is turned
    away and the next connection awaited. None if ``listener`` is closed (closing it does
    not wake an ``accept`` that waits: call this in a daemon thread)."""
    while True:
        try:
            return Channel(listener.accept())
        except (AuthenticationError, EOFError, ConnectionError):
            if closed.is_set():
                return None
        except OSError:
            return None  # the listener was closed
