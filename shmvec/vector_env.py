"""ShmVectorEnv: gymnasium's AsyncVectorEnv, over one shared-memory segment.

Example:
    >>> import gymnasium as gym
    >>> import shmvec
    >>> envs = shmvec.ShmVectorEnv([lambda: gym.make("CartPole-v1")] * 4, num_workers=2)
    >>> obs, infos = envs.reset(seed=42)
    >>> obs.shape
    (4, 4)
    >>> obs, rewards, terminations, truncations, infos = envs.step(envs.action_space.sample())
    >>> envs.close()
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import pickle
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import cloudpickle
import gymnasium as gym
import numpy as np
from gymnasium import logger as gym_logger
from gymnasium.error import AlreadyPendingCallError, ClosedEnvironmentError, NoAsyncCallError
from gymnasium.vector.async_vector_env import AsyncState
from gymnasium.vector.utils import batch_differing_spaces, batch_space, iterate
from gymnasium.vector.vector_env import ArrayType, AutoresetMode, VectorEnv

from shmvec import _core, _worker_loop
from shmvec import infos as infos_columns
from shmvec.async_api import AsyncRollouts
from shmvec.errors import WorkerDiedError, add_note
from shmvec.layout import PickledCodec, make_codec
from shmvec.spin import SpinPolicy, available_cpus, default_spin
from shmvec.worker import (
    CALL,
    CLOSE,
    RESET,
    SET_ATTR,
    STEP,
    InProcessWorker,
    LoopbackPipe,
    SegmentFd,
    WorkerSpec,
    check_env,
    make_layout,
    worker_main,
)

_AUTORESET_CODES = {
    AutoresetMode.NEXT_STEP: _worker_loop.MODE_NEXT_STEP,
    AutoresetMode.SAME_STEP: _worker_loop.MODE_SAME_STEP,
    AutoresetMode.DISABLED: _worker_loop.MODE_DISABLED,
}

logger = logging.getLogger("shmvec")

#: The main process checks that its workers are alive this often while it waits.
LIVENESS_CHECK_S = 0.1
LIVENESS_CHECK_NS = int(LIVENESS_CHECK_S * 1e9)
#: How long close() gives workers to close their envs, and SIGTERM to act.
CLOSE_GRACE_S = 5.0


class ShmVectorEnv(AsyncRollouts, VectorEnv):
    """Runs ``env_fns`` in worker processes; results come back through shared memory.

    The constructor takes ``gymnasium.vector.AsyncVectorEnv``'s arguments in the
    same order, plus keyword-only tuning arguments, and the object behaves as
    ``AsyncVectorEnv`` / ``SyncVectorEnv`` do: same spaces, same results for the
    same seeds and actions, same autoreset modes, infos and errors.

    Each worker owns a contiguous block of envs. Actions are written into an
    action slab, observations, rewards and done flags into a ring of
    ``ring_depth`` result slots, all typed columns of one memfd segment; a
    futex barrier replaces the pipes. Only infos, errors, ``call`` results and
    spaces without a fixed size are pickled, and only when there is one.

    Args:
        env_fns: zero-argument callables, each creating one env.
        shared_memory: if False, observations are pickled (every space works,
            slower), as in AsyncVectorEnv.
        copy: if True, ``reset``/``step`` return copies. If False they return
            views of the result ring: an array returned by a call stays valid
            for ``ring_depth - 1`` further ``step``/``reset`` calls.
        context: multiprocessing start method (``"fork"``, ``"spawn"``,
            ``"forkserver"``, or None for Python's default).
        daemon: whether workers are daemonic.
        worker: must be None: shmvec runs its own worker loop.
        observation_mode: ``"same"``, ``"different"`` or a ``(batched, single)``
            tuple of spaces, as in AsyncVectorEnv.
        autoreset_mode: an ``AutoresetMode`` or its string value.
        max_concurrency: at most this many envs inside ``reset``/``step`` at once;
            shmvec honours it by running at most that many workers (each worker
            steps its envs one after another).
        num_workers: worker processes; default ``min(num_envs, cpus)``. ``0`` runs
            every env in the main process (``in_process``), through the same code
            and with the same results: the debugging mode, where a breakpoint
            inside ``env.step`` just works.
        on_worker_death: ``"raise"`` (default): a dead worker (segfault, SIGKILL,
            OOM kill) is a ``WorkerDiedError``. ``"restart"``: it is started
            again, its envs are re-created and reset, and in that step they
            report ``truncated`` with ``infos["worker_restarted"]``; the other
            envs are unaffected. In async mode each env that was running
            delivers one result; the others report a truncated episode for
            their next command.
        on_env_error: ``"raise"`` (default): an exception in an env is raised
            here. ``"reset"``: the env is reset and its step reports
            ``truncated`` with ``infos["env_error"]`` (the exception's type and
            message); resets and ``call`` still raise.
        env_timeout: seconds a worker may take for one ``step``/``reset`` (sync
            mode: of its whole block; async mode: of one env); a worker past it
            is killed and treated as dead under ``on_worker_death``. None
            (default): no limit.
        fallback: ``"serial"``: if the kernel refuses what workers need (no
            memfd, futexes forbidden by a sandbox, no process can be started),
            log a warning saying why and run every env in the main process
            (as ``num_workers=0``). None (default): a RuntimeError says why.
        validate_actions: if True, ``step``/``send`` check every action against
            ``single_action_space`` (bounds, NaN in a Box, Discrete range) and
            raise a ValueError naming the envs before any env steps. Off by
            default, as in gymnasium: envs get what they are given.
        step_in_main: if True, the main process steps the first block of envs
            itself, in ``step_wait``/``recv``, while the workers step theirs:
            ``num_workers - 1`` processes are started and the main process's
            core does env work instead of waiting. The fastest choice when
            there are as many workers as cores and the envs are cheap, at the
            price of isolation: those envs live in the main process (a crash
            there is the trainer's crash, a timeout cannot interrupt them).
        batch_size: with ``batch_size < num_envs``, the async engine: use
            ``async_reset``/``send``/``recv`` (see shmvec/async_api.py).
        group_size: envs ``g*k .. g*k+g-1`` form group ``k``: ``reset(seed=s)``
            gives them all seed ``s + k`` and list seeds/options may have one
            entry per group (GRPO-style grouped rollouts).
        ring_depth: result slots in the ring (>= 2).
        spin_ns: how long a waiter (main or worker) spins before it sleeps on
            its futex; default ``shmvec.spin.default_spin``.
        env_concurrency: how many of its envs a worker may step at once. None
            (default): automatic: a worker whose envs mostly wait (sleeps,
            sockets, subprocesses: their step releases the GIL) steps up to
            its whole block at once in threads, as measured on a few steps; a
            worker whose envs compute steps them one after another. An int caps
            that choice (``1``: never). ``stats()["worker_env_threads"]`` shows
            the choice (shmvec/concurrent_envs.py).
    """

    def __init__(
        self,
        env_fns: Sequence[Callable[[], gym.Env]],
        shared_memory: bool = True,
        copy: bool = True,
        context: str | None = None,
        daemon: bool = True,
        worker: Callable | None = None,
        observation_mode: str | gym.Space = "same",
        autoreset_mode: str | AutoresetMode = AutoresetMode.NEXT_STEP,
        max_concurrency: int | None = None,
        *,
        num_workers: int | None = None,
        batch_size: int | None = None,
        group_size: int = 1,
        ring_depth: int = 2,
        spin_ns: int | None = None,
        on_worker_death: str = "raise",
        on_env_error: str = "raise",
        env_timeout: float | None = None,
        step_in_main: bool = False,
        fallback: str | None = None,
        validate_actions: bool = False,
        env_concurrency: int | None = None,
    ) -> None:
        self.closed = True  # until the workers are up; close() is then a no-op
        env_fns = _check_env_fns(env_fns)
        self.env_fns = env_fns
        self.shared_memory = shared_memory
        self.copy = copy
        self.context = context
        self.daemon = daemon
        self.worker = worker
        self.observation_mode = observation_mode
        self.autoreset_mode = (
            autoreset_mode
            if isinstance(autoreset_mode, AutoresetMode)
            else AutoresetMode(autoreset_mode)
        )
        self.max_concurrency = _check_max_concurrency(max_concurrency)
        if worker is not None:
            raise ValueError(
                "ShmVectorEnv runs its own worker loop over shared memory and cannot use a "
                "custom `worker`; use gymnasium.vector.AsyncVectorEnv for that."
            )
        self.num_envs = len(env_fns)

        dummy_env = env_fns[0]()
        check_env(dummy_env, 0)
        self.metadata = dict(dummy_env.metadata)
        self.metadata["autoreset_mode"] = self.autoreset_mode
        self.render_mode = dummy_env.render_mode
        self.single_action_space = dummy_env.action_space
        self.action_space = batch_space(self.single_action_space, self.num_envs)
        self._set_observation_spaces(dummy_env, observation_mode)
        dummy_env.close()
        del dummy_env

        if num_workers is None:
            num_workers = min(self.num_envs, available_cpus())
        if self.max_concurrency is not None:
            num_workers = min(num_workers, self.max_concurrency)
        if not 0 <= num_workers <= self.num_envs:
            raise ValueError(
                f"num_workers must be between 0 and num_envs={self.num_envs}, got {num_workers}"
            )
        self._spin_ns = spin_ns
        self._configure_workers(num_workers, step_in_main)
        self.env_concurrency = _check_env_concurrency(
            env_concurrency, self.max_concurrency, self.num_workers
        )
        self.batch_size = self.num_envs if batch_size is None else int(batch_size)
        if not 1 <= self.batch_size <= self.num_envs:
            raise ValueError(
                f"batch_size must be between 1 and num_envs={self.num_envs}, got {batch_size}"
            )
        self.is_async = self.batch_size < self.num_envs  # the EnvPool-style API (async_api)
        if group_size < 1 or self.num_envs % group_size:
            raise ValueError(f"group_size must divide num_envs={self.num_envs}, got {group_size}")
        self.group_size = group_size
        self.env_tags: list[str] | None = None  # set by shmvec.make_mix
        if self.is_async:
            # See csrc/result_ring.h: enough slots that a claim never overruns.
            ring_depth = max(ring_depth, -(-self.num_envs // self.batch_size) + 1)
        self.ring_depth = ring_depth
        self._obs_codec = make_codec(self.single_observation_space, shared_memory)
        self._action_codec = make_codec(self.single_action_space)
        self._pickled_actions = PickledCodec(self.single_action_space)
        if self.is_async and self._action_codec.pickled:
            raise ValueError(
                f"batch_size < num_envs needs a fixed-size action space, not "
                f"{self.single_action_space}"
            )
        self.on_worker_death = _check_choice("on_worker_death", on_worker_death, "restart")
        self.on_env_error = _check_choice("on_env_error", on_env_error, "reset")
        if env_timeout is not None and not env_timeout > 0:
            raise ValueError(f"env_timeout must be a positive number of seconds, got {env_timeout}")
        self.env_timeout = env_timeout
        self._killed_stuck: dict[int, str] = {}  # worker -> why shmvec killed it
        self._recovered: dict[int, dict] = {}  # messages of replacement workers
        self._reset_payloads: dict[int, tuple] = {}  # the last reset of each worker
        self._stats_restarts = 0
        self._stats_env_resets = 0
        self._stats_wait_s = 0.0
        self._stats_steps = 0
        self._stats_episodes = 0
        self._stats_started = time.perf_counter()
        self._state = AsyncState.DEFAULT
        self._unfinished_round = False
        self._pickled_obs: list | None = None  # last obs of each env, pickled spaces
        self._sync_reset_pending = False  # async_reset() in sync mode: recv() waits for it
        self._slot = 0
        self._workers: list = []
        self._main_worker: InProcessWorker | None = None  # worker 0 with step_in_main
        self._pipes: list = []
        self._stashed: list[tuple[deque, deque]] = []
        self._segment = None
        if fallback not in (None, "serial"):
            raise ValueError(f"fallback must be None or 'serial', got {fallback!r}")
        self.fallback = fallback
        self.validate_actions = bool(validate_actions)
        try:
            self._start(env_fns)
        except _SetupError as error:
            if fallback != "serial":
                raise RuntimeError(
                    f"{error}. Pass fallback='serial' to run every env in the main process instead."
                ) from error.__cause__
            logger.warning("%s: running every env in the main process (fallback='serial')", error)
            self._configure_workers(0, True)
            self._start(env_fns)
        self.closed = False

    # ------------------------------------------------------------------ setup

    def _configure_workers(self, num_workers: int, step_in_main: bool) -> None:
        # num_workers=0: one worker, run in this process (see InProcessWorker);
        # step_in_main: worker 0 runs in this process, the others are processes.
        self.in_process = num_workers == 0
        self.step_in_main = self.in_process or bool(step_in_main)
        self.num_workers = max(num_workers, 1)
        self._env_blocks = _split_blocks(self.num_envs, self.num_workers)
        processes = self.num_workers - 1 if self.step_in_main else self.num_workers
        spin_ns = self._spin_ns
        self._spin = default_spin(processes) if spin_ns is None else SpinPolicy(spin_ns, spin_ns)
        self._info_schemas: list[dict] = [{} for _ in range(self.num_workers)]

    def _set_observation_spaces(self, dummy_env: gym.Env, observation_mode) -> None:
        if isinstance(observation_mode, tuple) and len(observation_mode) == 2:
            batched, single = observation_mode
            if not (isinstance(batched, gym.Space) and isinstance(single, gym.Space)):
                raise TypeError(
                    "observation_mode as a tuple must be (batched space, single space), got "
                    f"{observation_mode!r}"
                )
            self.observation_space, self.single_observation_space = batched, single
        elif observation_mode == "same":
            self.single_observation_space = dummy_env.observation_space
            self.observation_space = batch_space(self.single_observation_space, self.num_envs)
        elif observation_mode == "different":
            self.single_observation_space = dummy_env.observation_space
            spaces = [dummy_env.observation_space] + [
                fn().observation_space for fn in self.env_fns[1:]
            ]
            self.observation_space = batch_differing_spaces(spaces)
        else:
            raise ValueError(
                "Invalid `observation_mode`, expected: 'same' or 'different' or tuple of single "
                f"and batch observation space, actual got {observation_mode}"
            )

    def _start(self, env_fns: list) -> None:
        self._layout = make_layout(self._worker_spec(0, 0, []))
        self._workers, self._pipes, self._stashed, self._main_worker = [], [], [], None
        try:
            self._segment = _create_segment(self._layout.total_bytes, private=self.in_process)
            buffer = memoryview(self._segment)
            self._barrier = _core.StepBarrier(
                self._segment, self._layout.barrier_offset, self.num_workers
            )
            if not self.in_process:
                _probe_futex(self._segment, self._layout.barrier_offset)
            self._message_flags = self._layout.worker_words(buffer)
            self._action_views = self._layout.action_views(buffer)
            self._slots = [self._layout.slot_views(buffer, k) for k in range(self.ring_depth)]
            if self.batch_size < self.num_envs:
                self._init_async(buffer)
            self._spawn_workers(env_fns)
            self._await_ready()
        except BaseException:
            self._terminate_workers()
            self._release()
            raise

    def _worker_spec(self, index: int, first_env: int, env_fns) -> WorkerSpec:
        mode = self.observation_mode if isinstance(self.observation_mode, str) else "custom"
        return WorkerSpec(
            index=index,
            first_env=first_env,
            env_fns=env_fns,
            num_envs=self.num_envs,
            num_workers=self.num_workers,
            num_slots=self.ring_depth,
            batch_size=self.batch_size,
            observation_space=self.single_observation_space,
            action_space=self.single_action_space,
            observation_mode=mode,
            shared_memory=self.shared_memory,
            autoreset_mode=_AUTORESET_CODES[self.autoreset_mode],
            spin_ns=self._spin.worker_ns,
            main_pid=os.getpid(),
            use_death_signal=threading.current_thread() is threading.main_thread(),
            on_env_error=self.on_env_error,
            # The main process's own block (step_in_main) is stepped serially.
            env_concurrency=1 if index == 0 and self.step_in_main else self.env_concurrency,
        )

    def _spawn_workers(self, env_fns: list) -> None:
        for index, rows in enumerate(self._env_blocks):
            self._stashed.append((deque(), deque()))  # (replies, row messages)
            if index == 0 and self.step_in_main:
                main_end, worker_end = LoopbackPipe.pair()
                spec = self._worker_spec(0, rows.start, env_fns[rows.start : rows.stop])
                self._main_worker = InProcessWorker(spec, self._segment, worker_end)
                self._workers.append(self._main_worker)
                self._pipes.append(main_end)
                logger.info("running envs %d..%d in the main process", rows.start, rows.stop - 1)
            else:
                process, pipe = self._start_worker(index)
                self._workers.append(process)
                self._pipes.append(pipe)

    def _start_worker(self, index: int, **spec_changes) -> tuple:
        """Starts the process of worker ``index`` (again, after a death);
        returns it and the main's end of its pipe."""
        ctx = multiprocessing.get_context(self.context)
        rows = self._env_blocks[index]
        block = self.env_fns[rows.start : rows.stop]
        payload = block if ctx.get_start_method() == "fork" else _pickle_env_fns(block, rows)
        spec = dataclasses.replace(self._worker_spec(index, rows.start, payload), **spec_changes)
        parent_end, child_end = ctx.Pipe(duplex=True)
        process = ctx.Process(
            target=worker_main,
            args=(spec, SegmentFd(self._segment.fd), child_end),
            name=f"shmvec-worker-{index}",
            daemon=self.daemon,
        )
        try:
            process.start()
        except OSError as exc:  # no fork/exec in this sandbox, too many processes...
            raise _SetupError(f"shmvec cannot start worker processes: {exc}") from exc
        logger.info(
            "started worker %d (pid %d, %s) for envs %d..%d",
            index, process.pid, ctx.get_start_method(), rows.start, rows.stop - 1,
        )  # fmt: skip
        child_end.close()
        return process, parent_end

    def _await_ready(self) -> None:
        for index in range(self.num_workers):
            message = self._recv(index, timeout=None)
            if "startup_error" in message:
                exc, tb = message["startup_error"]
                add_note(exc, f"shmvec worker {index} traceback:\n{tb}")
                raise exc

    # ------------------------------------------------------------------ reset

    def reset_async(
        self,
        seed: int | list[int | None] | None = None,
        options: dict[str, Any] | list[dict[str, Any] | None] | None = None,
        reset_mask: np.ndarray | None = None,
    ) -> None:
        """Sends a reset to every env, or to those in the reset mask.

        ``seed`` is an int (env ``i`` gets ``seed + i``, or ``seed + i // group_size``
        with groups), a list with one seed per env (or per group), or None.
        ``options`` is a dict for every env, or a list with one dict (or None) per
        env (or per group). The mask is ``options["reset_mask"]`` as in gymnasium,
        or, with a list of options, the ``reset_mask`` argument.
        """
        self._assert_is_running()
        if self.is_async:
            raise RuntimeError(
                "with batch_size < num_envs, reset with async_reset() and read with recv()"
            )
        seeds = self._expand_seeds(seed)
        if self._state != AsyncState.DEFAULT:
            raise AlreadyPendingCallError(
                "Calling `reset_async` while waiting for a pending call to "
                f"`{self._state.value}` to complete",
                str(self._state.value),
            )
        if isinstance(options, dict) and "reset_mask" in options:
            if reset_mask is not None:
                raise ValueError("reset_mask given twice: in options and as an argument")
            reset_mask = options.pop("reset_mask")
        mask = None if reset_mask is None else _check_reset_mask(reset_mask, self.num_envs)
        per_env = self._expand_options(options)
        self._finish_unfinished_round()
        slot = self._next_slot()
        for index, rows in enumerate(self._env_blocks):
            block = slice(rows.start, rows.stop)
            block_mask = None if mask is None else mask[block]
            self._reset_payloads[index] = (seeds[block], per_env[block], block_mask)
            self._send(index, "reset", self._reset_payloads[index])
        self._reset_mask = None if mask is None else mask.copy()
        self._post(RESET, slot)
        self._state = AsyncState.WAITING_RESET

    def reset_wait(self, timeout: float | None = None) -> tuple[Any, dict[str, Any]]:
        """Waits for the reset sent by ``reset_async``; returns ``(obs, infos)``."""
        self._assert_is_running()
        if self._state != AsyncState.WAITING_RESET:
            raise NoAsyncCallError(
                "Calling `reset_wait` without any prior call to `reset_async`.",
                AsyncState.WAITING_RESET.value,
            )
        messages = self._finish_round(timeout, "reset_wait")
        infos = self._merge_infos(messages)
        mask = self._reset_mask
        if mask is not None and not mask.all():
            self._carry_over_obs(~mask)
        obs = self._read_obs(messages)
        return obs, infos

    def reset(
        self,
        *,
        seed: int | list[int | None] | None = None,
        options: dict[str, Any] | list[dict[str, Any] | None] | None = None,
        reset_mask: np.ndarray | None = None,
    ) -> tuple[Any, dict[str, Any]]:
        """Resets the envs; see ``gymnasium.vector.VectorEnv.reset`` and ``reset_async``.

        In async mode (``batch_size < num_envs``) this is ``async_reset`` then
        ``recv``: it returns the first ``batch_size`` envs to finish resetting.
        """
        if self.is_async:
            if reset_mask is not None:
                raise ValueError("reset_mask needs batch_size == num_envs")
            self.async_reset(seed=seed, options=options)
            obs, _, _, _, infos = self.recv()
            return obs, infos
        self.reset_async(seed=seed, options=options, reset_mask=reset_mask)
        return self.reset_wait()

    def _expand_seeds(self, seed) -> list:
        return expand_seeds(seed, self.num_envs, self.group_size)

    def _expand_options(self, options) -> list:
        return expand_options(options, self.num_envs, self.group_size)

    # ------------------------------------------------------------------- step

    def step_async(self, actions: ArrayType) -> None:
        """Writes ``actions`` into the action slab and starts a step."""
        self._step_async(actions, write=True)

    def _step_async(self, actions: ArrayType | None, write: bool) -> None:
        """Starts a step; ``write=False`` when the caller filled the slab itself."""
        if self.closed or self.is_async or self._state is not AsyncState.DEFAULT:
            self._assert_is_running()
            if self.is_async:
                raise RuntimeError(
                    "with batch_size < num_envs, step with send(actions, env_ids) and recv()"
                )
            raise AlreadyPendingCallError(
                "Calling `step_async` while waiting for a pending call to "
                f"`{self._state.value}` to complete.",
                str(self._state.value),
            )
        self._finish_unfinished_round()
        by_value = False
        codec = self._action_codec
        if write and (self.validate_actions or not codec.write_exact(self._action_views, actions)):
            # Actions that are not exactly the columns' dtype (a list, float64 for
            # a float32 Box) reach each env as gymnasium hands them over: the
            # element iterating the batch gives, pickled. Bit 31 of the argument
            # says so.
            by_value = codec.pickled or not codec.is_exact(actions)
            if self.validate_actions:
                self._check_actions(actions, range(self.num_envs))
            if by_value:
                per_env = [None] * self.num_envs
                self._pickled_actions.write_batch(per_env, actions)
                for index, rows in enumerate(self._env_blocks):
                    self._send(index, "actions", per_env[rows.start : rows.stop])
            else:
                codec.write_batch(self._action_views, actions)
        self._post(STEP, self._next_slot() | (by_value << 31))
        self._state = AsyncState.WAITING_STEP

    def step_wait(
        self, timeout: float | None = None
    ) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Waits for the step started by ``step_async``."""
        if self.closed or self._state is not AsyncState.WAITING_STEP:
            self._assert_is_running()
            raise NoAsyncCallError(
                "Calling `step_wait` without any prior call to `step_async`.",
                AsyncState.WAITING_STEP.value,
            )
        messages = self._finish_round(timeout, "step_wait")
        infos = self._merge_infos(messages)
        if "env_error" in infos:
            self._note_env_resets(infos, np.arange(self.num_envs))
        slot = self._slots[self._slot]
        self._count(slot.terminations, slot.truncations)
        return (self._read_obs(messages), *self._slot_outcomes(slot), infos)

    def _slot_outcomes(self, slot) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rewards, terminations, truncations) of a ring slot: copies if ``copy``,
        the flags as bool."""
        rewards, terminations, truncations = slot.rewards, slot.terminations, slot.truncations
        if self.copy:
            rewards, terminations, truncations = (
                rewards.copy(), terminations.copy(), truncations.copy()
            )  # fmt: skip
        return rewards, terminations.view(np.bool_), truncations.view(np.bool_)

    def step(self, actions: ArrayType):
        """Steps every env; see ``gymnasium.vector.VectorEnv.step``.

        The common case, a sync-mode step of actions of exactly the space's
        dtype where no worker has anything to say, takes a short path: with
        cheap envs on 2 cores the main process's Python is a tenth of a step.
        Anything else goes through ``step_async``/``step_wait``; a short path
        that meets something unusual once the round is started (an env's
        error, a pickled info, a worker still busy after ``LIVENESS_CHECK_S``,
        a death) hands the round over to ``step_wait``.
        """
        # Inlined on purpose: each Python call here costs about a microsecond,
        # the caches being cold after the envs' own code.
        if (
            self.closed
            or self._state is not AsyncState.DEFAULT
            or self.is_async
            or self._unfinished_round
            or self.validate_actions
            or self.env_timeout is not None
            or self._obs_codec.pickled  # its observations come in messages
            or not self._action_codec.write_exact(self._action_views, actions)
        ):
            self.step_async(actions)
            return self.step_wait()
        barrier = self._barrier
        barrier.post(STEP, self._next_slot())  # _post's extras are for async mode and env_timeout
        self._state = AsyncState.WAITING_STEP
        try:
            if self._main_worker is not None:
                self._main_worker.poll(False)
            waited = time.perf_counter()
            done = barrier.wait_done(self._spin.main_ns, LIVENESS_CHECK_NS)
            self._stats_wait_s += time.perf_counter() - waited
        except BaseException:  # Ctrl-C: as in _finish_round
            self._state = AsyncState.DEFAULT
            raise
        if not done or barrier.messages() or self._recovered or any(self._info_schemas):
            return self.step_wait()
        self._state = AsyncState.DEFAULT
        slot = self._slots[self._slot]
        self._count(slot.terminations, slot.truncations)
        self.observations = obs = self._obs_codec.read_batch(slot.obs, self.copy)
        return (obs, *self._slot_outcomes(slot), {})

    # ------------------------------------------------------------- call & co

    def call_async(self, name: str, *args: Any, **kwargs: Any) -> None:
        """Calls ``name`` (or reads it, if not callable) in every env."""
        self._assert_is_running()
        if self._state != AsyncState.DEFAULT:
            raise AlreadyPendingCallError(
                "Calling `call_async` while waiting for a pending call to "
                f"`{self._state.value}` to complete.",
                str(self._state.value),
            )
        self._finish_unfinished_round()
        payload = (name, args, kwargs)
        for index in range(self.num_workers):
            self._send(index, "call", payload)
        self._post(CALL)
        self._state = AsyncState.WAITING_CALL

    def call_wait(self, timeout: float | None = None) -> tuple[Any, ...]:
        """The results of ``call_async``, one per env."""
        self._assert_is_running()
        if self._state != AsyncState.WAITING_CALL:
            raise NoAsyncCallError(
                "Calling `call_wait` without any prior call to `call_async`.",
                AsyncState.WAITING_CALL.value,
            )
        messages = self._finish_round(timeout, "call_wait")
        return tuple(r for message in messages.values() for r in message["results"])

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Calls ``name`` in every env and returns the results as a tuple."""
        self.call_async(name, *args, **kwargs)
        return self.call_wait()

    def get_attr(self, name: str) -> tuple[Any, ...]:
        """The attribute ``name`` of every env (callables are called, as in gymnasium)."""
        return self.call(name)

    def set_attr(self, name: str, values: list[Any] | tuple[Any, ...] | Any) -> None:
        """Sets ``name`` in every env: one value each, or the same value for all."""
        self._assert_is_running()
        if not isinstance(values, (list, tuple)):
            values = [values] * self.num_envs
        if len(values) != self.num_envs:
            raise ValueError(
                "Values must be a list or tuple with length equal to the number of "
                f"environments. Got `{len(values)}` values for {self.num_envs} environments."
            )
        if self._state != AsyncState.DEFAULT:
            raise AlreadyPendingCallError(
                "Calling `set_attr` while waiting for a pending call to "
                f"`{self._state.value}` to complete.",
                str(self._state.value),
            )
        self._finish_unfinished_round()
        for index, rows in enumerate(self._env_blocks):
            self._send(index, "set_attr", (name, list(values[rows.start : rows.stop])))
        self._post(SET_ATTR)
        self._state = AsyncState.WAITING_CALL
        self._finish_round(None, "set_attr")

    def render(self) -> tuple[Any, ...] | None:
        """Each env's ``render()``."""
        return self.call("render")

    @property
    def np_random_seed(self) -> tuple[int, ...]:
        """The sub-envs' ``np_random_seed``."""
        return self.get_attr("np_random_seed")

    @property
    def np_random(self) -> tuple[np.random.Generator, ...]:
        """Copies of the sub-envs' random generators."""
        return self.get_attr("np_random")

    # ------------------------------------------------------------------ close

    def close_extras(self, timeout: float | None = None, terminate: bool = False) -> None:
        """Closes the envs and stops the workers (SIGKILL after a grace period)."""
        if self._state != AsyncState.DEFAULT:
            gym_logger.warn(
                f"Calling `close` while waiting for a pending call to `{self._state.value}` "
                "to complete."
            )
            try:
                self._finish_round(0 if terminate else timeout, "close")
            except (multiprocessing.TimeoutError, WorkerDiedError):
                terminate = True
            except Exception:  # noqa: BLE001 - an env error in that call: still close
                pass
        if not terminate:
            try:
                self._finish_unfinished_round(CLOSE_GRACE_S if timeout is None else timeout)
                self._post(CLOSE)
                self._state = AsyncState.WAITING_CALL
                self._wait_done(CLOSE_GRACE_S if timeout is None else timeout, "close")
            except (multiprocessing.TimeoutError, WorkerDiedError):
                pass
            finally:
                self._state = AsyncState.DEFAULT
        if logger.isEnabledFor(logging.DEBUG):
            stats = self.stats()
            logger.debug(
                "closing: %d steps, %.0f steps/s, main waited %.0f%%, workers busy %s",
                stats["steps"], stats["steps_per_s"], 100 * stats["main_wait_fraction"],
                ", ".join(f"{100 * f:.0f}%" for f in stats["worker_busy_fraction"]),
            )  # fmt: skip
        self._terminate_workers(grace_s=0.0 if terminate else CLOSE_GRACE_S)
        for index, process in enumerate(self._workers):
            logger.info("worker %d (pid %d) exited with %s", index, process.pid, process.exitcode)
        self._release()

    def __enter__(self) -> ShmVectorEnv:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "closed", True):
            self.close(terminate=True)

    # ---------------------------------------------------------------- helpers

    def _assert_is_running(self) -> None:
        if self.closed:
            raise ClosedEnvironmentError(
                f"Trying to operate on `{type(self).__name__}`, after a call to `close()`."
            )

    def _next_slot(self) -> int:
        self._slot = (self._slot + 1) % self.ring_depth
        self._before_slot_reuse(self._slot)
        return self._slot

    def _before_slot_reuse(self, slot: int) -> None:
        """Called before workers may overwrite ``slot``; the torch bridge waits
        there for its device copy out of that slot to finish."""

    def _post(self, kind: int, arg: int = 0) -> None:
        """Starts a barrier round; async-mode workers sleep on their doorbells."""
        self._round_started = time.monotonic()
        self._barrier.post(kind, arg)
        if self.is_async:
            for bell in self._doorbells:
                bell.ring()

    def _send(self, index: int, tag: str, payload: Any) -> None:
        """Sends worker ``index`` a payload it reads with ``Worker._recv(tag)``."""
        message = pickle.dumps((tag, payload), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self._pipes[index].send_bytes(message)
        except (BrokenPipeError, ConnectionResetError):
            self._workers[index].join(1.0)
            if self.on_worker_death == "restart" and self._workers[index].exitcode is not None:
                return  # the round's wait restarts it (and resends a reset)
            self._check_alive(index)  # raises WorkerDiedError
            raise

    def _recv(self, index: int, timeout: float | None, row: bool = False) -> dict:
        """The next message of worker ``index``, noticing its death.

        Async mode interleaves two streams on a pipe: per-row messages (with a
        ``"row"`` key) and replies to barrier commands. Each caller asks for
        one; messages of the other are kept for their turn.
        """
        stash = self._stashed[index][row]
        if stash:
            return stash.popleft()
        while True:
            message = self._recv_any(index, timeout)
            if ("row" in message) == row:
                return message
            self._stashed[index][not row].append(message)

    def _recv_any(self, index: int, timeout: float | None) -> dict:
        pipe = self._pipes[index]
        deadline = None if timeout is None else time.monotonic() + timeout
        while not pipe.poll(LIVENESS_CHECK_S):
            self._check_alive(index)
            if deadline is not None and time.monotonic() > deadline:
                raise multiprocessing.TimeoutError(f"no message from shmvec worker {index}")
        try:
            return pickle.loads(pipe.recv_bytes())
        except EOFError:
            self._workers[index].join(1.0)
            self._check_alive(index)
            raise

    def _check_alive(self, index: int) -> None:
        process = self._workers[index]
        if process.exitcode is not None:
            error = WorkerDiedError(index, self._env_blocks[index], process.exitcode, process.pid)
            why = self._killed_stuck.pop(index, None)
            if why is not None:
                add_note(error, why)
            logger.error("%s", error)
            raise error

    def _remote_error(self, errors: list) -> BaseException:
        return _remote_error(errors, self._env_blocks)

    def _check_actions(self, actions: Any, env_ids) -> None:
        """``validate_actions``: a ValueError naming the envs whose action is not
        in the action space."""
        space = self.single_action_space
        bad = []
        for env, action in zip(env_ids, iterate(self.action_space, actions)):
            if isinstance(space, gym.spaces.Box):  # float64 for a float32 Box is fine
                action = np.asarray(action).astype(space.dtype, casting="same_kind")
            if not space.contains(action):
                bad.append(f"env {env}: {action!r}")
        if bad:
            more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
            raise ValueError(
                f"actions outside the action space {space}: {'; '.join(bad[:5])}{more}"
            )

    def _note_env_resets(self, infos: dict, env_ids: np.ndarray) -> None:
        """``on_env_error="reset"``: counts and logs the envs reset after an error."""
        rows = np.flatnonzero(infos["_env_error"])
        self._stats_env_resets += len(rows)
        for row in rows.tolist():
            logger.warning("env %d was reset after %s", env_ids[row], infos["env_error"][row])

    def _count(self, terminations: np.ndarray, truncations: np.ndarray) -> None:
        self._stats_steps += len(terminations)
        # The flags are bytes 0 or 1: OR-ed as two big integers, the set bits
        # are the envs whose episode ended (numpy's ufuncs cost more here).
        ended = int.from_bytes(terminations, "little") | int.from_bytes(truncations, "little")
        self._stats_episodes += ended.bit_count()

    def stats(self) -> dict[str, Any]:
        """Throughput and where the time goes, since construction.

        Returns a dict: ``steps`` (env steps returned), ``steps_per_s``,
        ``episodes`` (episodes ended), ``main_wait_fraction`` (time the main
        process spent waiting for results), ``worker_busy_fraction`` (per
        worker: time spent in env code and writing results),
        ``worker_cpu_fraction`` (per worker: CPU time of its process, all
        threads, over the elapsed time; for the main process's own block with
        ``step_in_main``, the main process's), ``worker_env_threads`` (per worker:
        envs it steps at once, see ``env_concurrency``), ``worker_restarts``
        and ``env_resets`` (envs reset after an exception, ``on_env_error``).
        """
        elapsed = time.perf_counter() - self._stats_started
        buffer = memoryview(self._segment)
        busy_ns = self._layout.worker_busy_ns(buffer)
        return {
            "steps": self._stats_steps,
            "steps_per_s": self._stats_steps / elapsed if elapsed > 0 else 0.0,
            "episodes": self._stats_episodes,
            "main_wait_fraction": self._stats_wait_s / elapsed if elapsed > 0 else 0.0,
            "worker_busy_fraction": (busy_ns / 1e9 / elapsed).tolist() if elapsed > 0 else [],
            "worker_cpu_fraction": [
                _cpu_seconds(process.pid) / elapsed if elapsed > 0 else 0.0
                for process in self._workers
            ],
            "worker_env_threads": self._layout.worker_env_threads(buffer).tolist(),
            "elapsed_s": elapsed,
            "worker_restarts": self._stats_restarts,
            "env_resets": self._stats_env_resets,
        }

    def _wait_done(self, timeout: float | None, name: str) -> None:
        """Waits for every worker to arrive; raises on timeout or a worker's death.

        With ``on_worker_death="restart"`` a dead worker is replaced and the
        replacement does its part of the round (``Worker.recover``); the round
        then ends when every other worker has finished it, whatever the
        barrier's count (the dead worker may or may not have arrived).
        """
        self._run_main_worker()
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.env_timeout is None:  # the common case first: one wait, no checks
            budget = LIVENESS_CHECK_S if timeout is None else min(timeout, LIVENESS_CHECK_S)
            if self._quick_wait(budget):
                return
        restarted: dict[int, WorkerDiedError] = {}

        def ready(spin_ns: int, budget_ns: int) -> bool:
            if not self.is_async:  # async mode times envs, in recv()
                self._kill_stuck_workers(restarted)
            if restarted:
                return self._finished_except(restarted, budget_ns)
            return self._barrier.wait_done(spin_ns, budget_ns)

        while True:
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            try:
                self._wait_for(
                    ready,
                    remaining,
                    lambda: (
                        f"The call to `{name}` has timed out after {timeout} second(s). "
                        f"Not finished: {self._unfinished_workers()}."
                    ),
                )
                break
            except WorkerDiedError as error:
                if self.on_worker_death != "restart" or name == "close":
                    raise
                if self.is_async:
                    self._restart_async_worker(error.worker)
                else:
                    self._restart_worker(error.worker)
                restarted[error.worker] = error
        if restarted and self._state == AsyncState.WAITING_CALL:
            error = next(iter(restarted.values()))
            add_note(error, f"the worker was restarted and its envs reset; `{name}` again")
            raise error

    def _quick_wait(self, budget_s: float) -> bool:
        """One futex wait of up to ``budget_s`` for the round's end; False if it
        did not end (the caller then checks the workers, timeouts and deaths)."""
        waited = time.perf_counter()
        done = self._barrier.wait_done(self._spin.main_ns, int(budget_s * 1e9))
        self._stats_wait_s += time.perf_counter() - waited
        return done

    def _finished_except(self, restarted: dict, budget_ns: int) -> bool:
        """True once every worker but the ``restarted`` ones finished this round."""
        finished = self._layout.worker_finished_generation(memoryview(self._segment))
        generation = self._barrier.generation
        others = [i for i in range(self.num_workers) if i not in restarted]
        deadline = time.monotonic() + budget_ns / 1e9
        while not all(finished[i] == generation for i in others):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.0002)  # a round with a restart: no need for a futex
        return True

    def _kill_stuck_workers(self, spared=()) -> None:
        """``env_timeout``: kills the workers past it: in sync mode those still in
        this round, in async mode those still in the env they began."""
        if self.env_timeout is None:
            return
        buffer = memoryview(self._segment)
        current = self._layout.worker_current_env(buffer)
        if self.is_async:
            started = self._layout.worker_env_started_ns(buffer)
            limit_ns = time.monotonic_ns() - int(self.env_timeout * 1e9)
            late = [i for i in range(self.num_workers) if current[i] and started[i] < limit_ns]
        elif time.monotonic() - self._round_started >= self.env_timeout:
            finished = self._layout.worker_finished_generation(buffer)
            generation = self._barrier.generation
            late = [i for i in range(self.num_workers) if finished[i] != generation]
        else:
            return
        for index in late:
            process = self._workers[index]
            if index in spared or process is self._main_worker or process.exitcode is not None:
                continue
            where = f"env {current[index] - 1}" if current[index] else "its envs"
            limit = self.env_timeout
            why = f"killed by shmvec: stuck in {where} for more than env_timeout={limit} s"
            logger.error("worker %d (pid %d) %s", index, process.pid, why)
            self._killed_stuck[index] = why
            process.kill()
            process.join(1.0)

    def _restart_worker(self, index: int) -> None:
        """Replaces dead worker ``index``; the new one recovers the current round."""
        rows = self._env_blocks[index]
        self._workers[index].join(1.0)
        self._pipes[index].close()
        self._stashed[index] = (deque(), deque())
        self._message_flags[index] = 0  # the dead worker's message died with its pipe
        kind = {AsyncState.WAITING_STEP: STEP, AsyncState.WAITING_RESET: RESET}.get(
            self._state, CALL
        )
        self._workers[index], self._pipes[index] = self._start_worker(
            index,
            generation=self._barrier.generation,
            recover=(kind, self._slot),
            info_schema=dict(self._info_schemas[index]),
        )
        if kind == RESET:
            self._send(index, "reset", self._reset_payloads[index])
            if self._reset_mask is not None:  # its envs are all new: none keeps its obs
                self._reset_mask[rows.start : rows.stop] = True
        message = self._recv(index, timeout=None)
        if "startup_error" in message:
            exc, tb = message["startup_error"]
            add_note(exc, f"while restarting shmvec worker {index}; traceback:\n{tb}")
            raise exc
        self._recovered[index] = message.get("recovered", {})
        self._stats_restarts += 1
        logger.warning(
            "restarted worker %d (pid %d) for envs %d..%d",
            index, self._workers[index].pid, rows.start, rows.stop - 1,
        )  # fmt: skip

    def _run_main_worker(self) -> None:
        """With ``step_in_main``: does worker 0's share of what was just asked."""
        if self._main_worker is not None:
            self._main_worker.poll(self.is_async)

    def _unfinished_workers(self) -> str:
        """The workers that have not finished the current round, and their env."""
        buffer = memoryview(self._segment)
        finished = self._layout.worker_finished_generation(buffer)
        current = self._layout.worker_current_env(buffer)
        generation = self._barrier.generation
        late = []
        for index, rows in enumerate(self._env_blocks):
            if finished[index] != generation:
                where = f", in env {current[index] - 1}" if current[index] else ""
                late.append(f"worker {index} (envs {rows.start}..{rows.stop - 1}{where})")
        return ", ".join(late) or "none (they finished as the wait ended)"

    def _wait_for(
        self, ready: Callable[[int, int], bool], timeout: float | None, why: Callable[[], str]
    ) -> None:
        """Calls ``ready(spin_ns, budget_ns)`` (a futex wait) until it returns True,
        checking between calls that every worker lives; ``multiprocessing.TimeoutError``
        with ``why()`` after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        waited = time.perf_counter()
        try:
            while True:
                budget = LIVENESS_CHECK_S
                if deadline is not None:
                    budget = min(budget, max(deadline - time.monotonic(), 0.0))
                if ready(self._spin.main_ns, int(budget * 1e9)):
                    return
                for index in range(self.num_workers):
                    self._check_alive(index)
                if deadline is not None and time.monotonic() >= deadline:
                    raise multiprocessing.TimeoutError(why())
        finally:
            self._stats_wait_s += time.perf_counter() - waited

    def _finish_round(self, timeout: float | None, name: str) -> dict[int, dict]:
        """Ends the pending round: waits, reads messages, re-raises env errors."""
        try:
            self._wait_done(timeout, name)
        except multiprocessing.TimeoutError:
            self._state = AsyncState.DEFAULT
            self._unfinished_round = True
            raise
        except BaseException:  # a dead worker, a failed restart, Ctrl-C
            self._state = AsyncState.DEFAULT
            raise
        self._state = AsyncState.DEFAULT
        messages = self._collect_messages()
        if messages:
            errors = [e for m in messages.values() for e in m.get("errors", ())]
            if errors:
                raise self._remote_error(errors)
        return messages

    def _collect_messages(self) -> dict[int, dict]:
        """This round's messages, by worker, in worker (so row) order."""
        # The barrier's count first: reading the workers' own words (numpy's
        # any() above all) costs several microseconds a round.
        if not (self._barrier.messages() or self._recovered):
            return {}
        flags = self._message_flags
        messages = self._recovered
        self._recovered = {}
        for index in np.flatnonzero(flags).tolist():
            flags[index] = 0
            messages[index] = self._recv(index, timeout=None)
        return dict(sorted(messages.items()))

    def _finish_unfinished_round(self, timeout: float | None = None) -> None:
        """Completes a round whose wait timed out, dropping its results."""
        if self._unfinished_round:
            self._wait_done(timeout, "close" if timeout is not None else "step_wait")
            self._collect_messages()
            self._unfinished_round = False

    def _merge_infos(self, messages: dict[int, dict]) -> dict[str, Any]:
        """This round's infos: pickled ones and numeric scalar columns, in env order."""
        if not messages and not any(self._info_schemas):
            return {}
        for index, message in messages.items():
            self._info_schemas[index].update(message.get("info_columns", ()))
        pickled = [item for m in messages.values() for item in m.get("infos", ())]
        gathered = {}
        if any(self._info_schemas):
            slot = self._slots[self._slot]
            groups = [slice(rows.start, rows.stop) for rows in self._env_blocks]
            gathered = infos_columns.gather(
                self._info_schemas, groups, slot.info_codes, slot.info_cells, self.num_envs
            )
        if not pickled:
            return infos_columns.merge_columns({}, gathered, self.num_envs)
        if gathered:
            pickled = sorted(
                pickled + infos_columns.column_dicts(gathered),
                key=lambda item: item[0],
            )
        infos: dict[str, Any] = {}
        for row, dicts in pickled:
            for info in dicts:
                infos = self._add_info(infos, info, row)
        return infos

    def _read_obs(self, messages: dict[int, dict]) -> Any:
        if self._obs_codec.pickled:
            values = self._pickled_obs or [None] * self.num_envs
            for message in messages.values():
                for row, value in message.get("obs", {}).items():
                    values[row] = value
            self._pickled_obs = values
            obs = self._obs_codec.read_batch(values, self.copy)
        else:
            obs = self._obs_codec.read_batch(self._slots[self._slot].obs, self.copy)
        self.observations = obs
        return obs

    def _carry_over_obs(self, rows: np.ndarray) -> None:
        """Envs left out of a masked reset keep their previous observation."""
        if self._obs_codec.pickled:
            return  # _read_obs keeps the last value of every env
        previous = self._slots[(self._slot - 1) % self.ring_depth].obs
        for new, old in zip(self._slots[self._slot].obs, previous):
            new[rows] = old[rows]

    def _terminate_workers(self, grace_s: float = 0.0) -> None:
        """Joins the workers for ``grace_s``, then SIGTERM, then SIGKILL."""
        for stop in (None, "terminate", "kill"):
            deadline = time.monotonic() + (grace_s if stop is None else 1.0)
            for process in self._workers:
                if process.exitcode is None and stop is not None:
                    # SIGKILL last: a worker whose env initialised SDL ignores SIGTERM.
                    getattr(process, stop)()
            for process in self._workers:
                process.join(max(deadline - time.monotonic(), 0.0))
            if all(p.exitcode is not None for p in self._workers):
                return

    def _release(self) -> None:
        for pipe in self._pipes:
            pipe.close()
        self._pipes = []
        self._workers = []
        if self._segment is not None:
            self._segment.close_fd()


def expand_seeds(seed, num_envs: int, group_size: int = 1) -> list:
    """One seed per env from an int (env ``i`` gets ``seed + i // group_size``), a
    list with one per env or per group, or None; envs of a group share theirs."""
    if seed is None:
        return [None] * num_envs
    if isinstance(seed, int):
        return [seed + i // group_size for i in range(num_envs)]
    seeds = list(seed)
    return _per_env(
        seeds,
        num_envs,
        group_size,
        lambda expected: (
            "If seeds are passed as a list the length must match "
            f"num_envs={expected} but got length={len(seeds)}."
        ),
    )


def expand_options(options, num_envs: int, group_size: int = 1) -> list:
    """One options dict (or None) per env from a dict, None, or a list with one
    per env or per group; envs of a group share theirs."""
    if options is None or isinstance(options, dict):
        return [options] * num_envs
    if not isinstance(options, (list, tuple)):
        raise TypeError(f"options must be a dict, a list of dicts or None, got {options!r}")
    for i, entry in enumerate(options):
        if entry is not None and not isinstance(entry, dict):
            raise TypeError(f"options[{i}] must be a dict or None, got {entry!r}")
    return _per_env(
        list(options),
        num_envs,
        group_size,
        lambda expected: (
            f"options as a list needs one entry per env: expected {expected}, got {len(options)}"
        ),
    )


def _per_env(values: list, n: int, g: int, message: Callable[[str], str]) -> list:
    """``values`` with one entry per env, or per group (then expanded to its envs);
    any other length is a ValueError with ``message(expected lengths)``."""
    if g > 1 and len(values) == n // g:
        return [values[i // g] for i in range(n)]
    if len(values) != n:
        raise ValueError(message(f"{n} (or num_envs / group_size = {n // g})" if g > 1 else str(n)))
    return values


class _SetupError(Exception):
    """The kernel refused what the workers need; ``fallback="serial"`` does without."""


def _create_segment(size: int, private: bool):
    """The segment; private (no fd, nothing shared) when every env runs here."""
    try:
        return _core.Segment.create_private(size) if private else _core.Segment.create(size)
    except OSError as exc:  # no memfd (old kernel, seccomp), no memory
        raise _SetupError(f"shmvec cannot create its shared-memory segment: {exc}") from exc


def _probe_futex(segment, offset: int) -> None:
    """One futex wake on a segment word: a sandbox may forbid futexes."""
    try:
        _core.futex_wake(segment, offset, 1)
    except OSError as exc:
        raise _SetupError(f"shmvec cannot use futexes here: {exc}") from exc


def _check_env_fns(env_fns) -> list:
    if isinstance(env_fns, (str, bytes)) or not isinstance(env_fns, Sequence):
        try:
            env_fns = list(env_fns)
        except TypeError:
            raise TypeError(
                f"env_fns must be a sequence of callables, got {type(env_fns).__name__}"
            ) from None
    env_fns = list(env_fns)
    if not env_fns:
        raise ValueError("env_fns is empty: a vector env needs at least one env")
    for i, fn in enumerate(env_fns):
        if not callable(fn):
            raise TypeError(f"env_fns[{i}] is not callable: {fn!r}")
    return env_fns


def _check_choice(name: str, value: str, other: str) -> str:
    if value not in ("raise", other):
        raise ValueError(f"{name} must be 'raise' or {other!r}, got {value!r}")
    return value


def _check_max_concurrency(value) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"`max_concurrency` must be an integer or None, got {type(value)}.")
    if value < 1:
        raise ValueError(f"`max_concurrency` must be a positive or None, got {value}.")
    return int(value)


def _check_env_concurrency(value, max_concurrency: int | None, num_workers: int) -> int | None:
    """The per-worker cap of envs stepped at once; ``max_concurrency`` bounds it
    too (at most that many envs inside ``step`` over all workers)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"env_concurrency must be None or an int >= 1, got {value!r}")
    if max_concurrency is not None:
        per_worker = max(1, max_concurrency // num_workers)
        value = per_worker if value is None else min(value, per_worker)
    return value


def _cpu_seconds(pid: int) -> float:
    """CPU time (user + system, all threads) of process ``pid`` so far; 0.0 if
    it cannot be read (gone, or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except OSError:
        return 0.0
    # fields[11], fields[12]: utime, stime (fields 14, 15 of proc(5), in clock ticks)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _check_reset_mask(mask, num_envs: int) -> np.ndarray:
    if not isinstance(mask, np.ndarray):
        raise TypeError(f"`options['reset_mask']` must be a numpy array, got {type(mask)}")
    if mask.shape != (num_envs,):
        raise ValueError(
            f"`options['reset_mask']` must have shape `({num_envs},)`, got {mask.shape}"
        )
    if mask.dtype != np.bool_:
        raise TypeError(f"`options['reset_mask']` must have `dtype=np.bool_`, got {mask.dtype}")
    if not np.any(mask):
        raise ValueError(
            "`options['reset_mask']` must contain a boolean array with at least one True "
            f"value, got reset_mask={mask}"
        )
    return mask


def _split_blocks(num_envs: int, num_workers: int) -> list[range]:
    """Contiguous, as-even-as-possible blocks of env rows, one per worker."""
    base, extra = divmod(num_envs, num_workers)
    blocks, start = [], 0
    for index in range(num_workers):
        size = base + (1 if index < extra else 0)
        blocks.append(range(start, start + size))
        start += size
    return blocks


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


def _remote_error(errors: list, blocks: list[range]) -> BaseException:
    """The first env error, with the env, the worker and the remote traceback."""
    row, exc, tb = errors[0]
    worker = next((i for i, b in enumerate(blocks) if row in b), None)
    add_note(exc, f"raised by env {row} in shmvec worker {worker}; remote traceback:\n{tb}")
    for other_row, other, _ in errors[1:]:
        add_note(exc, f"env {other_row} also raised {type(other).__name__}: {other}")
    return exc
