"""Fast checks of the benchmark package (shmvec_bench): registry, planning, the
async warm-up, the policy wait, RSS, the CLI and the hand-off on the CPU."""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from shmvec_bench import backends, registry, report, rss
from shmvec_bench.cli import main
from shmvec_bench.policy import SPIN_MARGIN_S, PolicyWait
from shmvec_bench.report import markdown_table
from shmvec_bench.runner import Case, Measurement, add_ratios, measure, plan_cases
from shmvec_bench.workloads import WORKLOADS


def test_registry_names_and_requirements():
    expected = {
        "shmvec", "shmvec-main", "shmvec-nocopy", "shmvec-async", "shmvec-sb3", "sync",
        "async", "async-nocopy", "sb3", "envpool", "envpool-async", "pufferlib", "single",
        "policy",
    }  # fmt: skip
    assert set(backends.BACKENDS) == expected
    assert set(backends.DEFAULT_BACKENDS) <= expected
    assert registry.REGISTRY["sb3"].requires == "stable_baselines3"
    assert registry.REGISTRY["shmvec-async"].is_async
    assert registry.REGISTRY["envpool-async"].is_async
    assert not registry.REGISTRY["shmvec"].is_async
    assert registry.REGISTRY["shmvec"].takes_workers and not registry.REGISTRY["sync"].takes_workers
    assert not registry.REGISTRY["envpool"].runs("noop")
    assert registry.REGISTRY["sync"].is_importable()


def test_open_backend_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        backends.open_backend("nope", "noop", 1)
    with pytest.raises(ValueError, match="unknown workload 'nope'"):
        backends.open_backend("sync", "nope", 1)
    with pytest.raises(ValueError, match="envpool has no 'noop' workload"):
        backends.open_backend("envpool", "noop", 1)


def test_shim_is_the_cli():
    from shmvec import bench

    assert bench.main is main


def test_async_batch_default_and_cap():
    assert registry.async_batch(8, None) == 4
    assert registry.async_batch(1, None) == 1
    assert registry.async_batch(8, 3) == 3
    assert registry.async_batch(8, 100) == 8


def test_plan_with_policy_adds_envs_alone_and_policy_alone_rows():
    cases = plan_cases(
        [("cpu100us", 8)], ["shmvec", "shmvec-async", "single"], policy_us=[200], batch_size=4
    )
    assert cases == [
        Case("cpu100us", "shmvec", 8, None, 0.0),
        Case("cpu100us", "shmvec-async", 8, None, 0.0),
        Case("cpu100us", "single", 1, None, 0.0),
        Case("cpu100us", "shmvec", 8, None, 200),
        Case("cpu100us", "shmvec-async", 8, None, 200),
        Case("cpu100us", "policy", 8, None, 200),
        Case("cpu100us", "policy", 4, None, 200),
    ]
    assert all(c.policy_us == 0 for c in plan_cases([("noop", 2)], ["sync", "policy"]))
    assert [c.backend for c in plan_cases([("noop", 2)], ["sync", "policy"])] == ["sync"]


class ScriptedAsyncEnv:
    """An in-process stand-in for an async vector env: env 3 comes back last."""

    num_envs = 4
    single_action_space = None

    def __init__(self):
        import gymnasium as gym

        self.single_action_space = gym.spaces.Discrete(2)
        self.batches = [[0, 1], [2, 0], [1, 2], [0, 1], [2, 3], [0, 1], [3, 2]]
        self.received, self.sent = [], []

    def async_reset(self, seed=None):
        pass

    def recv(self):
        ids = np.array(self.batches[len(self.received)])
        self.received.append(ids)
        return None, None, None, None, {"env_id": ids}

    def send(self, actions, env_ids):
        assert len(actions) == len(env_ids) == 2
        self.sent.append(list(env_ids))

    def close(self, **kwargs):
        pass


def test_async_timing_starts_once_every_env_came_back_twice():
    env = ScriptedAsyncEnv()
    args = registry.OpenArgs("noop", 4, None, None, 0, 2, None)
    stepper = registry.async_stepper(env, 2, args, seed=0)
    calls = stepper.every_env_back()
    # Env 3 comes back for the first time in batch 5 and the second in batch 7.
    assert calls == 7
    counts = np.bincount(np.concatenate(env.received), minlength=4)
    assert counts.min() >= registry.WARM_RETURNS_PER_ENV
    assert env.sent == env.batches  # every batch received was sent back


def test_measure_async_on_shmvec_counts_the_batch():
    m = measure("noop", "shmvec-async", 4, seconds=0.1, warmup_s=0.02, batch_size=2)
    assert m.error is None, m.error
    assert m.batch == 2 and m.steps > 0
    assert m.steps_per_s == pytest.approx(2 * m.steps / m.seconds)
    assert m.main_wait_frac is not None and 0 <= m.main_wait_frac <= 1
    assert m.main_cpu_us_per_row == pytest.approx(m.main_cpu_us_per_round / 2)
    assert m.rss_mib > 0


def test_policy_wait_is_accurate_and_mostly_sleeps():
    wait = PolicyWait(2000)
    for _ in range(20):
        wait()
    mean_s = wait.waited_s / wait.calls
    assert mean_s >= 2000e-6
    # The sleep leaves SPIN_MARGIN_S to the spin; the CPU it burns is about that, not 2 ms.
    assert wait.cpu_s / wait.calls < 0.5 * 2000e-6
    assert SPIN_MARGIN_S < 2000e-6
    with pytest.raises(ValueError, match="policy_us must be >= 0"):
        PolicyWait(-1)


def test_policy_caps_a_sync_loop():
    m = measure("noop", "sync", 4, seconds=0.1, warmup_s=0.02, policy_us=500)
    assert m.error is None, m.error
    assert m.policy_wait_us >= 500
    # 4 env steps per batch, each batch followed by >= 500 us of policy.
    assert m.steps_per_s <= 4 / 500e-6
    alone = measure("noop", "policy", 4, seconds=0.1, warmup_s=0.02, policy_us=500)
    assert alone.steps_per_s == pytest.approx(4 / (alone.policy_wait_us * 1e-6), rel=0.2)


def test_rss_counts_the_children():
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; b = bytearray(64 << 20); b[::4096] = "
         "b'x' * len(b[::4096]); print('ready', flush=True); time.sleep(30)"],
        stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert child.stdout.readline().strip() == b"ready"
        assert child.pid in rss.descendants(os.getpid())
        own_mib = rss.rss_kib(os.getpid()) / 1024
        assert rss.tree_rss_mib() >= own_mib + 60  # the child touched 64 MiB
    finally:
        child.kill()
        child.wait()
    assert rss.rss_kib(child.pid) == 0


def test_waiting_workload_sleeps_without_cpu():
    env = WORKLOADS["wait5ms"]()
    env.reset(seed=0)
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(4):
        env.step(env.action_space.sample())
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert wall >= 4 * 5e-3
    assert cpu < 0.5 * wall


def test_cli_writes_the_csv_with_the_new_columns(tmp_path, capsys):
    code = main([
        "--workloads", "noop", "--num-envs", "2", "--backends", "sync", "shmvec",
        "--seconds", "0.05", "--warmup", "0.01", "--out", str(tmp_path),
    ])  # fmt: skip
    assert code == 0
    rows = list(csv.DictReader(open(tmp_path / "results.csv")))
    assert [r["backend"] for r in rows] == ["sync", "shmvec"]
    assert all(float(r["rss_mib"]) > 0 for r in rows)
    assert rows[1]["main_wait_frac"] and rows[1]["vs_sync"]
    assert "| noop | shmvec | 2 |" in capsys.readouterr().out
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "throughput.png").stat().st_size > 0


def test_handoff_on_the_cpu(tmp_path, capsys, monkeypatch):
    torch = pytest.importorskip("torch")
    from shmvec_bench import handoff

    row = handoff.measure_case(torch, "pongsize", 2, torch.device("cpu"), 0.05, 0.01)
    assert row["obs_bytes"] == 2 * 4 * 84 * 84
    assert all(row[way] > 0 for way in ("env alone", "from_numpy", "TorchVectorEnv"))
    assert "pinned" not in row  # no pinned memory without CUDA
    if not torch.cuda.is_available():
        monkeypatch.setattr(handoff, "CASES", [("cartpole", 2)])
        assert handoff.run_handoff(None, 0.02, 0.01, tmp_path) == 0
        out = capsys.readouterr().out
        assert "CUDA not available: CPU figures only" in out
        assert "skipped (no CUDA)" in out
        assert (tmp_path / "handoff.csv").exists()


def _row(workload, backend, num_envs, steps_per_s):
    return Measurement(workload, backend, num_envs, 0, 100, 1.0, steps_per_s, 10.0)


def quick_like_rows():
    rows = [
        _row("cartpole", "shmvec", 32, 90_000),
        _row("cartpole", "sync", 32, 60_000),
        _row("cartpole", "single", 1, 50_000),
        _row("noop", "shmvec", 1, 30_000),
        _row("noop", "sync", 1, 20_000),
        _row("noop", "single", 1, 1_500_000),
    ]
    add_ratios(rows, cores=2)
    return rows


def test_efficiency_only_for_cpu_bound_workloads_and_not_on_single():
    rows = {(m.workload, m.backend): m for m in quick_like_rows()}
    assert rows["cartpole", "shmvec"].efficiency == pytest.approx(90_000 / (2 * 50_000))
    assert rows["cartpole", "sync"].efficiency == pytest.approx(60_000 / (2 * 50_000))
    # The single row would read 1 / cores by construction; a do-nothing step has no bound.
    assert rows["cartpole", "single"].efficiency is None
    assert all(m.efficiency is None for (w, _), m in rows.items() if w == "noop")
    assert rows["noop", "shmvec"].vs_sync == pytest.approx(1.5)


def test_table_names_the_efficiency_bound_and_leaves_it_empty_where_meaningless():
    table = markdown_table(quick_like_rows(), cores=2).splitlines()
    header = [h.strip() for h in table[0].strip("|").split("|")]
    column = header.index("efficiency (of 2 x single)")
    cells = {tuple(c.strip() for c in line.strip("|").split("|")[:2]): line for line in table[2:]}

    def efficiency(workload, backend):
        return [c.strip() for c in cells[workload, backend].strip("|").split("|")][column]

    assert efficiency("cartpole", "shmvec") == "90%"
    assert efficiency("cartpole", "single") == ""
    assert efficiency("noop", "shmvec") == efficiency("noop", "single") == ""
    # Without a CPU-bound workload the column is left out.
    noop_only = [m for m in quick_like_rows() if m.workload == "noop"]
    assert "efficiency" not in markdown_table(noop_only, cores=2)


def test_one_row_per_backend_is_bars_a_sweep_is_lines():
    rows = quick_like_rows()
    assert not report.is_sweep(rows)
    sweep = rows + [_row("cartpole", "shmvec", 64, 95_000), _row("cartpole", "sync", 64, 61_000)]
    assert report.is_sweep(sweep)
    workers = rows + [dataclasses.replace(rows[0], num_workers=4)]
    assert report.is_sweep(workers)


def test_bar_plot_labels_every_bar_relative_to_sync(tmp_path):
    plt = pytest.importorskip("matplotlib.pyplot")
    rows = quick_like_rows()
    fig = report._bars(plt, rows, cores=2)
    ax = fig.axes[0]
    try:
        heights = sorted(round(p.get_height(), 3) for p in ax.patches)
        assert heights == [1.0, 1.0, 1.5, 1.5]  # shmvec and sync per workload; single is no bar
        texts = {t.get_text() for t in ax.texts}
        assert {"1.50x\n90k/s", "1.50x\n30k/s", "1.00x\n60k/s"} <= texts
        # The bound (2 cores x one env, over sync) only for the CPU-bound workload.
        assert "1.67x" in texts
        assert [t.get_text() for t in ax.get_xticklabels()] == ["cartpole\n32 envs", "noop\n1 env"]
    finally:
        plt.close(fig)
    assert report.write_plot(rows, tmp_path / "bars.png", cores=2)
    assert (tmp_path / "bars.png").stat().st_size > 0


def test_help_describes_every_workload_and_backend(capsys):
    from shmvec_bench.cli import HANDOFF, parse_args

    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    usage = out[: out.index("\n\n")]
    assert "cartpole" not in usage and "--workloads NAME" in usage  # no choice lists in usage
    assert "shmvec-bench --quick" in out  # the examples
    listed = {
        line.split()[0]: line
        for line in out[out.index("\nworkloads:\n") :].splitlines()
        if line.startswith("  ") and not line.startswith("   ")
    }
    for name in [*WORKLOADS, HANDOFF, *backends.BACKENDS]:
        assert name in listed, f"{name} missing from --help"
        assert len(listed[name].split()) > 2, f"{name} has no description"
    assert "pipes and pickles (needs stable_baselines3)" in " ".join(out.split())
    assert max(map(len, out.splitlines())) <= 100
