"""ServerPolicy against a fake server that fails at the transport level: every malformed or
broken reply (not JSON, reset, closed, cut short, stalled) is retried and counted by what
happened; a server that stops and comes back on its port is waited for without a retry or a
dropped group; one that stays away past ``outage_timeout`` stops the loop naming it; and the
calls of attempts the rollouts cancelled stop their requests."""

from __future__ import annotations

import itertools
import re
import time

import pytest

from shmvec.rollouts import PolicyError, Task
from shmvec.rollouts.server import Retry, ServerPolicy, ServerUnreachable

pytest.importorskip("openai", reason="ServerPolicy needs openai (pip install 'shmvec[server]')")
pytest.importorskip("aiohttp", reason="the fake server needs aiohttp")
pytest.importorskip("transformers", reason="the tiny chat model needs transformers")

from llm_servers import FakeServer, free_port  # noqa: E402
from test_server_policy import messages, policy, rollouts, run  # noqa: E402


@pytest.mark.parametrize(
    ("fault", "interrupt", "kind"),
    [
        ("garbage", False, "bad_reply"),  # a 200 body that is not JSON
        ("garbage", True, "bad_reply"),  # a streamed chunk that is not JSON
        ("reset", False, "reset"),  # a TCP reset before the reply
        ("reset", True, "reset"),
        ("disconnect", False, "reset"),  # closed before the reply
        ("disconnect", True, "reset"),
        ("truncate", False, "dropped"),  # a body cut short of its length
        ("truncate", True, "dropped"),  # a stream that ends before its completion
        ("stall", True, "timeout"),  # a stream that stops past Retry.timeout_s
    ],
)
def test_transport_faults_are_retried_and_counted_by_kind(tiny_tokenizer, fault, interrupt, kind):
    """The first requests fail at the transport level; each is asked again, counted by what
    happened, no trajectory fails, no outage is declared (the server answers its probe), and
    an adaptive cap shrinks only for a timeout (an overload signal), not for a broken
    connection or reply."""
    bad = 5
    with FakeServer(
        tiny_tokenizer, fault=lambda n, body: fault if n < bad else "ok", hang_s=30.0
    ) as server:
        retry = Retry(attempts=8, backoff_s=0.01, timeout_s=1.0 if kind == "timeout" else 60.0)
        pol = policy(  # an adaptive cap starts at 64: here its ceiling, only a cut moves it
            server,
            tiny_tokenizer,
            retry=retry,
            interrupt=interrupt,
            adaptive=True,
            max_in_flight=64,
        )
        groups, stats = run(pol)
    assert stats["dropped"] == {} and len(groups) == 4
    faults = pol.stats()["faults"]
    assert len(server.seen) == stats["steps"] + sum(faults.values())
    if kind == "timeout":  # (a slow machine may let an answered request time out too)
        assert faults.keys() == {"timeout"} and faults["timeout"] >= bad
    else:
        assert faults == {kind: bad}
        assert pol.stats()["in_flight_limit"] == 64
    assert pol.stats()["failed"] == {} and pol.stats()["outages"] == 0


def test_a_server_outage_costs_no_retry_and_drops_nothing(tiny_tokenizer):
    """The server stops mid-run (its connections closed, new ones refused) and comes back on
    its port seconds later: with one request per turn allowed and no group retries, no
    trajectory fails and no group is dropped; the requests wait for the server, one outage
    is counted, and batches come again soon after its return."""
    server = FakeServer(tiny_tokenizer, port=free_port())
    server.start()
    pol = policy(server, tiny_tokenizer, retry=Retry(attempts=1, backoff_s=0.05))
    tasks = (Task(seed=s) for s in itertools.count())
    try:
        with rollouts(pol, envs=16, tasks=tasks, max_retries=0) as r:
            assert len(r.get_batch(2, timeout=60)) == 2
            server.stop()
            deadline = time.monotonic() + 30
            while not pol.stats()["faults"] and time.monotonic() < deadline:
                time.sleep(0.02)
            assert pol.stats()["faults"]  # the rows have met the outage
            time.sleep(3.0)  # the server stays down a while
            server.start()
            back = time.monotonic()
            after: list = []  # groups completed before the outage may be waiting: not these
            while len(after) < 2:
                after += [g for g in r.get_batch(1, timeout=60) if g.completed_s > back]
            back_s = time.monotonic() - back
            stats = r.stats()
    finally:
        server.stop()
    assert len(after) == 2
    assert stats["dropped"] == {} and stats["groups_dropped"] == {}
    counts = pol.stats()
    assert counts["failed"] == {} and counts["outages"] == 1 and counts["outage_s"] >= 3.0
    assert set(counts["faults"]) <= {"connect", "reset", "dropped"}, counts["faults"]
    print(f"first batch {back_s:.2f} s after the server's return; faults {counts['faults']}")
    assert back_s < 30  # probed every second at most: about 1 s


def test_a_server_away_past_outage_timeout_stops_the_loop_naming_it(tiny_tokenizer):
    url = f"http://127.0.0.1:{free_port()}/v1"
    pol = ServerPolicy(url, "tiny", tiny_tokenizer, messages, outage_timeout=1.0)
    with rollouts(pol) as r:
        r.submit([Task(seed=0)])
        with pytest.raises(PolicyError, match=re.escape(url)) as raised:
            r.get_batch(1, timeout=60)
    assert isinstance(raised.value.__cause__, ServerUnreachable)
    assert "outage_timeout=1.0" in str(raised.value.__cause__)
    assert pol.stats()["outages"] == 1 and pol.stats()["failed"] == {}
    with pytest.raises(ValueError, match="outage_timeout must be > 0 or None"):
        ServerPolicy(url, "tiny", tiny_tokenizer, messages, outage_timeout=0)


@pytest.mark.parametrize("then", ["503", "hang"])
def test_cancelled_attempts_stop_their_requests(tiny_tokenizer, then):
    """One trajectory fails at once and its group is dropped (no group retries): the other
    three attempts are cancelled, and their calls stop: no request is retried after
    (``503``), a request in flight is closed (``hang``), and none counts as failed."""
    fault = lambda n, body: "context" if n == 0 else then  # noqa: E731
    with FakeServer(tiny_tokenizer, fault=fault, hang_s=60.0) as server:
        retry = Retry(attempts=100_000, backoff_s=0.01, max_backoff_s=0.05, timeout_s=120.0)
        pol = policy(server, tiny_tokenizer, retry=retry)
        with rollouts(pol, max_retries=0) as r:
            r.submit([Task(seed=0)])
            deadline = time.monotonic() + 30
            while pol.stats().get("abandoned", 0) < 3 and time.monotonic() < deadline:
                time.sleep(0.02)
            sent = len(server.seen)
            time.sleep(0.5)
            assert len(server.seen) == sent  # the abandoned calls are over: nothing more
            deadline = time.monotonic() + 10
            while server.active and time.monotonic() < deadline:
                time.sleep(0.02)
            assert server.active == 0
            assert pol.stats()["abandoned"] == 3
            stats = r.stats()
    assert stats["groups_dropped"] == {"policy_error": 1}
    assert pol.stats()["failed"] == {"context_length": 1}
    if then == "hang":
        assert sent == 4 and all(s.disconnected for s in server.seen[1:])
