"""ServerPolicy with stop strings and stop ids against a fake server that stops as vLLM does
(``llm_servers.vllm_stop``): the ids are the completion, the id that completed a stop string
whole; the action's text is the server's text; a stop string across an interruption is found;
and the fields of ``Sampling.extra`` that would break token in, token out are refused."""

from __future__ import annotations

import threading

import pytest

from shmvec.rollouts import Task
from shmvec.rollouts.server import Sampling, ServerPolicy

pytest.importorskip("openai", reason="ServerPolicy needs openai (pip install 'shmvec[server]')")
pytest.importorskip("aiohttp", reason="the fake server needs aiohttp")
pytest.importorskip("transformers", reason="the tiny chat model needs transformers")

from llm_servers import FakeServer  # noqa: E402
from test_server_policy import messages, policy, rollouts, wait_for  # noqa: E402

RECT = 303  # the tiny tokenizer's "rect": a stop string "ec" ends inside it
BRACE, PERCENT = 93, 7  # "{" and "%"


def plant_rect(prompt: list[int], ids: list[int]) -> list[int]:
    return ids[:3] + [RECT] + ids[4:]


@pytest.mark.parametrize("interrupt", [False, True])
@pytest.mark.parametrize(
    "extra",
    [
        {"stop": ["ec"]},
        {"stop": "ec", "include_stop_str_in_output": True},
        {"stop_token_ids": [RECT]},
        {"stop": ["ec"], "min_tokens": 5},
        {"stop": ["\n", "ec"], "skip_special_tokens": False},
    ],
)
def test_a_stop_keeps_the_servers_ids_and_its_text(tiny_tokenizer, extra, interrupt):
    """Every turn keeps the ids the server answered with and the action is the server's text
    (vLLM's: cut at the stop string inside the last id, without the stop id's text)."""
    with FakeServer(tiny_tokenizer, edit=plant_rect) as server:
        pol = policy(server, tiny_tokenizer, interrupt=interrupt, sampling=Sampling(8, extra=extra))
        with rollouts(pol) as r:
            r.submit([Task(seed=s) for s in range(2)])
            groups = r.get_batch(2, timeout=60)
    stopped = 0
    for traj in (t for g in groups for t in g.trajectories):
        for action, turn in zip(traj.actions, traj.extras):
            seen = next(s for s in server.seen if s.prompt == turn.prompt_ids)
            assert turn.completion_ids == seen.ids and turn.finish_reason == seen.finish
            assert action == seen.text
            stopped += turn.finish_reason == "stop"
    if extra.get("min_tokens"):
        assert not stopped  # the planted stop comes within the first min_tokens ids
        return
    assert stopped == sum(len(t.extras) for g in groups for t in g.trajectories)
    first = groups[0].trajectories[0].extras[0]
    assert len(first.completion_ids) == 4 and first.completion_ids[-1] == RECT
    head = tiny_tokenizer.decode(first.completion_ids[:3])
    if "stop_token_ids" in extra:
        expected = head  # without the stop id's text
    else:  # cut before the stop string "ec" in "rect", or after it
        expected = head + ("rec" if extra.get("include_stop_str_in_output") else "r")
    assert groups[0].trajectories[0].actions[0] == expected


def test_a_stop_string_across_an_interruption_ends_the_completion(tiny_tokenizer):
    """A stop string whose first half came before set_version and second half after (two
    requests, neither of which holds it) ends the completion at its last id."""

    def split_stop(prompt: list[int], ids: list[int]) -> list[int]:
        if prompt[-1] == BRACE:  # the request that continues after the "{"
            return [PERCENT] + ids[1:]
        return ids[:2] + [BRACE] + ids[3:]

    hold = threading.Event()
    with FakeServer(tiny_tokenizer, hold=hold, hold_after=3, edit=split_stop) as server:
        sampling = Sampling(8, extra={"stop": ["{%"]})
        pol = policy(server, tiny_tokenizer, interrupt=True, sampling=sampling)
        with rollouts(pol) as r:
            r.submit([Task(seed=0)])
            wait_for(lambda: server.held == 4, "4 streams held after their '{'")
            r.set_version(1)
            wait_for(lambda: sum(s.disconnected for s in server.seen) == 4, "4 cut streams")
            hold.set()
            (group,) = r.get_batch(1, timeout=60)
    for traj in group.trajectories:
        first = traj.extras[0]
        assert first.completion_ids[2:] == [BRACE, PERCENT] and first.finish_reason == "stop"
        assert first.versions == [0, 0, 0, 1] and traj.versions[0] == 0
        assert traj.actions[0] == tiny_tokenizer.decode(first.completion_ids[:2])


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"n": 2}, "'n'"),
        ({"best_of": 3}, "'best_of'"),
        ({"use_beam_search": True}, "'use_beam_search'"),
        ({"echo": True}, "'echo'"),
        ({"suffix": "x"}, "'suffix'"),
        ({"truncate_prompt_tokens": 100}, "'truncate_prompt_tokens'"),
        ({"spaces_between_special_tokens": False}, "'spaces_between_special_tokens'"),
        ({"stream_options": {"include_usage": True}}, "'stream_options'"),
        ({"prompt_embeds": "x"}, "'prompt_embeds'"),
        ({"logprobs": 5}, "'logprobs'"),
        ({"max_tokens": 5}, "Sampling.max_tokens"),
        ({"stream": True}, "'stream'"),
        ({"return_token_ids": False}, "'return_token_ids'"),
        ({"stop": [""]}, "'stop'"),
        ({"stop": 3}, "'stop'"),
        ({"stop_token_ids": ["x"]}, "'stop_token_ids'"),
        ({"min_tokens": -1}, "'min_tokens'"),
        ({"ignore_eos": "yes"}, "'ignore_eos'"),
    ],
)
def test_extra_fields_that_break_token_in_token_out_are_refused(extra, field):
    with pytest.raises(ValueError, match=field):
        Sampling(extra=extra)


def test_guided_decoding_is_refused_with_interrupt(tiny_tokenizer):
    guided = Sampling(extra={"structured_outputs": {"regex": "[a-z]+"}, "top_k": 5})
    url = "http://127.0.0.1:1/v1"
    ServerPolicy(url, "tiny", tiny_tokenizer, messages, sampling=guided)  # whole requests: fine
    with pytest.raises(ValueError, match="structured_outputs.*interrupt=True"):
        ServerPolicy(url, "tiny", tiny_tokenizer, messages, sampling=guided, interrupt=True)


def test_a_continued_request_counts_its_ids_toward_min_tokens(tiny_tokenizer):
    pol = ServerPolicy(
        "http://127.0.0.1:1/v1",
        "tiny",
        tiny_tokenizer,
        messages,
        sampling=Sampling(8, extra={"min_tokens": 5, "top_k": 3}),
    )
    assert pol._body([1, 2], 8, False)["min_tokens"] == 5
    assert pol._body([1, 2, 9, 9, 9], 5, True, generated=3)["min_tokens"] == 2
    assert pol._body([1, 2, *[9] * 6], 2, True, generated=6)["min_tokens"] == 0
