"""Model-based tests of the rollout layer's parts: random schedules of every
operation over the book (all three on_stale policies, both modes) and over the
lag rule alone, the promises checked after every operation (tests/rollout_model.py).

``SHMVEC_MODEL_SEEDS`` (default 40) and ``SHMVEC_MODEL_OPS`` (default 400)
set the size of the run; a failure names its seed, and ``SHMVEC_MODEL_SEED``
runs that seed alone."""

from __future__ import annotations

import os

import pytest
from rollout_model import BookModel, lag_rule_schedule

SEEDS = int(os.environ.get("SHMVEC_MODEL_SEEDS", "40"))
OPS = int(os.environ.get("SHMVEC_MODEL_OPS", "400"))
ONLY = os.environ.get("SHMVEC_MODEL_SEED")
seeds = [int(ONLY)] if ONLY else range(SEEDS)


@pytest.mark.parametrize("mode", ["async", "sync"])
@pytest.mark.parametrize("on_stale", ["wait", "drop", "rerun"])
def test_random_schedules_keep_every_promise(on_stale, mode):
    for seed in seeds:
        model = BookModel(seed, on_stale, mode)
        try:
            model.run(OPS)
        except AssertionError as error:
            raise AssertionError(
                f"seed {seed} ({on_stale}, {mode}, {model.config}), after operations "
                f"{model.ops[-8:]}: {error}; rerun with SHMVEC_MODEL_SEED={seed}"
            ) from error


def test_the_lag_rule_alone_keeps_the_bound_for_any_rise_per_batch():
    handed = 0
    for seed in seeds if ONLY else range(SEEDS * 10):
        handed += lag_rule_schedule(seed, batches=max(OPS // 20, 10))["handed"]
    assert handed > 0
