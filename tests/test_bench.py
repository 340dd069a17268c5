"""Fast checks of the benchmark package (shmvec_bench): registry, planning, the
async warm-up, the policy wait, RSS, the CLI and the hand-off on the CPU."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from shmvec_bench import backends, registry, rss
from shmvec_bench.cli import main
from shmvec_bench.policy import SPIN_MARGIN_S, PolicyWait
from shmvec_bench.runner import Case, measure, plan_cases
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
