"""Failures: env exceptions, env_fn exceptions, dying workers, a dying main
process, leftovers in /dev/shm, malformed observations.

No test asserts a duration: a hang is caught by pytest-timeout instead.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import envs as test_envs
import numpy as np
import pytest
from gymnasium.vector import SyncVectorEnv
from helpers import dev_shm_files, pid_alive

import shmvec
from shmvec import ShmVectorEnv, WorkerDiedError

pytestmark = pytest.mark.timeout(60)

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
SHMVEC_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(shmvec.__file__)))


def notes(exc: BaseException) -> str:
    return "\n".join(getattr(exc, "__notes__", []))


def failing(n=4, fail_index=1, fail_step=3, **kwargs):
    kwargs.setdefault("context", "fork")
    kwargs.setdefault("num_workers", 2)
    fns = test_envs.indexed_fns(test_envs.FailingEnv, n, fail_index=fail_index, fail_step=fail_step)
    return ShmVectorEnv(fns, **kwargs)


def wait_until_dead(pids, timeout=5.0) -> list[int]:
    """Polls until every pid is gone (or a zombie); returns those still alive."""
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if pid_alive(p)]
        if alive:
            time.sleep(0.05)
    return alive


# ------------------------------------------------------ env exceptions


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_step_exception_is_reraised_with_env_and_traceback(context):
    envs = failing(context=context)
    try:
        pids = [p.pid for p in envs._pool.workers]
        envs.reset(seed=0)
        actions = np.array([1, 1, 1, 1])
        envs.step(actions)
        envs.step(actions)
        with pytest.raises(test_envs.EnvBoom) as info:
            envs.step(actions)
        exc = info.value
        assert type(exc) is test_envs.EnvBoom
        assert str(exc) == "step boom in env 1 at step 3"
        text = notes(exc)
        assert re.search(r"\benv 1\b", text), text
        assert "Traceback" in text and "raise EnvBoom" in text and "envs.py" in text, text
        # The worker survives; after reset() stepping works again.
        assert all(p.is_alive() for p in envs._pool.workers)
        assert [p.pid for p in envs._pool.workers] == pids
        obs, _ = envs.reset(seed=0)
        assert obs.tolist() == [[0, 0]] * 4
        obs, rewards, *_ = envs.step(np.array([1, 2, 3, 0]))
        assert obs.tolist() == [[1, 1], [1, 2], [1, 3], [1, 0]]
        assert rewards.tolist() == [1.0] * 4
    finally:
        envs.close()


def test_reset_exception_is_reraised_and_env_recovers():
    envs = failing(n=3, fail_index=2, num_workers=3)
    try:
        with pytest.raises(test_envs.EnvBoom) as info:
            envs.reset(seed=0, options={"fail": True})
        assert str(info.value) == "reset boom in env 2"
        assert re.search(r"\benv 2\b", notes(info.value))
        assert "Traceback" in notes(info.value)
        obs, _ = envs.reset(seed=0)
        assert obs.tolist() == [[0, 0]] * 3
        obs, *_ = envs.step(np.array([1, 1, 1]))
        assert obs.tolist() == [[1, 1]] * 3
    finally:
        envs.close()


def test_exceptions_in_two_envs_name_both():
    envs = failing(n=4, fail_index=(1, 3), num_workers=2)
    try:
        envs.reset(seed=0)
        envs.step(np.zeros(4, dtype=np.int64))
        envs.step(np.zeros(4, dtype=np.int64))
        with pytest.raises(test_envs.EnvBoom) as info:
            envs.step(np.zeros(4, dtype=np.int64))
        text = str(info.value) + "\n" + notes(info.value)
        assert "env 1" in text and "env 3" in text, text
        envs.reset(seed=0)
        obs, *_ = envs.step(np.zeros(4, dtype=np.int64))
        assert obs[:, 0].tolist() == [1] * 4
    finally:
        envs.close()


def test_step_before_reset_raises_like_sync():
    """gym.make's OrderEnforcing refuses step before reset, in the worker too."""
    from gymnasium.error import ResetNeeded

    envs = ShmVectorEnv(test_envs.gym_fns("CartPole-v1", 2), context="fork", num_workers=2)
    try:
        with pytest.raises(ResetNeeded) as info:
            envs.step(np.zeros(2, dtype=np.int64))
        assert re.search(r"\benv 0\b", notes(info.value))
        envs.reset(seed=0)
        obs, *_ = envs.step(np.zeros(2, dtype=np.int64))
        assert obs.shape == (2, 4)
    finally:
        envs.close()


def test_call_exception_is_reraised():
    envs = failing(n=2, fail_index=-1)
    try:
        with pytest.raises(TypeError, match="double"):
            envs.call("double")  # missing argument
        assert envs.call("double", 2) == (4, 4)
    finally:
        envs.close()


def test_unpicklable_exception_becomes_runtime_error():
    fns = test_envs.class_fns(test_envs.UnpicklableErrorEnv, 2)
    envs = ShmVectorEnv(fns, context="fork", num_workers=2)
    try:
        envs.reset(seed=0)
        with pytest.raises(Exception) as info:
            envs.step(np.zeros(2, dtype=np.int64))
        assert "UnpicklableError" in str(info.value) and "cannot travel" in str(info.value)
        # The workers are still there.
        assert envs.get_attr("t") == (0, 0)
    finally:
        envs.close()


@pytest.mark.parametrize("context", ["fork", "spawn"])
@pytest.mark.parametrize("num_workers", [1, 2])
def test_env_fn_exception_in_worker_raises_at_construction(context, num_workers):
    fns = [functools.partial(test_envs.CountingEnv), test_envs.RaisingEnvFactory()]
    fns += [functools.partial(test_envs.CountingEnv)] * 2
    before = {p.pid for p in multiprocessing.active_children()}
    with pytest.raises(test_envs.EnvBoom, match="env_fn failed on purpose"):
        ShmVectorEnv(fns, context=context, num_workers=num_workers)
    # No worker is left running.
    leftovers = [p for p in multiprocessing.active_children() if p.pid not in before]
    assert leftovers == [], leftovers


def test_env_fn_exception_in_parent():
    with pytest.raises(test_envs.EnvBoom):
        ShmVectorEnv([test_envs.RaisingEnvFactory()], context="fork")


# ------------------------------------------------------ dying workers


@pytest.mark.timeout(30)
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_worker_sigkilled_during_step(context):
    fns = test_envs.indexed_fns(test_envs.SelfKillingEnv, 4, kill_index=2, kill_step=2)
    envs = ShmVectorEnv(fns, context=context, num_workers=2)
    workers = list(envs._pool.workers)
    try:
        envs.reset(seed=0)
        envs.step(np.zeros(4, dtype=np.int64))
        with pytest.raises(WorkerDiedError) as info:
            envs.step(np.zeros(4, dtype=np.int64))
        exc = info.value
        message = str(exc)
        assert "worker 1" in message, message
        assert "2..3" in message, message
        assert "SIGKILL" in message, message
        assert exc.worker == 1
        assert list(exc.env_ids) == [2, 3]
        assert exc.exitcode == -signal.SIGKILL
        # Never a hang afterwards: the next calls fail the same way.
        with pytest.raises(WorkerDiedError):
            envs.step(np.zeros(4, dtype=np.int64))
        with pytest.raises(WorkerDiedError):
            envs.get_attr("t")
    finally:
        envs.close()
    assert envs.closed
    assert all(p.exitcode is not None for p in workers)


@pytest.mark.timeout(30)
def test_worker_killed_from_outside_while_idle():
    envs = ShmVectorEnv(test_envs.gym_fns("CartPole-v1", 6), context="fork", num_workers=3)
    workers = list(envs._pool.workers)
    try:
        envs.reset(seed=0)
        os.kill(workers[2].pid, signal.SIGKILL)
        workers[2].join(5)
        with pytest.raises(WorkerDiedError, match=r"worker 2 .*4\.\.5.*SIGKILL"):
            envs.step(np.zeros(6, dtype=np.int64))
    finally:
        envs.close()
    assert all(p.exitcode is not None for p in workers)


@pytest.mark.timeout(30)
def test_worker_killed_from_outside_during_slow_step():
    fns = test_envs.class_fns(test_envs.CountingEnv, 2, delay=1.0)
    envs = ShmVectorEnv(fns, context="fork", num_workers=2)
    workers = list(envs._pool.workers)
    try:
        envs.reset(seed=0)
        envs.step_async(np.zeros(2, dtype=np.int64))
        os.kill(workers[0].pid, signal.SIGKILL)
        with pytest.raises(WorkerDiedError, match=r"worker 0 .*0\.\.0.*SIGKILL"):
            envs.step_wait()
    finally:
        envs.close()
    assert all(p.exitcode is not None for p in workers)


def test_async_recv_notices_a_worker_killed_in_a_slow_step():
    # Its step would take 30 s: the batch cannot fill, and recv must not wait for it.
    fns = test_envs.class_fns(test_envs.CountingEnv, 4, delay=30.0)
    envs = ShmVectorEnv(fns, context="fork", num_workers=2, batch_size=2)
    workers = list(envs._pool.workers)
    try:
        envs.async_reset(seed=0)
        envs.recv()
        envs.recv()
        envs.send(np.zeros(4, dtype=np.int64), np.arange(4))
        os.kill(workers[0].pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(WorkerDiedError, match=r"worker 0 .*SIGKILL"):
            envs.recv()
        assert time.monotonic() - started < 10.0  # noticed by a liveness check, not the step
    finally:
        envs.close(terminate=True)  # the other worker is still in its 30 s step


@pytest.mark.timeout(30)
def test_worker_sigterm_is_reported():
    envs = ShmVectorEnv(test_envs.gym_fns("CartPole-v1", 2), context="fork", num_workers=2)
    try:
        envs.reset(seed=0)
        os.kill(envs._pool.workers[1].pid, signal.SIGTERM)
        with pytest.raises(WorkerDiedError, match="SIGTERM"):
            envs.reset(seed=0)
    finally:
        envs.close()


# ------------------------------------------------- the main process dies

MAIN_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time
    sys.path[:0] = [{shmvec_root!r}, {tests_dir!r}]  # the shmvec under test
    import numpy as np
    import envs
    from shmvec import ShmVectorEnv

    def main():
        fns = envs.class_fns(envs.CountingEnv, 4, delay={delay!r})
        v = ShmVectorEnv(fns, context={context!r}, num_workers=2)
        v.reset(seed=0)
        if {busy!r}:
            v.step_async(np.zeros(4, dtype=np.int64))  # workers sit in a long env.step
            time.sleep(0.5)
        else:
            v.step(np.zeros(4, dtype=np.int64))
        print(" ".join(str(p.pid) for p in v._pool.workers), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    if __name__ == "__main__":
        if {in_thread!r}:  # built from a non-main thread (a server, a Ray actor...)
            import threading
            t = threading.Thread(target=main)
            t.start()
            t.join()
        else:
            main()
    """
)


def _own_new_shm_files(before: set[str], pids: set[int]) -> set[str]:
    """New /dev/shm entries, ignoring multiprocessing heap files of unrelated processes."""
    new = set()
    for name in dev_shm_files() - before:
        m = re.match(r"pym-(\d+)-", name)
        if m and int(m.group(1)) not in pids:
            continue
        new.add(name)
    return new


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "context,busy,reaped,in_thread",
    [
        pytest.param("fork", False, True, False, id="fork-idle"),
        pytest.param("fork", True, True, False, id="fork-busy"),
        pytest.param("spawn", True, True, False, id="spawn-busy"),
        pytest.param("forkserver", False, True, False, id="forkserver-idle"),
        pytest.param("forkserver", True, True, False, id="forkserver-busy"),
        pytest.param("fork", False, False, False, id="fork-idle-unreaped"),
        pytest.param("forkserver", False, False, False, id="forkserver-idle-unreaped"),
        pytest.param("fork", True, True, True, id="fork-busy-built-in-thread"),
    ],
)
def test_workers_exit_when_main_is_sigkilled(tmp_path, context, busy, reaped, in_thread):
    """A SIGKILLed main process takes its workers with it, even when they are
    busy in a long env.step, even while its parent has not reaped it yet (a
    zombie main, as under any supervisor that waits later), and whichever
    thread built the vector env."""
    before = dev_shm_files()
    script = tmp_path / "main.py"
    script.write_text(
        MAIN_SCRIPT.format(
            tests_dir=TESTS_DIR,
            shmvec_root=SHMVEC_ROOT,
            context=context,
            busy=busy,
            in_thread=in_thread,
            delay=30.0 if busy else 0.0,
        )
    )
    out_path = tmp_path / "out.txt"
    with open(out_path, "w") as out:
        # stdout goes to a file: workers inherit it, and a pipe would keep
        # this test waiting for them.
        proc = subprocess.Popen([sys.executable, str(script)], stdout=out, stderr=subprocess.STDOUT)
    pids: list[int] = []
    try:
        if reaped:
            assert proc.wait(timeout=45) == -signal.SIGKILL, out_path.read_text()
        else:
            deadline = time.monotonic() + 45
            while _state(proc.pid) != "Z":
                assert time.monotonic() < deadline, out_path.read_text()
                time.sleep(0.02)
        pids = [int(p) for p in out_path.read_text().split()]
        assert len(pids) == 2, out_path.read_text()
        alive = wait_until_dead(pids, timeout=5.0)
        assert alive == [], (
            f"workers {alive} ({context}) outlived their SIGKILLed main process "
            f"(busy={busy}, main reaped={reaped}, built in a thread={in_thread})"
        )
        new = _own_new_shm_files(before, {proc.pid, *pids})
        assert new == set(), f"left in /dev/shm: {new}"
    finally:
        for pid in pids:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=10)
        wait_until_dead(pids, timeout=5.0)


@pytest.mark.parametrize("context", ["fork", "spawn"])
@pytest.mark.parametrize("shared_memory", [True, False])
def test_no_dev_shm_files_during_run_or_after_close(context, shared_memory):
    before = dev_shm_files()
    envs = ShmVectorEnv(
        test_envs.gym_fns("CartPole-v1", 4),
        context=context,
        num_workers=2,
        shared_memory=shared_memory,
    )
    pids = {os.getpid(), *(p.pid for p in envs._pool.workers)}
    try:
        envs.reset(seed=0)
        assert _own_new_shm_files(before, pids) == set()
    finally:
        envs.close()
    assert _own_new_shm_files(before, pids) == set()


def test_dropped_env_is_cleaned_up_by_del():
    envs = ShmVectorEnv(test_envs.gym_fns("CartPole-v1", 2), context="fork", num_workers=2)
    workers = list(envs._pool.workers)
    pids = [p.pid for p in workers]
    del envs
    import gc

    gc.collect()
    for p in workers:
        p.join(5)
    assert wait_until_dead(pids) == []


# -------------------------------------------------- malformed observations


@pytest.mark.parametrize("kind", ["short", "long_list", "scalar", "column"])
def test_wrong_observation_shape_names_the_env(kind):
    fns = test_envs.indexed_fns(test_envs.WrongShapeEnv, 3, bad_index=1, kind=kind)
    # gymnasium refuses each of these observations too.
    sync = SyncVectorEnv(fns)
    sync.reset(seed=0)
    with pytest.raises((ValueError, TypeError)):
        sync.step(np.zeros(3, dtype=np.int64))
    sync.close()

    envs = ShmVectorEnv(fns, context="fork", num_workers=2)
    try:
        envs.reset(seed=0)
        with pytest.raises((ValueError, TypeError)) as info:
            envs.step(np.zeros(3, dtype=np.int64))
        text = str(info.value) + "\n" + notes(info.value)
        assert re.search(r"\benv 1\b", text), text
        assert "shape" in text or "broadcast" in text, text
        obs, _ = envs.reset(seed=0)  # still usable
        assert obs.shape == (3, 4)
    finally:
        envs.close()


def test_worker_died_error_is_exported():
    assert shmvec.WorkerDiedError is WorkerDiedError
    assert issubclass(WorkerDiedError, RuntimeError)


def test_worker_died_error_pickles_with_its_fields_and_notes():
    import pickle

    error = WorkerDiedError(1, range(2, 4), -signal.SIGKILL, 4321)
    shmvec.errors.add_note(error, "the worker was restarted")
    copy = pickle.loads(pickle.dumps(error))
    assert str(copy) == str(error)
    assert str(error) == "shmvec worker 1 (pid 4321, envs 2..3) killed by signal SIGKILL"
    assert (copy.worker, copy.env_ids, copy.exitcode, copy.pid) == (1, range(2, 4), -9, 4321)
    assert copy.__notes__ == ["the worker was restarted"]
