"""WorkerPool: the segment, the worker processes, their pipes and their liveness.

Data flow: ``open()`` creates the segment and its views (barrier, action slab,
ring slots, per-worker lines); ``spawn()`` starts one worker per env block
(worker 0 in this process with ``step_in_main``) and waits until each says it
is ready. Afterwards ``send``/``recv`` carry the pipe half of the protocol
(shmvec/protocol.py), noticing a dead peer within ``LIVENESS_CHECK_S``.

Who may call what: everything from the main process's one thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import os
import pickle
import select
import time
from collections import deque
from typing import Any

import cloudpickle

from shmvec import _core
from shmvec.engine.options import EngineOptions
from shmvec.engine.wire import Row
from shmvec.errors import WorkerDiedError, add_note
from shmvec.in_process import InProcessWorker, LoopbackPipe
from shmvec.layout import make_layout
from shmvec.outbox import Outbox
from shmvec.protocol import LIVENESS_CHECK_S
from shmvec.start_method import worker_context
from shmvec.worker import SegmentFd, WorkerSpec, worker_main

logger = logging.getLogger("shmvec")

#: How long ``check_alive`` waits for the exit status of a worker that another
#: waiter reaped (another thread's ``Process.join`` records it a moment later).
REAPED_ELSEWHERE_S = 1.0


class SetupError(Exception):
    """The kernel refused what the workers need; ``fallback="serial"`` does without."""


class WorkerPool:
    """The workers of one vector env and the segment they share.

    Args:
        spec: the workers' common spec (``index``, ``first_env`` and ``env_fns``
            are filled in per worker).
        env_fns: every env's callable.
        blocks: the env ids of each worker.
        options: how the workers start (``EngineOptions``); with
            ``restart_on_death`` a send to a dead worker is left to the wait
            that restarts it.
    """

    def __init__(
        self, spec: WorkerSpec, env_fns: list, blocks: list[range], options: EngineOptions
    ) -> None:
        self.spec = spec
        self.env_fns = env_fns
        self.blocks = blocks
        self.num_workers = len(blocks)
        self.context = options.context
        self.daemon = options.daemon
        self.step_in_main = options.step_in_main
        self.private = options.in_process
        self.restart_on_death = options.restart_on_death
        self.layout = make_layout(spec)
        self.segment: Any = None  # the mapped _core.Segment, once open
        self.workers: list = []
        self.pipes: list = []
        # By worker, over its current pipe: sends that never block main (shmvec/outbox.py).
        self.outboxes: dict[int, Outbox] = {}
        # Per worker, read but not yet asked for: replies to rounds, in order,
        # and row messages by their ring row (one message a row).
        self.replies: list[deque] = [deque() for _ in blocks]
        self.row_messages: list[dict[Row, dict]] = [{} for _ in blocks]
        self.main_worker: InProcessWorker | None = None
        self.killed_stuck: dict[int, str] = {}  # worker -> why shmvec killed it

    # ------------------------------------------------------------- start-up

    def open(self) -> None:
        """Creates the segment and the main process's views of it."""
        layout = self.layout
        try:
            create = _core.Segment.create_private if self.private else _core.Segment.create
            self.segment = create(layout.total_bytes)
        except OSError as exc:  # no memfd (old kernel, seccomp), no memory
            raise SetupError(f"shmvec cannot create its shared-memory segment: {exc}") from exc
        buffer = memoryview(self.segment)
        self.barrier = _core.StepBarrier(self.segment, layout.barrier_offset, self.num_workers)
        if not self.private:
            try:  # one futex wake on a segment word: a sandbox may forbid futexes
                _core.futex_wake(self.segment, layout.barrier_offset, 1)
            except OSError as exc:
                raise SetupError(f"shmvec cannot use futexes here: {exc}") from exc
        self.message_flags = layout.worker_words(buffer)
        self.current_env = layout.worker_current_env(buffer)
        self.finished = layout.worker_finished_generation(buffer)
        self.busy_ns = layout.worker_busy_ns(buffer)
        self.env_threads = layout.worker_env_threads(buffer)
        self.env_started_ns = layout.worker_env_started_ns(buffer)
        self.action_views = layout.action_views(buffer)
        self.slots = [layout.slot_views(buffer, k) for k in range(layout.num_slots)]

    def spawn(self) -> None:
        """Starts every worker and waits until each is ready."""
        for index, rows in enumerate(self.blocks):
            if index == 0 and self.step_in_main:
                main_end, worker_end = LoopbackPipe.pair()
                # The main process's own block is stepped serially: its threads
                # would compete with the user's.
                spec = self._spec(0, self.env_fns[rows.start : rows.stop], env_concurrency=1)
                self.main_worker = InProcessWorker(spec, self.segment, worker_end)
                self.workers.append(self.main_worker)
                self.pipes.append(main_end)
                logger.info("running envs %d..%d in the main process", rows.start, rows.stop - 1)
            else:
                process, pipe = self.start_worker(index)
                self.workers.append(process)
                self.pipes.append(pipe)
        for index in range(self.num_workers):
            self.expect_ready(index, f"shmvec worker {index}")

    def _spec(self, index: int, env_fns: Any, **changes: Any) -> WorkerSpec:
        first_env = self.blocks[index].start
        return dataclasses.replace(
            self.spec, index=index, first_env=first_env, env_fns=env_fns, **changes
        )

    def start_worker(self, index: int, **spec_changes: Any) -> tuple:
        """Starts the process of worker ``index`` (again, after a death); returns it
        and the main's end of its pipe."""
        # typeshed's BaseContext has no Process; every concrete context has one.
        ctx: Any = worker_context(self.context)
        rows = self.blocks[index]
        block = self.env_fns[rows.start : rows.stop]
        payload = block if ctx.get_start_method() == "fork" else _pickle_env_fns(block, rows)
        spec = self._spec(index, payload, **spec_changes)
        parent_end, child_end = ctx.Pipe(duplex=True)
        process = ctx.Process(
            target=worker_main,
            args=(spec, SegmentFd(self.segment.fd), child_end),
            name=f"shmvec-worker-{index}",
            daemon=self.daemon,
        )
        try:
            process.start()
        except OSError as exc:  # no fork/exec in this sandbox, too many processes...
            raise SetupError(f"shmvec cannot start worker processes: {exc}") from exc
        logger.info(
            "started worker %d (pid %d, %s) for envs %d..%d",
            index, process.pid, ctx.get_start_method(), rows.start, rows.stop - 1,
        )  # fmt: skip
        child_end.close()
        return process, parent_end

    def expect_ready(self, index: int, who: str) -> dict:
        """Worker ``index``'s start-up message; its start-up error is raised here,
        with ``who`` and the remote traceback in a note."""
        message = self.recv(index, timeout=None)
        if "startup_error" in message:
            exc, tb = message["startup_error"]
            add_note(exc, f"{who} traceback:\n{tb}")
            raise exc
        return message

    def replace(self, index: int, **spec_changes: Any) -> None:
        """Retires dead worker ``index`` (or a replacement that died before it was
        ready) and starts its replacement. Messages the dead one sent stay
        readable (row messages are kept, replies dropped)."""
        self.workers[index].join(1.0)
        self.drain(index)
        outbox = self.outboxes.pop(index, None)
        if outbox is not None:
            outbox.close(flush_s=0.0)
        self.pipes[index].close()
        self.replies[index].clear()  # replies to rounds it will never finish
        self.message_flags[index] = 0  # a round's message it flagged died with it
        # It died in an env: its replacement starts in none (env_timeout reads this).
        self.current_env[index] = 0
        self.workers[index], self.pipes[index] = self.start_worker(index, **spec_changes)

    # ----------------------------------------------------------------- pipes

    def send(self, index: int, tag: str, payload: Any) -> None:
        """Sends worker ``index`` a payload it reads with ``Worker._recv(tag)``."""
        message = pickle.dumps((tag, payload), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self._outbox(index).send_bytes(message)
        except (BrokenPipeError, ConnectionResetError):
            self.workers[index].join(1.0)
            if self.restart_on_death and self.exited(index):
                return  # the round's wait restarts it (and resends a reset)
            self.check_alive(index)  # raises WorkerDiedError
            raise

    def send_spills(self, spills: dict[int, dict]) -> None:
        """Sends each worker the spilled text of its envs' actions, by env."""
        for index, rows in enumerate(self.blocks):
            mine = {env: spill for env, spill in spills.items() if env in rows}
            if mine:
                self.send(index, "spills", mine)

    def _outbox(self, index: int) -> Outbox:
        """The outbox over worker ``index``'s current pipe."""
        pipe, outbox = self.pipes[index], self.outboxes.get(index)
        if outbox is None or outbox.conn is not pipe:
            if outbox is not None:
                outbox.close(flush_s=0.0)
            outbox = self.outboxes[index] = Outbox(pipe)
        return outbox

    def recv(self, index: int, timeout: float | None) -> dict:
        """The next reply of worker ``index`` (to a barrier command, or its
        start-up message), noticing its death. Row messages read meanwhile are
        kept for ``recv_row``."""
        replies = self.replies[index]
        while not replies:
            self._keep(index, self._recv_any(index, timeout))
        return replies.popleft()

    def recv_row(self, index: int, row: Row) -> dict:
        """Worker ``index``'s message of ring row ``row`` (async mode), noticing
        its death. Workers send them in the order they publish rows, and a
        replacement's may come before its predecessor's: each is kept by row."""
        messages = self.row_messages[index]
        while row not in messages:
            self._keep(index, self._recv_any(index, None))
        return messages.pop(row)

    def _keep(self, index: int, message: dict) -> None:
        if "row" in message:
            self.row_messages[index][message["row"]] = message
        else:
            self.replies[index].append(message)

    def _recv_any(self, index: int, timeout: float | None) -> dict:
        pipe = self.pipes[index]
        deadline = None if timeout is None else time.monotonic() + timeout
        while not pipe.poll(LIVENESS_CHECK_S):
            self.check_alive(index)
            if deadline is not None and time.monotonic() > deadline:
                raise multiprocessing.TimeoutError(f"no message from shmvec worker {index}")
        try:
            return pickle.loads(pipe.recv_bytes())
        except (EOFError, OSError):  # OSError: it died with a message of main's unread
            self.workers[index].join(1.0)
            self.check_alive(index)
            raise

    def drain(self, index: int) -> None:
        """Reads what worker ``index`` has sent, without waiting, into its stashes."""
        pipe = self.pipes[index]
        with contextlib.suppress(EOFError, OSError):
            while pipe.poll(0):
                self._keep(index, pickle.loads(pipe.recv_bytes()))

    # -------------------------------------------------------------- liveness

    def exited(self, index: int) -> bool:
        """Whether worker ``index``'s process has exited: its exit status is
        known, or it is gone but another waiter reaped it (a ``join`` in
        another thread of the user's, ``os.waitpid``), so that the status reads
        None here for a while or for good."""
        process = self.workers[index]
        if process.exitcode is not None:
            return True
        if process is self.main_worker:
            return False
        poller = select.poll()  # not select.select: the sentinel's fd may pass 1023
        poller.register(process.sentinel, select.POLLIN)
        return bool(poller.poll(0))

    def check_alive(self, index: int) -> None:
        """WorkerDiedError if worker ``index`` has exited."""
        if not self.exited(index):
            return
        process = self.workers[index]
        # Reaped by another thread's join: it records the status a moment later.
        deadline = time.monotonic() + REAPED_ELSEWHERE_S
        while process.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.001)
        error = WorkerDiedError(index, self.blocks[index], process.exitcode, process.pid)
        why = self.killed_stuck.pop(index, None)
        if why is not None:
            add_note(error, why)
        logger.error("%s", error)
        raise error

    def check_all_alive(self) -> None:
        for index in range(self.num_workers):
            self.check_alive(index)

    def dead_workers(self) -> set[int]:
        """The workers whose process has exited."""
        return {index for index in range(self.num_workers) if self.exited(index)}

    def kill(self, index: int, why: str) -> None:
        """Kills worker ``index`` (a timeout); its death is then reported with ``why``."""
        process = self.workers[index]
        logger.error("worker %d (pid %d) %s", index, process.pid, why)
        self.killed_stuck[index] = why
        process.kill()
        process.join(1.0)

    def cpu_seconds(self) -> list[float]:
        """CPU time (user + system, all threads) of each worker's process so far."""
        return [_cpu_seconds(process.pid) for process in self.workers]

    def run_main_worker(self) -> None:
        """With ``step_in_main``: does worker 0's share of what was just asked."""
        if self.main_worker is not None:
            self.main_worker.poll()

    # -------------------------------------------------------------- shutdown

    def terminate(self, grace_s: float = 0.0) -> None:
        """Joins the workers for ``grace_s``, then SIGTERM, then SIGKILL."""
        for stop in (None, "terminate", "kill"):
            deadline = time.monotonic() + (grace_s if stop is None else 1.0)
            for index, process in enumerate(self.workers):
                if stop is not None and not self.exited(index):
                    # SIGKILL last: a worker whose env initialised SDL ignores SIGTERM.
                    getattr(process, stop)()
            for process in self.workers:
                process.join(max(deadline - time.monotonic(), 0.0))
            if all(self.exited(index) for index in range(len(self.workers))):
                return

    def release(self) -> None:
        """Closes the pipes and the segment's fd (the mapping lives while views do)."""
        for outbox in self.outboxes.values():
            outbox.close(flush_s=0.0)
        for pipe in self.pipes:
            pipe.close()
        self.pipes = []
        self.outboxes = {}
        self.workers = []
        if self.segment is not None:
            self.segment.close_fd()


def _pickle_env_fns(block: list, rows: range) -> bytes:
    try:
        return cloudpickle.dumps(block)
    except Exception as exc:
        for offset, fn in enumerate(block):
            try:
                cloudpickle.dumps(fn)
            except Exception:  # noqa: BLE001
                raise TypeError(
                    f"env_fns[{rows.start + offset}] cannot be pickled for a worker started "
                    f"with spawn/forkserver: {exc!r}. Use context='fork' or a picklable callable."
                ) from exc
        raise


def _cpu_seconds(pid: int) -> float:
    """CPU time of process ``pid``; 0.0 if it cannot be read (gone, or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except OSError:
        return 0.0
    # fields[11], fields[12]: utime, stime (fields 14, 15 of proc(5), in clock ticks)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
