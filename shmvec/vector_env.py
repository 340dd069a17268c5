"""ShmVectorEnv: gymnasium's AsyncVectorEnv, over one shared-memory segment.

This class is the gymnasium face: its state machine (``reset_async`` /
``reset_wait``, ``step_async`` / ``step_wait``, ``call`` ...), the async API
(``async_reset`` / ``send`` / ``recv``) and every argument check. The engine
parts it composes live in shmvec/engine/ (workers, rounds, supervision, the
async ring, result decoding, stats); what crosses process boundaries is in
shmvec/protocol.py.

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
from gymnasium.vector.utils import batch_differing_spaces, batch_space
from gymnasium.vector.vector_env import ArrayType, AutoresetMode

from shmvec.batching import (
    Options,
    Seeds,
    VectorEnvBase,
    check_actions,
    check_reset_mask,
    expand_options,
    expand_seeds,
    in_env_order,
    recv_whole_batch,
    split_blocks,
    take_reset_mask,
)
from shmvec.engine import EngineOptions, SetupError, Stats, build_engine
from shmvec.errors import WorkerDiedError
from shmvec.layout import ArrayCodec, PickledCodec, lease_regions, make_codec
from shmvec.protocol import (
    AUTORESET_CODES,
    BY_VALUE_BIT,
    CALL,
    CLOSE,
    CLOSE_GRACE_S,
    ENV_STEP,
    SET_ATTR,
    STEP,
)
from shmvec.spin import available_cpus, default_pinning, default_spin, fixed_spin
from shmvec.worker import WorkerSpec, check_env

logger = logging.getLogger("shmvec")

__all__ = ["ShmVectorEnv", "expand_options", "expand_seeds"]


class ShmVectorEnv(VectorEnvBase):
    """Runs ``env_fns`` in worker processes; results come back through shared memory.

    ``AsyncVectorEnv``'s arguments in the same order, plus keyword-only tuning
    ones; it behaves as ``AsyncVectorEnv`` / ``SyncVectorEnv`` do, bit for bit.

    Args:
        env_fns: zero-argument callables, each creating one env.
        shared_memory: if False, observations are pickled, as in AsyncVectorEnv.
        copy: if False, results are views of the result ring, valid for
            ``ring_depth - 1`` further ``step``/``reset`` calls. If True, they
            are the caller's own; observations of 64 KiB a batch or more are
            lent rather than copied: arrays over shared memory that no later
            call writes while they (or views of them) are held
            (shmvec/engine/leases.py).
        context: multiprocessing start method (None: Python's default).
        daemon: whether workers are daemonic.
        worker: must be None: shmvec runs its own worker loop.
        observation_mode: ``"same"``, ``"different"`` or a ``(batched, single)``
            tuple of spaces, as in AsyncVectorEnv.
        autoreset_mode: an ``AutoresetMode`` or its string value.
        max_concurrency: at most this many envs stepping at once (as many workers).
        num_workers: worker processes; default ``min(num_envs, cpus)``. ``0``: every
            env in the main process, through the same code (for debugging).
        on_worker_death: ``"raise"`` (default): a dead worker is a
            ``WorkerDiedError``. ``"restart"``: it is started again and its
            envs, re-created and reset, report ``truncated`` with
            ``infos["worker_restarted"]``; the other envs are unaffected.
        on_env_error: ``"raise"`` (default) or ``"reset"``: the env is reset and
            its step reports ``truncated`` with ``infos["env_error"]``.
        env_timeout: seconds a worker may take for one ``step``/``reset`` (its
            block in sync mode, one env in async mode); past it, it is killed
            and handled as dead. None (default): no limit.
        fallback: ``"serial"``: if the kernel refuses what workers need, warn
            and run every env in the main process. None: a RuntimeError.
        validate_actions: check every action against ``single_action_space``
            (a ValueError naming the envs before any steps). Off by default.
        step_in_main: the main process steps the first block itself while
            ``num_workers - 1`` processes step the others: fastest for cheap
            envs with a worker per core, at the price of isolation.
        batch_size: with ``batch_size < num_envs``, the async engine: use
            ``async_reset``/``send``/``recv`` (see shmvec/engine/async_engine.py).
        group_size: envs ``g*k .. g*k+g-1`` share seed ``s + k`` and may share
            list seeds/options (GRPO-style grouped rollouts).
        ring_depth: result slots in the ring (>= 2).
        spin_ns: how long a waiter spins before it sleeps (``shmvec.spin``).
        env_concurrency: envs a worker may step at once, in threads, when they
            mostly wait (shmvec/concurrent_envs.py). None: decided by measuring;
            an int caps it (``1``: never).
        pin_workers: keep each worker process on one CPU (worker ``k`` on the
            ``k``-th usable CPU, round robin). None (default): in sync mode, when
            there are at least as many worker processes as CPUs, on 8 CPUs or
            more (``shmvec.spin.default_pinning``). A worker whose envs start processes
            unpins itself and them (within a second, or 256 rounds if longer).
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
        pin_workers: bool | None = None,
    ) -> None:
        self.closed = True  # until the workers are up; close() is then a no-op
        if worker is not None:
            raise ValueError(
                "ShmVectorEnv runs its own worker loop over shared memory and cannot use a "
                "custom `worker`; use gymnasium.vector.AsyncVectorEnv for that."
            )
        self.env_fns = env_fns = _check_env_fns(env_fns)
        self.num_envs = num_envs = len(env_fns)
        self.shared_memory, self._copy = shared_memory, copy
        self.context, self.daemon, self.worker = context, daemon, worker
        self.observation_mode = observation_mode
        self.autoreset_mode = AutoresetMode(autoreset_mode)
        self.max_concurrency = _check_max_concurrency(max_concurrency)
        self._env_concurrency_arg = _check_env_concurrency(env_concurrency)
        if pin_workers not in (None, True, False):
            raise ValueError(f"pin_workers must be None, True or False, got {pin_workers!r}")
        self._pin_workers_arg = pin_workers
        dummy_env = env_fns[0]()
        check_env(dummy_env, 0)
        self.metadata = {**dummy_env.metadata, "autoreset_mode": self.autoreset_mode}
        self.render_mode = dummy_env.render_mode
        self.single_action_space = dummy_env.action_space
        self.action_space = batch_space(self.single_action_space, num_envs)
        self.observation_space, self.single_observation_space = _observation_spaces(
            dummy_env, observation_mode, env_fns
        )
        dummy_env.close()
        del dummy_env
        if num_workers is None:
            num_workers = min(num_envs, available_cpus())
        if self.max_concurrency is not None:
            num_workers = min(num_workers, self.max_concurrency)
        _check_range("num_workers", num_workers, 0, num_envs)
        self.batch_size = num_envs if batch_size is None else int(batch_size)
        _check_range("batch_size", self.batch_size, 1, num_envs, batch_size)
        self.is_async = self.batch_size < num_envs  # the EnvPool-style API
        if group_size < 1 or num_envs % group_size:
            raise ValueError(f"group_size must divide num_envs={num_envs}, got {group_size}")
        self.group_size = group_size
        self.env_tags: list[str] | None = None  # set by shmvec.make_mix
        if self.is_async:
            # See csrc/result_ring.h: enough slots that a claim never overruns.
            ring_depth = max(ring_depth, -(-num_envs // self.batch_size) + 1)
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
        if fallback not in (None, "serial"):
            raise ValueError(f"fallback must be None or 'serial', got {fallback!r}")
        self.fallback = fallback
        self.validate_actions = bool(validate_actions)
        # What step()'s short path cannot do, whatever the round.
        self._short_path = not (self.is_async or env_timeout or self._obs_codec.pickled)
        self._state = AsyncState.DEFAULT
        self._sync_reset_pending = False  # async_reset() in sync mode: recv() waits for it
        self._stats = Stats()
        try:
            self._start(num_workers, step_in_main, spin_ns)
        except SetupError as error:
            if fallback != "serial":
                raise RuntimeError(
                    f"{error}. Pass fallback='serial' to run every env in the main process instead."
                ) from error.__cause__
            logger.warning("%s: running every env in the main process (fallback='serial')", error)
            self._start(0, True, spin_ns)
        self.closed = False

    def _start(self, num_workers: int, step_in_main: bool, spin_ns: int | None) -> None:
        """Builds the engine. ``num_workers=0``: one worker, in this process."""
        self.in_process = num_workers == 0
        self.step_in_main = self.in_process or bool(step_in_main)
        self.num_workers = max(num_workers, 1)
        self._env_blocks = split_blocks(self.num_envs, self.num_workers)
        self.env_concurrency = _per_worker_concurrency(  # None: a whole block
            self._env_concurrency_arg, self.max_concurrency, self.num_workers
        )
        processes = self.num_workers - 1 if self.step_in_main else self.num_workers
        spin = default_spin(processes) if spin_ns is None else fixed_spin(spin_ns)
        self.pin_workers = (
            default_pinning(processes, self.is_async)
            if self._pin_workers_arg is None
            else self._pin_workers_arg
        )
        options = EngineOptions(
            copy=self._copy, context=self.context, daemon=self.daemon,
            step_in_main=self.step_in_main, in_process=self.in_process,
            env_timeout=self.env_timeout, restart_on_death=self.on_worker_death == "restart",
        )  # fmt: skip
        engine = build_engine(
            _worker_spec(self, spin.worker_ns), self.env_fns, self._env_blocks,
            self._obs_codec, self._stats, spin, options,
        )  # fmt: skip
        self._pool, self._decoder, self._rounds = engine.pool, engine.decoder, engine.rounds
        self._async = engine.async_engine
        self._action_views = self._pool.action_views  # the short path's, one lookup fewer
        self._slots = self._pool.slots

    # ------------------------------------------------------------------ reset

    def reset_async(self, seed: Seeds = None, options: Options = None, reset_mask=None) -> None:
        """Sends a reset to every env, or to those in the reset mask.

        ``seed``: an int (env ``i`` gets ``seed + i // group_size``), a list (per env
        or per group) or None; ``options``: a dict or such a list. The mask is
        ``options["reset_mask"]`` as in gymnasium, or the ``reset_mask`` argument.
        """
        self._assert_is_running()
        if self.is_async:
            raise RuntimeError(
                "with batch_size < num_envs, reset with async_reset() and read with recv()"
            )
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
        rounds = self._rounds
        slot = rounds.slot
        infos = self._decoder.batch_infos(slot, messages)
        mask = rounds.reset_mask
        if mask is not None and not mask.all():
            previous = rounds.obs_views((slot - 1) % rounds.ring_depth)
            self._decoder.carry_over_obs(~mask, rounds.obs_views(slot), previous)
        self.observations = obs = rounds.read_obs(messages)
        return obs, infos

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
            self._assert_idle("step_async")
        rounds = self._rounds
        rounds.finish_unfinished()
        by_value = False
        codec = self._action_codec
        if write and (self.validate_actions or not codec.write_exact(self._action_views, actions)):
            # Actions that are not exactly the columns' dtype (a list, float64 for
            # a float32 Box) reach each env as gymnasium hands them over: the
            # element iterating the batch gives, pickled (protocol.BY_VALUE_BIT).
            by_value = codec.pickled or not codec.is_exact(actions)
            if self.validate_actions:
                every_env = range(self.num_envs)
                check_actions(self.single_action_space, self.action_space, actions, every_env)
            if by_value:
                per_env = [None] * self.num_envs
                self._pickled_actions.write_batch(per_env, actions)
                rounds.send_blocks("actions", per_env)
            else:
                codec.write_batch(self._action_views, actions)
        rounds.post(STEP, rounds.obs_arg(rounds.next_slot()) | (BY_VALUE_BIT if by_value else 0))
        self._state = AsyncState.WAITING_STEP

    def step_wait(
        self, timeout: float | None = None
    ) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Waits for the step started by ``step_async``."""
        if self.closed or self._state is not AsyncState.WAITING_STEP:
            self._assert_waiting(AsyncState.WAITING_STEP, "step_wait", "step_async")
        messages = self._finish(timeout, "step_wait")
        decoder, slot = self._decoder, self._rounds.slot
        infos = decoder.batch_infos(slot, messages)
        if "env_error" in infos:
            self._stats.note_env_resets(infos, np.arange(self.num_envs))
        self._stats.count(self.num_envs, decoder.ended(slot))
        self.observations = obs = self._rounds.read_obs(messages)
        return (obs, *decoder.outcomes(slot), infos)

    def step(self, actions: ArrayType):
        """Steps every env; see ``gymnasium.vector.VectorEnv.step``.

        A sync-mode step of actions of exactly the space's dtype takes the short
        path (``RoundDriver.step_round``; each Python call here costs about a
        microsecond). Anything else, and a short round that met something
        unusual (an error, a pickled info, a late worker), goes through
        ``step_async`` / ``step_wait``.
        """
        if (
            self.closed
            or self._state is not AsyncState.DEFAULT
            or not self._short_path
            or self.validate_actions
            or self._rounds.unfinished
            or not self._action_codec.write_exact(self._action_views, actions)
        ):
            self.step_async(actions)
            return self.step_wait()
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
        return (obs, *decoder.outcomes(slot), decoder.batch_infos(slot, {}))

    # ------------------------------------------------------------------ async

    def async_reset(self, seed: Seeds = None, options: Options = None, env_ids=None) -> None:
        """Resets envs without waiting; ``recv()`` returns the results.

        ``seed`` and ``options`` are expanded over all envs as in ``reset``
        (groups included), then env ``e`` gets entry ``e``. ``env_ids`` (default:
        all) names the envs to reset; they must be idle: ``recv()`` their
        results first.
        """
        self._assert_is_running()
        if not self.is_async:
            if env_ids is not None:
                raise ValueError("env_ids in async_reset needs batch_size < num_envs")
            self.reset_async(seed=seed, options=options)
            self._sync_reset_pending = True  # the next recv() is reset_wait()
            return
        ids = self._async.idle_env_ids(env_ids)
        self._async.reset_envs(ids, self._expand_seeds(seed), self._expand_options(options))

    def send(self, actions: Any, env_ids: Any = None) -> None:
        """Hands ``actions[i]`` to env ``env_ids[i]`` and returns at once.

        ``env_ids`` defaults to the envs of the last ``recv()``. Each env must be
        awaiting an action (its last result was received). In sync mode
        ``env_ids`` must name every env (in any order).
        """
        self._assert_is_running()
        if not self.is_async:
            self.step_async(in_env_order(self.single_action_space, actions, env_ids, self.num_envs))
            return
        env_ids = self._async.send_env_ids(env_ids)
        if self.validate_actions:
            check_actions(self.single_action_space, self.action_space, actions, env_ids)
        self._action_codec.write_rows(self._action_views, env_ids, actions)
        self._async.start_envs(env_ids, ENV_STEP)

    def recv(self, timeout: float | None = None):
        """The next ``batch_size`` results: ``(obs, rewards, terminations,
        truncations, infos)`` with ``infos["env_id"]``, the env of each row.

        With ``copy=False`` the arrays are views of the ring, valid until the
        next ``recv()``.
        """
        self._assert_is_running()
        if not self.is_async:
            pending, self._sync_reset_pending = self._sync_reset_pending, False
            return recv_whole_batch(self, pending, timeout)
        return self._async.recv(timeout)

    # ------------------------------------------------------------- call & co

    def call_async(self, name: str, *args: Any, **kwargs: Any) -> None:
        """Calls ``name`` (or reads it, if not callable) in every env."""
        self._assert_is_running()
        self._assert_idle("call_async")
        self._rounds.finish_unfinished()
        for index in range(self.num_workers):
            self._pool.send(index, "call", (name, args, kwargs))
        self._rounds.post(CALL)
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
        self._rounds.send_blocks("set_attr", list(values), lambda block: (name, block))
        self._rounds.post(SET_ATTR)
        self._state = AsyncState.WAITING_CALL
        self._finish(None, "set_attr")

    @property
    def np_random_seed(self) -> tuple[int, ...]:
        """The sub-envs' ``np_random_seed``."""
        return self.get_attr("np_random_seed")

    @property
    def np_random(self) -> tuple[np.random.Generator, ...]:
        """Copies of the sub-envs' random generators."""
        return self.get_attr("np_random")

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
        grace_s = CLOSE_GRACE_S if timeout is None else timeout
        if not terminate:
            try:
                self._rounds.finish_unfinished(grace_s)
                self._rounds.post(CLOSE)
                self._rounds.wait(grace_s, "close")
            except (multiprocessing.TimeoutError, WorkerDiedError):
                pass
        self._stats.log_summary(self._pool.busy_ns)
        pool = self._pool
        pool.terminate(grace_s=0.0 if terminate else CLOSE_GRACE_S)
        for index, process in enumerate(pool.workers):
            logger.info("worker %d (pid %d) exited with %s", index, process.pid, process.exitcode)
        pool.release()

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
        return ResultHandoff(self)

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
        (envs it steps at once), ``worker_restarts`` and ``env_resets`` (envs
        reset after an exception, ``on_env_error``).
        """
        pool = self._pool
        return self._stats.report(pool.busy_ns, pool.cpu_seconds(), pool.env_threads.tolist())


def _worker_spec(env: ShmVectorEnv, spin_ns: int) -> WorkerSpec:
    """What every worker of ``env`` shares (``index`` and its envs come later)."""
    mode = env.observation_mode if isinstance(env.observation_mode, str) else "custom"
    return WorkerSpec(
        index=0, first_env=0, env_fns=[], num_envs=env.num_envs,
        num_workers=env.num_workers, num_slots=env.ring_depth, batch_size=env.batch_size,
        observation_space=env.single_observation_space,
        action_space=env.single_action_space, observation_mode=mode,
        shared_memory=env.shared_memory,
        autoreset_mode=AUTORESET_CODES[env.autoreset_mode], spin_ns=spin_ns,
        main_pid=os.getpid(),
        use_death_signal=threading.current_thread() is threading.main_thread(),
        on_env_error=env.on_env_error,
        env_concurrency=env.env_concurrency, pin_cpu=env.pin_workers,
        obs_regions=lease_regions(
            env._obs_codec.columns(), env.batch_size, env.ring_depth if env.is_async else 0
        ),
    )  # fmt: skip


class ResultHandoff:
    """A ShmVectorEnv's results and action slab, for a device bridge.

    Results rotate through ``num_slots`` ring slots; ``on_slot_reuse(hook)``
    has ``hook(slot)`` called before workers may overwrite a slot, so a bridge
    can wait there for its device copy out of it.
    """

    def __init__(self, env: ShmVectorEnv) -> None:
        self._env = env
        # What a bridge pins: the segment up to the lease regions, which a
        # bridge does not use (it reads ring slots with copy=False).
        self.region = (env._pool.segment.address, env._pool.layout.ring_end)
        self.num_slots = len(env._slots)

    @property
    def last_slot(self) -> int:
        """The ring slot that the last ``step``/``reset``/``recv`` returned."""
        env = self._env
        return env._async.held_slot if env.is_async else env._rounds.slot

    def slot_views(self, slot: int):
        """The arrays of ring slot ``slot`` (shmvec.layout.SlotViews)."""
        return self._env._slots[slot]

    def on_slot_reuse(self, hook: Callable[[int], None]) -> None:
        self._env._rounds.before_slot_reuse = hook

    def action_slab(self) -> np.ndarray | None:
        """The action slab when actions are one array column, else None: write a
        batch there and call ``step_written``."""
        env = self._env
        return env._action_views[0] if isinstance(env._action_codec, ArrayCodec) else None

    def step_written(self):
        """``step`` with the actions already written into ``action_slab()``."""
        self._env._step_async(None, write=False)
        return self._env.step_wait()


def _observation_spaces(dummy_env: gym.Env, observation_mode, env_fns: list) -> tuple:
    """(batched, single) observation spaces, as AsyncVectorEnv builds them."""
    if isinstance(observation_mode, tuple) and len(observation_mode) == 2:
        batched, single = observation_mode
        if not (isinstance(batched, gym.Space) and isinstance(single, gym.Space)):
            raise TypeError(
                "observation_mode as a tuple must be (batched space, single space), got "
                f"{observation_mode!r}"
            )
        return batched, single
    single = dummy_env.observation_space
    if observation_mode == "same":
        return batch_space(single, len(env_fns)), single
    if observation_mode == "different":
        spaces = [single] + [fn().observation_space for fn in env_fns[1:]]
        return batch_differing_spaces(spaces), single
    raise ValueError(
        "Invalid `observation_mode`, expected: 'same' or 'different' or tuple of single "
        f"and batch observation space, actual got {observation_mode}"
    )


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


def _check_range(name: str, value: int, low: int, high: int, given: Any = None) -> None:
    if not low <= value <= high:
        got = value if given is None else given
        raise ValueError(f"{name} must be between {low} and num_envs={high}, got {got}")


def _check_choice(name: str, value: str, other: str) -> str:
    if value not in ("raise", other):
        raise ValueError(f"{name} must be 'raise' or {other!r}, got {value!r}")
    return value


def _check_env_concurrency(value) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"env_concurrency must be None or an int >= 1, got {value!r}")
    return value


def _per_worker_concurrency(value, max_concurrency: int | None, num_workers: int) -> int | None:
    """``env_concurrency`` per worker, bounded by ``max_concurrency`` too (at most
    that many envs inside ``step`` over all workers)."""
    if max_concurrency is not None:
        per_worker = max(1, max_concurrency // num_workers)
        value = per_worker if value is None else min(value, per_worker)
    return value


def _check_max_concurrency(value) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"`max_concurrency` must be an integer or None, got {type(value)}.")
    if value < 1:
        raise ValueError(f"`max_concurrency` must be a positive or None, got {value}.")
    return int(value)
