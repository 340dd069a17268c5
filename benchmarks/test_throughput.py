"""Throughput of shmvec against gymnasium's Sync/AsyncVectorEnv, with pytest-benchmark.

Run with::

    python -m pytest benchmarks --benchmark-only -q

Groups (one per workload and size) and what each answers:

- ``cartpole-32envs``: a cheap env, many of them: is the per-step overhead small?
- ``cpu100us-8envs``: a 100 us CPU-bound step: does shmvec use every core?
  ``parallel_efficiency = steps/s / (cores x single-env steps/s)``.
- ``noop-1env``: a step that does nothing: the round trip (``step_us``).
- ``largeobs-8envs``: 1 MiB observations: shmvec's lent arrays (``shmvec``,
  copy=True) and ring views (``shmvec-nocopy``) against Sync/AsyncVectorEnv
  (``sync`` and ``async`` copy; ``async-nocopy`` is the copy=False peer).
- ``varstep-16envs``: steps that burn 1-20 x 9.5 us at random: the async
  engine (``batch_size=8``, recv/send) against shmvec's sync mode.
- ``pong-8envs``: Atari Pong with gymnasium's AtariPreprocessing and
  FrameStack(4) (skipped without ale-py): env-bound, against EnvPool's Pong-v5
  (C++ preprocessing) and gymnasium Async.
- ``cartpole-async-16envs``: shmvec's async engine beside EnvPool's, same
  batch (skipped without EnvPool).
- ``sb3-cartpole-16envs``: shmvec behind SB3's VecEnv API (``shmvec.sb3``)
  against SB3's SubprocVecEnv (skipped without stable-baselines3).

Peers that are not installed (EnvPool, SB3, PufferLib) are skipped.

A round is a fixed number of batched steps, so every backend of a group does
the same work; the times in pytest-benchmark's table are per round. The
summary printed at the end (and ``extra_info`` in ``--benchmark-json``) gives
steps/s and shmvec's ratio against each peer measured in the same run. No test
asserts a timing target: these report, they do not gate.
"""

from __future__ import annotations

import pytest

#: Rounds per benchmark, after one warm-up round.
ROUNDS = 10


@pytest.mark.benchmark(group="cartpole-32envs")
@pytest.mark.parametrize("backend", ["shmvec", "shmvec-main", "sync", "async", "pufferlib"])
def test_cartpole_32_envs(throughput, backend):
    _skip_if_missing(backend)
    throughput("cartpole", backend, num_envs=32, steps=100, rounds=ROUNDS)


@pytest.mark.benchmark(group="cpu100us-8envs")
@pytest.mark.parametrize("backend", ["shmvec", "shmvec-main", "sync", "single"])
def test_cpu100us_8_envs(throughput, backend):
    # single steps one env: 8x the steps keeps the work per round equal.
    num_envs, steps = (1, 400) if backend == "single" else (8, 50)
    throughput("cpu100us", backend, num_envs=num_envs, steps=steps, rounds=ROUNDS)


@pytest.mark.benchmark(group="noop-1env")
@pytest.mark.parametrize("backend", ["shmvec", "shmvec-main", "sync", "async"])
def test_noop_round_trip(throughput, backend):
    throughput("noop", backend, num_envs=1, steps=1000, rounds=ROUNDS)


@pytest.mark.benchmark(group="largeobs-8envs")
@pytest.mark.parametrize("backend", ["shmvec", "shmvec-nocopy", "sync", "async", "async-nocopy"])
def test_largeobs_8_envs(throughput, backend):
    throughput("largeobs", backend, num_envs=8, steps=50, rounds=ROUNDS)


@pytest.mark.benchmark(group="varstep-16envs")
@pytest.mark.parametrize("backend", ["shmvec-async", "shmvec", "sync"])
def test_varstep_async_vs_sync(throughput, backend):
    # shmvec-async makes 8 env steps a call, the others 16: equal work per round.
    steps = 100 if backend == "shmvec-async" else 50
    throughput("varstep", backend, num_envs=16, steps=steps, rounds=ROUNDS)


@pytest.mark.benchmark(group="pong-8envs")
@pytest.mark.parametrize(
    "backend", ["shmvec", "shmvec-main", "envpool", "async", "pufferlib", "single"]
)
def test_pong_8_envs(throughput, backend):
    pytest.importorskip("ale_py")
    pytest.importorskip("cv2")
    _skip_if_missing(backend)
    throughput("pong", backend, num_envs=8, steps=40, rounds=ROUNDS)


@pytest.mark.benchmark(group="cartpole-async-16envs")
@pytest.mark.parametrize("backend", ["shmvec-async", "envpool-async", "shmvec", "envpool"])
def test_cartpole_async_vs_envpool(throughput, backend):
    if backend.startswith("envpool"):
        pytest.importorskip("envpool")
    steps = 400 if backend.endswith("async") else 200
    throughput("cartpole", backend, num_envs=16, steps=steps, rounds=ROUNDS)


@pytest.mark.benchmark(group="sb3-cartpole-16envs")
@pytest.mark.parametrize("backend", ["shmvec-sb3", "sb3"])
def test_sb3_adapter_vs_subproc(throughput, backend):
    pytest.importorskip("stable_baselines3")
    throughput("cartpole", backend, num_envs=16, steps=100, rounds=ROUNDS)


def _skip_if_missing(backend: str) -> None:
    """Skips a peer whose package is not installed."""
    module = {"envpool": "envpool", "pufferlib": "pufferlib"}.get(backend)
    if module is not None:
        pytest.importorskip(module)
