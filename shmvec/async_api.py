"""EnvPool-style asynchronous rollouts: ``async_reset``, ``send``, ``recv``.

With ``ShmVectorEnv(..., batch_size=k)`` and ``k < num_envs`` there is no
barrier between envs: ``send(actions, env_ids)`` hands actions to some envs
and returns at once; each worker steps an env as soon as its action arrives
and writes the result into the next free row of the result ring (rows are
claimed in arrival order, see csrc/result_ring.h); ``recv()`` returns the
first ``k`` results to arrive, with ``infos["env_id"]`` saying whose they are.
Each env's trajectory is exactly the one it would have alone with the same
seed and actions; only the order in which envs come back varies.

Example:
    >>> import gymnasium as gym
    >>> import numpy as np
    >>> import shmvec
    >>> envs = shmvec.ShmVectorEnv(
    ...     [lambda: gym.make("CartPole-v1")] * 8, num_workers=2, batch_size=4
    ... )
    >>> envs.async_reset(seed=0)
    >>> for _ in range(10):
    ...     obs, rewards, terminations, truncations, infos = envs.recv()
    ...     envs.send(np.zeros(4, dtype=np.int64), infos["env_id"])
    >>> obs.shape
    (4, 4)
    >>> envs.close()

With ``batch_size == num_envs`` (the default), ``send``/``recv`` are
``step_async``/``step_wait`` with env ids, so code written for the async API
also runs in sync mode.
"""

from __future__ import annotations

import logging
import pickle
import time
from typing import Any

import numpy as np
from gymnasium.vector.vector_env import VectorEnv

from shmvec import _core, _worker_loop
from shmvec import infos as info_columns
from shmvec.errors import WorkerDiedError, add_note

logger = logging.getLogger("shmvec")

#: How often recv() checks that every worker lives, when it does not have to wait.
LIVENESS_CHECK_S = 0.1

#: ``env_ids`` of a ring row that no worker has written since main released it.
UNWRITTEN = -1


class _BatchInfos:
    """``VectorEnv._add_info`` over a batch of ``num_envs`` rows."""

    _add_info = VectorEnv._add_info

    def __init__(self, rows: int) -> None:
        self.num_envs = rows


class AsyncRollouts:
    """The async half of ShmVectorEnv (a mixin: it uses ShmVectorEnv's state)."""

    # ------------------------------------------------------------------ setup

    def _init_async(self, buffer) -> None:
        layout = self._layout
        self._ring = _core.ResultRing(
            self._segment, layout.ring_offset, layout.num_slots, self.batch_size
        )
        self._doorbells = [_core.Doorbell(self._segment, off) for off in layout.doorbell_offsets]
        self._env_commands = layout.env_commands(buffer)
        self._env_worker = np.empty(self.num_envs, dtype=np.int64)
        for index, rows in enumerate(self._env_blocks):
            self._env_worker[rows.start : rows.stop] = index
        # Envs whose last result the user has (or that were never reset).
        self._awaiting = np.ones(self.num_envs, dtype=bool)
        self._was_reset = False
        self._recv_slot = 0
        self._held_slot: int | None = None
        self._last_env_ids: np.ndarray | None = None
        # For on_worker_death="restart": rows consumed so far (claims before this
        # one are done with), each env's last command and reset arguments.
        self._consumed_rows = 0
        self._liveness_checked = time.monotonic()
        self._last_command = np.zeros(self.num_envs, dtype=np.uint8)
        self._env_reset_args: dict[int, tuple] = {}
        for views in self._slots:
            views.env_ids[:] = UNWRITTEN

    # ------------------------------------------------------------------ reset

    def async_reset(
        self,
        seed: int | list[int | None] | None = None,
        options: dict[str, Any] | list[dict[str, Any] | None] | None = None,
        env_ids: Any = None,
    ) -> None:
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
        ids = np.arange(self.num_envs) if env_ids is None else self._check_env_ids(env_ids)
        busy = ids[~self._awaiting[ids]]
        if busy.size:
            raise RuntimeError(
                f"async_reset() while envs {busy.tolist()} are still running: recv() their "
                "results first"
            )
        seeds = self._expand_seeds(seed)
        per_env = self._expand_options(options)
        workers = self._env_worker[ids]
        for index in np.unique(workers).tolist():
            args = {e: (seeds[e], per_env[e]) for e in ids[workers == index].tolist()}
            self._env_reset_args.update(args)
            self._send(index, "reset", args)
        self._start_envs(ids, _worker_loop.ENV_RESET)
        self._was_reset = True

    # ------------------------------------------------------------------- send

    def send(self, actions: Any, env_ids: Any = None) -> None:
        """Hands ``actions[i]`` to env ``env_ids[i]`` and returns at once.

        ``env_ids`` defaults to the envs of the last ``recv()``. Each env must be
        awaiting an action (its last result was received). In sync mode
        ``env_ids`` must name every env (in any order).
        """
        self._assert_is_running()
        if not self.is_async:
            self._send_sync(actions, env_ids)
            return
        if not self._was_reset:
            raise RuntimeError("send() before async_reset(): reset the envs first")
        if env_ids is None:
            if self._last_env_ids is None:
                raise ValueError("send() needs env_ids: no recv() has returned any yet")
            env_ids = self._last_env_ids
        env_ids = self._check_env_ids(env_ids)
        if self.validate_actions:
            self._check_actions(actions, env_ids.tolist())
        self._action_codec.write_rows(self._action_views, env_ids, actions)
        self._start_envs(env_ids, _worker_loop.ENV_STEP)

    def _check_env_ids(self, env_ids: Any) -> np.ndarray:
        ids = np.asarray(env_ids)
        if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
            raise TypeError(f"env_ids must be a 1-D array of ints, got {env_ids!r}")
        ids = ids.astype(np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_envs):
            bad = ids[(ids < 0) | (ids >= self.num_envs)]
            raise ValueError(f"env_ids {bad.tolist()} out of range [0, {self.num_envs})")
        counts = np.bincount(ids, minlength=self.num_envs)
        if len(ids) != np.count_nonzero(counts):
            raise ValueError(f"env_ids {np.flatnonzero(counts > 1).tolist()} appear more than once")
        running = ids[~self._awaiting[ids]]
        if running.size:
            raise ValueError(
                f"envs {running.tolist()} are not awaiting an action: their previous "
                "step is still running (recv() its result first)"
            )
        return ids

    def _start_envs(self, env_ids: np.ndarray, command: int) -> None:
        self._env_commands[env_ids] = command
        self._last_command[env_ids] = command
        self._awaiting[env_ids] = False
        workers = np.bincount(self._env_worker[env_ids], minlength=self.num_workers)
        for index in np.flatnonzero(workers).tolist():
            self._doorbells[index].ring()

    def _send_sync(self, actions: Any, env_ids: Any) -> None:
        if env_ids is not None:
            ids = np.asarray(env_ids)
            if sorted(ids.tolist()) != list(range(self.num_envs)):
                raise ValueError(
                    "with batch_size == num_envs, send() steps every env: env_ids must name "
                    f"each of the {self.num_envs} envs once, got {ids.tolist()}"
                )
            if not np.array_equal(ids, np.arange(self.num_envs)):
                ordered = np.empty_like(np.asarray(actions))
                ordered[ids] = actions
                actions = ordered
        self.step_async(actions)

    # ------------------------------------------------------------------- recv

    def recv(self, timeout: float | None = None):
        """The next ``batch_size`` results: ``(obs, rewards, terminations,
        truncations, infos)`` with ``infos["env_id"]``, the env of each row.

        With ``copy=False`` the arrays are views of the ring, valid until the
        next ``recv()``.
        """
        self._assert_is_running()
        if not self.is_async:
            return self._recv_sync(timeout)
        in_flight = int(np.count_nonzero(~self._awaiting))
        if in_flight < self.batch_size:
            raise RuntimeError(
                f"recv() waits for batch_size={self.batch_size} results but only {in_flight} "
                "envs are running: send() actions first"
            )
        if self._held_slot is not None:
            self._before_slot_reuse(self._held_slot)
            self._slots[self._held_slot].env_ids[:] = UNWRITTEN
            self._ring.release(self._held_slot)
            self._held_slot = None
        slot = self._recv_slot
        views = self._slots[slot]
        messages: dict[int, dict] = {}
        while True:
            try:
                self._check_workers_now_and_then()
                self._run_main_worker()
                self._wait_slot(slot, timeout)
                env_ids = views.env_ids.astype(np.int64)
                self._row_messages(slot, views, env_ids, messages)
                break
            except WorkerDiedError as error:
                if self.on_worker_death != "restart":
                    raise
                self._restart_async_worker(error.worker, {(slot, row) for row in messages})
        self._consumed_rows += self.batch_size
        self._awaiting[env_ids] = True
        self._last_env_ids = env_ids
        self._held_slot = slot
        self._recv_slot = (slot + 1) % self._layout.num_slots
        self._count(views.terminations, views.truncations)
        errors = [e for m in messages.values() for e in m.get("errors", ())]
        if errors:
            raise self._remote_error(errors)
        obs = self._read_rows_obs(views, messages)
        infos = self._merge_row_infos(views, env_ids, messages)
        if "env_error" in infos:
            self._note_env_resets(infos, env_ids)
        infos["env_id"] = env_ids
        return (obs, *self._slot_outcomes(views), infos)

    def _check_workers_now_and_then(self) -> None:
        """Notices a dead worker even while the others keep filling the batches
        (its envs would starve silently): every ``LIVENESS_CHECK_S``."""
        now = time.monotonic()
        if now - self._liveness_checked >= LIVENESS_CHECK_S:
            self._liveness_checked = now
            self._kill_stuck_workers()
            for index in range(self.num_workers):
                self._check_alive(index)

    def _recv_sync(self, timeout: float | None):
        return recv_whole_batch(self, timeout)

    def _wait_slot(self, slot: int, timeout: float | None) -> None:
        def ready(spin_ns: int, budget_ns: int) -> bool:
            self._kill_stuck_workers()
            return self._ring.wait_full(slot, spin_ns, budget_ns)

        self._wait_for(
            ready,
            timeout,
            lambda: (
                f"The call to `recv` has timed out after {timeout} second(s): "
                f"{self._ring.filled(slot)} of {self.batch_size} results arrived; envs "
                f"still running or queued: {np.flatnonzero(~self._awaiting).tolist()}."
            ),
        )

    def _row_messages(self, slot: int, views, env_ids: np.ndarray, messages: dict) -> None:
        """Adds to ``messages`` those of the rows that have one, by row (after a
        worker's restart, the rows it still lacks)."""
        for row in np.flatnonzero(views.messages).tolist():
            if row in messages:
                continue
            index = int(self._env_worker[env_ids[row]])
            message = self._recv(index, timeout=None, row=True)
            if message["row"] != (slot, row):
                raise RuntimeError(
                    f"shmvec internal error: worker {index} sent the message of row "
                    f"{message['row']} where ({slot}, {row}) was expected"
                )
            self._info_schemas[index].update(message.get("info_columns", ()))
            messages[row] = message

    # ---------------------------------------------------------------- restart

    def _restart_async_worker(self, dead: int, read: frozenset | set = frozenset()) -> None:
        """``on_worker_death="restart"`` in async mode: replaces worker ``dead`` so
        that each of its envs still running delivers exactly one result.

        Once the other workers have done all they were given, the ring tells
        what the dead worker left: rows it published (their messages are read
        from its pipe, which outlives it), at most one row it claimed but never
        published (a hole that would keep its slot from filling), and at most
        one env whose command it took but whose row it never claimed. The
        replacement fills the hole or claims a row for that env, and every other
        env of its block reports a truncated episode for its next command.
        ``read``: the (slot, row)s whose messages main already has.
        """
        self._workers[dead].join(1.0)
        self._drain_pipe(dead)
        self._pipes[dead].close()
        self._stashed[dead][False].clear()  # replies to rounds it will never finish
        self._message_flags[dead] = 0  # a round's message it flagged died with it
        self._quiesce(dead)
        plan = self._recovery_plan(dead, read)
        rows = self._env_blocks[dead]
        self._workers[dead], self._pipes[dead] = self._start_worker(
            dead,
            generation=self._barrier.generation,
            recover=("async", plan),
            info_schema=dict(self._info_schemas[dead]),
        )
        running = [e for e in rows if not self._awaiting[e]]
        resets = {e: self._env_reset_args[e] for e in running if e in self._env_reset_args}
        if resets:
            self._send(dead, "reset", resets)
        message = self._recv(dead, timeout=None)
        if "startup_error" in message:
            exc, tb = message["startup_error"]
            add_note(exc, f"while restarting shmvec worker {dead}; traceback:\n{tb}")
            raise exc
        self._doorbells[dead].ring()
        self._stats_restarts += 1
        logger.warning(
            "restarted worker %d (pid %d) for envs %d..%d",
            dead, self._workers[dead].pid, rows.start, rows.stop - 1,
        )  # fmt: skip

    def _drain_pipe(self, index: int) -> None:
        """Reads what worker ``index`` has sent, without waiting, into its stashes."""
        pipe = self._pipes[index]
        try:
            while pipe.poll(0):
                message = pickle.loads(pipe.recv_bytes())
                self._stashed[index]["row" in message].append(message)
        except (EOFError, OSError):
            pass

    def _quiesce(self, dead: int) -> None:
        """Waits until every worker but ``dead`` has finished every env it was
        given (their commands clear, none in an env), reading their pipes so
        that none blocks on a full one."""
        current = self._layout.worker_current_env(memoryview(self._segment))
        while True:
            self._run_main_worker()
            busy = [
                index
                for index, rows in enumerate(self._env_blocks)
                if index != dead
                and (current[index] or self._env_commands[rows.start : rows.stop].any())
            ]
            if not busy:
                return
            for index in busy:
                self._check_alive(index)
                self._drain_pipe(index)
            time.sleep(0.0002)

    def _recovery_plan(self, dead: int, read: frozenset | set) -> dict[int, tuple]:
        """What the replacement of ``dead`` must deliver: env -> (how, slot, row,
        command), ``how`` one of "hole", "claim", "rewrite" (Worker.recover_async)."""
        batch, slots = self.batch_size, self._layout.num_slots
        first, claimed = self._consumed_rows, self._ring.claimed()
        where: dict[int, tuple[int, int]] = {}  # env -> its unconsumed row
        unwritten, last_of_dead, per_slot = [], None, {}
        for n in range(first, claimed):
            slot, row = (n // batch) % slots, n % batch
            per_slot[slot] = per_slot.get(slot, 0) + 1
            env = int(self._slots[slot].env_ids[row])
            if env == UNWRITTEN:
                unwritten.append((slot, row))
            else:
                where[env] = (slot, row)
                if env in self._env_blocks[dead]:
                    last_of_dead = env
        holes = (claimed - first) - sum(self._ring.filled(s) for s in per_slot)
        if holes not in (0, 1) or len(unwritten) > holes:
            raise RuntimeError(
                f"shmvec internal error: {holes} unpublished rows, {len(unwritten)} unwritten, "
                f"after worker {dead} died"
            )
        hole_env, hole = None, None
        if holes:  # the dead worker's last claim
            hole = unwritten[0] if unwritten else where.pop(last_of_dead)
            hole_env = None if unwritten else last_of_dead
        plan = {}
        for env in self._env_blocks[dead]:
            command = int(self._last_command[env])
            if self._awaiting[env] or self._env_commands[env]:
                continue  # idle, or not started: the replacement's first command does it
            if env == hole_env:
                plan[env] = ("hole", *hole, command)
            elif env in where:
                slot, row = where[env]
                if (
                    self._slots[slot].messages[row]
                    and (slot, row) not in read
                    and not any(m["row"] == (slot, row) for m in self._stashed[dead][True])
                ):
                    plan[env] = ("rewrite", slot, row, command)  # its message was lost
            else:
                plan[env] = ("claim", 0, 0, command)
        if hole is not None and hole_env is None:
            claims = [env for env, how in plan.items() if how[0] == "claim"]
            if len(claims) != 1:
                raise RuntimeError(
                    f"shmvec internal error: an unwritten row and envs {claims} without one"
                )
            plan[claims[0]] = ("hole", *hole, plan[claims[0]][3])
        return plan

    def _read_rows_obs(self, views, messages: dict[int, dict]) -> Any:
        if self._obs_codec.pickled:
            values = [None] * self.batch_size
            for row, message in messages.items():
                values[row] = next(iter(message["obs"].values()))
            return self._obs_codec.read_batch(values, self.copy)
        return self._obs_codec.read_batch(views.obs, self.copy)

    def _merge_row_infos(self, views, env_ids: np.ndarray, messages: dict[int, dict]) -> dict:
        batch = _BatchInfos(self.batch_size)
        gathered = {}
        if any(self._info_schemas):
            workers = self._env_worker[env_ids]
            groups = [np.flatnonzero(workers == index) for index in range(self.num_workers)]
            gathered = info_columns.gather(
                self._info_schemas, groups, views.info_codes, views.info_cells, self.batch_size
            )
        pickled = [item for m in messages.values() for item in m.get("infos", ())]
        if not pickled:
            return info_columns.merge_columns({}, gathered, self.batch_size)
        items = sorted(pickled + info_columns.column_dicts(gathered), key=lambda item: item[0])
        infos: dict[str, Any] = {}
        for row, dicts in items:
            for info in dicts:
                infos = batch._add_info(infos, info, row)
        return infos


def recv_whole_batch(env: Any, timeout: float | None) -> tuple:
    """``recv()`` when ``batch_size == num_envs`` (ShmVectorEnv and RayVectorEnv):
    the pending reset, as a step with zero rewards, or the pending step, with
    ``infos["env_id"]``."""
    if env._sync_reset_pending:
        env._sync_reset_pending = False
        obs, infos = env.reset_wait(timeout)
        zeros = np.zeros(env.num_envs, dtype=bool)
        result = obs, np.zeros(env.num_envs), zeros, zeros.copy(), infos
    else:
        result = env.step_wait(timeout)
    result[4]["env_id"] = np.arange(env.num_envs)
    return result
