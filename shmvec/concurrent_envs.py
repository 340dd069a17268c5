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

This module is the mechanism; ``shmvec.worker`` hooks it in at three places
(``ConcurrentEnvs.step_function``, ``.pending_function``, ``.drain``).
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

from shmvec import _worker_loop
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


def _shifted(callback, i: int):
    """``callback(i, ...)`` for a stepper that sees env ``i`` as its env 0."""
    if callback is None:
        return None
    return lambda _zero, *args: callback(i, *args)


class ConcurrentEnvs:
    """One worker's choice between its serial loop and threads.

    ``step_function()`` and ``pending_function()`` return either the Cython
    loops of ``shmvec._worker_loop`` or stand-ins with the same signatures
    that probe (step env by env, measuring) or step envs in threads.
    """

    def __init__(
        self,
        block_size: int,
        first_env: int,
        cap: int | None,
        current_env,
        env_started=None,
        threads_word=None,
        cpu: int | None = None,
        pin: bool = False,
    ) -> None:
        self.governor = ConcurrencyGovernor(block_size, cap)
        # The CPU for this worker's env threads (None: never placed).
        self._cpu = cpu if cpu is not None and _can_find_children() else None
        self._next_child_check = 0.0
        self._everywhere = os.sched_getaffinity(0)
        # The calling thread (the one that steps serially) runs on _cpu alone,
        # unless its envs started processes already (see _check_children).
        self._pinned = pin and self._cpu is not None and not _child_pids()
        if self._pinned:
            try:
                os.sched_setaffinity(0, {self._cpu})
            except OSError:  # the CPU was taken away meanwhile: run unpinned
                self._pinned = False
        self.first_env = first_env
        self.pool = EnvThreadPool(self._everywhere)
        self.running = RunningEnvs(first_env, current_env, env_started)
        self._threads_word = threads_word
        self._probe: WaitProbe | None = None
        self._per_env_key: tuple | None = None
        self._per_env: list = []
        self._claimed = np.zeros(block_size, dtype=bool)  # async: env queued or running
        # Reading the worker's pipe (a reset's seed), apart from row_lock: a
        # thread waiting for its seed must not hold up the others' messages.
        self._recv_lock = threading.Lock()
        # From a row's claim to its message's send (see _worker_loop.step_pending).
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
        """How many step rounds ``_worker_loop.SerialRounds`` may run before this
        hook must decide again (0: now); the worker says how many ran with
        ``ran_serial``. A pinned worker comes back at least every
        ``REPROBE_ROUNDS`` rounds to look for child processes."""
        if self.governor.threads > 1:
            return 0
        rounds = self.governor.serial_rounds()
        return min(rounds, REPROBE_ROUNDS) if self._pinned else rounds

    def ran_serial(self, rounds: int) -> None:
        self.governor.ran(rounds)

    def step_function(self) -> Callable:
        """What steps the block this round: ``_worker_loop.step_envs`` or a
        stand-in with its signature."""
        if self.governor.threads > 1:
            return self._step_threaded
        if self.governor.probe_due():
            return self._step_probing
        return _worker_loop.step_envs

    def _step_probing(self, stepper, envs, first_row, *args) -> tuple:
        infos, errors, announced = [], [], []
        for i in range(len(envs)):
            before = self._sample()
            part = self._step_one(stepper, envs, first_row, args, i, args[-2])
            after = self._sample()
            _extend(infos, errors, announced, part)
            if self.governor.add(before, after):
                self._decided()
                if self.governor.threads > 1 and i + 1 < len(envs):
                    rest = self._step_threaded(stepper, envs, first_row, *args, start=i + 1)
                    _extend(infos, errors, announced, rest)
                    return infos, errors, announced
        self.governor.finish()
        self._decided()
        return infos, errors, announced

    @staticmethod
    def _step_one(stepper, envs, first_row, args, i, current_env) -> tuple:
        action_views, obs_views, slot, autoreset, info_columns, _current, on_error = args
        return _worker_loop.step_envs(
            stepper,
            envs[i : i + 1],
            first_row + i,
            action_views,
            obs_views,
            slot,
            autoreset[i : i + 1],
            info_columns,
            current_env,
            _shifted(on_error, i),
        )

    def _step_threaded(self, stepper, envs, first_row, *args, start: int = 0) -> tuple:
        action_views, obs_views, slot, autoreset, info_columns, current_env, on_error = args
        self._check_children()
        per_env = self._per_env_args(envs, autoreset, on_error)
        step_envs = _worker_loop.step_envs

        def step(i: int) -> tuple:
            env, env_autoreset, env_current, env_on_error = per_env[i]
            return step_envs(stepper, env, first_row + i, action_views, obs_views, slot,
                             env_autoreset, info_columns, env_current, env_on_error)  # fmt: skip

        try:  # current_env is the worker's word (self.running's): rows are env ids
            parts = self.map_envs(step, list(range(start, len(envs))))
        finally:
            current_env[0] = 0
        infos, errors, announced = [], [], []
        for part in parts:
            _extend(infos, errors, announced, part)
        return infos, errors, announced

    def _per_env_args(self, envs: list, autoreset, on_error) -> list:
        """Per env of the block: (``[env]``, its autoreset flag, a scratch
        current_env word, ``on_error`` for it), made once (the worker passes the
        same objects every round)."""
        key = (envs, autoreset, on_error)
        if self._per_env_key is None or any(a is not b for a, b in zip(key, self._per_env_key)):
            self._per_env_key = key
            self._per_env = [
                (envs[i : i + 1], autoreset[i : i + 1], np.zeros(1, dtype=np.uint32),
                 _shifted(on_error, i))
                for i in range(len(envs))
            ]  # fmt: skip
        return self._per_env

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

    def pending_function(self) -> Callable:
        """What runs the envs that have a command: ``_worker_loop.step_pending``
        or a stand-in with its signature."""
        if self.governor.threads > 1:
            return self._pending_threaded
        if self.governor.probe_due():
            return self._pending_probing
        return _worker_loop.step_pending

    def _pending_probing(self, stepper, ring, envs, first_env, commands, *args) -> None:
        for i in range(len(envs)):
            command = commands[i]
            if not command:
                continue
            before = self._sample()
            # args[6], args[10]: the worker's current_env and env_started words
            self._run_pending(stepper, ring, envs, first_env, commands, args, i, args[6], args[10])
            after = self._sample()
            # A reset tells nothing of the steps (the first commands are resets).
            if command == ENV_STEP and self.governor.add(before, after):
                self._decided()
                if self.governor.threads > 1:
                    self._pending_threaded(stepper, ring, envs, first_env, commands, *args)
                    return
        self.governor.finish()
        self._decided()

    @staticmethod
    def _run_pending(stepper, ring, envs, first_env, commands, args, i, current_env,
                     env_started) -> None:  # fmt: skip
        (take_reset_args, action_views, slots, info_columns, autoreset, send_message,
         _current, on_error, restarted, restart, _started, *row_lock) = args  # fmt: skip
        _worker_loop.step_pending(
            stepper,
            ring,
            envs[i : i + 1],
            first_env + i,
            commands[i : i + 1],
            take_reset_args,
            action_views,
            slots,
            info_columns,
            autoreset[i : i + 1],
            send_message,
            current_env,
            _shifted(on_error, i),
            None if restarted is None else restarted[i : i + 1],
            _shifted(restart, i),
            env_started,
            *row_lock,
        )

    def _pending_threaded(self, stepper, ring, envs, first_env, commands, *args) -> None:
        """Queues every env with a command that no thread has yet; a thread
        that finishes an env runs it again if a new command came meanwhile."""
        take_reset_args, send_message = args[0], args[5]
        self._check_children()
        locked_args = (
            _locked(take_reset_args, self._recv_lock),
            *args[1:5],
            send_message,  # under row_lock
            *args[6:],
            self._row_lock,
        )
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
                scratch_env = np.zeros(1, dtype=np.uint32)
                scratch_started = np.zeros(1, dtype=np.uint64)
                while True:
                    running.begin(i)  # before step_pending clears the command
                    try:
                        self._run_pending(stepper, ring, envs, first_env, commands,
                                          locked_args, i, scratch_env, scratch_started)  # fmt: skip
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
    pids = []
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
    infos.extend(part[0])
    errors.extend(part[1])
    announced.extend(part[2])
