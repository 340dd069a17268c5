"""Envs that wait: a worker steps several of its envs at once, in threads.

Envs of agent training (tool calls, sandboxes, remote simulators) spend most
of a step blocked in a call that releases the GIL (a socket, a subprocess, a
sleep). A worker that steps its block one env after the other then waits for
each in turn. Here a worker measures, on a few probe steps, how much of an
env's step is spent blocked (wall time less CPU time less time spent runnable
but not running); when it is most of it, the worker steps its envs with a pool
of threads, one per env of its block (or ``env_concurrency``, if less).
CPU-bound envs keep the single-threaded Cython loop; a probe costs a few
``env.step`` calls every ``REPROBE_ROUNDS`` rounds.

Why threads in the worker, not more processes: a waiting env needs no core,
only somewhere to wait; a thread costs ~100 KiB where a process with its own
interpreter and gymnasium import costs ~25 MiB, and the CPU-bound path (one
worker per core, no GIL contention) stays as it is.

A worker's env threads share one GIL, so one of them runs Python at a time;
they are placed on one CPU (worker ``k``: the ``k``-th CPU it may use) so that
each GIL hand-off is a switch on that CPU, not a wake-up of a thread on
another CPU (measured on the 2-core VM, 2 workers x 128 envs that wait 20 ms:
CPU per env step 62 -> 30 us, 73% -> 81% of 256 / 20 ms). A child process
inherits the CPU of the thread that starts it, so a worker whose envs start
processes (sandboxes, tool calls) is unplaced for good, its children too,
once it has any (checked every ``CHILD_CHECK_S``). A worker pinned to its CPU
(``pin=True``, see ``shmvec.spin.default_pinning``) steps there serially too, and
is unpinned the same way (checked at least every ``REPROBE_ROUNDS`` rounds).

Each env is stepped by one thread at a time and writes its results at its
own row (sync mode) or a row it claims (async mode), so results never depend
on timing; infos and errors are gathered per env and returned in row order.

This module is the mechanism; the worker hooks it in where it steps its envs
(``ConcurrentEnvs.step``, ``.map_envs``; ``.run_pending`` and ``.drain`` in
``shmvec.wires.AsyncWire``) and before each wait (``.spin_ns``).
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

from shmvec.protocol import ENV_STEP

# A step counts as waiting when at least this share of the time it was on a
# CPU or blocked is spent blocked. Time spent runnable but not running (on the
# run queue of a busy machine) counts as neither: under load it is most of a
# waiting env's wall time too (measured: 3.0 ms of 6.7 ms, sleeps of ~1.6 ms).
# CPU-bound envs measure ~0.0-0.05; an env that sleeps 5 ms per step ~0.99.
WAITING_FRACTION = 1 / 3
# Threads pay only when a step blocks for longer than handing an env to a
# thread costs: ~20 us here (128 envs that sleep 20 ms take 22.5 ms rounds
# through the pool). Below twice that per step, "blocked" time is the noise of
# a short CPU-bound step (a page fault, the probe's own syscalls): measured,
# CartPole steps in async mode on a busy machine were once judged waiting.
MIN_BLOCKED_NS = 40_000
# A probe decides after this many env steps, or sooner once they took this long.
PROBE_STEPS = 16
PROBE_WALL_NS = 5_000_000
# While serial, probe again every this many rounds (envs may start waiting
# later, e.g. once an episode reaches its tool calls). A probe round of 8
# CartPole envs costs ~20 µs more than the plain loop: 0.1 µs a round here.
REPROBE_ROUNDS = 256
# While threads step a sync round, the worker's main thread names the first
# env not done yet this often (for env_timeout's message; the timeout itself
# is the main process's).
WAIT_POLL_S = 0.1
# While a worker's env threads are placed on one CPU, it looks for child
# processes this often (reading /proc/self/task/*/children: ~10 us a thread).
CHILD_CHECK_S = 1.0
# A result of EnvThreadPool.map not in yet.
PENDING = object()
# Serial rounds before a probe when the worker never probes (a block of one env).
NEVER = 1 << 62


class WaitProbe:
    """Blocked, CPU and run-queue time of the calling thread between two samples.

    Must be created and used by the same thread: ``/proc/thread-self`` is
    resolved when the file is opened.
    """

    def __init__(self) -> None:
        try:
            self._schedstat: int | None = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            self._schedstat = None  # no schedstat: run-queue time counts as blocked

    def sample(self) -> tuple[int, int, int]:
        """(wall ns, thread CPU ns, ns spent runnable but not running)."""
        run_delay = 0
        if self._schedstat is not None:
            run_delay = int(os.pread(self._schedstat, 64, 0).split()[1])
        return time.perf_counter_ns(), time.thread_time_ns(), run_delay

    def close(self) -> None:
        if self._schedstat is not None:
            os.close(self._schedstat)
            self._schedstat = None


def threads_for(wall_ns: int, cpu_ns: int, run_delay_ns: int, limit: int, steps: int = 1) -> int:
    """How many envs to step at once, given what ``steps`` serial steps took:
    1 unless they mostly wait, and for more than ``MIN_BLOCKED_NS`` each, else
    ``limit`` (the block, or the user's cap).

    Not ``wall / cpu``, the threads that would keep one core busy: a sync
    round ends when its last env does, so ``k`` threads for a block of ``n``
    take ``ceil(n / k)`` step times (measured, 256 envs that wait 20 ms on 2
    workers: 5.9k steps/s with k = wall/cpu = 96 of 128, 11k+ with 128). An
    idle thread costs only its stack.
    """
    blocked = wall_ns - cpu_ns - run_delay_ns
    if limit <= 1 or blocked < MIN_BLOCKED_NS * steps:
        return 1
    return 1 if blocked < WAITING_FRACTION * (blocked + cpu_ns) else limit


class ConcurrencyGovernor:
    """Decides, from probe samples, how many envs a worker steps at once."""

    def __init__(self, block_size: int, cap: int | None) -> None:
        self.limit = block_size if cap is None else min(cap, block_size)
        self.threads = 1
        self._countdown = 0 if self.limit > 1 else -1  # -1: never probe
        self._reset_totals()

    def _reset_totals(self) -> None:
        self._steps = self._wall = self._cpu = self._delay = 0

    def probe_due(self) -> bool:
        """Called once per serial round: True when this round should be a probe
        (until a probe has seen two env steps, every round is)."""
        if self._countdown <= 0:
            return self._countdown == 0
        self._countdown -= 1
        return False

    def serial_rounds(self) -> int:
        """How many serial rounds may run before ``probe_due`` says True
        (``NEVER`` when it never will); ``ran(n)`` counts them."""
        return NEVER if self._countdown < 0 else self._countdown

    def ran(self, rounds: int) -> None:
        if self._countdown > 0:
            self._countdown -= rounds

    def add(self, before: tuple[int, int, int], after: tuple[int, int, int]) -> bool:
        """Adds one env step's samples; True if the probe decided already (the
        steps took long enough to tell)."""
        self._steps += 1
        self._wall += after[0] - before[0]
        self._cpu += after[1] - before[1]
        self._delay += after[2] - before[2]
        if self._steps >= PROBE_STEPS or (self._steps >= 2 and self._wall >= PROBE_WALL_NS):
            self._decide()
            return True
        return False

    def finish(self) -> None:
        """The end of a probe round: decides if it saw enough steps."""
        if self._steps >= 2:
            self._decide()

    def _decide(self) -> None:
        self.threads = threads_for(self._wall, self._cpu, self._delay, self.limit, self._steps)
        self._reset_totals()
        self._countdown = REPROBE_ROUNDS


class EnvThreadPool:
    """Daemon threads that run tasks from one queue (started as needed), on
    the CPUs ``place`` gives them."""

    def __init__(self, everywhere: set[int]) -> None:
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._everywhere = everywhere  # the CPUs the process may use
        self._cpus: set[int] | None = None  # None: everywhere
        self._placement = 0  # bumped by place(); each thread compares its own

    def place(self, cpus: set[int] | None) -> None:
        """Runs the threads on ``cpus`` (None: wherever the process may run),
        each from its next task on."""
        if cpus != self._cpus:
            self._cpus = cpus
            self._placement += 1

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
        placement = 0
        while True:
            task = self._tasks.get()
            if placement != self._placement:
                placement = self._placement
                try:
                    os.sched_setaffinity(0, self._cpus or self._everywhere)
                except OSError:
                    pass  # a CPU taken away meanwhile: it stays where it is
            try:
                task()
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
            self._started[i] = time.monotonic_ns()  # CLOCK_MONOTONIC, as the .pyx
            self._publish()

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


class ConcurrentEnvs:
    """One worker's choice between its serial loop and threads.

    ``step`` and ``run_pending`` run a ``_worker_loop.Block``'s own loops, or
    stand-ins that probe (step env by env, measuring) or step its envs in
    threads, each env a ``Block.part`` of its own.
    """

    def __init__(self, block, cap: int | None, threads_word=None, cpu: int | None = None,
                 pin: bool = False) -> None:  # fmt: skip
        """``block``: the worker's ``_worker_loop.Block``; ``cap``: envs stepped at
        once at most (None: the block); ``threads_word``: where to publish how
        many; ``cpu``: where to place env threads (None: never placed); ``pin``:
        step serially on ``cpu`` alone."""
        block_size, first_env = len(block.envs), block.first_row
        self.governor = ConcurrencyGovernor(block_size, cap)
        # The CPU for this worker's env threads (None: never placed).
        self._cpu = cpu if cpu is not None and _can_find_children() else None
        self._next_child_check = 0.0
        self._everywhere = os.sched_getaffinity(0)
        # The calling thread (the one that steps serially) runs on _cpu alone,
        # unless its envs started processes already (see _check_children).
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
        self._probe: WaitProbe | None = None
        self._parts_of = None  # the block _block_parts are of
        self._block_parts: list = []
        self._claimed = np.zeros(block_size, dtype=bool)  # async: env queued or running
        # Reading the worker's pipe (a reset's seed), apart from row_lock: a
        # thread waiting for its seed must not hold up the others' messages.
        self._recv_lock = threading.Lock()
        # From a row's claim to its message's send (see _worker_loop.Block).
        self._row_lock = threading.Lock()
        self._publish_threads()

    def spin_ns(self, spin_ns: int) -> int:
        """Spinning for the next command steals the core the env threads need.
        Called before every wait for a command (sync and async mode)."""
        if self._pinned:
            self._check_children()
        return 0 if self.governor.threads > 1 else spin_ns

    def _publish_threads(self) -> None:
        if self._threads_word is not None:
            self._threads_word[0] = self.governor.threads

    def _decided(self) -> None:
        self.pool.grow(self.governor.threads if self.governor.threads > 1 else 0)
        self._publish_threads()
        if self.governor.threads > 1:
            self._next_child_check = 0.0  # now, before any thread is placed
            self._check_children()
        if self._cpu is not None:
            self.pool.place({self._cpu} if self.governor.threads > 1 else None)

    def _check_children(self) -> None:
        """Unplaces the env threads (and unpins this thread) for good, and frees
        the CPU of the children placed with them, once this process has child
        processes. Called from the thread that steps serially."""
        now = time.monotonic()
        if self._cpu is None or now < self._next_child_check:
            return
        self._next_child_check = now + CHILD_CHECK_S
        children = _child_pids()
        if not children:
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

    def _sample(self) -> tuple[int, int, int]:
        if self._probe is None:
            self._probe = WaitProbe()  # in the thread that steps serially
        return self._probe.sample()

    # ----------------------------------------------------------- sync mode

    def serial_rounds(self) -> int:
        """How many step rounds ``_worker_loop.Block.serve_rounds`` may run before this
        hook must decide again (0: now); the worker says how many ran with
        ``ran_serial``. A pinned worker comes back at least every
        ``REPROBE_ROUNDS`` rounds to look for child processes."""
        if self.governor.threads > 1:
            return 0
        rounds = self.governor.serial_rounds()
        return min(rounds, REPROBE_ROUNDS) if self._pinned else rounds

    def ran_serial(self, rounds: int) -> None:
        self.governor.ran(rounds)

    def step(self, block, action_views: list, obs_views, slot: int) -> tuple:
        """Steps the block this round as ``block.step_block`` does (a
        ``_worker_loop.Block``): serially, probing, or in threads."""
        if self.governor.threads > 1:
            return self._step_threaded(block, action_views, obs_views, slot)
        if self.governor.probe_due():
            return self._step_probing(block, action_views, obs_views, slot)
        return block.step_block(action_views, obs_views, slot)

    def _step_probing(self, block, action_views: list, obs_views, slot: int) -> tuple:
        infos: list = []
        errors: list = []
        announced: list = []
        size = len(block.envs)
        for i in range(size):
            env = block.part(i, block.current_env)
            before = self._sample()
            part = env.step_block(action_views, obs_views, slot)
            after = self._sample()
            _extend(infos, errors, announced, part)
            if self.governor.add(before, after):
                self._decided()
                if self.governor.threads > 1 and i + 1 < size:
                    rest = self._step_threaded(block, action_views, obs_views, slot, start=i + 1)
                    _extend(infos, errors, announced, rest)
                    return infos, errors, announced
        self.governor.finish()
        self._decided()
        return infos, errors, announced

    def _step_threaded(self, block, action_views: list, obs_views, slot: int, start: int = 0):
        self._check_children()
        parts = self._parts(block)

        def step(i: int) -> tuple:
            return parts[i].step_block(action_views, obs_views, slot)

        try:  # block.current_env is the worker's word (self.running's)
            done = self.map_envs(step, list(range(start, len(parts))))
        finally:
            self.running.current_env[0] = 0
        infos: list = []
        errors: list = []
        announced: list = []
        for part in done:
            _extend(infos, errors, announced, part)
        return infos, errors, announced

    def _parts(self, block) -> list:
        """Per env of ``block``: ``block.part(i)`` with its own scratch words,
        reading its reset's seed under ``_recv_lock`` and sending under
        ``_row_lock``; made once (the worker has one block)."""
        if self._parts_of is not block:
            self._parts_of = block
            take_reset_args = _locked(block.take_reset_args, self._recv_lock)
            self._block_parts = []
            for i in range(len(block.envs)):
                part = block.part(i, np.zeros(1, np.uint32), np.zeros(1, np.uint64))
                part.take_reset_args, part.row_lock = take_reset_args, self._row_lock
                self._block_parts.append(part)
        return self._block_parts

    def map_envs(self, function: Callable[[int], Any], indices: list[int]) -> list:
        """``[function(i) for i in indices]`` (i: an env of the block), in
        threads once this worker's envs wait (sync mode's resets)."""
        current_env = self.running.current_env
        if self.governor.threads <= 1:
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
        serially, probing, or in threads."""
        if self.governor.threads > 1:
            self._pending_threaded(block)
        elif self.governor.probe_due():
            self._pending_probing(block)
        else:
            block.step_pending()

    def _pending_probing(self, block) -> None:
        commands = np.asarray(block.commands)
        for i in range(len(block.envs)):
            command = commands[i]
            if not command:
                continue
            env = block.part(i, block.current_env, block.env_started)
            before = self._sample()
            env.step_pending()
            after = self._sample()
            # A reset tells nothing of the steps (the first commands are resets).
            if command == ENV_STEP and self.governor.add(before, after):
                self._decided()
                if self.governor.threads > 1:
                    self._pending_threaded(block)
                    return
        self.governor.finish()
        self._decided()

    def _pending_threaded(self, block) -> None:
        """Queues every env with a command that no thread has yet; a thread
        that finishes an env runs it again if a new command came meanwhile."""
        self._check_children()
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

            def task(i=i) -> None:
                while True:
                    running.begin(i)  # before step_pending clears the command
                    try:
                        parts[i].step_pending()
                    finally:
                        with running.lock:
                            running.end(i)
                            again = bool(commands[i])
                            if not again:
                                claimed[i] = False
                    if not again:
                        return

            self.pool.submit(task)

    def drain(self) -> None:
        """Waits until no env thread runs (before a barrier command: call,
        set_attr, close touch every env)."""
        while self._claimed.any():
            time.sleep(0.0005)


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


def _locked(function: Callable, lock: threading.Lock) -> Callable:
    def locked(*args):
        with lock:
            return function(*args)

    return locked


def _extend(infos: list, errors: list, announced: list, part: tuple) -> None:
    """Appends a part's ``(infos, errors, announced)`` (``Block.step_block``'s)."""
    part_infos, part_errors, part_announced = part
    infos.extend(part_infos)
    errors.extend(part_errors)
    announced.extend(part_announced)
