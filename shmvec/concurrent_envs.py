"""Envs that wait: a worker steps several of its envs at once, in threads.

Envs of agent training (tool calls, sandboxes, remote simulators) spend most
of a step blocked in a call that releases the GIL (a socket, a subprocess, a
sleep). A worker that steps its block one env after the other then waits for
each in turn. With ``env_concurrency=k`` a worker steps up to ``k`` envs of
its block at once, with a pool of threads, one per env; without it, the
single-threaded Cython loop steps them one after another. shmvec does not guess
which envs wait: a guess from timing a few steps misjudged CPU-bound envs on a
busy machine (docs/design/heuristics.md).

Threads, not processes: a waiting env needs somewhere to wait, not a core. A
worker's env threads share one GIL; while other processes leave the worker's
CPU (worker ``k``: the ``k``-th CPU it may use) quiet, they run on it alone, so
each GIL hand-off is a switch on that CPU, and while others keep it busy they
run on every CPU (``CpuNeighbours``, checked every ``CHILD_CHECK_S``: an
inference server's threads bound to that CPU held placed threads off it for
seconds). Once the worker has child processes (checked as often; a pinned
worker also every ``CHILD_CHECK_ROUNDS`` rounds) they and the threads go back
to every CPU for good. Measurements: docs/design/heuristics.md.

Each env is stepped by one thread at a time and writes its results at its
own row (sync mode) or a row it claims (async mode), so results never depend
on timing; infos and errors are gathered per env and returned in row order.

This module is the mechanism; the worker hooks it in where it steps its envs
(``ConcurrentEnvs.step``, ``.map_envs``; ``.run_pending`` and ``.drain`` in
``shmvec.wires.AsyncWire``), before each wait (``.before_wait``) and in the spin
of the waits (``.spin``). With ``step_deadline`` in async mode, the worker's main
thread abandons an env thread past the deadline and has a new env report in its
place (``.watch_deadline``, ``.check_deadlines``; docs/design/step-deadline.md).
"""

from __future__ import annotations

import functools
import itertools
import os
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

from shmvec.spin import NO_SPIN, Spin

# A pinned worker that steps serially looks for child processes at least every
# this many rounds (see _check_placement).
CHILD_CHECK_ROUNDS = 256
# While threads step a sync round, the worker's main thread names the first
# env not done yet this often (for env_timeout's message; the timeout itself
# is the main process's).
WAIT_POLL_S = 0.1
# A worker that may place its env threads on its CPU looks for child processes
# (reading /proc/self/task/*/children: ~10 us a thread) and at its CPU's other
# users (one line of /proc/stat) this often.
CHILD_CHECK_S = 1.0
# A worker's env threads move to its CPU once other processes have used at most
# NEIGHBOUR_SHARE of it in NEIGHBOUR_CHECKS intervals of NEIGHBOUR_CHECK_S in a
# row, and back to every CPU once they have used more as many times.
NEIGHBOUR_SHARE = 0.5
NEIGHBOUR_CHECK_S = 1.0
NEIGHBOUR_CHECKS = 2
# A result of EnvThreadPool.map not in yet.
PENDING = object()
# Serial rounds with no limit.
NEVER = 1 << 62
# What a pool task returns to end its thread: an env thread abandoned past
# step_deadline, back at last, whose stand-in took its place in the pool.
RETIRE = object()


class EnvThreadPool:
    """Daemon threads that run tasks from one queue (started as needed), on
    the CPUs ``place`` gives them. ``place`` and ``grow`` are called from one
    thread (the worker's)."""

    def __init__(self, everywhere: set[int]) -> None:
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._everywhere = everywhere  # the CPUs the process may use
        self._cpus: set[int] | None = None  # None: everywhere
        self._placing = threading.Lock()  # a new thread places itself apart from place()

    def place(self, cpus: set[int] | None) -> None:
        """Runs the threads on ``cpus`` (None: wherever the process may run) from
        now on, a thread that waits for its CPU too."""
        with self._placing:
            if cpus != self._cpus:
                self._cpus = cpus
                for thread in list(self._threads):
                    if thread.native_id is not None:
                        _set_cpus(thread.native_id, cpus or self._everywhere)

    @property
    def size(self) -> int:
        return len(self._threads)

    def grow(self, size: int) -> None:
        while len(self._threads) < size:
            thread = threading.Thread(
                target=self._serve, name=f"shmvec-env-{len(self._threads)}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def submit(self, task: Callable[[], None]) -> None:
        self._tasks.put(task)

    def _serve(self) -> None:
        with self._placing:
            _set_cpus(0, self._cpus or self._everywhere)
        while True:
            task = self._tasks.get()
            try:
                if task() is RETIRE:
                    self._threads.remove(threading.current_thread())
                    return
            except BaseException:  # noqa: BLE001 - a shmvec bug: say so, keep the thread
                traceback.print_exc(file=sys.stderr)

    def map(self, function: Callable[[int], Any], items: list[int], on_wait=None) -> list:
        """``[function(item) ...]`` run by the pool while the caller waits,
        calling ``on_wait(results)`` every ``WAIT_POLL_S``; an exception is
        returned in place of its result, and a result not yet in is ``PENDING``."""
        if not items:
            return []  # nothing would release ``done``
        results: list = [PENDING] * len(items)
        finished = itertools.count(1)  # next() is atomic under the GIL: no lock
        last = len(items)
        done = threading.Lock()
        done.acquire()

        def run(k: int) -> None:
            try:
                results[k] = function(items[k])
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                results[k] = exc
            if next(finished) == last:
                done.release()

        put = self._tasks.put
        for k in range(len(items)):
            put(functools.partial(run, k))
        # The worker's watchdog thread notices the main's death meanwhile.
        while not done.acquire(timeout=WAIT_POLL_S):
            if on_wait is not None:
                on_wait(results)
        return results


class RunningEnvs:
    """Which envs of the block are inside a step, published in the worker's
    shared words: ``current_env`` (1 + the env that has run longest, 0 when
    none) and ``env_started`` (when it began), as the serial loop does for
    its one env, so that ``env_timeout`` and recovery work unchanged."""

    def __init__(self, first_env: int, current_env, env_started=None) -> None:
        self._first = first_env
        self.current_env = current_env
        self._started_word = env_started
        self._started: dict[int, int] = {}  # in start order: the first is the oldest
        self.lock = threading.Lock()

    def begin(self, i: int) -> None:
        with self.lock:
            self._started.pop(i, None)  # an env replaced after its deadline: the newest now
            self._started[i] = time.monotonic_ns()  # CLOCK_MONOTONIC, as the .pyx
            self._publish()

    def started(self, i: int) -> int | None:
        """When env ``i`` began its command (monotonic ns), None if not running."""
        with self.lock:
            return self._started.get(i)

    def started_before(self, when_ns: int) -> list[int]:
        """The envs running since before ``when_ns``."""
        with self.lock:
            return [i for i, started in self._started.items() if started < when_ns]

    def end(self, i: int) -> None:
        """Call with ``lock`` held."""
        self._started.pop(i, None)
        self._publish()

    def _publish(self) -> None:
        if not self._started:
            self.current_env[0] = 0
            return
        oldest = next(iter(self._started))
        if self._started_word is not None:
            self._started_word[0] = self._started[oldest]
        self.current_env[0] = self._first + oldest + 1


class CpuNeighbours:
    """How busy processes other than this one keep one CPU: the CPU's busy time in
    ``/proc/stat`` (steal included) less this process's CPU time, as a share of
    each interval. This process's threads may have run elsewhere too, so the
    share errs low."""

    def __init__(self, cpu: int) -> None:
        self._prefix = f"cpu{cpu} ".encode()
        self._last = self._read()

    def _read(self) -> tuple[float, float, float] | None:
        """(now, the CPU's busy seconds, this process's CPU seconds), or None if
        ``/proc/stat`` does not say."""
        try:
            with open("/proc/stat", "rb") as stat:
                line = next((ln for ln in stat if ln.startswith(self._prefix)), None)
        except OSError:
            return None
        if line is None:
            return None
        ticks = [int(x) for x in line.split()[1:9]]
        busy = sum(ticks) - ticks[3] - ticks[4]  # all but idle and iowait
        return time.monotonic(), busy / _CLOCK_TICKS, time.process_time()

    def share(self, interval_s: float) -> float | None:
        """Others' share of the CPU since the last reading, once ``interval_s``
        has passed since it (then a new interval starts); else None."""
        last = self._last
        if last is None or time.monotonic() - last[0] < interval_s:
            return None
        now = self._last = self._read()
        if now is None:
            return None
        wall = now[0] - last[0]
        return ((now[1] - last[1]) - (now[2] - last[2])) / wall


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class ConcurrentEnvs:
    """One worker's choice between its serial loop and threads.

    ``step`` and ``run_pending`` run a ``_worker_loop.Block``'s own loops, or
    stand-ins that step its envs in threads, each env a ``Block.part`` of its own.
    """

    def __init__(self, block, cap: int | None, threads_word=None, cpu: int | None = None,
                 pin: bool = False) -> None:  # fmt: skip
        """``block``: the worker's ``_worker_loop.Block``; ``cap``: envs stepped at
        once (``env_concurrency``; None or 1: one after another); ``threads_word``:
        where to publish how many; ``cpu``: where to place env threads (None: never
        placed); ``pin``: step serially on ``cpu`` alone."""
        block_size, first_env = len(block.envs), block.first_row
        self.threads = 1 if cap is None else max(1, min(cap, block_size))
        # The CPU for this worker's env threads (None: never placed).
        self._cpu = cpu if cpu is not None and _can_find_children() else None
        self._next_child_check = 0.0
        self._everywhere = os.sched_getaffinity(0)
        # The calling thread (the one that steps serially) runs on _cpu alone,
        # unless its envs started processes already (see _check_placement).
        self._pinned = pin and self._cpu is not None and not _child_pids()
        if self._pinned and self._cpu is not None:
            try:
                os.sched_setaffinity(0, {self._cpu})
            except OSError:  # the CPU was taken away meanwhile: run unpinned
                self._pinned = False
        self.first_env = first_env
        self.pool = EnvThreadPool(self._everywhere)
        env_started = None if block.env_started is None else np.asarray(block.env_started)
        self.running = RunningEnvs(first_env, np.asarray(block.current_env), env_started)
        self._threads_word = threads_word
        self._parts_of = None  # the block _block_parts are of
        self._take_reset_args: Callable | None = None  # the parts' (under _recv_lock)
        self._block_parts: list = []
        self._claimed = np.zeros(block_size, dtype=bool)  # async: env queued or running
        # Reading the worker's pipe (a reset's seed), apart from row_lock: a
        # thread waiting for its seed must not hold up the others' messages.
        self._recv_lock = threading.Lock()
        # From a row's claim to its message's send (see _worker_loop.Block).
        self._row_lock = threading.Lock()
        # step_deadline, for envs in threads (see watch_deadline).
        self._deadline_ns: int | None = None
        self._replace_env: Callable[[int, bool], tuple] | None = None
        # Env threads go to _cpu while other processes leave it quiet (see _follow_neighbours).
        self._neighbours = (
            CpuNeighbours(self._cpu) if self._cpu is not None and self.threads > 1 else None
        )
        self._placed = False
        self._checks_against = 0  # checks in a row that disagreed with _placed
        self._publish_threads()
        if self.threads > 1:
            self._start_threads()

    def watch_deadline(self, seconds: float, replace_env: Callable[[int, bool], tuple]) -> None:
        """Async mode, envs in threads: an env past ``seconds`` in one command is
        abandoned to its thread (which discards its result when it returns and
        ends; a new thread takes its place in the pool), and ``replace_env(i,
        False)`` (``Worker.deadline_result``) gives the result reported instead,
        from a new env. Checked by ``check_deadlines``, before each wait."""
        self._deadline_ns = int(seconds * 1e9)
        self._replace_env = replace_env

    def spin(self, spin: Spin) -> Spin:
        """The worker's spin while it waits for work: none with env threads,
        whose core it would steal."""
        return NO_SPIN if self.threads > 1 else spin

    def before_wait(self) -> None:
        """Called before every wait for work (sync and async mode)."""
        if self._pinned:
            self._check_placement()
        if self._deadline_ns is not None:
            self.check_deadlines()

    def _publish_threads(self) -> None:
        if self._threads_word is not None:
            self._threads_word[0] = self.threads

    def _start_threads(self) -> None:
        self.pool.grow(self.threads)
        self._check_placement()

    def _check_placement(self) -> None:
        """Unplaces the env threads (and unpins this thread) for good, and frees
        the CPU of the children placed with them, once this process has child
        processes; else places or unplaces the env threads as other processes
        use their CPU. Called from the thread that steps serially."""
        if self._cpu is None or time.monotonic() < self._next_child_check:
            return
        children = _child_pids()
        if not children:
            self._follow_neighbours()
            # From the end of this check: the next one finds a whole NEIGHBOUR_CHECK_S
            # since the neighbours' reading (reading the children took a while).
            self._next_child_check = time.monotonic() + CHILD_CHECK_S
            return
        self._cpu = None
        self.pool.place(None)
        if self._pinned:
            self._pinned = False
            try:
                os.sched_setaffinity(0, self._everywhere)
            except OSError:
                pass  # some of those CPUs were taken away: it stays where it is
        for pid in children:
            try:
                os.sched_setaffinity(pid, self._everywhere)
            except OSError:
                pass  # gone already

    def _follow_neighbours(self) -> None:
        """Env threads on every CPU at first; on ``_cpu`` once other processes have
        used at most ``NEIGHBOUR_SHARE`` of it in ``NEIGHBOUR_CHECKS`` intervals in a
        row, and back on every CPU once they have used more as many times (a pinned
        serial worker is left alone)."""
        if self._neighbours is None or self._cpu is None:
            return
        share = self._neighbours.share(NEIGHBOUR_CHECK_S)
        if share is None:
            return
        quiet = share <= NEIGHBOUR_SHARE
        self._checks_against = 0 if quiet == self._placed else self._checks_against + 1
        if self._checks_against >= NEIGHBOUR_CHECKS:
            self._placed, self._checks_against = quiet, 0
            self.pool.place({self._cpu} if quiet else None)

    # ----------------------------------------------------------- sync mode

    def serial_rounds(self) -> int:
        """How many step rounds ``_worker_loop.Block.serve_rounds`` may run before this
        hook must be asked again (0: none, the envs step in threads). A pinned
        worker comes back every ``CHILD_CHECK_ROUNDS`` rounds to look for child
        processes."""
        if self.threads > 1:
            return 0
        return CHILD_CHECK_ROUNDS if self._pinned else NEVER

    def step(self, block, action_views: list, obs_views, slot: int) -> tuple:
        """Steps the block this round as ``block.step_block`` does (a
        ``_worker_loop.Block``): serially, or in threads."""
        if self.threads > 1:
            return self._step_threaded(block, action_views, obs_views, slot)
        return block.step_block(action_views, obs_views, slot)

    def _step_threaded(self, block, action_views: list, obs_views, slot: int) -> tuple:
        self._check_placement()
        parts = self._parts(block)

        def step(i: int) -> tuple:
            return parts[i].step_block(action_views, obs_views, slot)

        try:  # block.current_env is the worker's word (self.running's)
            done = self.map_envs(step, list(range(len(parts))))
        finally:
            self.running.current_env[0] = 0
        infos: list = []
        errors: list = []
        announced: list = []
        spills: list = []
        for part in done:
            _extend(infos, errors, announced, spills, part)
        return infos, errors, announced, spills

    def _parts(self, block) -> list:
        """Per env of ``block``: ``block.part(i)`` with its own scratch words,
        reading its reset's seed (also a restarted env's) under ``_recv_lock``
        and sending under ``_row_lock``; made once (the worker has one block)."""
        if self._parts_of is not block:
            self._parts_of = block
            self._take_reset_args = _locked(block.take_reset_args, self._recv_lock)
            # A restarted env's first reset reads its seed from the pipe as well.
            self._restart = _locked(block.restart, self._recv_lock) if block.restart else None
            # The parts share the block's stepper: its pipe reads take the same lock.
            block.stepper.take_spill = _locked(block.stepper.take_spill, self._recv_lock)
            self._block_parts = [self._make_part(block, i) for i in range(len(block.envs))]
        return self._block_parts

    def _make_part(self, block, i: int):
        part = block.part(i, np.zeros(1, np.uint32), np.zeros(1, np.uint64))
        part.take_reset_args, part.row_lock = self._take_reset_args, self._row_lock
        part.restart = self._restart
        return part

    def map_envs(self, function: Callable[[int], Any], indices: list[int]) -> list:
        """``[function(i) for i in indices]`` (i: an env of the block), in
        threads when ``env_concurrency`` asks for them (sync mode's resets)."""
        current_env = self.running.current_env
        if self.threads <= 1:
            results = []
            for i in indices:
                current_env[0] = self.first_env + i + 1
                results.append(function(i))
            return results

        def name_first_pending(results: list) -> None:
            for i, result in zip(indices, results):
                if result is PENDING:
                    current_env[0] = self.first_env + i + 1
                    return

        if indices:
            current_env[0] = self.first_env + indices[0] + 1
        results = self.pool.map(function, indices, name_first_pending)
        for result in results:
            if isinstance(result, BaseException):
                raise result  # function catches the envs' exceptions: a bug
        return results

    # ---------------------------------------------------------- async mode

    def run_pending(self, block) -> None:
        """Runs the envs that have a command as ``block.step_pending`` does:
        serially, or in threads."""
        if self.threads > 1:
            self._pending_threaded(block)
        else:
            block.step_pending()

    def _pending_threaded(self, block) -> None:
        """Queues every env with a command that no thread has yet; a thread
        that finishes an env runs it again if a new command came meanwhile."""
        self._check_placement()
        parts = self._parts(block)
        commands = np.asarray(block.commands)
        running, claimed = self.running, self._claimed
        # A snapshot: main writes commands while we read (numpy's nonzero counts,
        # then fills, and fails if the count moved). A command set after it
        # rings the doorbell again.
        for i in np.flatnonzero(commands.copy()).tolist():
            with running.lock:
                if claimed[i]:
                    continue
                claimed[i] = True
            self.pool.submit(functools.partial(self._serve_env, parts, commands, i))

    def _serve_env(self, parts: list, commands: np.ndarray, i: int, replace: bool = False):
        """A pool task: runs env ``i``'s commands until it has none; ``replace``:
        first report the result of env ``i`` replaced after its deadline. Returns
        ``RETIRE`` from a thread abandoned meanwhile."""
        running, claimed = self.running, self._claimed
        while True:
            running.begin(i)  # before step_pending clears the command
            part = None
            try:
                if replace:
                    replace = False
                    self._report_replaced(parts, i)
                else:
                    part = parts[i]
                    part.step_pending()
            finally:
                abandoned = part is not None and part.abandoned
                if not abandoned:
                    with running.lock:
                        running.end(i)
                        again = bool(commands[i])
                        if not again:
                            claimed[i] = False
            if part is not None and abandoned:
                # Env i is served by another thread now, with a new env object:
                # this one is closed here, where it was in use.
                _close_quietly(part.envs[0])
                return RETIRE
            if not again:
                return None

    def check_deadlines(self) -> None:
        """Abandons each env thread past the deadline (see ``watch_deadline``).
        Called from the worker's main thread."""
        deadline_ns = self._deadline_ns
        if deadline_ns is None or self.threads <= 1 or self._parts_of is None:
            return
        parts = self._block_parts
        for i in self.running.started_before(time.monotonic_ns() - deadline_ns):
            part = parts[i]
            # A part publishes its row under row_lock: past this check, it never will.
            with self._row_lock:
                if part.abandoned or not part.in_env:
                    continue  # published already, or replaced
                started = self.running.started(i)  # in_env first: this command's start
                if started is None or time.monotonic_ns() - started < deadline_ns:
                    continue
                part.abandoned = True
            self.pool.grow(self.pool.size + 1)  # the stuck thread's stand-in
            commands = np.asarray(self._parts_of.commands)
            self.pool.submit(functools.partial(self._serve_env, parts, commands, i, True))

    def _report_replaced(self, parts: list, i: int) -> None:
        """Env ``i``'s result after its deadline, from a new env, published as its
        row through a new part (the abandoned one keeps the old env)."""
        assert self._replace_env is not None and self._parts_of is not None
        block = self._parts_of
        result, error = None, None
        try:
            result = self._replace_env(i, False)  # sets block.envs[i]
        except Exception as exc:  # noqa: BLE001 - re-raised in the main process
            error = (self.first_env + i, exc, traceback.format_exc())
        parts[i] = part = self._make_part(block, i)
        part.report(result, error)

    def drain(self) -> None:
        """Waits until no env thread runs (before a barrier command: call,
        set_attr, close touch every env)."""
        while self._claimed.any():
            time.sleep(0.0005)
            if self._deadline_ns is not None:
                self.check_deadlines()  # an env stuck for ever is abandoned, not waited for


def _set_cpus(tid: int, cpus: set[int]) -> None:
    """Runs thread ``tid`` of this process (0: the calling one) on ``cpus``."""
    try:
        os.sched_setaffinity(tid, cpus)
    except OSError:
        pass  # the thread ended, or a CPU was taken away: it stays where it is


def _can_find_children() -> bool:
    """Whether the kernel lists a thread's children (CONFIG_PROC_CHILDREN)."""
    return os.path.exists(f"/proc/self/task/{threading.get_native_id()}/children")


def _child_pids() -> list[int]:
    """The child processes of every thread of this process."""
    pids: list[int] = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/children", "rb") as children:
                pids.extend(int(pid) for pid in children.read().split())
        except OSError:
            pass  # the thread ended meanwhile
    return pids


def _close_quietly(env) -> None:
    try:
        env.close()
    except Exception:  # noqa: BLE001 - a broken env: best effort
        traceback.print_exc(file=sys.stderr)


def _locked(function: Callable, lock: threading.Lock) -> Callable:
    def locked(*args):
        with lock:
            return function(*args)

    return locked


def _extend(infos: list, errors: list, announced: list, spills: list, part: tuple) -> None:
    """Appends a part's ``(infos, errors, announced, spills)`` (``Block.step_block``'s)."""
    part_infos, part_errors, part_announced, part_spills = part
    infos.extend(part_infos)
    errors.extend(part_errors)
    announced.extend(part_announced)
    spills.extend(part_spills)
