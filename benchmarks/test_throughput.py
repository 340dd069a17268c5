"""Throughput of shmvec against gymnasium's Sync/AsyncVectorEnv, with pytest-benchmark.

Run with::

    python -m pytest benchmarks --benchmark-only -q

Groups (one per workload and size) and what each answers:

- ``cartpole-32envs``: a cheap env, many of them: is the per-step overhead small?
- ``cpu100us-8envs``: a 100 us CPU-bound step: does shmvec use every core?
  ``parallel_efficiency = steps/s / (cores x single-env steps/s)``.
- ``noop-1env``: a step that does nothing: the round trip (``step_us``).
- ``largeobs-8envs``: 1 MiB observations: shmvec's zero-copy views against
  AsyncVectorEnv (``async`` copies; ``async-nocopy`` is its copy=False peer).

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
@pytest.mark.parametrize("backend", ["shmvec", "sync", "async"])
def test_cartpole_32_envs(throughput, backend):
    throughput("cartpole", backend, num_envs=32, steps=100, rounds=ROUNDS)


@pytest.mark.benchmark(group="cpu100us-8envs")
@pytest.mark.parametrize("backend", ["shmvec", "sync", "single"])
def test_cpu100us_8_envs(throughput, backend):
    # single steps one env: 8x the steps keeps the work per round equal.
    num_envs, steps = (1, 400) if backend == "single" else (8, 50)
    throughput("cpu100us", backend, num_envs=num_envs, steps=steps, rounds=ROUNDS)


@pytest.mark.benchmark(group="noop-1env")
@pytest.mark.parametrize("backend", ["shmvec", "sync", "async"])
def test_noop_round_trip(throughput, backend):
    throughput("noop", backend, num_envs=1, steps=1000, rounds=ROUNDS)


@pytest.mark.benchmark(group="largeobs-8envs")
@pytest.mark.parametrize("backend", ["shmvec-nocopy", "async", "async-nocopy"])
def test_largeobs_8_envs(throughput, backend):
    throughput("largeobs", backend, num_envs=8, steps=50, rounds=ROUNDS)
