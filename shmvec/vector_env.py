"""ShmVectorEnv: gymnasium's AsyncVectorEnv, over one shared-memory segment.

This class is the gymnasium face: its state machine (``reset_async`` /
``reset_wait``, ``step_async`` / ``step_wait``, ``call`` ...) and the async API
(``async_reset`` / ``send`` / ``recv``, whose sync-mode case is
``VectorEnvBase``'s). Its arguments are checked in shmvec/options.py, its
workers started by shmvec/startup.py, actions written by shmvec/actions.py, and
a device bridge reaches the ring through shmvec/handoff.py. The engine parts it
composes live in shmvec/engine/
(workers, rounds, supervision, the async ring, result decoding, stats); what
crosses process boundaries is in shmvec/protocol.py.

Example:
    >>> import gymnasium as gym
    >>> import shmvec
    >>> envs = shmvec.ShmVectorEnv([lambda: gym.make("CartPole-v1")] * 4, num_workers=2)
    >>> obs, infos = envs.reset(seed=42)
    >>> obs.shape
    (4, 4)
    >>> obs, rewards, terminations, truncations, infos = envs.step(envs.action_space.sample())
    >>> envs.close()

With ``batch_size < num_envs``, EnvPool-style rollouts:

    >>> import numpy as np
    >>> envs = shmvec.ShmVectorEnv(
    ...     [lambda: gym.make("CartPole-v1")] * 8, num_workers=2, batch_size=4
    ... )
    >>> envs.async_reset(seed=0)
    >>> for _ in range(10):
    ...     obs, rewards, terminations, truncations, infos = envs.recv()
    ...     envs.send(np.zeros(4, dtype=np.int64), infos["env_id"])
    >>> envs.close()
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import logger as gym_logger
from gymnasium.vector.async_vector_env import AsyncState
from gymnasium.vector.vector_env import ArrayType, AutoresetMode

from shmvec.actions import ActionWriter
from shmvec.batching import (
    Options,
    Seeds,
    VectorEnvBase,
    check_reset_mask,
    expand_options,
    expand_seeds,
    take_reset_mask,
)
from shmvec.codecs import TEXT_BYTES, make_codec
from shmvec.engine import EngineOptions, Stats
from shmvec.engine.async_engine import AsyncEngine
from shmvec.engine.pool import WorkerPool
from shmvec.engine.rounds import RoundDriver
from shmvec.errors import WorkerDiedError
from shmvec.handoff import ResultHandoff
from shmvec.layout import lease_regions
from shmvec.options import (
    TuningOptions,
    check_env_fns,
    check_max_concurrency,
    check_no_worker,
    describe_envs,
)
from shmvec.protocol import (
    AUTORESET_CODES,
    CLOSE,
    CLOSE_GRACE_S,
    ENV_STEP,
)
from shmvec.row_infos import RowInfos
from shmvec.spin import NO_SPIN
from shmvec.startup import start_workers
from shmvec.worker import WorkerSpec

logger = logging.getLogger("shmvec")

__all__ = ["ShmVectorEnv", "expand_options", "expand_seeds"]


class ShmVectorEnv(VectorEnvBase):
    """Runs ``env_fns`` in worker processes; results come back through shared memory.

    ``AsyncVectorEnv``'s arguments in the same order, plus keyword-only tuning
    ones; it behaves as ``AsyncVectorEnv`` / ``SyncVectorEnv`` do, bit for bit.

    Args:
        env_fns (Sequence[Callable[[], gym.Env]]): zero-argument callables, one an env.
        shared_memory (bool, default True): if False, observations are pickled (Async's).
        copy (bool, default True): if False, results are views of the result ring,
            valid for ``ring_depth - 1`` further ``step``/``reset`` calls. If True,
            they are the caller's own; observations of 64 KiB a batch or more are
            lent rather than copied: arrays over shared memory that no later call
            writes while they (or views of them) are held (shmvec/engine/leases.py).
        context (str | None, default None): multiprocessing start method (None: Python's).
        daemon (bool, default True): whether workers are daemonic.
        worker (Callable | None, default None): must be None (shmvec runs its own loop).
        observation_mode (str | gym.Space | tuple[gym.Space, gym.Space], default "same"):
            ``"same"``, ``"different"`` or a ``(batched, single)`` tuple of spaces, as in
            AsyncVectorEnv.
        autoreset_mode (str | AutoresetMode, default AutoresetMode.NEXT_STEP): an
            ``AutoresetMode`` or its string value.
        max_concurrency (int | None, default None): at most this many envs stepping
            at once (as many workers).
        num_workers (int | None, default None): worker processes; None:
            ``min(num_envs, cpus)``, the CPUs it may use (``spin.available_cpus``).
            ``0``: every env in the main process, through the same code (for debugging).
        batch_size (int | None, default None): with ``batch_size < num_envs``, the
            async engine: use ``async_reset``/``send``/``recv`` (see
            shmvec/engine/async_engine.py). None: ``num_envs``.
        group_size (int, default 1): envs ``g*k .. g*k+g-1`` share seed ``s + k`` and
            may share list seeds/options (GRPO-style grouped rollouts).
        ring_depth (int, default 2): result slots in the ring (>= 2).
        spin_ns (int | None, default None): how long a waiter spins before it sleeps.
            None: each waiter's spin adapts to the gaps it sees, capped by the core
            count (``shmvec.spin.default_spin``); an int >= 0: every waiter spins
            exactly that many nanoseconds.
        on_worker_death (str, default "raise"): ``"raise"``: a dead worker is a
            ``WorkerDiedError``. ``"restart"``: it is started again and its envs,
            re-created and reset, report ``truncated`` with
            ``infos["worker_restarted"]``; the other envs are unaffected.
        on_env_error (str, default "raise"): ``"raise"`` or ``"reset"``: the env is
            reset and its step reports ``truncated`` with ``infos["env_error"]``.
        env_timeout (float | None, default None): seconds a worker may take for one
            ``step``/``reset`` (its block in sync mode, one env in async mode); past
            it, it is killed and handled as dead. None: no limit.
        step_in_main (bool, default False): the main process steps the first block
            itself while ``num_workers - 1`` processes step the others: fastest for
            cheap envs with a worker per core, at the price of isolation.
        fallback (str | None, default None): ``"serial"``: if the kernel refuses what
            workers need, warn and run every env in the main process. None: a
            RuntimeError.
        validate_actions (bool, default False): check every action against
            ``single_action_space`` (a ValueError naming the envs before any steps).
        env_concurrency (int | None, default None): envs a worker steps at once, in
            threads, for envs whose step mostly waits (shmvec/concurrent_envs.py).
            None or ``1``: one after another.
        pin_workers (bool | None, default None): keep each worker process on one CPU
            (worker ``k`` on the ``k``-th usable CPU, round robin). None: in sync
            mode, when there are at least as many worker processes as CPUs, on 8 CPUs
            or more (``shmvec.spin.default_pinning``). A worker whose envs start
            processes unpins itself and them (within a second, or 256 rounds if
            longer).
        text_bytes (int, default 4096): UTF-8 bytes of each
            :class:`~shmvec.UnboundedText` value (observation or action) stored
            inline in shared memory, per env and ring slot; a longer value
            spills, that env only, to the worker's pipe. 0: every non-empty
            text spills.
        step_deadline (float | None, default None): seconds one env's ``step`` or
            ``reset`` may take. Past it, that env alone is interrupted (the other
            envs of its worker keep their state and steps), replaced by a new env
            from its env_fn and reset, and the step reports ``truncated`` with
            ``infos["step_deadline"]`` (the deadline, a float). Needs worker
            processes; with ``env_concurrency``, async mode. Code that never returns
            to the interpreter cannot be interrupted: set ``env_timeout`` above it.
    """

    def __init__(
        self,
        env_fns: Sequence[Callable[[], gym.Env]],
        shared_memory: bool = True,
        copy: bool = True,
        context: str | None = None,
        daemon: bool = True,
        worker: Callable | None = None,
        observation_mode: str | gym.Space | tuple[gym.Space, gym.Space] = "same",
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
        pin_workers: bool | None = None,
        text_bytes: int = TEXT_BYTES,
        step_deadline: float | None = None,
    ) -> None:
        self.closed = True  # until the workers are up; close() is then a no-op
        check_no_worker(worker)
        self.env_fns = env_fns = check_env_fns(env_fns)
        self.num_envs = num_envs = len(env_fns)
        self.shared_memory, self._copy = shared_memory, copy
        self.context, self.daemon, self.worker = context, daemon, worker
        self.observation_mode = observation_mode
        self.autoreset_mode = AutoresetMode(autoreset_mode)
        self.max_concurrency = check_max_concurrency(max_concurrency)
        self._tuning = tuning = TuningOptions(
            num_workers=num_workers, batch_size=batch_size, group_size=group_size,
            ring_depth=ring_depth, spin_ns=spin_ns, on_worker_death=on_worker_death,
            on_env_error=on_env_error, env_timeout=env_timeout, step_in_main=step_in_main,
            fallback=fallback, validate_actions=bool(validate_actions),
            env_concurrency=env_concurrency, pin_workers=pin_workers, text_bytes=text_bytes,
            step_deadline=step_deadline,
        )  # fmt: skip
        described = describe_envs(env_fns, observation_mode)
        self.metadata = {**described.metadata, "autoreset_mode": self.autoreset_mode}
        self.render_mode = described.render_mode
        self.single_action_space = described.single_action_space
        self.action_space = described.action_space
        self.single_observation_space = described.single_observation_space
        self.observation_space = described.observation_space
        sizes = tuning.sizes(num_envs, self.max_concurrency)
        self.batch_size, self.ring_depth = sizes.batch_size, sizes.ring_depth
        self.group_size = group_size
        self.is_async = self.batch_size < num_envs  # the EnvPool-style API
        tuning.check_deadline(sizes.num_workers, self.is_async)
        self.step_deadline = None if step_deadline is None else float(step_deadline)
        self.env_tags: list[str] | None = None  # set by shmvec.make_mix
        self.text_bytes = int(tuning.text_bytes)
        self._obs_codec = make_codec(self.single_observation_space, shared_memory, self.text_bytes)
        self._action_codec = make_codec(self.single_action_space, True, self.text_bytes)
        if self.is_async and self._action_codec.pickled:
            raise ValueError(
                f"batch_size < num_envs needs a fixed-size action space, not "
                f"{self.single_action_space}"
            )
        self.on_worker_death, self.on_env_error = on_worker_death, on_env_error
        self.env_timeout, self.fallback = env_timeout, fallback
        self.validate_actions = tuning.validate_actions
        # What step()'s short path cannot do, whatever the round.
        self._short_path = not (self.is_async or env_timeout or self._obs_codec.pickled)
        self._state = AsyncState.DEFAULT
        self._sync_reset_pending = False  # async_reset() in sync mode: recv() waits for it
        self._stats = Stats()
        options = EngineOptions(
            copy=copy, context=context, daemon=daemon, env_timeout=env_timeout,
            restart_on_death=on_worker_death == "restart",
        )  # fmt: skip
        started = start_workers(
            _worker_spec(self), env_fns, tuning, options, self._obs_codec, self._stats,
            sizes.num_workers, self.max_concurrency,
        )  # fmt: skip
        self.num_workers, self._env_blocks = started.num_workers, started.blocks
        self.in_process, self.step_in_main = started.in_process, started.step_in_main
        self.env_concurrency, self.pin_workers = started.env_concurrency, started.pin_workers
        engine = started.engine
        self._pool, self._decoder, self._rounds = engine.pool, engine.decoder, engine.rounds
        self._async = engine.async_engine
        self._action_views = self._pool.action_views  # the short path's, one lookup fewer
        spaces = (self.single_action_space, self.action_space)
        self._actions = ActionWriter(
            self._action_codec, self._action_views, spaces, self.validate_actions
        )
        self._slots = self._pool.slots
        self.closed = False

    # ------------------------------------------------------------------ reset

    def reset_async(self, seed: Seeds = None, options: Options = None, reset_mask=None) -> None:
        """Sends a reset to every env, or to those in the reset mask.

        ``seed``: an int (env ``i`` gets ``seed + i // group_size``), a list (per env
        or per group) or None; ``options``: a dict or such a list. The mask is
        ``options["reset_mask"]`` as in gymnasium, or the ``reset_mask`` argument.
        """
        self._assert_is_running()
        self._assert_sync("reset_async")
        seeds = self._expand_seeds(seed)
        self._assert_idle("reset_async", "")
        reset_mask = take_reset_mask(options, reset_mask)
        mask = None if reset_mask is None else check_reset_mask(reset_mask, self.num_envs)
        per_env = self._expand_options(options)
        self._rounds.finish_unfinished()
        self._rounds.post_reset(seeds, per_env, mask)
        self._state = AsyncState.WAITING_RESET

    def reset_wait(self, timeout: float | None = None) -> tuple[Any, dict[str, Any]]:
        """Waits for the reset sent by ``reset_async``; returns ``(obs, infos)``."""
        self._assert_waiting(AsyncState.WAITING_RESET, "reset_wait", "reset_async")
        messages = self._finish(timeout, "reset_wait")
        self.observations, infos = self._rounds.reset_result(messages)
        return self.observations, infos

    # ------------------------------------------------------------------- step

    def step_async(self, actions: ArrayType) -> None:
        """Writes ``actions`` into the action slab and starts a step."""
        self._step_async(actions, write=True)

    def _step_async(self, actions: ArrayType | None, write: bool) -> None:
        """Starts a step; ``write=False`` when the caller filled the slab itself."""
        if self.closed or self.is_async or self._state is not AsyncState.DEFAULT:
            self._assert_is_running()
            self._assert_sync("step_async")
            self._assert_idle("step_async")
        rounds = self._rounds
        rounds.finish_unfinished()
        per_env, spills = (
            self._actions.write_batch(actions, self.num_envs) if write else (None, None)
        )
        rounds.post_step(per_env)
        if spills:  # after the post: a worker reads them as it steps (no full pipe waits)
            self._pool.send_spills(spills)
        self._state = AsyncState.WAITING_STEP

    def step_wait(
        self, timeout: float | None = None
    ) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Waits for the step started by ``step_async``."""
        if self.closed or self._state is not AsyncState.WAITING_STEP:
            self._assert_waiting(AsyncState.WAITING_STEP, "step_wait", "step_async")
        result = self._rounds.step_result(self._finish(timeout, "step_wait"))
        self.observations = result[0]
        return result

    def step(self, actions: ArrayType):
        """Steps every env; see ``gymnasium.vector.VectorEnv.step``.

        A sync-mode step of actions of exactly the space's dtype takes the short
        path (``RoundDriver.step_round``; each Python call here costs about a
        microsecond). Anything else, and a short round that met something
        unusual (an error, a pickled info, a late worker), goes through
        ``step_async`` / ``step_wait``.
        """
        if self._short_path_open() and self._action_codec.write_exact(self._action_views, actions):
            return self._step_short()
        self.step_async(actions)
        return self.step_wait()

    def _short_path_open(self) -> bool:
        """Whether the next step may take the short path, its actions aside."""
        if self.closed or self._state is not AsyncState.DEFAULT or self._rounds.unfinished:
            return False
        return self._short_path and not self.validate_actions

    def _step_short(self):
        """The short path of ``step``, the actions already in the slab."""
        self._state = AsyncState.WAITING_STEP
        try:
            clean = self._rounds.step_round()
        except BaseException:  # Ctrl-C: as in _finish
            self._state = AsyncState.DEFAULT
            raise
        if not clean:
            return self.step_wait()
        self._state = AsyncState.DEFAULT
        rounds, decoder = self._rounds, self._decoder
        slot = rounds.slot
        self._stats.count(self.num_envs, decoder.ended(slot))
        if rounds.unread is None:  # no lease region: one call fewer
            obs = self._obs_codec.read_batch(self._slots[slot].obs, self._copy)
        else:
            obs = rounds.read_obs({})
        self.observations = obs
        infos = decoder.batch_infos(slot, {})
        if self.step_deadline is not None and "step_deadline" in infos:  # a clean round's column
            self._stats.note_block_deadlines(infos, self._env_blocks)
        return (obs, *decoder.outcomes(slot), infos)

    # ------------------------------------------------------------------ async

    def _async_reset(self, seed: Seeds, options: Options, env_ids: Any) -> None:
        engine = self._async_engine()
        ids = engine.idle_env_ids(env_ids)
        engine.reset_envs(ids, self._expand_seeds(seed), self._expand_options(options))

    def _send(self, actions: Any, env_ids: Any) -> None:
        engine = self._async_engine()
        env_ids = engine.send_env_ids(env_ids)
        spills = self._actions.write_rows(env_ids, actions)
        if spills:  # before the command, as a reset's seed: the worker waits for them
            self._pool.send_spills(spills)
        engine.start_envs(env_ids, ENV_STEP)

    def _recv(
        self, timeout: float | None, partial: bool, take_ready: bool
    ) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        """With ``copy=False`` the arrays are views of the ring, valid until the
        next ``recv()`` (a smaller batch's too: the first rows of a ring slot)."""
        return self._async_engine().recv(timeout, partial, take_ready)

    def _async_engine(self) -> AsyncEngine:
        assert self._async is not None, "batch_size < num_envs"
        return self._async

    def row_infos(self) -> RowInfos:
        """The last batch's infos row by row, as each env returned them (``RowInfos``)."""
        return self._decoder.row_infos()

    # ------------------------------------------------------------- call & co

    def call_async(self, name: str, *args: Any, **kwargs: Any) -> None:
        """Calls ``name`` (or reads it, if not callable) in every env."""
        self._assert_is_running()
        self._assert_idle("call_async")
        self._rounds.finish_unfinished()
        self._rounds.post_call(name, args, kwargs)
        self._state = AsyncState.WAITING_CALL

    def call_wait(self, timeout: float | None = None) -> tuple[Any, ...]:
        """The results of ``call_async``, one per env."""
        self._assert_waiting(AsyncState.WAITING_CALL, "call_wait", "call_async")
        messages = self._finish(timeout, "call_wait")
        return tuple(r for message in messages.values() for r in message["results"])

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Calls ``name`` in every env and returns the results as a tuple."""
        self.call_async(name, *args, **kwargs)
        return self.call_wait()

    def set_attr(self, name: str, values: list[Any] | tuple[Any, ...] | Any) -> None:
        """Sets ``name`` in every env: one value each, or the same value for all."""
        self._assert_is_running()
        values = self._attr_values(values)
        self._assert_idle("set_attr")
        self._rounds.finish_unfinished()
        self._rounds.post_set_attr(name, list(values))
        self._state = AsyncState.WAITING_CALL
        self._finish(None, "set_attr")

    def close_extras(self, timeout: float | None = None, terminate: bool = False) -> None:
        """Closes the envs and stops the workers (SIGKILL after a grace period)."""
        if self._state != AsyncState.DEFAULT:
            gym_logger.warn(
                f"Calling `close` while waiting for a pending call to `{self._state.value}` "
                "to complete."
            )
            try:
                self._finish(0 if terminate else timeout, "close")
            except (multiprocessing.TimeoutError, WorkerDiedError):
                terminate = True
            except Exception:  # noqa: BLE001 - an env error in that call: still close
                pass
        _stop_engine(self._rounds, self._pool, self._stats, timeout, terminate)

    def __del__(self) -> None:
        if not getattr(self, "closed", True):
            self.close(terminate=True)

    @property
    def copy(self) -> bool:
        """Whether results are copies (True) or views of the ring (False)."""
        return self._copy

    @copy.setter
    def copy(self, value: bool) -> None:
        self._copy = self._decoder.copy = bool(value)

    def handoff(self) -> ResultHandoff:
        """The hooks a device bridge (shmvec.torch) uses to copy results out of
        the ring and write actions into the slab without extra copies."""
        slab = self._actions.slab()
        return ResultHandoff(self._pool, self._rounds, self._async, slab, self._step_written)

    def _step_written(self) -> tuple[Any, ...]:
        """``step`` with the actions already written into the action slab."""
        if self._short_path_open():
            return self._step_short()
        self._step_async(None, write=False)
        return self.step_wait()

    def _finish(self, timeout: float | None, name: str) -> dict[int, dict]:
        """Ends the pending round (``RoundDriver.finish``); the state is idle after."""
        try:
            return self._rounds.finish(timeout, name)
        finally:
            self._state = AsyncState.DEFAULT

    def stats(self) -> dict[str, Any]:
        """Throughput and where the time goes, since construction.

        Returns a dict: ``steps`` (env steps returned), ``steps_per_s``,
        ``episodes`` (episodes ended), ``main_wait_fraction`` (time the main
        process spent waiting for results), ``worker_busy_fraction`` (per
        worker: time in env code and writing results), ``worker_cpu_fraction``
        (its process's CPU time over the elapsed time), ``worker_env_threads``
        (envs it steps at once), ``worker_restarts``, ``env_resets`` (envs
        reset after an exception, ``on_env_error``) and ``env_deadlines`` (per
        worker: envs replaced after running past ``step_deadline``).
        """
        pool = self._pool
        return self._stats.report(pool.busy_ns, pool.cpu_seconds(), pool.env_threads.tolist())


def _stop_engine(
    rounds: RoundDriver, pool: WorkerPool, stats: Stats, timeout: float | None, terminate: bool
) -> None:
    """Has the workers close their envs (``terminate``: not), then stops them,
    SIGKILL after a grace period; logs the stats and each worker's exit."""
    grace_s = CLOSE_GRACE_S if timeout is None else timeout
    if not terminate:
        try:
            rounds.finish_unfinished(grace_s)
            rounds.post(CLOSE)
            rounds.wait(grace_s, "close")
        except (multiprocessing.TimeoutError, WorkerDiedError):
            pass
    stats.log_summary(pool.busy_ns)
    pool.terminate(grace_s=0.0 if terminate else CLOSE_GRACE_S)
    for index, process in enumerate(pool.workers):
        logger.info("worker %d (pid %d) exited with %s", index, process.pid, process.exitcode)
    pool.release()


def _worker_spec(env: ShmVectorEnv) -> WorkerSpec:
    """What every worker of ``env`` shares (``index`` and its envs come later,
    where each env runs from ``shmvec.startup``)."""
    mode = env.observation_mode if isinstance(env.observation_mode, str) else "custom"
    return WorkerSpec(
        index=0, first_env=0, env_fns=[], num_envs=env.num_envs,
        num_workers=1, num_slots=env.ring_depth, batch_size=env.batch_size,
        observation_space=env.single_observation_space,
        action_space=env.single_action_space, observation_mode=mode,
        shared_memory=env.shared_memory,
        autoreset_mode=AUTORESET_CODES[env.autoreset_mode], spin=NO_SPIN,
        main_pid=os.getpid(),
        use_death_signal=threading.current_thread() is threading.main_thread(),
        on_env_error=env.on_env_error, text_bytes=env.text_bytes,
        step_deadline=env.step_deadline,
        obs_regions=lease_regions(
            env._obs_codec.columns(), env.batch_size, env.ring_depth if env.is_async else 0
        ),
    )  # fmt: skip


def client_vector_env(
    env_fns: list[Callable[[], Any]],
    env_concurrency: int,
    batch_size: int | None,
    vector_kwargs: dict[str, Any],
) -> ShmVectorEnv:
    """The async ``ShmVectorEnv`` that ``Rollouts`` and ``AwaitableEnvs`` build from env fns:
    failures as results (``on_env_error="reset"``, ``on_worker_death="restart"``) and a
    batch of a sixteenth of the envs by default (small batches bring rows to their
    consumer sooner; docs: performance)."""
    return ShmVectorEnv(
        env_fns,
        batch_size=batch_size or max(1, len(env_fns) // 16),
        env_concurrency=env_concurrency,
        on_env_error="reset",
        on_worker_death="restart",
        **vector_kwargs,
    )
