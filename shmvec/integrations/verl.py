"""shmvec in verl: an agent loop whose env runs in shmvec's worker processes.

verl (0.9) runs one coroutine per trajectory: its ``AgentLoopWorker`` calls
``AgentLoopBase.run(sampling_params, **row)`` for every row of a batch and gathers
them. ``ShmvecAgentLoop.run`` leases an env of the process's ``AwaitableEnvs``
(made once per process from the ``envs`` factory), resets it with the row's task,
and alternates ``server_manager.generate(prompt_ids=...)`` with ``await
env.step(action)``, token ids in and out: the model's ids are kept as generated
(mask 1, their log-probabilities), and each observation is appended as the ids of
the chat template's text for it (:meth:`ChatTokens.delta
<shmvec.rollouts.tokens.ChatTokens.delta>`: the rest of the assistant turn's closing,
such as the newline after ChatML's ``<|im_end|>``, then the message and the
generation prompt; mask 0, log-probability 0.0). Nothing is rendered twice.

The env is a text env (``shmvec.UnboundedText`` observations and actions, or any
whose observations ``str()`` well); its rewards summed are the trajectory's
``reward_score``. An action outside the env's action space (``action_of``'s value for the
model's text) ends the trajectory there, with the turn's ids kept: ``extra_fields["env_ended"]``
is ``"invalid_action"`` and the recorded trajectory's ``reason`` names the action and the
space. An env error, a step past ``step_deadline`` or a dead worker
raises an ``EnvFailure`` from that ``run()`` only (``max_retries`` runs the
trajectory again first); the env serves the next trajectory.

Importing this module registers it under ``"shmvec_env"`` (verl's ``register``; a
subclass goes under a name of your own) and name the env factory in verl's agent loop config::

    - name: guess_game
      _target_: shmvec.integrations.verl.ShmvecAgentLoop
      envs: my_project.envs:make_envs      # () -> ShmVectorEnv / make_mix / AwaitableEnvs
      max_turns: 8

A row's task: ``env_tag``, ``env_seed`` and ``env_options`` columns, or the same
keys (``tag``, ``seed``, ``options``) in its ``extra_info``; ``raw_prompt`` (the
chat so far) is put before the env's first observation.
"""

from __future__ import annotations

import atexit
import importlib
import time
from collections.abc import Callable
from typing import Any
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import (
    AgentLoopBase,
    AgentLoopMetrics,
    AgentLoopOutput,
    register,
)

from shmvec.awaitable import AwaitableEnv, AwaitableEnvs
from shmvec.errors import EnvFailure
from shmvec.rollouts.policies import action_problem
from shmvec.rollouts.records import Status, Task
from shmvec.rollouts.tokens import ChatTokens

__all__ = ["ShmvecAgentLoop", "close_env_pools", "env_pool"]

#: The process's pools, by env factory (verl makes one agent loop per trajectory).
_POOLS: dict[Any, AwaitableEnvs] = {}


def _resolve(factory: str | Callable[[], Any]) -> Callable[[], Any]:
    if callable(factory):
        return factory
    module, _, name = factory.replace(":", ".").rpartition(".")
    if not module:
        raise ValueError(f"envs={factory!r}: name a factory as 'package.module:function'")
    found = getattr(importlib.import_module(module), name, None)
    if not callable(found):
        raise ValueError(f"envs={factory!r}: {module} has no callable {name!r}")
    return found


def env_pool(envs: str | Callable[[], Any]) -> AwaitableEnvs:
    """This process's ``AwaitableEnvs`` for the factory ``envs`` (a callable, or its
    ``"module:function"`` name) made on first use: the factory returns a vector env
    in async mode (``ShmVectorEnv``, ``make_mix``; closed at exit) or an
    ``AwaitableEnvs``."""
    pool = _POOLS.get(envs)
    if pool is None or pool._closed:
        made = _resolve(envs)()
        pool = made if isinstance(made, AwaitableEnvs) else AwaitableEnvs(made, close_envs=True)
        _POOLS[envs] = pool
    return pool


@atexit.register
def close_env_pools() -> None:
    """Closes every pool ``env_pool`` made (and the vector envs it made them from)."""
    while _POOLS:
        _, pool = _POOLS.popitem()
        pool.close()


class ShmvecAgentLoop(AgentLoopBase):
    """verl's agent loop over an env leased from shmvec's awaitable envs.

    Args (beside ``AgentLoopBase``'s, which verl passes):
        envs: the env factory (see ``env_pool``); a subclass may set it as a class
            attribute instead.
        max_turns: at most this many model turns (default: the rollout config's
            ``multi_turn.max_assistant_turns``, else until the env ends).
        max_retries: runs of a trajectory again after an ``EnvFailure`` before
            ``run`` raises it.

    Override ``task_of(row)``, ``observation_message(obs)`` or ``action_of(text)``
    to change how a row becomes a task, an observation a chat message, or the
    model's text an action.
    """

    envs: str | Callable[[], Any] | None = None
    max_turns: int | None = None
    max_retries: int = 0

    def __init__(
        self,
        *args: Any,
        envs: str | Callable[[], Any] | None = None,
        max_turns: int | None = None,
        max_retries: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if envs is not None:
            self.envs = envs
        if self.envs is None:
            raise ValueError(
                "ShmvecAgentLoop needs envs=: the env factory ('module:function' in the agent "
                "loop config, or a class attribute of a subclass)"
            )
        multi_turn = self.rollout_config.get("multi_turn", None) or {}
        self.max_turns = max_turns or self.max_turns or multi_turn.get("max_assistant_turns")
        if max_retries is not None:
            self.max_retries = max_retries
        self.response_length = int(self.rollout_config.response_length)
        self.chat = ChatTokens(self.tokenizer, self.apply_chat_template_kwargs)

    # ----------------------------------------------------------- what to change

    def task_of(self, row: dict[str, Any]) -> Task:
        """The env task of a dataset row (see the module)."""
        extra = row.get("extra_info") or {}
        return Task(
            seed=_int_or_none(row.get("env_seed", extra.get("seed"))),
            options=row.get("env_options", extra.get("options")),
            tag=row.get("env_tag", extra.get("tag")),
        )

    def observation_message(self, observation: Any) -> dict[str, Any]:
        """The chat message of an env observation: the user's turn."""
        return {"role": "user", "content": str(observation)}

    def action_of(self, text: str) -> Any:
        """The env action of the model's text (special tokens removed)."""
        return text

    # -------------------------------------------------------------------- run

    async def run(self, sampling_params: dict[str, Any], **row: Any) -> AgentLoopOutput:
        """One trajectory: leases an env, alternates generation and env steps."""
        assert self.envs is not None
        pool = env_pool(self.envs)
        task = self.task_of(row)
        async with pool.env(tag=task.tag) as env:
            for attempt in range(self.max_retries + 1):
                try:
                    return await self._trajectory(env, task, sampling_params, row)
                except EnvFailure:
                    if attempt == self.max_retries:
                        raise
        raise AssertionError("unreachable")  # pragma: no cover

    async def _trajectory(
        self, env: AwaitableEnv, task: Task, sampling_params: dict[str, Any], row: dict
    ) -> AgentLoopOutput:
        timings = {"generate_sequences": 0.0, "tool_calls": 0.0}
        started = time.perf_counter()
        obs, _ = await env.reset(seed=task.seed, options=task.options)
        timings["tool_calls"] += time.perf_counter() - started
        messages = [*list(row.get("raw_prompt") or []), self.observation_message(obs)]
        prompt_ids = self._cap_text_prompt_length(self.chat.first_prompt(messages))
        response_ids: list[int] = []
        mask: list[int] = []
        logprobs: list[float] | None = []
        request_id = uuid4().hex  # one per trajectory: its turns share a prefix
        reward, turns, observed, ended = 0.0, 0, 1, "response_length"
        while len(response_ids) < self.response_length:
            started = time.perf_counter()
            output = await self.server_manager.generate(
                request_id=request_id,
                prompt_ids=prompt_ids + response_ids,
                sampling_params=sampling_params,
            )
            timings["generate_sequences"] += time.perf_counter() - started
            generated = list(output.token_ids)
            response_ids += generated
            mask += [1] * len(generated)
            logprobs = _extend_logprobs(logprobs, output.log_probs, len(generated))
            turns += 1
            if len(response_ids) >= self.response_length:
                break
            action = self.action_of(self.chat.reply_text(generated))
            invalid = action_problem(env.action_space, action)
            if invalid is not None:  # the model's mistake: this trajectory's outcome
                ended = Status.INVALID_ACTION.value
                if env.trajectory is not None:
                    env.trajectory.status, env.trajectory.reason = Status.INVALID_ACTION, invalid
                break
            started = time.perf_counter()
            obs, step_reward, terminated, truncated, _ = await env.step(action)
            timings["tool_calls"] += time.perf_counter() - started
            reward += float(step_reward)
            if terminated or truncated:
                ended = "terminated" if terminated else "truncated"
                break
            if self.max_turns is not None and turns >= self.max_turns:
                ended = "max_turns"
                break
            appended = self.chat.delta([self.observation_message(obs)], generated)
            response_ids += appended
            mask += [0] * len(appended)
            if logprobs is not None:
                logprobs += [0.0] * len(appended)
            observed += 1
        n = self.response_length
        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=response_ids[:n],
            response_mask=mask[:n],
            response_logprobs=logprobs[:n] if logprobs is not None else None,
            reward_score=reward,
            num_turns=len(messages) - 1 + observed + turns,
            metrics=AgentLoopMetrics(
                generate_sequences=timings["generate_sequences"], tool_calls=timings["tool_calls"]
            ),
            extra_fields={
                "env_id": env.env_id,
                "env_tag": env.tag,
                "env_ended": ended,
                "env_trajectory": env.trajectory,
                "request_id": request_id,
            },
        )


# verl's registry names the class by its module path; the class itself stays as it is.
register("shmvec_env")(ShmvecAgentLoop)


def _extend_logprobs(
    logprobs: list[float] | None, new: list[float] | None, count: int
) -> list[float] | None:
    """The response's log-probabilities with a generation's appended; None once any
    generation came without them (the server was not asked for them)."""
    if logprobs is None or new is None:
        return None
    if len(new) != count:
        raise ValueError(f"the server returned {len(new)} log-probabilities for {count} token ids")
    return logprobs + [float(x) for x in new]


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)
