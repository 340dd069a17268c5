"""``fallback="serial"``: when the kernel refuses what workers need, run every
env in the main process (with a warning saying why) instead of failing; without
it, a clear error says why. The refusals are simulated where shmvec asks the
kernel: the segment, the futex probe, and starting a process."""

from __future__ import annotations

import errno
import logging
import multiprocessing.process

import envs as test_envs
import numpy as np
import pytest
from gymnasium.vector import SyncVectorEnv
from helpers import assert_same

from shmvec import ShmVectorEnv, _core


def refuse(*args, **kwargs):
    raise OSError(errno.ENOSYS, "Function not implemented")


REFUSALS = {
    "memfd": (_core.Segment, "create", "cannot create its shared-memory segment"),
    "futex": (_core, "futex_wake", "cannot use futexes here"),
    "process": (multiprocessing.process.BaseProcess, "start", "cannot start worker processes"),
}


@pytest.mark.parametrize("refused", list(REFUSALS))
def test_without_fallback_the_error_says_why(monkeypatch, refused):
    owner, name, why = REFUSALS[refused]
    monkeypatch.setattr(owner, name, refuse)
    with pytest.raises(RuntimeError, match=f"{why}.*Function not implemented") as error:
        ShmVectorEnv(test_envs.gym_fns("CartPole-v1", 4), num_workers=2)
    assert "fallback='serial'" in str(error.value)
    assert isinstance(error.value.__cause__, OSError)


@pytest.mark.parametrize("refused", list(REFUSALS))
def test_serial_fallback_warns_and_gives_sync_results(monkeypatch, caplog, refused):
    owner, name, why = REFUSALS[refused]
    monkeypatch.setattr(owner, name, refuse)
    fns = test_envs.gym_fns("CartPole-v1", 4)
    with caplog.at_level(logging.WARNING, logger="shmvec"):
        envs = ShmVectorEnv(fns, num_workers=2, fallback="serial")
    sync = SyncVectorEnv(fns)
    try:
        assert envs.in_process and envs.num_workers == 1
        assert any(
            why in r.getMessage() and "fallback='serial'" in r.getMessage() for r in caplog.records
        )
        assert_same(envs.reset(seed=5), sync.reset(seed=5))
        rng = np.random.default_rng(0)
        for _ in range(60):
            actions = rng.integers(0, 2, 4)
            assert_same(envs.step(actions), sync.step(actions))
    finally:
        envs.close()
        sync.close()


def test_fallback_argument_is_checked():
    with pytest.raises(ValueError, match="fallback must be None or 'serial'"):
        ShmVectorEnv(test_envs.gym_fns("CartPole-v1", 2), fallback="threads")


def test_num_workers_0_needs_no_shared_memory(monkeypatch):
    """The in-process mode maps a private segment: no memfd, no futex."""
    monkeypatch.setattr(_core.Segment, "create", refuse)
    monkeypatch.setattr(_core, "futex_wake", refuse)
    envs = ShmVectorEnv(test_envs.gym_fns("CartPole-v1", 2), num_workers=0)
    try:
        assert envs._pool.segment.fd == -1
        envs.reset(seed=0)
        assert envs.step(np.zeros(2, dtype=np.int64))[0].shape == (2, 4)
    finally:
        envs.close()
