"""Fast checks of the rollout benchmark (shmvec_bench.rollouts): every runner on a tiny
workload returns the groups asked for, each complete, with sane metrics; the text
envs replay from their seed whatever else runs in the process; the CLI writes its
table, CSV and plot."""

from __future__ import annotations

import csv
import importlib.util
import signal
import subprocess
import sys
import time

import pytest

from shmvec import UnboundedText
from shmvec_bench.rollouts.backends import REGISTRY, Backend
from shmvec_bench.rollouts.cli import main
from shmvec_bench.rollouts.policies import make_policy
from shmvec_bench.rollouts.records import RunContext
from shmvec_bench.rollouts.runner import measure, median_row
from shmvec_bench.rollouts.workloads import WORKLOADS, make_env

pytestmark = pytest.mark.usefixtures("no_threads_left")

NUM_ENVS, GROUP = 8, 4
HAS_GEM = importlib.util.find_spec("gem") is not None
#: gem-llm's games where it is installed, else FrozenLake as text (gymnasium only).
GAME = "guess" if HAS_GEM else "frozenlake"
needs_gem = pytest.mark.skipif(not HAS_GEM, reason="needs gem-llm")


@pytest.mark.parametrize("backend", list(REGISTRY))
def test_every_runner_returns_complete_groups(backend):
    if not REGISTRY[backend].is_importable():
        pytest.skip(f"needs {REGISTRY[backend].requires}")
    policy = make_policy("latency", WORKLOADS[GAME].actions)
    ctx = RunContext(GAME, NUM_ENVS, GROUP, NUM_ENVS // GROUP, policy)
    runner = REGISTRY[backend].open(ctx)
    try:
        for _ in range(2):
            groups = runner.get_batch()
            assert len(groups) == NUM_ENVS // GROUP
            for group in groups:
                assert len(group.trajectories) == GROUP
                assert sorted(t.member for t in group.trajectories) == list(range(GROUP))
                for traj in group.trajectories:
                    assert traj.seed == group.seed
                    assert traj.status in ("done", "truncated")
                    assert 1 <= traj.steps <= WORKLOADS[GAME].max_turns
                    assert traj.finished >= traj.started
        assert runner.env_steps >= sum(t.steps for g in groups for t in g.trajectories)
    finally:
        runner.close()
    # Each task's group came back once, and every group returned was launched.
    assert ctx.stream.launched >= 2 * NUM_ENVS // GROUP


@pytest.mark.parametrize("backend", ["ragen-serial", "shmvec"])
def test_measure_accounts_consistently(backend):
    m = measure(GAME, backend, num_envs=NUM_ENVS, group_size=GROUP, seconds=0.2, timeout=60)
    assert m.outcome == "ok"
    assert m.groups == m.batches * (NUM_ENVS // GROUP)
    assert m.groups_per_s == pytest.approx(m.groups / m.seconds)
    assert m.steps_per_s > 0 and m.cpu_s_per_step > 0
    assert 0.0 <= m.policy_idle_share <= 1.0
    assert m.get_batch_p50_s <= m.get_batch_p99_s
    assert 0 < m.traj_p50_s <= m.traj_p99_s
    assert m.pss_mib > 0 and m.failed_trajectories == 0 and m.lost_groups == 0


@needs_gem
def test_a_crashing_runner_is_a_result_with_its_losses():
    m = measure(
        "faults", "ragen-serial", num_envs=NUM_ENVS, group_size=GROUP, seconds=30, timeout=60
    )
    assert m.outcome.startswith("crash: ToolError")
    assert m.lost_groups >= NUM_ENVS // GROUP


def test_a_runner_that_hangs_while_opening_leaves_no_process_behind(monkeypatch):
    started = []

    class HangsOpening:
        def __init__(self, ctx):
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            started.append(child)
            time.sleep(30)  # the deadline interrupts this: the runner is never returned

    monkeypatch.setitem(
        REGISTRY, "hangs-opening", Backend("hangs-opening", HangsOpening, "test", "nothing")
    )
    m = measure("frozenlake", "hangs-opening", num_envs=4, group_size=2, seconds=0.1, timeout=1)
    assert m.outcome.startswith("hang")
    assert started[0].wait(timeout=10) == -signal.SIGKILL


def test_median_row_takes_each_field_median():
    rows = [
        measure("frozenlake", "ragen-serial", num_envs=4, group_size=2, seconds=0.05, seed=s)
        for s in range(3)
    ]
    merged = median_row(rows)
    assert merged.runs == 3 and merged.outcome == "ok"
    assert (
        min(r.groups_per_s for r in rows)
        <= merged.groups_per_s
        <= max(r.groups_per_s for r in rows)
    )


@pytest.mark.parametrize(
    "workload",
    [pytest.param(w, marks=needs_gem) for w in ("guess", "minesweeper", "sudoku")] + ["frozenlake"],
)
def test_text_envs_replay_from_their_seed(workload):
    """Two envs stepped interleaved give what each gives alone: their randomness is their own."""
    actions = WORKLOADS[workload].actions

    def play(envs, seed):
        out = [[env.reset(seed=seed)[0]] for env in envs]
        for k in range(6):
            for env, trace in zip(envs, out):
                trace.append(env.step(actions[(3 * k + 1) % len(actions)])[:3])
        return out

    together = play([make_env(workload, 0), make_env(workload, 1)], seed=7)
    alone = play([make_env(workload, 2)], seed=7)
    assert together[0] == together[1] == alone[0]
    env = make_env(workload)
    assert isinstance(env.observation_space, UnboundedText)
    assert isinstance(env.action_space, UnboundedText)


@needs_gem
def test_gem_games_can_be_made_in_many_threads_at_once():
    # A fresh process, so that the first import of the game happens in the threads.
    code = (
        "import threading\n"
        "from shmvec_bench.rollouts.workloads import make_env\n"
        "made, errors = [], []\n"
        "def make(i):\n"
        "    try:\n"
        "        made.append(make_env('guess', i).reset(seed=i)[0])\n"
        "    except Exception as error:\n"
        "        errors.append(repr(error))\n"
        "threads = [threading.Thread(target=make, args=(i,)) for i in range(16)]\n"
        "[t.start() for t in threads]\n"
        "[t.join() for t in threads]\n"
        "assert not errors and len(made) == 16, errors\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_cli_writes_table_csv_and_plot(tmp_path, capsys):
    out = tmp_path / "out"
    code = main(
        ["--workloads", "frozenlake", "--backends", "ragen-serial", "shmvec-loop",
         "--num-envs", "4", "--group-size", "2", "--seconds", "0.1", "--repeats", "1",
         "--out", str(out)]
    )  # fmt: skip
    assert code == 0
    table = capsys.readouterr().out
    assert "| frozenlake | latency | shmvec-loop | 4 |" in table
    with open(out / "rollouts.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert {r["backend"] for r in rows} == {"ragen-serial", "shmvec-loop"}
    assert all(r["outcome"] == "ok" for r in rows)


def test_cli_gives_the_layer_a_row_per_lag_bound(tmp_path, capsys):
    out = tmp_path / "out"
    code = main(
        ["--workloads", "frozenlake", "--backends", "shmvec", "ragen-serial",
         "--max-lag", "1", "-1", "--num-envs", "4", "--group-size", "2", "--seconds", "0.1",
         "--repeats", "1", "--out", str(out)]
    )  # fmt: skip
    assert code == 0
    table = capsys.readouterr().out
    assert "| frozenlake | latency | shmvec (max_lag=1) | 4 |" in table
    assert "| frozenlake | latency | shmvec (no lag bound) | 4 |" in table
    with open(out / "rollouts.csv") as fh:
        rows = {(r["backend"], r["variant"]) for r in csv.DictReader(fh)}  # runs and medians
    assert rows == {("ragen-serial", ""), ("shmvec", "max_lag=1"), ("shmvec", "no lag bound")}


@pytest.mark.parametrize("name", ["latency", "gru"])
def test_policies_answer_every_row_from_the_vocabulary(name):
    if name == "gru":
        pytest.importorskip("torch")
    actions = WORKLOADS["frozenlake"].actions
    policy = make_policy(name, actions, seed=1)
    answers = policy(["first observation", "", "x" * 500])
    assert len(answers) == 3 and set(answers) <= set(actions)
    busy_s, calls, rows = policy.clock.snapshot()
    assert busy_s > 0 and (calls, rows) == (1, 3)


def test_the_batcher_skips_cancelled_requests_and_fails_the_pending_at_close(monkeypatch):
    """A request cancelled while it waits (a rollout closing) is never answered and breaks
    nothing; the requests pending at close fail with Stopped; no thread raises."""
    import threading

    from shmvec_bench.rollouts.policies import Batcher, Stopped

    raised = []
    monkeypatch.setattr(threading, "excepthook", raised.append)
    release, calls = threading.Event(), []

    def policy(observations):
        calls.append(list(observations))
        release.wait(10)
        return [o.upper() for o in observations]

    batcher = Batcher(policy)
    first = batcher.submit("a")
    while not calls:  # the first batch is running
        time.sleep(0.001)
    cancelled, kept = batcher.submit("b"), batcher.submit("c")
    assert cancelled.cancel()
    release.set()
    assert first.result(10) == "A" and kept.result(10) == "C"
    assert calls == [["a"], ["c"]]
    release.clear()
    busy = batcher.submit("d")
    while len(calls) < 3:
        time.sleep(0.001)
    pending = batcher.submit("e")
    closing = threading.Thread(target=batcher.close)
    closing.start()
    while not batcher._stop:  # closed while "d" runs: "e" is pending at close
        time.sleep(0.001)
    release.set()
    closing.join(10)
    assert busy.result(10) == "D"
    with pytest.raises(Stopped):
        pending.result(10)
    with pytest.raises(Stopped):
        batcher.submit("f")
    assert not raised
