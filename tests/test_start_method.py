"""Workers get a start method that is safe once CUDA is initialized, and forked
workers leave the atexit callbacks they inherit alone."""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import pathlib
import signal
import sys
import weakref

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


# ------------------------------------------------ atexit callbacks and fork


class HeldAtExit:
    """Stands for Ray's gRPC client of the GCS, which only an atexit callback of
    a ``cluster_utils.Cluster``'s node keeps alive: torn down in a forked child,
    where the parent's threads are missing, it crashes the child (SIGSEGV). Its
    callback writes ``path`` if it runs in a child."""

    def __init__(self, path: pathlib.Path) -> None:
        self.pid = os.getpid()
        self.path = path

    def __del__(self) -> None:
        if os.getpid() != self.pid:
            os.kill(os.getpid(), signal.SIGSEGV)

    def shutdown(self) -> None:
        if os.getpid() != self.pid:
            self.path.write_text("ran")


@pytest.fixture
def held_at_exit(tmp_path):
    """A HeldAtExit that only this process's atexit callbacks hold; yields the file
    its callback writes if it runs in a child."""
    ran = tmp_path / "parent-callback-ran-in-child"
    callback = HeldAtExit(ran).shutdown
    atexit.register(callback)
    registered = weakref.WeakMethod(callback)
    del callback
    yield ran
    atexit.unregister(registered())


def test_forked_workers_keep_inherited_atexit_callbacks(held_at_exit):
    """A forked worker neither releases nor runs the atexit callbacks it inherits
    (Python 3.13's multiprocessing drops them in a forked child: after a Ray
    cluster, every worker died by SIGSEGV), threaded envs included."""
    fns = [lambda: gym.make("CartPole-v1")] * 4
    envs = shmvec.ShmVectorEnv(fns, num_workers=2, context="fork", env_concurrency=2)
    sync = gym.vector.SyncVectorEnv(fns)
    try:
        np.testing.assert_array_equal(envs.reset(seed=3)[0], sync.reset(seed=3)[0])
        actions = np.array([0, 1, 1, 0])
        for _ in range(5):
            for a, b in zip(envs.step(actions)[:4], sync.step(actions)[:4]):
                np.testing.assert_array_equal(a, b)
        assert envs.stats()["worker_env_threads"] == [2, 2]
    finally:
        envs.close()
        sync.close()
    assert not held_at_exit.exists()


def _register_at_exit(path: str, code: int) -> None:
    atexit.register(pathlib.Path(path).write_text, "ran")
    sys.exit(code)


@pytest.mark.parametrize("code", [0, 3])
def test_fork_context_runs_the_childs_own_atexit_callbacks_only(held_at_exit, tmp_path, code):
    """A child of shmvec's fork context runs the atexit callbacks registered in it,
    not those it inherited, and exits with its own status."""
    own = tmp_path / "own"
    ctx = start_method.worker_context("fork")
    process = ctx.Process(target=_register_at_exit, args=(str(own), code))
    process.start()
    process.join()
    assert process.exitcode == code
    assert own.read_text() == "ran"
    assert not held_at_exit.exists()
