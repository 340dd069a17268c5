"""Token records (shmvec.rollouts.tokens) and the tiny chat model (shmvec.testing.tiny_llm):
prompts grow by ids only, the template's delta matches what the template renders (with what it
writes between turns, such as ChatML's newline after ``<|im_end|>``, after a stop at the
end-of-turn token and after a length stop), and a trainer's samples hold every id with its
mask, logprob and version."""

from __future__ import annotations

import hashlib
import random

import pytest

from shmvec.rollouts import Group, Status, Task, Trajectory
from shmvec.rollouts.tokens import (
    ChatTokens,
    StopRule,
    TurnTokens,
    batch_samples,
    next_prompt_ids,
    stop_completion,
    trajectory_sample,
    turn_prompt,
)

pytest.importorskip("transformers", reason="the tiny chat model needs transformers")
pytest.importorskip("tokenizers", reason="the tiny chat model needs tokenizers")
pytest.importorskip("torch", reason="the tiny chat model needs torch")

from chat_tokenizer import chatml_tokenizer  # noqa: E402


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


def test_appended_ids_decode_to_the_rendered_chat():
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    tokenizer = chatml_tokenizer()
    chat = ChatTokens(tokenizer)
    assert chat.closing == "<|im_end|>\n"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    ids = chat.first_prompt(messages)
    for _ in range(6):
        said = f"I say {rng.randint(1, 9)}"
        generated = tokenizer.encode(said, add_special_tokens=False)
        if rng.random() < 0.7:
            generated.append(tokenizer.eos_token_id)  # a stop at the end of the turn
        answer = {"role": "user", "content": f"No. Try {rng.choice(['higher', 'lower'])}."}
        ids += generated + chat.delta([answer], generated)
        messages += [{"role": "assistant", "content": chat.reply_text(generated)}, answer]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(ids, skip_special_tokens=False) == rendered, seed


def test_the_newline_after_the_end_of_turn_token_is_appended():
    tokenizer = chatml_tokenizer()
    chat = ChatTokens(tokenizer)
    stopped = tokenizer.encode("I say 5", add_special_tokens=False) + [tokenizer.eos_token_id]
    assert chat.closing_left(stopped) == "\n"
    assert chat.closing_left(stopped[:-1]) == "<|im_end|>\n"  # a length stop
    appended = tokenizer.decode(chat.delta([{"role": "user", "content": "No."}], stopped))
    assert appended == "\n<|im_start|>user\nNo.<|im_end|>\n<|im_start|>assistant\n"


def test_chat_template_kwargs_reach_every_rendering():
    tokenizer = chatml_tokenizer()
    # ChatML with the role's separator a template variable (a newline unless given).
    tokenizer.chat_template = (
        "{% set sep = sep if sep is defined else '\\n' %}"
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + sep + m['content'] }}"
        "{{ '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant' + sep }}{% endif %}"
    )
    chat = ChatTokens(tokenizer, chat_template_kwargs={"sep": ": "})
    opening = [{"role": "user", "content": "Hi"}]
    prompt = chat.first_prompt(opening)
    assert tokenizer.decode(prompt) == "<|im_start|>user: Hi<|im_end|>\n<|im_start|>assistant: "
    assert tokenizer.decode(ChatTokens(tokenizer).first_prompt(opening)) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    completion = chat.encode("I say 5") + [tokenizer.eos_token_id]
    new = [{"role": "user", "content": "No."}]
    delta = chat.delta(new, completion)
    assert tokenizer.decode(delta) == "\n<|im_start|>user: No.<|im_end|>\n<|im_start|>assistant: "
    chat_so_far = [*opening, {"role": "assistant", "content": "I say 5"}, *new]
    rendered = tokenizer.apply_chat_template(
        chat_so_far, tokenize=False, add_generation_prompt=True, sep=": "
    )
    assert tokenizer.decode(prompt + completion + delta) == rendered


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


def _random_texts(tokenizer, seed: int, count: int) -> list[str]:
    """Texts of specials, ASCII, accented and CJK letters, digits and whitespace runs."""
    rng = random.Random(seed)
    pieces = [*tokenizer.all_special_tokens, " ", "  ", "\n", "\t", "é", "ß", "数", "7", "42"]
    pieces += ["Guess", " higher", "lower!", "<|im", "_end|>", "\\boxed{3}", "?", "\u00a0"]
    return ["".join(rng.choices(pieces, k=rng.randrange(1, 40))) for _ in range(count)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_chat_encodes_through_the_rust_tokenizer_as_the_tokenizer_does(tokenizer, seed):
    chat = ChatTokens(tokenizer)
    assert chat._core is not None, "a fast tokenizer with nothing set is encoded by its core"
    for text in _random_texts(tokenizer, seed, 300):
        expected = list(tokenizer.encode(text, add_special_tokens=False))
        assert chat.encode(text) == expected, f"seed {seed}: {text!r}"


def test_a_tokenizer_the_core_would_encode_otherwise_keeps_its_own_encode():
    """Truncation set on the core, or special tokens split by the wrapper: the wrapper's
    ``encode`` gives the ids, as before."""
    truncating = chatml_tokenizer()
    truncating.backend_tokenizer.enable_truncation(max_length=3)
    assert ChatTokens(truncating)._core is None
    splitting = chatml_tokenizer()
    splitting.split_special_tokens = True
    chat = ChatTokens(splitting)
    assert chat._core is None
    text = "<|im_start|>user\nhi<|im_end|>\n"
    assert chat.encode(text) == list(splitting.encode(text, add_special_tokens=False))
    assert splitting.convert_tokens_to_ids("<|im_start|>") not in chat.encode(text)


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


def test_a_template_that_rewrites_earlier_turns_is_refused():
    tokenizer = chatml_tokenizer()
    # Shows only the last assistant turn: earlier ones vanish when one is added.
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
        "{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endif %}{% endfor %}"
    )
    with pytest.raises(ValueError, match="renders earlier turns differently"):
        ChatTokens(tokenizer)


def _trajectory(chat: ChatTokens, group_id: int, index: int, turns: int) -> Trajectory:
    traj = Trajectory(Task(seed=group_id), group_id, index, 0)
    messages = [{"role": "user", "content": f"task {group_id}"}]
    for t in range(turns):
        if t:
            messages = [{"role": "user", "content": f"obs {t}"}]
        prompt, start = turn_prompt(chat, traj.extras, messages)
        completion = chat.encode(f"act{t}")
        logprobs = [-0.5 - t - k for k in range(len(completion))]
        turn = TurnTokens(prompt, completion, logprobs, [t] * len(completion), start, messages)
        traj.actions.append(f"act{t}")
        traj.extras.append(turn)
        traj.rewards.append(float(t))
        traj.versions.append(t)
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
    assert sample.status == traj.status.value


def test_batch_keeps_groups_contiguous(tokenizer):
    chat = ChatTokens(tokenizer)
    groups = [
        Group(g, Task(seed=g), [_trajectory(chat, g, i, turns=1 + i) for i in range(3)], [])
        for g in (4, 9)
    ]
    for g in groups:
        for t in g.trajectories:
            t.status = Status.TERMINATED
    groups[1].trajectories[2].status = Status.POLICY_ENDED  # its context was full
    batch = batch_samples(groups)
    assert len(batch) == 6 and batch.group_ids == [4, 4, 4, 9, 9, 9]
    assert batch.rewards == [0.0, 1.0, 3.0] * 2
    assert batch.statuses == ["terminated"] * 5 + ["policy_ended"]
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


def test_turn_prompt_grows_by_the_delta(tokenizer):
    chat = ChatTokens(tokenizer)
    opening = [{"role": "user", "content": "go"}]
    assert turn_prompt(chat, [], opening) == (chat.first_prompt(opening), 0)
    traj = _trajectory(chat, 3, 0, turns=2)
    first, second = traj.extras
    new = [{"role": "user", "content": "obs 1"}]
    assert second.env_start == len(first.context_ids)
    assert second.prompt_ids == next_prompt_ids(first, chat.delta(new, first.completion_ids))
    assert second.env_ids == chat.delta(new, first.completion_ids)


def test_a_turn_after_another_policys_turn_is_refused(tokenizer):
    chat = ChatTokens(tokenizer)
    with pytest.raises(ValueError, match="last extra is str, not TurnTokens"):
        turn_prompt(chat, ["right"], [{"role": "user", "content": "again"}])


@pytest.mark.parametrize("seed", range(4))
def test_stops_end_completions_where_vllm_does(tokenizer, seed):
    """Over random completions and stop fields, ``stop_completion`` keeps the ids vLLM keeps
    and gives the text it answers with (``vllm_stop``: vLLM's rule applied one id at a
    time, as its detokenizer does)."""
    from llm_servers import vllm_stop

    rng = random.Random(seed)
    chat = ChatTokens(tokenizer)
    words = ["e", "ec", " t", "st", "\n", "a b", "ion"]
    stopped = 0
    for _ in range(150):
        body = {
            "stop": rng.sample(words, rng.randint(0, 3)),
            "stop_token_ids": rng.sample(range(3, len(tokenizer)), rng.randint(0, 2)),
            "include_stop_str_in_output": rng.random() < 0.3,
            "min_tokens": rng.choice([0, 0, 2, 5]),
            "ignore_eos": rng.random() < 0.2,
        }
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 24))]
        kept, text, finish = vllm_stop(tokenizer, body, ids)
        got = stop_completion(chat, ids, StopRule.of(body, chat.stop_ids))
        assert (got.kept, got.text, got.stopped) == (kept, text, finish == "stop"), (body, ids)
        stopped += got.stopped
    assert stopped > 15  # the draws do stop, by strings and by ids


def test_a_stop_string_inside_the_last_id_cuts_the_text_not_the_ids(tokenizer):
    chat = ChatTokens(tokenizer)
    ids = tokenizer.encode("ab", add_special_tokens=False) + [303]  # 303: "rect"
    rule = StopRule(strings=("ec",))
    assert stop_completion(chat, ids, rule).kept == len(ids)
    assert stop_completion(chat, ids, rule).text == "abr"
    assert stop_completion(chat, ids, StopRule(strings=("ec",), include=True)).text == "abrec"
    # a completion grown over two requests: the ids after the stop are not the completion's
    later = ids + tokenizer.encode("xyz", add_special_tokens=False)
    assert stop_completion(chat, later, rule) == stop_completion(chat, ids, rule)
    assert stop_completion(chat, [*ids, chat.tokenizer.eos_token_id], StopRule()).text == "abrect"
