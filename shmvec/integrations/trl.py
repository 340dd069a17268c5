"""TRL's ``GRPOTrainer`` with its envs in shmvec: a ``rollout_func`` that runs each prompt's
``num_generations`` trajectories as one group through :class:`~shmvec.rollouts.Rollouts`
and hands the trainer their token ids, log-probabilities, env masks and env rewards::

    rollout_func = RolloutFunc.from_env_fns(
        [FrozenLakeText] * 8, env_concurrency=1,
        task_of=lambda prompt: Task(seed=int(prompt)), policy=ModelPolicy(max_new_tokens=16),
    )
    trainer = GRPOTrainer(model, reward_funcs=env_reward, args=config,
                          train_dataset=dataset, processing_class=tokenizer,
                          rollout_func=rollout_func)

TRL calls ``rollout_func(prompts, trainer)`` with ``num_generations`` copies of each prompt
in a row (a group) and wants one row back per prompt, in the same order: ``prompt_ids``,
``completion_ids`` and ``logprobs``, and here also ``env_mask`` (1 for a model token, 0 for
a token the env's reply added between turns), ``env_reward`` and ``env_status``, which TRL
passes to the reward functions (:func:`env_reward` returns the first; the second says how
each trajectory ended, ``"policy_ended"`` for a conversation that outgrew the model's context
under ``ServerPolicy(on_context_full="end")``; TRL 1.16 leaves a row for which every reward
function returns None out of its group's baseline, with an advantage of 0). Each row is one
trajectory: the first turn's prompt, then every turn's completion with the env's reply
between them, as ids (:mod:`shmvec.rollouts.tokens`: never decoded and rendered again).

The policy is any rollout policy whose extras are :class:`~shmvec.rollouts.tokens.TurnTokens`:
:class:`ModelPolicy` samples with the trainer's own model in this process, and
:class:`~shmvec.rollouts.server.ServerPolicy` from an OpenAI-compatible server. Needs
``pip install "shmvec[trl]"``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from shmvec.rollouts import (
    EndTrajectory,
    Group,
    PolicyBatch,
    PolicyError,
    PolicyFailure,
    PolicyOutput,
    PolicyRow,
    Rollouts,
    Task,
)
from shmvec.rollouts.tokens import (
    ChatTokens,
    TurnTokens,
    batch_samples,
    context_full,
    turn_prompt,
)

__all__ = ["ModelPolicy", "RolloutFunc", "env_reward", "user_message"]

#: The row key that carries each trajectory's total env reward to TRL's reward functions.
ENV_REWARD = "env_reward"
#: The row key that carries how each trajectory ended (a ``Status`` value) to them.
ENV_STATUS = "env_status"


def env_reward(completions: list[Any], env_reward: list[float], **kwargs: Any) -> list[float]:
    """A TRL reward function: each row's env reward (its trajectory's total reward)."""
    return [float(r) for r in env_reward]


# ------------------------------------------------------------------ the rollout function


class RolloutFunc:
    """TRL's ``rollout_func``: each call runs every prompt's group through ``Rollouts``.

    Args:
        envs: a vector env in async mode, as :class:`~shmvec.rollouts.Rollouts` takes it
            (``on_env_error="reset"``, ``on_worker_death="restart"``); it stays open after
            ``close()``. :meth:`from_env_fns` makes one instead.
        task_of: turns a prompt, as TRL passes it (a dataset row's ``prompt``), into the
            :class:`~shmvec.rollouts.Task` its group starts from (a reset seed, options).
        policy: a rollout policy whose extras are ``TurnTokens`` (one per turn):
            :class:`ModelPolicy`, or a per-row policy that calls an inference server. A
            policy with a ``with_trainer(trainer)`` context manager runs inside it
            during each call.
        max_retries: a failed trajectory (env error, dead worker, step deadline) is run
            again from its task up to this many times; a group that still fails makes the
            call raise.
        max_steps: a trajectory ends after this many turns.
        info_keys: the info keys each turn keeps in ``Trajectory.infos``.
        timeout: seconds a call waits for its groups before raising ``TimeoutError``.

    Each call submits one group per prompt, with ``num_generations`` trajectories
    (``num_generations_eval`` while the model is in eval mode), stamps the trainer's
    ``global_step`` as the policy version and waits until every group is complete; groups
    are launched only while a call waits (the rollouts' sync mode), so the policy never
    runs while the trainer trains. ``last_groups`` holds the call's groups in prompt order
    (for :func:`~shmvec.rollouts.replay`, logging).
    """

    def __init__(
        self,
        envs: Any,
        task_of: Callable[[Any], Task],
        policy: Any,
        *,
        max_retries: int = 2,
        max_steps: int | None = None,
        info_keys: Sequence[str] = (),
        timeout: float | None = None,
    ) -> None:
        if not callable(task_of):
            raise TypeError(f"task_of must be a callable prompt -> Task, got {task_of!r}")
        self.envs, self.task_of, self.policy, self.timeout = envs, task_of, policy, timeout
        # min_survivors and redundancy stay at their defaults: a group must have exactly
        # num_generations rows, and nothing may run after a call has returned.
        self._rollout_kwargs: dict[str, Any] = dict(
            mode="sync", max_retries=max_retries, max_steps=max_steps, info_keys=tuple(info_keys)
        )
        self._env_fns: dict[str, Any] | None = None  # from_env_fns's, to make the envs with
        self.rollouts: Rollouts | None = None
        self.last_groups: list[Group] = []
        self._failed: BaseException | None = None
        self._closed = False

    @classmethod
    def from_env_fns(
        cls,
        env_fns: list[Callable[[], Any]],
        task_of: Callable[[Any], Task],
        policy: Any,
        *,
        env_concurrency: int,
        batch_size: int | None = None,
        vector_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> RolloutFunc:
        """A rollout function over a ``ShmVectorEnv`` of ``env_fns``, made at the first call
        as :meth:`Rollouts.from_env_fns <shmvec.rollouts.Rollouts.from_env_fns>` makes it
        (``env_concurrency``, ``batch_size``, ``vector_kwargs``); ``close()`` closes it. The
        other arguments are the constructor's."""
        self = cls(None, task_of, policy, **kwargs)
        self._env_fns = dict(
            env_fns=list(env_fns),
            env_concurrency=env_concurrency,
            batch_size=batch_size,
            vector_kwargs=vector_kwargs,
        )
        return self

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        """The rows of ``prompts`` (``num_generations`` copies of each prompt in a row), in
        their order: ``prompt_ids``, ``completion_ids``, ``logprobs``, ``env_mask`` and
        ``env_reward``, one entry per prompt."""
        if self._closed:
            raise RuntimeError("this rollout function is closed")
        if self._failed is not None:
            raise RuntimeError(
                f"an earlier call of this rollout function failed ({self._failed!r}); its "
                "groups may still be running: make a new one"
            ) from self._failed
        group_size = _group_size(trainer)
        tasks = [self._task(prompt) for prompt in whole_groups(prompts, group_size)]
        rollouts = self._rollouts(group_size)
        step = int(trainer.state.global_step)
        if step < rollouts.version:
            raise ValueError(
                f"the trainer is at step {step}, behind the {rollouts.version} of an earlier "
                "call: a rollout function serves one trainer (make one per training run)"
            )
        rollouts.set_version(step)
        with_trainer = getattr(self.policy, "with_trainer", None)
        with with_trainer(trainer) if with_trainer is not None else contextlib.nullcontext():
            rollouts.submit(tasks)
            try:
                groups = self._collect(rollouts, tasks)
            except BaseException as error:  # its groups may be left running
                self._failed = error
                raise
        self.last_groups = groups
        batch = batch_samples(groups)
        return {
            "prompt_ids": batch.prompt_ids,
            "completion_ids": batch.completion_ids,
            "logprobs": batch.logprobs,
            "env_mask": batch.mask,
            ENV_REWARD: batch.rewards,
            ENV_STATUS: batch.statuses,
        }

    def _task(self, prompt: Any) -> Task:
        task = self.task_of(prompt)
        if not isinstance(task, Task):
            raise TypeError(
                f"task_of({prompt!r:.80}) returned {task!r:.80}, not a shmvec.rollouts.Task"
            )
        # A task object of its own per group: groups are matched to prompts by identity.
        return dataclasses.replace(task)

    def _rollouts(self, group_size: int) -> Rollouts:
        if self.rollouts is None:
            if self._env_fns is not None:
                self.rollouts = Rollouts.from_env_fns(
                    policy=self.policy,
                    group_size=group_size,
                    **self._env_fns,
                    **self._rollout_kwargs,
                )
            else:
                self.rollouts = Rollouts(
                    self.envs, self.policy, group_size=group_size, **self._rollout_kwargs
                )
        elif self.rollouts.group_size != group_size:
            raise ValueError(
                f"this call's groups have {group_size} trajectories but earlier ones had "
                f"{self.rollouts.group_size}: set num_generations_eval equal to num_generations "
                "(one rollout function runs one group size)"
            )
        return self.rollouts

    def _collect(self, rollouts: Rollouts, tasks: list[Task]) -> list[Group]:
        try:
            groups = rollouts.get_batch(len(tasks), timeout=self.timeout)
        except RuntimeError as error:
            dropped = rollouts.stats()["groups_dropped"]
            if not dropped:
                raise
            raise RuntimeError(
                f"groups were dropped after their trajectories failed past max_retries "
                f"({dropped}): TRL needs every group whole"
            ) from error
        position = {id(task): k for k, task in enumerate(tasks)}
        if sorted(position.get(id(g.task), -1) for g in groups) != list(range(len(tasks))):
            raise RuntimeError("the rollouts handed over groups of other tasks than this call's")
        return sorted(groups, key=lambda g: position[id(g.task)])

    def close(self) -> None:
        """Stops the rollouts (and closes the vector env that :meth:`from_env_fns` made)."""
        self._closed = True
        if self.rollouts is not None:
            self.rollouts.close()

    def __enter__(self) -> RolloutFunc:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


def _group_size(trainer: Any) -> int:
    training = getattr(trainer.model, "training", True)
    size = trainer.num_generations if training else trainer.num_generations_eval
    return int(size)


def whole_groups(prompts: Sequence[Any], group_size: int) -> list[Any]:
    """The prompt of each group in ``prompts``, in order.

    Raises:
        ValueError: ``prompts`` are not whole groups (``group_size`` equal prompts in a
            row), naming the first row that breaks one.
    """
    count = len(prompts)
    if count == 0 or count % group_size:
        raise ValueError(
            f"rollout_func got {count} prompts, not a whole number of groups of "
            f"num_generations={group_size}. TRL hands each process num_generations copies of "
            "a prompt in a row; over several processes a group stays whole only when "
            "per_device_train_batch_size * steps_per_generation is a multiple of it"
        )
    firsts = []
    for start in range(0, count, group_size):
        first = prompts[start]
        for row in range(start + 1, start + group_size):
            if prompts[row] != first:
                raise ValueError(
                    f"rows {start}..{start + group_size - 1} must be {group_size} copies of one "
                    f"prompt (a group), but row {row} is {prompts[row]!r:.80} and row {start} "
                    f"is {first!r:.80}"
                )
        firsts.append(first)
    return firsts


# -------------------------------------------------------------- the trainer's own model


def user_message(row: PolicyRow) -> list[dict[str, Any]]:
    """The messages a turn adds by default: the observation as a user message."""
    return [{"role": "user", "content": row.observation}]


@dataclass
class _TrainerModel:
    """What one ``rollout_func`` call lends the policy: the model and its settings."""

    model: Any
    chat: ChatTokens
    pad_id: int
    temperature: float
    max_new_tokens: int
    version: int
    context: int | None  # the longest prompt and completion the model takes


class ModelPolicy:
    """A batched rollout policy that samples each turn with the trainer's own model, in this
    process, keeping each turn's ids and log-probabilities as ``TurnTokens``.

    Args:
        messages: ``messages(row) -> list of {"role", "content"}``: the chat messages the
            row's observation adds (on a trajectory's first turn, the opening messages:
            system, task, observation), as
            :class:`~shmvec.rollouts.server.ServerPolicy` takes them. Default: the
            observation as a user message.
        max_new_tokens: the longest completion of one turn (default: the trainer's
            ``max_completion_length``).
        context_length: the longest prompt and completion the model takes (default: its
            config's ``max_position_embeddings``). A turn's completion stops at it, and a
            later turn whose prompt fills it ends its trajectory as finished
            (``policy_ended``, as ``ServerPolicy(on_context_full="end")`` does); an opening
            prompt that does not fit is an error.
        action: turns the completion's text into the env's action, as
            :class:`~shmvec.rollouts.server.ServerPolicy`'s ``action`` does (default: the
            text). It may raise :class:`~shmvec.rollouts.PolicyFailure` to fail the row's
            trajectory (``policy_error``) or :class:`~shmvec.rollouts.EndTrajectory` to end it.

    It samples from the whole distribution at the trainer's ``temperature`` (no top-k or
    top-p), so that each log-probability is the one TRL recomputes for the same weights; the
    action sent to the env is the completion decoded without special tokens (or ``action`` of
    it). An action outside the env's action space (a character outside a ``Text`` space's
    charset) fails its trajectory as ``invalid_action``, which ``max_retries`` retries; the
    other rows go on. It runs only
    inside a call of :class:`RolloutFunc` (its ``with_trainer``), which lends it the
    model as TRL's own generation does (``trl.models.unwrap_model_for_generation``).
    """

    def __init__(
        self,
        messages: Callable[[PolicyRow], list[dict[str, Any]]] = user_message,
        *,
        max_new_tokens: int | None = None,
        context_length: int | None = None,
        action: Callable[[str], Any] | None = None,
    ) -> None:
        if not callable(messages):
            raise TypeError(f"messages must be a function of a row, got {messages!r}")
        if action is not None and not callable(action):
            raise TypeError(f"action must be None or a function of the reply text, got {action!r}")
        if max_new_tokens is not None and (
            not isinstance(max_new_tokens, int) or max_new_tokens < 1
        ):
            raise ValueError(f"max_new_tokens must be None or an int >= 1, got {max_new_tokens!r}")
        if context_length is not None and (
            not isinstance(context_length, int) or context_length < 1
        ):
            raise ValueError(f"context_length must be None or an int >= 1, got {context_length!r}")
        self.messages, self.max_new_tokens = messages, max_new_tokens
        self.context_length, self.action = context_length, action
        self._lock = threading.Lock()  # held while a batch is sampled
        self._model_state: _TrainerModel | None = None
        self._chat: ChatTokens | None = None

    @contextlib.contextmanager
    def with_trainer(self, trainer: Any) -> Iterator[None]:
        """Lends the policy ``trainer``'s model, tokenizer and sampling settings; on exit,
        waits for the batch being sampled, if any, and takes them back."""
        from trl.models import unwrap_model_for_generation

        tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
        if self._chat is None or self._chat.tokenizer is not tokenizer:
            self._chat = ChatTokens(tokenizer)
        temperature = float(trainer.args.temperature)
        if temperature <= 0:
            raise ValueError(f"ModelPolicy samples: the temperature must be > 0, got {temperature}")
        pad_id = tokenizer.pad_token_id
        if pad_id is None:
            pad_id = min(self._chat.stop_ids, default=0)
        with unwrap_model_for_generation(
            trainer.model_wrapped,
            trainer.accelerator,
            gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs,
        ) as model:
            state = _TrainerModel(
                model=model,
                chat=self._chat,
                pad_id=int(pad_id),
                temperature=temperature,
                max_new_tokens=self.max_new_tokens or int(trainer.args.max_completion_length),
                version=int(trainer.state.global_step),
                context=self.context_length
                or getattr(getattr(model, "config", None), "max_position_embeddings", None),
            )
            with self._lock:
                self._model_state = state
            try:
                yield
            finally:
                with self._lock:
                    self._model_state = None

    def __call__(self, batch: PolicyBatch) -> PolicyOutput:
        with self._lock:
            state = self._model_state
            if state is None:
                raise PolicyError(
                    "ModelPolicy samples with the trainer's model, which it holds only during "
                    "a call of RolloutFunc"
                )
            turns = self._sample(state, batch)
        actions = [
            turn if isinstance(turn, EndTrajectory) else self._action(state, turn) for turn in turns
        ]
        extras = [None if isinstance(turn, EndTrajectory) else turn for turn in turns]
        return PolicyOutput(actions=actions, extras=extras)

    def _action(self, state: _TrainerModel, turn: TurnTokens) -> Any:
        """The env action of ``turn``; a ``PolicyFailure`` or ``EndTrajectory`` that
        ``action`` raised stands in the row's place."""
        text = state.chat.reply_text(turn.completion_ids)
        if self.action is None:
            return text
        try:
            return self.action(text)
        except (PolicyFailure, EndTrajectory) as outcome:
            return outcome

    def _sample(self, state: _TrainerModel, batch: PolicyBatch) -> list[TurnTokens | EndTrajectory]:
        """Each row's turn, or the end of its trajectory where its prompt fills the context."""
        ends: dict[int, EndTrajectory] = {}
        prompts = []  # the rows to sample: (prompt ids, env start, messages)
        for row, (trajectory, observation, env_id) in enumerate(
            zip(batch.trajectories, batch.observations, batch.env_ids)
        ):
            messages = self.messages(PolicyRow(observation, trajectory, int(env_id)))
            if not isinstance(messages, list) or not messages:
                raise ValueError(
                    f"messages(row) returned {messages!r} for env {env_id}: it must return the "
                    "non-empty list of chat messages the observation adds"
                )
            prompt_ids, env_start = turn_prompt(state.chat, trajectory.extras, messages)
            full = context_full(prompt_ids, state.context)
            if full is not None:
                if not trajectory.extras:
                    raise PolicyError(f"the opening prompt of env {env_id}: {full}")
                ends[row] = EndTrajectory(full)
            else:
                prompts.append((prompt_ids, env_start, messages))
        turns = iter(self._generate(state, prompts) if prompts else [])
        return [ends[row] if row in ends else next(turns) for row in range(len(batch.env_ids))]

    def _generate(
        self, state: _TrainerModel, prompts: list[tuple[list[int], int, Any]]
    ) -> list[TurnTokens]:
        """One turn for each of ``prompts`` (prompt ids, env start, messages), sampled in one
        ``generate`` call; each completion cut after its end of turn and at the context."""
        import torch
        from transformers import GenerationConfig

        width = max(len(ids) for ids, _, _ in prompts)
        device = state.model.device
        input_ids = torch.tensor(
            [[state.pad_id] * (width - len(ids)) + ids for ids, _, _ in prompts], device=device
        )
        attention = torch.tensor(
            [[0] * (width - len(ids)) + [1] * len(ids) for ids, _, _ in prompts], device=device
        )
        stop = sorted(state.chat.stop_ids)
        # No row keeps more ids than the context leaves it (cut below): none is made past.
        most = state.max_new_tokens
        if state.context is not None:
            most = min(most, max(state.context - len(ids) for ids, _, _ in prompts))
        config = GenerationConfig(
            do_sample=True,
            temperature=state.temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=most,
            eos_token_id=stop or None,
            pad_token_id=state.pad_id,
            return_dict_in_generate=True,
            output_logits=True,
            disable_compile=True,  # as TRL's own generation: no compile per prompt length
        )
        output = state.model.generate(
            input_ids=input_ids, attention_mask=attention, generation_config=config
        )
        new = output.sequences[:, width:]
        logits = torch.stack(output.logits, dim=1).float() / state.temperature
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        turns = []
        for row, (prompt_ids, env_start, messages) in enumerate(prompts):
            ids = new[row].tolist()
            if state.context is not None:
                ids = ids[: state.context - len(prompt_ids)]
            length, finish = len(ids), "length"
            for at, token in enumerate(ids):
                if token in state.chat.stop_ids:
                    length, finish = at + 1, "stop"
                    break
            turns.append(
                TurnTokens(
                    prompt_ids=prompt_ids,
                    completion_ids=ids[:length],
                    logprobs=logprobs[row, :length].tolist(),
                    versions=[state.version] * length,
                    env_start=env_start,
                    messages=messages,
                    finish_reason=finish,
                )
            )
        return turns
