"""Workers get a start method that is safe once CUDA is initialized."""

from __future__ import annotations

import logging
import multiprocessing

import gymnasium as gym
import numpy as np
import pytest

import shmvec
from shmvec import start_method


@pytest.fixture
def cuda_on(monkeypatch):
    """Pretends this process initialized CUDA (no GPU needed for the decision)."""
    monkeypatch.setattr(start_method, "cuda_initialized", lambda: True)


def test_cuda_not_initialized_without_torch_import(monkeypatch):
    # Without torch imported CUDA cannot be initialized, and asking imports nothing.
    import sys

    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert start_method.cuda_initialized() is False
    assert "torch" not in sys.modules


def test_default_context_unchanged_without_cuda(monkeypatch):
    monkeypatch.setattr(start_method, "cuda_initialized", lambda: False)
    default = multiprocessing.get_all_start_methods()[0]
    assert start_method.worker_context(None).get_start_method() == default


@pytest.mark.skipif(
    multiprocessing.get_all_start_methods()[0] != "fork", reason="fork is not the default here"
)
def test_cuda_initialized_switches_fork_to_forkserver(cuda_on):
    assert start_method.worker_context(None).get_start_method() == "forkserver"
    assert start_method.worker_context("spawn").get_start_method() == "spawn"


def test_explicit_fork_after_cuda_warns(cuda_on, caplog):
    with caplog.at_level(logging.WARNING, logger="shmvec"):
        assert start_method.worker_context("fork").get_start_method() == "fork"
    assert "context='forkserver' or 'spawn'" in caplog.text


@pytest.mark.skipif(
    multiprocessing.get_all_start_methods()[0] != "fork", reason="fork is not the default here"
)
def test_envs_and_restarts_after_cuda_use_forkserver(cuda_on, caplog):
    """Envs created (and workers restarted) once CUDA is up start from the
    forkserver, and give SyncVectorEnv's results."""
    fns = [lambda: gym.make("CartPole-v1")] * 4
    with caplog.at_level(logging.INFO, logger="shmvec"):
        envs = shmvec.ShmVectorEnv(fns, num_workers=2, on_worker_death="restart")
    sync = gym.vector.SyncVectorEnv(fns)
    try:
        assert "forkserver" in caplog.text
        obs, _ = envs.reset(seed=3)
        expected, _ = sync.reset(seed=3)
        np.testing.assert_array_equal(obs, expected)
        actions = np.array([0, 1, 1, 0])
        for _ in range(5):
            got = envs.step(actions)
            want = sync.step(actions)
            for a, b in zip(got[:4], want[:4]):
                np.testing.assert_array_equal(a, b)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="shmvec"):
            envs._pool.workers[1].kill()  # a restart starts a worker again
            envs._pool.workers[1].join()
            envs.step(actions)
        assert "restarted worker 1" in caplog.text and "forkserver" in caplog.text
    finally:
        envs.close()
        sync.close()
