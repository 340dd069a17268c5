"""Token records (shmvec.rollouts.tokens) and the tiny chat model (shmvec.testing.tiny_llm):
prompts grow by ids only, the template's delta matches what the template renders, and a
trainer's samples hold every id with its mask, logprob and version."""

from __future__ import annotations

import hashlib
import random

import pytest

from shmvec.rollouts import Group, Task, Trajectory
from shmvec.rollouts.tokens import (
    ChatTokens,
    TurnTokens,
    batch_samples,
    next_prompt_ids,
    trajectory_sample,
)

pytest.importorskip("transformers", reason="the tiny chat model needs transformers")
pytest.importorskip("tokenizers", reason="the tiny chat model needs tokenizers")
pytest.importorskip("torch", reason="the tiny chat model needs torch")


@pytest.fixture(scope="module")
def tokenizer(tiny_llm_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_llm_path))


def _files_digest(path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.iterdir())
        if p.is_file()
    }


def test_tiny_llm_is_deterministic_per_seed(tmp_path):
    from shmvec.testing.tiny_llm import TinyLLMSpec, build_tiny_llm

    a = build_tiny_llm(tmp_path / "a", TinyLLMSpec(seed=3))
    b = build_tiny_llm(tmp_path / "b", TinyLLMSpec(seed=3))
    c = build_tiny_llm(tmp_path / "c", TinyLLMSpec(seed=4))
    assert _files_digest(a) == _files_digest(b)
    assert _files_digest(a)["model.safetensors"] != _files_digest(c)["model.safetensors"]


def test_tiny_llm_is_cached(tmp_path):
    from shmvec.testing.tiny_llm import TinyLLMSpec, tiny_llm

    first = tiny_llm(TinyLLMSpec(seed=5), cache_dir=tmp_path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    again = tiny_llm(TinyLLMSpec(seed=5), cache_dir=tmp_path)
    assert again == first and (again / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no staging left


def test_tiny_llm_speaks_chatml(tokenizer):
    ids = ChatTokens(tokenizer).first_prompt([{"role": "user", "content": "left"}])
    assert tokenizer.decode(ids) == "<|im_start|>user\nleft<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token == "<|im_end|>"


@pytest.mark.parametrize("stopped", [True, False])
def test_delta_is_what_the_template_renders_after_a_reply(tokenizer, stopped):
    """For a reply whose ids are its text's own tokenization, prompt + completion + delta
    equals the whole chat rendered again: the delta adds exactly the template's text."""
    chat = ChatTokens(tokenizer)
    opening = [{"role": "system", "content": "play"}, {"role": "user", "content": "row 1"}]
    prompt = chat.first_prompt(opening)
    reply = chat.encode("move left")
    completion = [*reply, tokenizer.eos_token_id] if stopped else reply
    turn = TurnTokens(prompt, completion, [0.0] * len(completion), [0] * len(completion))
    turn.messages = opening
    new = [{"role": "user", "content": "row 2"}]
    grown = next_prompt_ids(turn, chat.delta(new, completion))
    assert grown[: len(turn.context_ids)] == turn.context_ids
    assert grown == chat.rerender([turn], new)


def test_drift_happens_with_random_byte_tokens(tokenizer):
    """Random ids (what a random byte-level model writes) often re-tokenize otherwise: the
    id path keeps them, the text path would not."""
    chat = ChatTokens(tokenizer)
    rng = random.Random(0)
    opening = [{"role": "user", "content": "go"}]
    prompt = chat.first_prompt(opening)
    specials = set(tokenizer.all_special_ids)
    ordinary = [i for i in range(len(tokenizer)) if i not in specials]
    drifted = 0
    for _ in range(50):
        completion = [rng.choice(ordinary) for _ in range(12)]
        turn = TurnTokens(prompt, completion, [0.0] * 12, [0] * 12, messages=opening)
        new = [{"role": "user", "content": "ok"}]
        grown = next_prompt_ids(turn, chat.delta(new, completion))
        assert grown[: len(turn.context_ids)] == turn.context_ids
        drifted += grown != chat.rerender([turn], new)
    assert drifted > 10, f"only {drifted}/50 re-rendered prompts differed"


def test_turn_checks_its_lengths():
    with pytest.raises(ValueError, match="one logprob and one version per completion id"):
        TurnTokens([1], [2, 3], [0.0], [0, 0])
    with pytest.raises(ValueError, match="env_start=5 is outside the prompt of 1 ids"):
        TurnTokens([1], [2], [0.0], [0], env_start=5)


def test_chat_tokens_refuses_bad_templates_and_messages(tokenizer):
    class NoTemplate:
        chat_template = None

    with pytest.raises(ValueError, match="has no chat template"):
        ChatTokens(NoTemplate())
    chat = ChatTokens(tokenizer)
    with pytest.raises(ValueError, match="non-empty list of chat messages"):
        chat.first_prompt([])
    with pytest.raises(ValueError, match="a dict with 'role' and 'content'"):
        chat.delta([{"content": "x"}], [1])


def _trajectory(chat: ChatTokens, group_id: int, index: int, turns: int) -> Trajectory:
    traj = Trajectory(Task(seed=group_id), group_id, index, 0)
    messages = [{"role": "user", "content": f"task {group_id}"}]
    prompt, start, previous = chat.first_prompt(messages), 0, None
    for t in range(turns):
        if previous is not None:
            messages = [{"role": "user", "content": f"obs {t}"}]
            start = len(previous.context_ids)
            prompt = next_prompt_ids(previous, chat.delta(messages, previous.completion_ids))
        completion = chat.encode(f"act{t}")
        logprobs = [-0.5 - t - k for k in range(len(completion))]
        turn = TurnTokens(prompt, completion, logprobs, [t] * len(completion), start, messages)
        traj.actions.append(f"act{t}")
        traj.extras.append(turn)
        traj.rewards.append(float(t))
        traj.versions.append(t)
        previous = turn
    return traj


def test_samples_hold_every_id_with_mask_logprob_and_version(tokenizer):
    chat = ChatTokens(tokenizer)
    traj = _trajectory(chat, 7, 1, turns=3)
    sample = trajectory_sample(traj)
    last = traj.extras[-1]
    assert sample.prompt_ids + sample.completion_ids == last.context_ids
    n = len(sample.completion_ids)
    assert len(sample.mask) == len(sample.logprobs) == len(sample.versions) == n
    model = [i for i, m in enumerate(sample.mask) if m]
    assert [sample.completion_ids[i] for i in model] == [
        i for turn in traj.extras for i in turn.completion_ids
    ]
    assert [sample.logprobs[i] for i in model] == [p for t in traj.extras for p in t.logprobs]
    assert [sample.versions[i] for i in model] == [v for t in traj.extras for v in t.versions]
    env = [i for i, m in enumerate(sample.mask) if not m]
    assert [sample.completion_ids[i] for i in env] == traj.extras[1].env_ids + (
        traj.extras[2].env_ids
    )
    assert all(sample.versions[i] == -1 and sample.logprobs[i] == 0.0 for i in env)
    assert sample.reward == 3.0 and sample.turn_rewards == [0.0, 1.0, 2.0]
    assert (sample.group_id, sample.index) == (7, 1)


def test_batch_keeps_groups_contiguous(tokenizer):
    chat = ChatTokens(tokenizer)
    groups = [
        Group(g, Task(seed=g), [_trajectory(chat, g, i, turns=1 + i) for i in range(3)], [])
        for g in (4, 9)
    ]
    batch = batch_samples(groups)
    assert len(batch) == 6 and batch.group_ids == [4, 4, 4, 9, 9, 9]
    assert batch.rewards == [0.0, 1.0, 3.0] * 2
    assert all(len(m) == len(c) for m, c in zip(batch.mask, batch.completion_ids))


def test_sample_refuses_broken_records(tokenizer):
    chat = ChatTokens(tokenizer)
    traj = _trajectory(chat, 0, 0, turns=2)
    traj.extras[1].prompt_ids[0] += 1
    with pytest.raises(ValueError, match="turn 1's prompt does not start with turn 0's"):
        trajectory_sample(traj)
    traj.extras[0] = {"token_ids": [1]}
    with pytest.raises(ValueError, match="kept dict, not TurnTokens"):
        trajectory_sample(traj)
