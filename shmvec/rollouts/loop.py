"""The loop that owns the vector env: in a thread of its own, it starts the
attempts the book launches, sends the policy's answers, receives results and
tells the book what came back, through the vector env's public async API
(``async_reset``, ``send``, ``recv``) only.

An env whose trajectory ends starts its next one at once; there is no turn
barrier. Each received batch's rows that await an action go to the policy's
runner at once; its answers are sent on the loop's next pass. No result waits
for another env: a row waits at most ``POLL_S`` (a per-row policy) or
``BATCH_WAIT_S`` (a batched one, once its call is done) for its batch to fill,
and the loop then takes the rows that are in (``recv(take_ready=True)``).
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from typing import Any

import numpy as np
from gymnasium.vector.utils import concatenate, create_empty_array
from gymnasium.vector.vector_env import AutoresetMode

from shmvec.rollouts.book import Book
from shmvec.rollouts.policies import PolicyRunner, action_problem, split_row_output
from shmvec.rollouts.records import PolicyRow, Status, Trajectory
from shmvec.rollouts.rows import rows_of, take_rows
from shmvec.row_infos import infos_by_row

#: Infos with which the vector env reports that an env lost its state, and the
#: failure each one is (``on_env_error="reset"``, ``on_worker_death="restart"``,
#: RayVectorEnv's ``on_actor_death="restart"``, ``step_deadline``).
FAILURE_INFOS = {
    "env_error": Status.ENV_ERROR,
    "worker_restarted": Status.WORKER_DIED,
    "actor_restarted": Status.WORKER_DIED,
    "node_lost": Status.NODE_LOST,  # ClusterVectorEnv: its node agent was lost or drained
    "step_deadline": Status.DEADLINE,
}
#: How long one ``recv`` blocks before the loop looks at its stop flag again.
RECV_SLICE_S = 0.25
#: How long ``recv`` blocks while policy answers may come in: an answer waits
#: at most this long to be sent (small beside a policy call); and how long a row
#: for a per-row policy waits for its batch to fill.
POLL_S = 0.002
#: How long a row for a batched policy waits for its batch to fill once the policy's
#: call is done: envs that step at the same pace fill it sooner, and a row of a fast env
#: never waits for a slow env's step longer than this.
BATCH_WAIT_S = 0.005


class Loop:
    """The thread that drives ``envs`` for ``book`` (see the module).

    Everything it shares with the trainer's threads (the book, ``error``,
    ``stopping``) it reads and changes under ``changed``'s lock, and it
    notifies ``changed`` whenever a waiter may have something to see.
    """

    def __init__(
        self,
        envs: Any,
        book: Book,
        runner: PolicyRunner,
        changed: threading.Condition,
        info_keys: tuple[str, ...] = (),
    ) -> None:
        self.envs, self.book, self.runner, self.changed = envs, book, runner, changed
        self.info_keys = info_keys
        self.num_envs, self.batch_size = envs.num_envs, envs.batch_size
        self.action_space = envs.single_action_space
        self.expect_reset = np.zeros(self.num_envs, dtype=bool)
        self.sent_s = np.zeros(self.num_envs)
        self.active_s = 0.0  # time during which some attempt was unfinished
        self.held_s = 0.0  # time during which the lag bound kept a free env from a task
        self.started_s = self.tick_s = time.monotonic()
        self.error: BaseException | None = None
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="shmvec-rollouts", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        with self.changed:
            self.stopping = True
            self.changed.notify_all()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join()

    def _run(self) -> None:
        try:
            while self._turn():
                pass
        except BaseException as error:  # noqa: BLE001 - handed to the trainer's thread
            with self.changed:
                self.error = error
                self.changed.notify_all()

    def _turn(self) -> bool:
        """One pass: start attempts, send answers, receive one batch, ask the policy."""
        book = self.book
        with self.changed:
            if self.stopping:
                return False
            now = time.monotonic()
            if book.active:
                self.active_s += now - self.tick_s
            if book.held:
                self.held_s += now - self.tick_s
            self.tick_s = now
            resolved = book.resolutions
            book.set_lost(getattr(self.envs, "lost_env_ids", ()))
            starts = book.launch(now)
            answers = self._take_answers(now)
            if book.resolutions != resolved:
                self.changed.notify_all()
            idle = not starts and not answers and not book.busy
            if idle:
                self._check_envs_left()
                self.changed.wait(POLL_S if self.runner.outstanding else RECV_SLICE_S)
        if idle:
            if hasattr(self.envs, "update_agents"):
                self.envs.update_agents()  # a cluster's agents started, were lost or drained
            return True
        if starts:
            self._start(starts)
        if answers:
            self._send(answers)
        if book.busy:
            self._receive()
        return True

    def _check_envs_left(self) -> None:
        """A RuntimeError when work waits and no env will ever take it (every node agent
        of a ClusterVectorEnv is gone)."""
        if getattr(self.envs, "exhausted", False) and (self.book.queue or self.book.tasks_left()):
            raise RuntimeError(
                "no env can take work: every node agent was lost or drained "
                f"({getattr(self.envs, 'lost_agents', {})})"
            )

    def _start(self, starts: list[tuple[int, Trajectory]]) -> None:
        seeds: list[int | None] = [None] * self.num_envs
        options: list[dict[str, Any] | None] = [None] * self.num_envs
        for env, traj in starts:
            seeds[env], options[env] = traj.task.seed, traj.task.options
        ids = np.array([env for env, _ in starts], dtype=np.int64)
        self.expect_reset[ids] = True
        self.sent_s[ids] = time.monotonic()
        self.envs.async_reset(seed=seeds, options=options, env_ids=ids)

    def _send(self, answers: list[tuple[int, Any]]) -> None:
        space = self.action_space
        out: Any = create_empty_array(space, len(answers))
        actions = concatenate(space, [a for _, a in answers], out)
        ids = np.array([env for env, _ in answers], dtype=np.int64)
        self.expect_reset[ids] = False
        self.sent_s[ids] = time.monotonic()
        self.envs.send(actions, ids)

    def _receive(self) -> None:
        """Receives a batch (fewer rows when fewer envs run), records it and hands
        the rows that await an action to the policy's runner."""
        running = len(self.book.busy)
        busy, per_row = self.runner.outstanding, self.runner.per_row
        # A batched policy that is busy takes no row before its call ends: the rows wait
        # in the slot (it fills meanwhile), and the loop looks for answers every POLL_S.
        try:
            result = self.envs.recv(
                timeout=POLL_S if busy or per_row else BATCH_WAIT_S,
                partial=running < self.batch_size,
                take_ready=per_row or not busy,
            )
        except (multiprocessing.TimeoutError, TimeoutError):
            return
        with self.changed:
            resolved = self.book.resolutions
            # A row recorded early may belong to an attempt that a later row's
            # outcome cancelled (its group completed or was dropped): its env is
            # free already.
            rows = [(i, env) for i, env in self._record(result) if self.book.on_env[env]]
            if rows:
                self._ask(rows, result[0])
            if self.book.resolutions != resolved:
                self.changed.notify_all()

    def _record(self, result: tuple) -> list[tuple[int, int]]:
        """Tells the book a received batch; returns the rows (row, env) that await
        an action."""
        obs, rewards, terminations, truncations, infos = result
        book = self.book
        env_ids = infos["env_id"].tolist()
        now = time.monotonic()
        observations = rows_of(obs)
        failures = [
            (infos[f"_{key}"], infos[key], status)
            for key, status in FAILURE_INFOS.items()
            if f"_{key}" in infos
        ]
        needs = []
        for i, env in enumerate(env_ids):
            traj = book.returned(env)
            if traj is None:
                continue  # a cancelled attempt's last result
            traj.env_s += now - self.sent_s[env]
            failure = next(((values, status) for mask, values, status in failures if mask[i]), None)
            if failure is not None:
                book.failed(traj, failure[1], str(failure[0][i]), now)
                continue
            info = self._chosen_infos(infos, i)
            if self.expect_reset[env]:
                book.reset_done(traj, observations[i], info)
            elif not book.step_done(
                traj,
                observations[i],
                float(rewards[i]),
                bool(terminations[i]),
                bool(truncations[i]),
                info,
                now,
            ):
                continue
            needs.append((i, env))
        return needs

    def _chosen_infos(self, infos: dict, row: int) -> dict[str, Any]:
        if not self.info_keys:
            return {}
        if not any(k in infos for k in self.info_keys):
            return {}
        # The row's values as its env returned them (Python scalars stay Python scalars).
        return infos_by_row(self.envs, infos).info(row, only=self.info_keys)

    def _ask(self, rows: list[tuple[int, int]], obs: Any) -> None:
        """Hands the policy's runner the rows ``(row, env)`` of the received
        observations ``obs``: each row's observation as its trajectory recorded
        it, and their batch (copied: the runner keeps it)."""
        trajs: list[Trajectory] = [self.book.on_env[env] for _, env in rows]  # type: ignore[misc]
        self.runner.submit(
            [PolicyRow(traj.observations[-1], traj, env) for traj, (_, env) in zip(trajs, rows)],
            take_rows(obs, [i for i, _ in rows]),
        )

    def _take_answers(self, now: float) -> list[tuple[int, Any]]:
        """The policy's answers for attempts still running, recorded, as (env, action)."""
        answers = []
        taken = self.runner.take()
        # Failures and ends first: one may settle its group and cancel the group's other
        # attempts, whose answers are then not sent (their envs are freed at once, not left
        # to a result). An action outside the action space fails its own trajectory only:
        # the vector env would refuse the whole batch it came in.
        for answer in taken:
            traj = answer.key[0]
            if traj.status is not Status.RUNNING:
                continue
            if answer.failure is not None:
                self.book.failed(traj, Status.POLICY_ERROR, answer.failure, now)
            elif answer.end is not None:
                self.book.policy_ended(traj, answer.end, now)
            elif answer.error is None:
                action = split_row_output(answer.output)[0]
                invalid = action_problem(self.action_space, action)
                if invalid is not None:
                    self.book.failed(traj, Status.INVALID_ACTION, invalid, now)
        for answer in taken:
            traj, version = answer.key
            if answer.error is not None:
                raise answer.error
            if traj.status is not Status.RUNNING or answer.failure or answer.end:
                continue  # cancelled, failed or ended meanwhile; its env was freed then
            action, extra = split_row_output(answer.output)
            traj.policy_s += answer.ended_s - answer.started_s
            if self.book.answered(traj, action, extra, version, now):
                answers.append((traj.env_id, action))
        return answers


def check_envs(envs: Any) -> None:
    """Raises ValueError unless ``envs`` can run rollouts (async mode, failures as results)."""
    if not getattr(envs, "is_async", False):
        raise ValueError(
            "Rollouts needs a vector env in async mode (batch_size < num_envs), so that each "
            f"env steps on its own; got batch_size={getattr(envs, 'batch_size', None)} of "
            f"num_envs={getattr(envs, 'num_envs', None)}"
        )
    if getattr(envs, "on_env_error", "reset") != "reset":
        raise ValueError(
            "Rollouts turns env errors into trajectory outcomes: make the vector env with "
            "on_env_error='reset'"
        )
    death = getattr(envs, "on_worker_death", getattr(envs, "on_actor_death", "restart"))
    if death != "restart":
        raise ValueError(
            "Rollouts turns dead workers into trajectory outcomes: make the vector env with "
            "on_worker_death='restart' (RayVectorEnv: on_actor_death='restart')"
        )
    mode = getattr(envs, "autoreset_mode", AutoresetMode.NEXT_STEP)
    if AutoresetMode(mode) is AutoresetMode.SAME_STEP:
        raise ValueError(
            "Rollouts records each episode's last observation: use autoreset_mode NEXT_STEP "
            "or DISABLED, not SAME_STEP"
        )
