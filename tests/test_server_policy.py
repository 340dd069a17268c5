"""ServerPolicy against a fake OpenAI-compatible server: the ids it sends and keeps, every
server failure turned into retries and then into counted trajectory outcomes, the cap on
requests in flight, close(), interruption across versions, and clear errors for bad input."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import os
import random
import threading
import time

import pytest

from shmvec.rollouts import PolicyError, Rollouts, Status, Task
from shmvec.rollouts.server import Retry, Sampling, ServerPolicy
from shmvec.rollouts.server_client import ClientShards, InFlightLimit
from shmvec.rollouts.tokens import TurnTokens, batch_samples
from shmvec.text_envs import FrozenLakeText

pytest.importorskip("openai", reason="ServerPolicy needs openai (pip install 'shmvec[server]')")
pytest.importorskip("aiohttp", reason="the fake server needs aiohttp")
pytest.importorskip("transformers", reason="the tiny chat model needs transformers")

from llm_servers import FakeServer, free_port, random_faults  # noqa: E402

FAST = Retry(attempts=6, backoff_s=0.01, max_backoff_s=0.05, timeout_s=60.0)
STEPS = 3


def messages(row):
    if not row.trajectory.actions:
        return [
            {"role": "system", "content": "Play FrozenLake: answer left, down, right or up."},
            {"role": "user", "content": row.observation},
        ]
    return [{"role": "user", "content": row.observation}]


def policy(server, tokenizer, **kwargs) -> ServerPolicy:
    kwargs.setdefault("retry", FAST)
    kwargs.setdefault("sampling", Sampling(max_tokens=8))
    return ServerPolicy(server.base_url, "tiny", tokenizer, messages, **kwargs)


def rollouts(pol, envs: int = 8, group_size: int = 4, **kwargs) -> Rollouts:
    lake = functools.partial(FrozenLakeText, max_episode_steps=STEPS, is_slippery=False)
    return Rollouts.from_env_fns(
        [lake] * envs, pol, env_concurrency=envs, group_size=group_size, **kwargs
    )


def run(pol, groups: int = 4, **kwargs):
    with rollouts(pol, **kwargs) as r:
        r.submit([Task(seed=s) for s in range(groups)])
        batch = r.get_batch(groups, timeout=120)
        return batch, r.stats()


def run_until_dropped(pol) -> dict:
    """One task's group, without retries, until it is dropped (or 60 s): the rollouts' stats."""
    with rollouts(pol, max_retries=0) as r:
        r.submit([Task(seed=0)])
        deadline = time.monotonic() + 60
        while not r.stats()["groups_dropped"] and time.monotonic() < deadline:
            time.sleep(0.02)
        return r.stats()


def turns_of(groups) -> list[TurnTokens]:
    return [turn for g in groups for t in g.trajectories for turn in t.extras]


def test_ids_sent_and_kept_are_the_servers(tiny_tokenizer):
    """Every turn keeps the ids and logprobs the server sent for exactly the prompt it got,
    and each later prompt is the previous prompt and completion followed by the delta."""
    with FakeServer(tiny_tokenizer) as server:
        pol = policy(server, tiny_tokenizer, count_drift=True)
        groups, stats = run(pol)
    by_prompt = {tuple(s.prompt): s for s in server.seen}
    turns = turns_of(groups)
    assert len(turns) == len(server.seen) == stats["steps"]
    for turn in turns:
        seen = by_prompt[tuple(turn.prompt_ids)]
        assert turn.completion_ids == seen.ids and turn.logprobs == seen.logprobs
        assert turn.versions == [0] * len(seen.ids)
    for g in groups:
        for traj in g.trajectories:
            for prev, turn in zip(traj.extras, traj.extras[1:]):
                assert turn.prompt_ids[: turn.env_start] == prev.prompt_ids + prev.completion_ids
            assert traj.actions == [
                tiny_tokenizer.decode(t.completion_ids, skip_special_tokens=True)
                for t in traj.extras
            ]
    batch = batch_samples(groups)
    assert len(batch) == 16 and batch.group_ids == [g.group_id for g in groups for _ in range(4)]
    assert pol.stats()["compared_turns"] == sum(1 for t in turns if t.drift is not None) > 0


@pytest.mark.parametrize("kind", ["503", "429", "500", "hang", "empty", "null_logprobs"])
def test_failed_requests_are_retried(tiny_tokenizer, kind):
    """The first requests fail; each is asked again and no trajectory fails."""
    bad = 5
    fault = lambda n, body: kind if n < bad else "ok"  # noqa: E731
    timeout_s = 1.0 if kind == "hang" else 60.0
    with FakeServer(tiny_tokenizer, fault=fault, hang_s=30.0) as server:
        retry = Retry(attempts=8, backoff_s=0.01, timeout_s=timeout_s)
        pol = policy(server, tiny_tokenizer, retry=retry)
        groups, stats = run(pol)
    assert stats["dropped"] == {} and len(groups) == 4
    faults = pol.stats()["faults"]
    # every request the server saw is a kept turn or a counted fault
    assert len(server.seen) == stats["steps"] + sum(faults.values())
    expected = {"hang": "timeout", "503": "server_error", "500": "server_error"}
    expected |= {"429": "rate_limited", "null_logprobs": "no_logprobs", "empty": "empty_reply"}
    if kind == "hang":  # (a slow machine may let an answered request time out too)
        assert faults.keys() == {"timeout"} and faults["timeout"] >= bad
    else:
        assert faults == {expected[kind]: bad}


def test_dropped_stream_keeps_its_tokens(tiny_tokenizer):
    """A connection broken mid-stream: the tokens already received are kept and the
    completion goes on from the prompt plus them."""
    fault = lambda n, body: "drop" if n == 0 else "ok"  # noqa: E731
    with FakeServer(tiny_tokenizer, fault=fault) as server:
        pol = policy(server, tiny_tokenizer, interrupt=True)
        groups, stats = run(pol, groups=1)
    first = server.seen[0]
    assert first.disconnected and 0 < len(first.ids) < first.max_tokens
    resumed = next(s for s in server.seen if s.prompt == first.prompt + first.ids)
    assert resumed.max_tokens == first.max_tokens - len(first.ids)
    kept = [
        (t.completion_ids, t.logprobs) for t in turns_of(groups) if t.prompt_ids == first.prompt
    ]
    assert (first.ids + resumed.ids, first.logprobs + resumed.logprobs) in kept
    assert pol.stats()["faults"] == {"dropped": 1} and stats["dropped"] == {}


def test_server_that_starts_late_is_waited_for(tiny_tokenizer):
    """Connections are refused until the server listens: the rows wait and retry. The server
    starts once a refusal is counted (a fixed delay would race the rollouts' own start)."""
    port = free_port()
    late = FakeServer(tiny_tokenizer, port=port)
    pol = ServerPolicy(
        late.base_url,
        "tiny",
        tiny_tokenizer,
        messages,
        sampling=Sampling(max_tokens=8),
        retry=Retry(attempts=40, backoff_s=0.05, max_backoff_s=0.2),
    )

    def start_after_a_refusal() -> None:
        deadline = time.monotonic() + 60.0
        while not pol.stats()["faults"].get("connect") and time.monotonic() < deadline:
            time.sleep(0.01)
        late.start()

    starter = threading.Thread(target=start_after_a_refusal)
    starter.start()
    try:
        groups, stats = run(pol, groups=2)
    finally:
        starter.join()
        late.stop()
    assert stats["dropped"] == {} and len(groups) == 2
    assert pol.stats()["faults"].get("connect", 0) >= 1, pol.stats()["faults"]


def test_failures_past_the_retries_fail_trajectories_and_are_counted(tiny_tokenizer):
    """With one request per turn allowed, each failed request fails its trajectory as
    policy_error; the group policy retries them and every group is delivered."""
    bad = 6
    fault = lambda n, body: "503" if n < bad else "ok"  # noqa: E731
    with FakeServer(tiny_tokenizer, fault=fault) as server:
        pol = policy(server, tiny_tokenizer, retry=Retry(attempts=1))
        groups, stats = run(pol, max_retries=bad)
    assert len(groups) == 4
    assert stats["dropped"] == {"policy_error": bad} and stats["retries"] == bad
    failed = [t for g in groups for t in g.failed if t.status is Status.POLICY_ERROR]
    assert len(failed) == bad
    assert all("server_error" in t.reason for t in failed)
    assert pol.stats()["failed"] == {"server_error": bad}


def test_five_percent_faults_the_loop_never_stops(tiny_tokenizer):
    """5% of requests answered 503 or left to time out: no exception reaches the trainer,
    every fault is counted, every group is delivered."""
    seed = int.from_bytes(os.urandom(4), "little")
    fault = random_faults(0.05, seed)
    with FakeServer(tiny_tokenizer, fault=fault, hang_s=2.0) as server:
        pol = policy(server, tiny_tokenizer, retry=Retry(backoff_s=0.01, timeout_s=1.0))
        groups, stats = run(pol, groups=8, envs=16)
    injected = sum(s.fault != "ok" for s in server.seen)
    faults = pol.stats()["faults"]
    assert len(groups) == 8, f"seed {seed}"
    assert len(server.seen) == stats["steps"] + sum(faults.values()), f"seed {seed}"
    assert sum(faults.values()) >= injected, f"seed {seed}"  # (a slow answer may time out too)
    assert stats["dropped"] == {}, f"seed {seed}"


def test_context_length_fails_the_trajectory_at_once(tiny_tokenizer):
    fault = lambda n, body: "context" if n == 0 else "ok"  # noqa: E731
    with FakeServer(tiny_tokenizer, fault=fault) as server:
        pol = policy(server, tiny_tokenizer)
        groups, stats = run(pol, groups=1)
    assert stats["dropped"] == {"policy_error": 1}
    (failed,) = [t for g in groups for t in g.failed]
    assert failed.reason.startswith("context_length") and "after 1 failed" in failed.reason


def test_a_prompt_past_the_context_fails_without_a_request(tiny_tokenizer):
    """The opening prompt fits a context of 150 ids, the second turn's does not: each
    trajectory fails as policy_error before sending it, and its group is dropped."""
    with FakeServer(tiny_tokenizer, max_model_len=150) as server:
        pol = policy(server, tiny_tokenizer)
        stats = run_until_dropped(pol)
    assert stats["groups_dropped"] == {"policy_error": 1}
    dropped = stats["dropped"]
    assert dropped["policy_error"] >= 1 and sum(dropped.values()) == 4
    assert dropped.keys() <= {"policy_error", "group_dropped"}
    (calls,) = pol.stats()["failed"].values()
    assert pol.stats()["failed"] == {"context_length": calls} and calls >= dropped["policy_error"]
    assert server.seen and all(len(s.prompt) < 150 for s in server.seen)


def test_on_context_full_end_ends_a_trajectory_whose_prompt_outgrows_the_context(tiny_tokenizer):
    """The opening prompt fits a context of 150 ids, the second turn's does not: with
    ``on_context_full="end"`` each trajectory ends as policy_ended after its first turn, with
    the tokens the server sent, and every group is delivered."""
    with FakeServer(tiny_tokenizer, max_model_len=150) as server:
        pol = policy(server, tiny_tokenizer, on_context_full="end")
        groups, stats = run(pol, groups=2)
    trajs = [t for g in groups for t in g.trajectories]
    assert len(trajs) == 8 and stats["dropped"] == {} and stats["completed"] == 8
    for traj in trajs:
        assert traj.status is Status.POLICY_ENDED and traj.num_steps == 1
        assert traj.reason.startswith("context_length: a prompt of")
    assert len(server.seen) == 8 and all(len(s.prompt) < 150 for s in server.seen)
    by_prompt = {tuple(s.prompt): s for s in server.seen}
    for turn in turns_of(groups):
        assert turn.completion_ids == by_prompt[tuple(turn.prompt_ids)].ids
    assert pol.stats()["ended"] == {"context_length": 8} and pol.stats()["failed"] == {}
    assert batch_samples(groups).statuses == ["policy_ended"] * 8


def test_on_context_full_end_after_the_servers_context_length_reply(tiny_tokenizer):
    """The server refuses every later turn as too long (a 400): with
    ``on_context_full="end"`` each trajectory ends after its first turn, at once."""
    openings: list[int] = []

    def fault(n, body):
        openings.append(len(body["prompt"])) if not openings else None
        return "context" if len(body["prompt"]) > openings[0] else "ok"

    with FakeServer(tiny_tokenizer, fault=fault) as server:
        pol = policy(server, tiny_tokenizer, on_context_full="end")
        groups, stats = run(pol)
    trajs = [t for g in groups for t in g.trajectories]
    assert len(trajs) == 16 and stats["dropped"] == {}
    for traj in trajs:
        assert traj.status is Status.POLICY_ENDED and traj.num_steps == 1
        assert traj.reason.startswith("context_length") and "after 1 failed" in traj.reason
    assert pol.stats()["faults"] == {"context_length": 16} == pol.stats()["ended"]


def test_on_context_full_end_still_fails_an_opening_that_does_not_fit(tiny_tokenizer):
    """A first turn that does not fit has nothing to hand over: it fails as policy_error."""
    with FakeServer(tiny_tokenizer, max_model_len=20) as server:
        pol = policy(server, tiny_tokenizer, on_context_full="end")
        stats = run_until_dropped(pol)
    assert stats["groups_dropped"] == {"policy_error": 1} and not server.seen
    assert pol.stats()["ended"] == {} and pol.stats()["failed"]["context_length"] >= 1


def test_requests_in_flight_are_capped(tiny_tokenizer):
    with FakeServer(tiny_tokenizer, token_delay_s=0.005) as server:
        pol = policy(server, tiny_tokenizer, max_in_flight=3, interrupt=True)
        groups, _ = run(pol, groups=4, envs=16)
    assert len(groups) == 4 and 1 <= server.max_active <= 3


def test_client_shards_hold_the_connections_and_balance_the_requests():
    shards = ClientShards("http://127.0.0.1:1/v1", "EMPTY", 100, Retry())
    assert len(shards.clients) == 4  # at most SHARD_CONNECTIONS = 32 connections each
    with contextlib.ExitStack() as stack:
        taken = [stack.enter_context(shards.client()) for _ in range(100)]
        assert shards.in_flight == [25, 25, 25, 25]
        assert {id(c) for c in taken} == {id(c) for c in shards.clients}
    assert shards.in_flight == [0, 0, 0, 0]
    asyncio.run(shards.aclose())


def test_adaptive_limit_halves_on_overload_and_grows_back():
    limit = InFlightLimit(32, adaptive=True, minimum=2, cooldown_s=0.0)
    start = limit.limit
    limit.overloaded()
    assert limit.limit == start // 2
    for _ in range(5):
        limit.overloaded()
    assert limit.limit == 2
    for _ in range(2):
        limit.answered(0.01)
    assert limit.limit == 3
    slow = InFlightLimit(8, adaptive=True, target_latency_s=0.5, cooldown_s=0.0)
    slow.answered(1.0)
    assert slow.limit == 4
    fixed = InFlightLimit(8)
    fixed.overloaded()
    assert fixed.limit == 8


def test_close_cancels_requests_in_flight(tiny_tokenizer):
    fault = lambda n, body: "hang"  # noqa: E731
    with FakeServer(tiny_tokenizer, fault=fault, hang_s=60.0) as server:
        pol = policy(server, tiny_tokenizer, retry=Retry(timeout_s=120.0))
        r = rollouts(pol)
        r.submit([Task(seed=0)])
        deadline = time.monotonic() + 30
        while server.active < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.active >= 4
        started = time.monotonic()
        r.close()
        closed_s = time.monotonic() - started
        deadline = time.monotonic() + 10
        while server.active and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.active == 0 and all(s.disconnected for s in server.seen)
    assert closed_s < 30  # far below the 60 s the server would hang


def test_interrupt_continues_under_the_new_version(tiny_tokenizer):
    """Streams in flight at set_version are cancelled after their first tokens; each goes on
    under the new version from its prompt plus those tokens; every token keeps its version
    and none is lost."""
    hold = threading.Event()
    with FakeServer(tiny_tokenizer, hold=hold, hold_after=3) as server:
        pol = policy(server, tiny_tokenizer, interrupt=True)
        with rollouts(pol) as r:
            r.submit([Task(seed=0)])
            deadline = time.monotonic() + 30
            while server.held < 4 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert server.held == 4
            r.set_version(1)
            deadline = time.monotonic() + 30
            while sum(s.disconnected for s in server.seen) < 4 and time.monotonic() < deadline:
                time.sleep(0.02)
            hold.set()
            (group,) = r.get_batch(1, timeout=60)
    assert pol.stats()["interrupted"] == 4 and pol.stats()["tokens_interrupted"] == 4 * 3
    for traj in group.trajectories:
        first = traj.extras[0]
        assert first.versions == [0, 0, 0] + [1] * 5 and len(first.completion_ids) == 8
        assert traj.versions[0] == 0 and all(t.versions == [1] * 8 for t in traj.extras[1:])
        cut = next(s for s in server.seen if s.prompt == first.prompt_ids)
        resumed = next(s for s in server.seen if s.prompt == first.prompt_ids + cut.ids)
        assert cut.disconnected and cut.ids == first.completion_ids[:3]
        assert first.completion_ids == cut.ids + resumed.ids
    assert group.version == 1 and group.lag == 1


def wait_for(condition, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert condition(), f"timed out waiting for {what}"


def test_a_request_interrupted_before_its_first_token_leaves_no_version(tiny_tokenizer):
    """Streams cut by set_version before their first token give the action no trace of the
    old version: its version is its ids', the new one, and its group's lag is 0."""
    hold = threading.Event()
    with FakeServer(tiny_tokenizer, hold=hold, hold_after=0) as server:
        pol = policy(server, tiny_tokenizer, interrupt=True)
        with rollouts(pol) as r:
            r.submit([Task(seed=0)])
            wait_for(lambda: server.held == 4, "4 streams held before their first token")
            r.set_version(1)
            wait_for(lambda: sum(s.disconnected for s in server.seen) == 4, "4 cut streams")
            hold.set()
            (group,) = r.get_batch(1, timeout=60)
    assert pol.stats()["interrupted"] == 4 and pol.stats()["tokens_interrupted"] == 0
    for traj in group.trajectories:
        assert traj.extras[0].versions == [1] * 8
        assert traj.versions == [1] * len(traj.versions)
    assert group.version == 1 and group.lag == 0


def test_a_row_waiting_for_a_slot_across_set_version_is_sent_under_the_new_one(tiny_tokenizer):
    """With one request in flight at most, the row that waits for the slot while the version
    changes is sent under the new version: all its ids and its action carry it."""
    hold = threading.Event()
    with FakeServer(tiny_tokenizer, hold=hold, hold_after=3) as server:
        pol = policy(server, tiny_tokenizer, interrupt=True, max_in_flight=1)
        with rollouts(pol, envs=2, group_size=2) as r:
            r.submit([Task(seed=0)])
            wait_for(lambda: server.held == 1, "the first row's stream held")
            wait_for(lambda: len(pol.limit._waiters) == 1, "the second row waiting for a slot")
            r.set_version(1)
            wait_for(lambda: server.held == 2, "the second row's stream held")
            hold.set()
            (group,) = r.get_batch(1, timeout=60)
    firsts = sorted((t.extras[0].versions, t.versions[0]) for t in group.trajectories)
    assert firsts == [([0, 0, 0] + [1] * 5, 0), ([1] * 8, 1)]


def test_every_id_carries_the_version_it_was_sent_under(tiny_tokenizer):
    """Under interrupt=True, set_version at random times while rows wait for one of two
    in-flight slots: each action's version is the oldest of its ids', and no id is older
    than the policy's version when its request reached the server."""
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    box: list[ServerPolicy] = []

    def unique(row):  # one prompt per attempt, so that each request names its trajectory
        traj = row.trajectory
        named = f"{row.observation} ({traj.group_id}.{traj.index}.{traj.attempt})"
        return messages(row)[:-1] + [{"role": "user", "content": named}]

    with FakeServer(tiny_tokenizer, token_delay_s=0.002, tag=lambda: box[0].version) as server:
        pol = ServerPolicy(
            server.base_url, "tiny", tiny_tokenizer, unique, retry=FAST,
            sampling=Sampling(max_tokens=8), interrupt=True, max_in_flight=2,
        )  # fmt: skip
        box.append(pol)
        done = threading.Event()
        with rollouts(pol) as r:
            r.submit([Task(seed=s) for s in range(4)])

            def bump() -> None:
                version = 0
                while not done.wait(rng.uniform(0.002, 0.03)):
                    version += 1
                    r.set_version(version)

            bumper = threading.Thread(target=bump)
            bumper.start()
            try:
                groups = r.get_batch(4, timeout=120)
            finally:
                done.set()
                bumper.join()
    assert pol.stats()["interrupted"] > 0, f"seed {seed}"
    for traj in (t for g in groups for t in g.trajectories):
        for step, turn in enumerate(traj.extras):
            assert traj.versions[step] == min(turn.versions), f"seed {seed}"
            p, ids = turn.prompt_ids, turn.completion_ids
            sent = {}  # ids already in the prompt -> the last request sent so (the one kept)
            for seen in server.seen:
                k = len(seen.prompt) - len(p)
                if 0 <= k < len(ids) and seen.prompt == p + ids[:k]:
                    sent[k] = seen
            for i, version in enumerate(turn.versions):
                request = sent[max(k for k in sent if k <= i)]
                assert version >= request.tag, f"seed {seed}: id {i} of step {step}"


@pytest.mark.parametrize(
    ("server_kwargs", "model", "match"),
    [
        ({}, "other", "does not serve model 'other'"),
        ({"openai": False}, "tiny", "not an OpenAI-compatible server"),
        ({"tokenize": "other"}, "tiny", "tokenizer does not match the server's"),
    ],
)
def test_bad_setups_raise_clear_errors(tiny_tokenizer, server_kwargs, model, match):
    with FakeServer(tiny_tokenizer, **server_kwargs) as server:
        pol = ServerPolicy(server.base_url, model, tiny_tokenizer, messages, retry=FAST)
        with rollouts(pol) as r:
            r.submit([Task(seed=0)])
            with pytest.raises(PolicyError, match=match):
                r.get_batch(1, timeout=60)


def test_messages_that_return_nothing_raise(tiny_tokenizer):
    with FakeServer(tiny_tokenizer) as server:
        pol = ServerPolicy(server.base_url, "tiny", tiny_tokenizer, lambda row: [], retry=FAST)
        with rollouts(pol) as r:
            r.submit([Task(seed=0)])
            with pytest.raises(PolicyError, match="must return the non-empty list"):
                r.get_batch(1, timeout=60)


def test_bad_arguments():
    class Tok:
        chat_template = "x"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return "".join(m["content"] for m in messages)

        def __len__(self):
            return 10

    async def coro(row):
        return []

    with pytest.raises(TypeError, match="messages must be a plain function"):
        ServerPolicy("http://127.0.0.1:1/v1", "m", Tok(), coro)
    with pytest.raises(ValueError, match="max_in_flight must be an int >= 1"):
        ServerPolicy("http://127.0.0.1:1/v1", "m", Tok(), messages, max_in_flight=0)
    with pytest.raises(ValueError, match="on_context_full must be 'fail' or 'end'"):
        ServerPolicy("http://127.0.0.1:1/v1", "m", Tok(), messages, on_context_full="truncate")
    with pytest.raises(ValueError, match="max_tokens must be an int >= 1"):
        Sampling(max_tokens=0)
    with pytest.raises(ValueError, match="attempts must be an int >= 1"):
        Retry(attempts=0)


def test_many_failures_keep_envs_in_order(tiny_tokenizer):
    """Requests fail at random with one attempt allowed: trajectories fail, groups retry and
    drop while other attempts start and step; no env gets a command before its last result."""
    seed = int.from_bytes(os.urandom(4), "little")
    with FakeServer(tiny_tokenizer, fault=random_faults(0.3, seed, ("503",))) as server:
        pol = policy(server, tiny_tokenizer, retry=Retry(attempts=1))
        tasks = (Task(seed=s) for s in itertools.count())
        with rollouts(pol, envs=16, tasks=tasks) as r:
            for _ in range(6):
                assert len(r.get_batch(2, timeout=60)) == 2, f"seed {seed}"
            stats = r.stats()
    # a failed call whose attempt its group had cancelled meanwhile counts as group_dropped
    failed_calls = sum(pol.stats()["failed"].values())
    assert stats["dropped"]["policy_error"] <= failed_calls, f"seed {seed}"
    assert failed_calls <= stats["dropped"]["policy_error"] + stats["dropped"].get(
        "group_dropped", 0
    ), f"seed {seed}"
    assert stats["launched"] == (
        stats["completed"] + sum(stats["dropped"].values()) + stats["in_flight"]
    ), f"seed {seed}"


def test_a_connection_idle_past_the_keep_alive_is_not_reused(tiny_tokenizer, monkeypatch):
    """The client reuses a connection idle for less than ``KEEPALIVE_S`` and opens a new one
    after, so that it never sends on a connection the server may be closing (a server's
    keep-alive is longer: uvicorn's 5 s)."""
    from shmvec.rollouts import server_client

    monkeypatch.setattr(server_client, "KEEPALIVE_S", 0.3)
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2, "logprobs": 1}

    async def three_requests(url: str) -> None:
        client = server_client.make_client(url, "x", 4, Retry())
        try:
            for gap in (0.0, 0.05, 0.8):
                await asyncio.sleep(gap)
                await server_client.post_completions(client, body)
        finally:
            await client.close()

    with FakeServer(tiny_tokenizer) as server:
        asyncio.run(three_requests(server.base_url))
        first, again, later = server.peer_ports
    assert again == first  # idle 0.05 s: reused
    assert later != first  # idle 0.8 s: a new connection
