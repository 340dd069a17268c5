"""The gymnasium VectorEnv API of ShmVectorEnv, and the errors for misuse.

Item numbers refer to /work/shared/GYMNASIUM_CONTRACT.md.
"""

from __future__ import annotations

import copy
import functools
import multiprocessing
import os
import re
import time

import envs as test_envs
import gymnasium as gym
import numpy as np
import pytest
from gymnasium.error import AlreadyPendingCallError, ClosedEnvironmentError, NoAsyncCallError
from gymnasium.spaces import Box, Discrete
from gymnasium.vector import AutoresetMode, SyncVectorEnv, VectorEnv
from gymnasium.vector.utils import batch_differing_spaces
from helpers import assert_same

import shmvec
from shmvec import ShmVectorEnv
from shmvec.layout import LEASE_REGIONS

pytestmark = pytest.mark.timeout(60)


def cartpole(n: int = 4, **kwargs) -> ShmVectorEnv:
    kwargs.setdefault("context", "fork")
    kwargs.setdefault("num_workers", 2)
    return ShmVectorEnv(test_envs.gym_fns("CartPole-v1", n), **kwargs)


def counting(n: int = 4, env_kwargs=None, **kwargs) -> ShmVectorEnv:
    kwargs.setdefault("context", "fork")
    kwargs.setdefault("num_workers", 2)
    fns = test_envs.class_fns(test_envs.CountingEnv, n, **(env_kwargs or {}))
    return ShmVectorEnv(fns, **kwargs)


@pytest.fixture
def envs():
    env = cartpole()
    yield env
    env.close()


# ------------------------------------------------------ attributes (1-22)


def test_attributes_match_sync(envs):
    sync = SyncVectorEnv(test_envs.gym_fns("CartPole-v1", 4))
    assert isinstance(envs, VectorEnv)
    assert type(envs.num_envs) is int and envs.num_envs == 4
    assert envs.single_observation_space == sync.single_observation_space
    assert envs.observation_space == sync.observation_space
    assert envs.single_action_space == sync.single_action_space
    assert envs.action_space == sync.action_space
    assert isinstance(envs.metadata, dict)
    assert envs.metadata["autoreset_mode"] is AutoresetMode.NEXT_STEP
    assert {k: v for k, v in envs.metadata.items() if k != "autoreset_mode"} == {
        k: v for k, v in sync.metadata.items() if k != "autoreset_mode"
    }
    # The sub-env's class-level metadata is not modified.
    from gymnasium.envs.classic_control.cartpole import CartPoleEnv

    assert "autoreset_mode" not in CartPoleEnv.metadata
    envs.metadata["extra"] = 1  # a plain, writable dict
    assert envs.render_mode is None
    assert envs.closed is False
    assert envs.spec is None
    assert envs.unwrapped is envs
    assert repr(envs) == "ShmVectorEnv(num_envs=4)"
    sync.close()


def test_constructor_arguments_are_kept():
    fns = test_envs.gym_fns("CartPole-v1", 3)
    envs = ShmVectorEnv(
        fns, False, False, "fork", False, None, "same", "SameStep", 2, num_workers=2
    )
    try:
        assert envs.env_fns == fns
        assert envs.shared_memory is False
        assert envs.copy is False
        assert envs.context == "fork"
        assert envs.daemon is False
        assert envs.worker is None
        assert envs.observation_mode == "same"
        assert envs.autoreset_mode is AutoresetMode.SAME_STEP
        assert envs.max_concurrency == 2
    finally:
        envs.close()


def test_env_fns_as_keyword():
    envs = ShmVectorEnv(env_fns=test_envs.gym_fns("CartPole-v1", 2), context="fork")
    try:
        assert envs.num_envs == 2
        obs, _ = envs.reset(seed=0)
        assert obs.shape == (2, 4)
    finally:
        envs.close()


@pytest.mark.parametrize(
    "value,expected",
    [
        ("NextStep", AutoresetMode.NEXT_STEP),
        ("SameStep", AutoresetMode.SAME_STEP),
        ("Disabled", AutoresetMode.DISABLED),
        (AutoresetMode.SAME_STEP, AutoresetMode.SAME_STEP),
    ],
)
def test_autoreset_mode_from_string(value, expected):
    envs = cartpole(2, autoreset_mode=value)
    try:
        assert envs.autoreset_mode is expected
        assert envs.metadata["autoreset_mode"] is expected
    finally:
        envs.close()


@pytest.mark.parametrize("value", ["next_step", "Foo", 3])
def test_autoreset_mode_invalid(value):
    with pytest.raises(ValueError):
        cartpole(2, autoreset_mode=value)


@pytest.mark.parametrize(
    "value,message",
    [
        ("2", "`max_concurrency` must be an integer or None, got <class 'str'>."),
        (1.5, "`max_concurrency` must be an integer or None, got <class 'float'>."),
        (0, "`max_concurrency` must be a positive or None, got 0."),
        (-3, "`max_concurrency` must be a positive or None, got -3."),
    ],
)
def test_max_concurrency_validation(value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        cartpole(2, max_concurrency=value)


@pytest.mark.parametrize("value", [1, np.int64(2)])
def test_max_concurrency_valid_values(value):
    envs = cartpole(4, max_concurrency=value, num_workers=4)
    try:
        assert envs.max_concurrency == value
        envs.reset(seed=0)
        envs.step(np.zeros(4, dtype=np.int64))
    finally:
        envs.close()


def test_max_concurrency_limits_envs_inside_step():
    probe = multiprocessing.get_context("fork").Array("i", 2)
    fns = [functools.partial(test_envs.ConcurrencyProbeEnv, probe) for _ in range(6)]
    envs = ShmVectorEnv(fns, context="fork", num_workers=6, max_concurrency=2)
    try:
        envs.reset(seed=0)
        for _ in range(5):
            envs.step(np.ones(6, dtype=np.int64))
        assert probe[0] == 0
        assert 1 <= probe[1] <= 2, f"{probe[1]} envs were inside step at once"
    finally:
        envs.close()


def test_custom_worker_is_rejected():
    def worker(*args):  # pragma: no cover - never called
        pass

    with pytest.raises(ValueError, match="worker"):
        cartpole(2, worker=worker)


# 0 is valid: every env in the main process (test_num_workers_0_*).
@pytest.mark.parametrize("num_workers", [5, -1])
def test_num_workers_out_of_range(num_workers):
    with pytest.raises(ValueError, match="num_workers must be between 0 and num_envs=4"):
        cartpole(4, num_workers=num_workers)


def test_bad_env_fns():
    with pytest.raises(ValueError):
        ShmVectorEnv([], context="fork")
    with pytest.raises(TypeError):
        ShmVectorEnv([test_envs.gym_fns("CartPole-v1", 1)[0], 42], context="fork")


@pytest.mark.parametrize("where", [0, 3])
def test_env_fn_returning_a_non_env_is_named(where):
    fns = test_envs.gym_fns("CartPole-v1", 4)
    fns[where] = lambda: "CartPole-v1"
    with pytest.raises(TypeError, match=rf"env_fns\[{where}\] returned 'str', not an env: "):
        ShmVectorEnv(fns, num_workers=2, context="fork")


def test_daemon_flag_reaches_workers():
    for daemon in (True, False):
        envs = cartpole(2, daemon=daemon)
        try:
            assert [p.daemon for p in envs._pool.workers] == [daemon, daemon]
            envs.reset(seed=0)
        finally:
            envs.close()


def test_unpicklable_env_fn_under_spawn_is_named():
    import threading

    lock = threading.Lock()

    def bad_fn():
        assert lock is not None
        return gym.make("CartPole-v1")

    fns = [test_envs.gym_fns("CartPole-v1", 1)[0], bad_fn]
    with pytest.raises(TypeError, match=r"env_fns\[1\]"):
        ShmVectorEnv(fns, context="spawn", num_workers=2)


def test_ring_depth_below_two_is_rejected():
    with pytest.raises(ValueError, match="ring_depth"):
        cartpole(2, ring_depth=1)


# ------------------------------------------------------- observation_mode


def test_observation_mode_different():
    fns = [
        functools.partial(test_envs.CountingEnv, high=10),
        functools.partial(test_envs.CountingEnv, high=20),
        functools.partial(test_envs.CountingEnv, high=30),
    ]
    envs = ShmVectorEnv(fns, context="fork", num_workers=2, observation_mode="different")
    sync = SyncVectorEnv(fns, observation_mode="different")
    try:
        expected = batch_differing_spaces([fn().observation_space for fn in fns])
        assert envs.observation_space == expected == sync.observation_space
        assert envs.single_observation_space == sync.single_observation_space
        assert_same(envs.reset(seed=1), sync.reset(seed=1))
        actions = np.array([1, 2, 3])
        assert_same(envs.step(actions), sync.step(actions))
    finally:
        envs.close()
        sync.close()


def test_observation_mode_same_with_different_spaces_fails():
    fns = [
        functools.partial(test_envs.CountingEnv, high=10),
        functools.partial(test_envs.CountingEnv, high=20),
    ]
    with pytest.raises(
        RuntimeError,
        match="the sub-environments observation spaces are not equivalent. .*If this is "
        "intentional, use `observation_mode='different'` instead.",
    ):
        ShmVectorEnv(fns, context="fork", num_workers=2)


def test_observation_mode_different_shapes_fail():
    fns = [
        functools.partial(test_envs.CountingEnv, obs_len=2),
        functools.partial(test_envs.CountingEnv, obs_len=3),
    ]
    with pytest.raises(ValueError):
        ShmVectorEnv(fns, context="fork", num_workers=2, observation_mode="different")


def test_different_action_spaces_fail():
    fns = [
        functools.partial(test_envs.CountingEnv, n_actions=4),
        functools.partial(test_envs.CountingEnv, n_actions=5),
    ]
    with pytest.raises(RuntimeError, match="In order to batch actions"):
        ShmVectorEnv(fns, context="fork", num_workers=2)


def test_observation_mode_tuple():
    single = Box(0, 1_000_000, (2,), np.int64)
    batched = Box(0, 1_000_000, (3, 2), np.int64)
    envs = counting(3, observation_mode=(batched, single))
    try:
        assert envs.observation_space is batched
        assert envs.single_observation_space is single
        obs, _ = envs.reset(seed=0)
        assert obs in batched
        obs, *_ = envs.step(np.array([1, 2, 3]))
        assert obs.tolist() == [[1, 1], [1, 2], [1, 3]]
    finally:
        envs.close()


def test_observation_mode_tuple_of_non_spaces():
    with pytest.raises(TypeError):
        counting(2, observation_mode=("a", "b"))


@pytest.mark.parametrize("mode", ["foo", None, 3])
def test_observation_mode_invalid(mode):
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Invalid `observation_mode`, expected: 'same' or 'different' or tuple of single and "
            f"batch observation space, actual got {mode}"
        ),
    ):
        counting(2, observation_mode=mode)


# ------------------------------------------------- async state machine (43-47)


def test_already_pending_call_errors(envs):
    envs.reset_async(seed=0)
    pending = "while waiting for a pending call to `reset` to complete"
    checks = [
        (lambda: envs.reset_async(), f"Calling `reset_async` {pending}"),
        (lambda: envs.step_async(np.zeros(4, dtype=np.int64)), f"Calling `step_async` {pending}."),
        (lambda: envs.call_async("gravity"), f"Calling `call_async` {pending}."),
        (lambda: envs.set_attr("gravity", 1.0), f"Calling `set_attr` {pending}."),
    ]
    for fn, message in checks:
        with pytest.raises(AlreadyPendingCallError, match=re.escape(message)) as info:
            fn()
        assert info.value.name == "reset"
    obs, _ = envs.reset_wait()
    assert obs.shape == (4, 4)

    envs.step_async(np.zeros(4, dtype=np.int64))
    with pytest.raises(AlreadyPendingCallError, match="pending call to `step`") as info:
        envs.reset_async()
    assert info.value.name == "step"
    with pytest.raises(AlreadyPendingCallError) as info:
        envs.step_async(np.zeros(4, dtype=np.int64))
    assert info.value.name == "step"
    envs.step_wait()

    envs.call_async("gravity")
    with pytest.raises(AlreadyPendingCallError, match="pending call to `call`") as info:
        envs.step_async(np.zeros(4, dtype=np.int64))
    assert info.value.name == "call"
    assert envs.call_wait() == (9.8,) * 4


def test_no_async_call_errors(envs):
    for fn, name, message in [
        (envs.reset_wait, "reset", "Calling `reset_wait` without any prior call to `reset_async`."),
        (envs.step_wait, "step", "Calling `step_wait` without any prior call to `step_async`."),
        (envs.call_wait, "call", "Calling `call_wait` without any prior call to `call_async`."),
    ]:
        with pytest.raises(NoAsyncCallError, match=re.escape(message)) as info:
            fn()
        assert info.value.name == name
    # A wait of the wrong kind is also refused, and the pending call survives.
    envs.reset_async(seed=0)
    with pytest.raises(NoAsyncCallError):
        envs.step_wait()
    obs, _ = envs.reset_wait()
    assert obs.shape == (4, 4)


def test_order_of_checks_in_reset_async_and_set_attr(envs):
    """closed, then seed length, then pending call, then reset_mask (item 27);
    set_attr: closed, then length, then pending call (item 51)."""
    envs.reset(seed=0)
    envs.step_async(np.zeros(4, dtype=np.int64))
    with pytest.raises(ValueError, match="length must match"):
        envs.reset_async(seed=[1, 2])
    with pytest.raises(AlreadyPendingCallError):
        envs.reset_async(options={"reset_mask": [True]})
    with pytest.raises(ValueError, match="Values must be a list or tuple"):
        envs.set_attr("gravity", [1.0])
    envs.step_wait()


def test_async_equals_sync_calls(envs):
    envs.reset_async(5, None)  # positional arguments are allowed here
    obs_positional, _ = envs.reset_wait()
    envs.reset_async(seed=5)
    obs_async, _ = envs.reset_wait()
    obs_sync, _ = envs.reset(seed=5)
    assert_same(obs_async, obs_sync)
    assert_same(obs_positional, obs_sync)


# ---------------------------------------------------------------- closing


def test_closed_environment_errors():
    envs = cartpole(2)
    envs.close()
    assert envs.closed is True
    message = re.escape("Trying to operate on `ShmVectorEnv`, after a call to `close()`.")
    actions = np.zeros(2, dtype=np.int64)
    calls = {
        "reset": lambda: envs.reset(),
        "reset_async": lambda: envs.reset_async(),
        "reset_wait": lambda: envs.reset_wait(),
        "step": lambda: envs.step(actions),
        "step_async": lambda: envs.step_async(actions),
        "step_wait": lambda: envs.step_wait(),
        "call": lambda: envs.call("gravity"),
        "call_async": lambda: envs.call_async("gravity"),
        "call_wait": lambda: envs.call_wait(),
        "get_attr": lambda: envs.get_attr("gravity"),
        "set_attr": lambda: envs.set_attr("gravity", 1.0),
        "set_attr_wrong_length": lambda: envs.set_attr("gravity", [1.0]),
        "render": lambda: envs.render(),
        "np_random_seed": lambda: envs.np_random_seed,
    }
    for name, fn in calls.items():
        with pytest.raises(ClosedEnvironmentError, match=message):
            fn()
            pytest.fail(f"{name} did not raise")
    envs.close()  # a second close is a no-op
    envs.close(terminate=True)
    assert envs.closed is True


def test_close_stops_workers():
    envs = cartpole(4, num_workers=2)
    workers = list(envs._pool.workers)
    assert len(workers) == 2 and all(p.is_alive() for p in workers)
    envs.close()
    assert all(p.exitcode is not None for p in workers)


def test_close_terminate_with_pending_step_warns():
    envs = counting(2, env_kwargs={"delay": 2.0})
    envs.reset(seed=0)
    envs.step_async(np.array([1, 1]))
    with pytest.warns(
        UserWarning, match="Calling `close` while waiting for a pending call to `step` to complete"
    ):
        envs.close(terminate=True)
    assert envs.closed


def test_close_rejects_unknown_keyword(envs):
    with pytest.raises(TypeError):
        envs.close(bogus=True)


def test_context_manager():
    """``with ShmVectorEnv(...) as envs:`` closes the workers on exit, like gymnasium.Env."""
    with cartpole(2) as envs:
        assert isinstance(envs, ShmVectorEnv)
        envs.reset(seed=0)
        workers = list(envs._pool.workers)
    assert envs.closed
    assert all(p.exitcode is not None for p in workers)


# ------------------------------------------------- call, get_attr, set_attr


def test_call_get_attr_set_attr():
    envs = counting(4, env_kwargs={"tag": "t"}, num_workers=3)
    try:
        assert envs.get_attr("tag") == ("t",) * 4
        assert envs.call("tag") == ("t",) * 4  # a non-callable is returned as is
        assert envs.call("double", 3) == (6,) * 4
        assert envs.call("double", x=5) == (10,) * 4
        envs.set_attr("offset", [10, 20, 30, 40])
        assert envs.get_attr("offset") == (10, 20, 30, 40)
        envs.set_attr("offset", (1, 2, 3, 4))
        assert envs.get_attr("offset") == (1, 2, 3, 4)
        assert envs.call("double", 1) == (3, 4, 5, 6)
        envs.reset(seed=0)
        obs, *_ = envs.step(np.zeros(4, dtype=np.int64))
        assert obs[:, 0].tolist() == [2, 3, 4, 5]
        envs.set_attr("offset", 7)  # one value for every env
        assert envs.get_attr("offset") == (7,) * 4
        # Values are copies: mutating a returned object changes nothing remotely.
        spaces_ = envs.get_attr("observation_space")
        assert all(s == envs.single_observation_space for s in spaces_)
    finally:
        envs.close()


@pytest.mark.parametrize("values", [[1, 2, 3], (1, 2, 3, 4, 5), []])
def test_set_attr_wrong_length(values):
    envs = counting(4)
    try:
        with pytest.raises(
            ValueError,
            match=re.escape(
                "Values must be a list or tuple with length equal to the number of "
                f"environments. Got `{len(values)}` values for 4 environments."
            ),
        ):
            envs.set_attr("offset", values)
        envs.set_attr("offset", [0, 0, 0, 1])  # still usable
        assert envs.get_attr("offset") == (0, 0, 0, 1)
    finally:
        envs.close()


def test_call_missing_attribute_raises_and_env_survives():
    envs = counting(3)
    try:
        with pytest.raises(AttributeError):
            envs.call("no_such_attribute")
        assert envs.get_attr("offset") == (0, 0, 0)
        envs.reset(seed=0)
        obs, *_ = envs.step(np.array([1, 2, 3]))
        assert obs.tolist() == [[1, 1], [1, 2], [1, 3]]
    finally:
        envs.close()


def test_set_attr_matches_sync_wrapper_semantics():
    """set_attr sets the attribute on the layer that has it, as set_wrapper_attr does."""
    fns = test_envs.gym_fns("CartPole-v1", 2)
    envs = ShmVectorEnv(fns, context="fork", num_workers=2)
    sync = SyncVectorEnv(fns)
    try:
        for v in (envs, sync):
            v.set_attr("gravity", [1.0, 2.0])
        assert envs.get_attr("gravity") == sync.get_attr("gravity") == (1.0, 2.0)
    finally:
        envs.close()
        sync.close()


# ----------------------------------------------------------------- render


def test_render_rgb_array_counting():
    envs = counting(3, env_kwargs={"render_mode": "rgb_array"})
    try:
        assert envs.render_mode == "rgb_array"
        envs.reset(seed=0)
        envs.step(np.zeros(3, dtype=np.int64))
        frames = envs.render()
        assert isinstance(frames, tuple) and len(frames) == 3
        for frame in frames:
            assert frame.shape == (3, 5, 3) and frame.dtype == np.uint8
            assert (frame == 1).all()
    finally:
        envs.close()


def test_render_rgb_array_cartpole_equals_sync():
    fns = test_envs.gym_fns("CartPole-v1", 2, render_mode="rgb_array")
    envs = ShmVectorEnv(fns, context="fork", num_workers=2)
    sync = SyncVectorEnv(fns)
    try:
        assert envs.render_mode == sync.render_mode == "rgb_array"
        envs.reset(seed=3)
        sync.reset(seed=3)
        assert_same(envs.render(), sync.render())
    finally:
        envs.close()
        sync.close()


def test_render_without_render_mode(envs):
    envs.reset(seed=0)
    assert envs.render() == (None,) * 4


# ---------------------------------------------------------------- seeding


def _seeded_cartpole(i: int):
    env = gym.make("CartPole-v1")
    env.reset(seed=i)
    env.action_space.seed(100 + i)
    return env


def test_np_random_seed_from_make_env():
    fns = [functools.partial(_seeded_cartpole, i) for i in range(4)]
    envs = ShmVectorEnv(fns, context="fork", num_workers=2)
    sync = SyncVectorEnv(fns)
    try:
        assert envs.np_random_seed == (0, 1, 2, 3), "building the vector env must not reseed"
        gens = envs.np_random
        assert isinstance(gens, tuple) and len(gens) == 4
        assert all(isinstance(g, np.random.Generator) for g in gens)
        assert [g.random() for g in gens] == [g.random() for g in sync.np_random]
        with pytest.raises(AttributeError):
            envs.np_random = None
        # The batched action space's RNG follows the single space's seed.
        assert_same(envs.action_space.sample(), sync.action_space.sample())
        envs.reset(seed=10)
        assert envs.np_random_seed == (10, 11, 12, 13)
        envs.reset(seed=[5, 6, 7, 8])
        assert envs.np_random_seed == (5, 6, 7, 8)
    finally:
        envs.close()
        sync.close()


@pytest.mark.parametrize("seed", [[1, 2, 3], [1, 2, 3, 4, 5], []])
def test_seed_list_wrong_length(envs, seed):
    with pytest.raises(
        ValueError,
        match=re.escape(
            "If seeds are passed as a list the length must match num_envs=4 but got "
            f"length={len(seed)}."
        ),
    ):
        envs.reset(seed=seed)
    obs, _ = envs.reset(seed=[1, 2, 3, 4])  # still usable
    assert obs.shape == (4, 4)


def test_reset_passes_options():
    fns = test_envs.class_fns(test_envs.CustomSpaceEnv, 3)
    envs = ShmVectorEnv(fns, context="fork", num_workers=2)
    try:
        _, infos = envs.reset(seed=0, options={"difficulty": 2})
        assert infos["options"]["difficulty"].tolist() == [2, 2, 2]
        assert infos["_options"].all()
    finally:
        envs.close()


# ------------------------------------------------------------- reset_mask


@pytest.mark.parametrize(
    "mask,exc",
    [
        pytest.param([True, False, True, False], TypeError, id="list"),
        pytest.param(np.array([True, False, True]), ValueError, id="shape"),
        pytest.param(np.array([[True, False, True, False]]), ValueError, id="2d"),
        pytest.param(np.array([1, 0, 1, 0]), TypeError, id="dtype"),
        pytest.param(np.zeros(4, dtype=bool), ValueError, id="all-false"),
    ],
)
def test_reset_mask_errors_match_sync(envs, mask, exc):
    sync = SyncVectorEnv(test_envs.gym_fns("CartPole-v1", 4))
    try:
        with pytest.raises(exc) as expected:
            sync.reset(options={"reset_mask": copy.deepcopy(mask)})
        options = {"reset_mask": copy.deepcopy(mask), "other": 1}
        with pytest.raises(exc) as got:
            envs.reset(options=options)
        assert str(got.value) == str(expected.value)
        assert "reset_mask" not in options, "popped even when the check fails, as gymnasium does"
        obs, _ = envs.reset(seed=0)  # still usable
        assert obs.shape == (4, 4)
    finally:
        sync.close()


def test_reset_mask_exact_messages(envs):
    with pytest.raises(
        TypeError,
        match=re.escape("`options['reset_mask']` must be a numpy array, got <class 'list'>"),
    ):
        envs.reset(options={"reset_mask": [True] * 4})
    with pytest.raises(
        ValueError, match=re.escape("`options['reset_mask']` must have shape `(4,)`, got (3,)")
    ):
        envs.reset(options={"reset_mask": np.ones(3, dtype=bool)})
    with pytest.raises(
        TypeError, match=re.escape("`options['reset_mask']` must have `dtype=np.bool_`, got int64")
    ):
        envs.reset(options={"reset_mask": np.ones(4, dtype=np.int64)})
    with pytest.raises(
        ValueError,
        match=re.escape(
            "`options['reset_mask']` must contain a boolean array with at least one True "
            "value, got reset_mask=[False False False False]"
        ),
    ):
        envs.reset(options={"reset_mask": np.zeros(4, dtype=bool)})


# ------------------------------------------------------------- timeouts


def _record_calls(envs, calls: list) -> None:
    """Appends the name of each step_async/step_wait call to ``calls``."""
    for name in ("step_async", "step_wait"):
        real = getattr(envs, name)

        def recorded(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        setattr(envs, name, recorded)


@pytest.mark.parametrize("step_in_main", [False, True])
def test_step_short_path_and_its_handovers(step_in_main):
    """step() skips step_async/step_wait when the actions have the space's dtype
    and no worker has anything to say; otherwise it starts with step_async, or
    hands the started round to step_wait. (Equivalence with Sync is tested
    through step() everywhere else.)"""
    envs = counting(2, step_in_main=step_in_main)
    calls: list[str] = []
    try:
        envs.reset(seed=0)
        _record_calls(envs, calls)
        obs, *_ = envs.step(np.array([1, 2]))  # int64, as the Discrete space
        assert calls == [] and obs.tolist() == [[1, 1], [1, 2]]
        obs, *_ = envs.step([3, 0])  # a list: passed by value, the general path
        assert calls == ["step_async", "step_wait"] and obs.tolist() == [[2, 3], [2, 0]]
        calls.clear()
        envs.set_attr("delay", [0.0, 0.25])  # past LIVENESS_CHECK_S: handed over
        obs, *_ = envs.step(np.array([1, 1]))
        assert calls == ["step_wait"] and obs.tolist() == [[3, 1], [3, 1]]
    finally:
        envs.close()
    infos = ShmVectorEnv(
        test_envs.class_fns(test_envs.ScriptedInfoEnv, 2), num_workers=2, step_in_main=step_in_main
    )
    try:
        infos.set_attr("script", [[{"note": "pickled"}], [{}]])
        infos.reset(seed=0)
        _record_calls(infos, calls)
        calls.clear()
        *_, info = infos.step(np.array([0, 1]))  # a worker's message: handed over
        assert calls == ["step_wait"] and info["note"].tolist() == ["pickled", None]
    finally:
        infos.close()


def test_step_wait_timeout_then_usable():
    envs = counting(2, env_kwargs={"delay": 0.5})
    try:
        envs.reset(seed=0)
        envs.step_async(np.array([1, 2]))
        with pytest.raises(multiprocessing.TimeoutError) as info:
            envs.step_wait(timeout=0.05)
        assert type(info.value) is multiprocessing.TimeoutError
        # gymnasium's message, then which workers (and envs) had not finished.
        message = str(info.value)
        assert message.startswith("The call to `step_wait` has timed out after 0.05 second(s). ")
        assert "Not finished: worker 0 (envs 0..0, in env 0)" in message
        # The state is back to default: a new step can start, and its results
        # are its own (the timed-out step's results are not handed out).
        obs, rewards, term, trunc, _ = envs.step(np.array([3, 0]))
        assert obs.tolist() == [[2, 3], [2, 0]]
        assert rewards.tolist() == [2.0, 2.0]
        obs, rewards, *_ = envs.step(np.array([1, 1]))
        assert obs.tolist() == [[3, 1], [3, 1]]
    finally:
        envs.close()


def test_call_wait_and_reset_wait_timeout():
    envs = counting(2, env_kwargs={"delay": 0.3})
    try:
        envs.reset(seed=0)
        envs.step_async(np.array([1, 1]))
        with pytest.raises(multiprocessing.TimeoutError, match="step_wait"):
            envs.step_wait(timeout=0.01)
        # The next call waits for the unfinished round before starting its own.
        assert envs.get_attr("t") == (1, 1)
        envs.reset_async(seed=0)
        obs, _ = envs.reset_wait(timeout=10)
        assert obs.tolist() == [[0, 0], [0, 0]]
    finally:
        envs.close()


# ---------------------------------------------------------- bad actions


@pytest.mark.parametrize(
    "actions,exc",
    [
        pytest.param(np.zeros(3, dtype=np.int64), ValueError, id="too-few"),
        pytest.param(np.zeros(5, dtype=np.int64), ValueError, id="too-many"),
        pytest.param(np.zeros((4, 1), dtype=np.int64), ValueError, id="extra-dim"),
        # gymnasium: TypeError("Unable to iterate over the following elements: 1")
        pytest.param(1, TypeError, id="scalar"),
        pytest.param(np.full(4, 0.5), TypeError, id="float-for-discrete"),
        pytest.param(["a", "b", "c", "d"], TypeError, id="strings"),
    ],
)
def test_bad_actions_raise_in_main_and_env_survives(actions, exc):
    fns = test_envs.gym_fns("CartPole-v1", 4)
    envs = ShmVectorEnv(fns, context="fork", num_workers=2)
    sync = SyncVectorEnv(fns)
    try:
        assert_same(envs.reset(seed=1), sync.reset(seed=1))
        with pytest.raises(exc):
            envs.step(actions)
        good = np.array([0, 1, 1, 0])
        assert_same(envs.step(good), sync.step(good))
        assert_same(envs.step(good), sync.step(good))
    finally:
        envs.close()
        sync.close()


@pytest.mark.parametrize(
    "actions,exc",
    [
        pytest.param(np.zeros((4, 2), dtype=np.float32), ValueError, id="wrong-shape"),
        pytest.param(np.zeros(4, dtype=np.float32), ValueError, id="missing-dim"),
        pytest.param(np.zeros((3, 1), dtype=np.float32), ValueError, id="wrong-count"),
    ],
)
def test_bad_box_actions(actions, exc):
    fns = test_envs.gym_fns("Pendulum-v1", 4)
    envs = ShmVectorEnv(fns, context="fork", num_workers=2)
    sync = SyncVectorEnv(fns)
    try:
        assert_same(envs.reset(seed=1), sync.reset(seed=1))
        with pytest.raises(exc):
            envs.step(actions)
        good = np.full((4, 1), 0.5, dtype=np.float32)
        assert_same(envs.step(good), sync.step(good))
    finally:
        envs.close()
        sync.close()


def test_bad_dict_actions():
    fns = test_envs.class_fns(test_envs.CustomSpaceEnv, 3)
    envs = ShmVectorEnv(fns, context="fork", num_workers=2)
    sync = SyncVectorEnv(fns)
    try:
        assert_same(envs.reset(seed=2), sync.reset(seed=2))
        with pytest.raises(ValueError):
            envs.step({"move": np.zeros(2, dtype=np.int64), "force": np.zeros((2, 2), np.float32)})
        with pytest.raises((KeyError, ValueError, TypeError)):
            envs.step({"move": np.zeros(3, dtype=np.int64)})
        good = {"move": np.array([0, 1, 2]), "force": np.full((3, 2), 0.25, np.float32)}
        assert_same(envs.step(good), sync.step(good))
    finally:
        envs.close()
        sync.close()


@pytest.mark.parametrize(
    "kind,actions",
    [
        pytest.param("discrete", np.array([0, 3, 1]), id="discrete-ndarray"),
        pytest.param("discrete", [0, 3, 1], id="discrete-list"),
        pytest.param("box", np.array([[0.5, -0.5], [0, 1], [1, 1]], np.float32), id="box"),
        pytest.param("text", ("x", "yy", "zxz"), id="text"),
    ],
)
def test_actions_reach_envs_as_in_sync(kind, actions):
    """Each env receives exactly the element iterate() produced: same type,
    dtype and value as under SyncVectorEnv (contract item 31)."""
    fns = test_envs.class_fns(test_envs.ActionTypeEnv, 3, kind=kind)
    envs = ShmVectorEnv(fns, context="fork", num_workers=2)
    sync = SyncVectorEnv(fns)
    try:
        envs.reset(seed=0)
        sync.reset(seed=0)
        envs.step(actions)
        sync.step(actions)
        assert envs.get_attr("seen") == sync.get_attr("seen")
    finally:
        envs.close()
        sync.close()


def test_python_list_actions(envs):
    sync = SyncVectorEnv(test_envs.gym_fns("CartPole-v1", 4))
    try:
        assert_same(envs.reset(seed=4), sync.reset(seed=4))
        assert_same(envs.step([0, 1, 0, 1]), sync.step([0, 1, 0, 1]))
    finally:
        sync.close()


# ---------------------------------------------------------------- copy


@pytest.mark.parametrize("ring_depth", [2, 3, 4])
def test_copy_false_views_stay_valid_for_ring_depth_minus_one_steps(ring_depth):
    envs = counting(2, copy=False, ring_depth=ring_depth)
    try:
        envs.reset(seed=0)
        a = np.array([1, 2])
        obs, rewards, term, trunc, _ = envs.step(a)
        kept = (obs.copy(), rewards.copy(), term.copy(), trunc.copy())
        assert obs.tolist() == [[1, 1], [1, 2]]
        later = []
        for k in range(ring_depth - 1):
            later.append(envs.step(a)[0])
            assert later[-1][:, 0].tolist() == [k + 2, k + 2]
            assert_same(obs, kept[0], f"obs after {k + 1} further steps")
            assert_same(rewards, kept[1], f"rewards after {k + 1} further steps")
            assert_same(term, kept[2])
            assert_same(trunc, kept[3])
        # copy=False hands out views of the ring, not copies.
        assert not obs.flags.owndata
        # ring_depth further steps later, the slot has been reused.
        envs.step(a)
        assert obs[:, 0].tolist() == [ring_depth + 1] * 2
    finally:
        envs.close()


def test_copy_false_reset_obs_is_a_view_too():
    envs = counting(2, copy=False, ring_depth=2)
    try:
        obs, _ = envs.reset(seed=0)
        kept = obs.copy()
        envs.step(np.array([1, 1]))
        assert_same(obs, kept)
    finally:
        envs.close()


def test_copy_true_returns_independent_arrays():
    envs = counting(2, copy=True, ring_depth=2)
    try:
        obs0, _ = envs.reset(seed=0)
        obs1, rewards1, *_ = envs.step(np.array([1, 1]))
        obs1_kept = obs1.copy()
        obs1[:] = -1  # writing into a returned array changes nothing inside
        rewards1[:] = -1
        for _ in range(3):
            obs, *_ = envs.step(np.array([2, 2]))
        assert obs0.tolist() == [[0, 0], [0, 0]]
        assert obs1_kept.tolist() == [[1, 1], [1, 1]]
        assert obs.tolist() == [[4, 2], [4, 2]]
        assert not np.shares_memory(obs1, obs)
        assert not np.shares_memory(obs0, obs)
    finally:
        envs.close()


def _leased(array) -> bool:
    return type(array.base).__name__ == "RegionLease"


def test_copy_true_large_observations_are_lent_not_copied():
    """Observations of 64 KiB a round or more (shmvec.layout.lease_regions) are
    handed over in lease regions instead of copies. Each batch stays what step
    returned for as long as it (or a view of it) is held; with more batches
    held than there are regions, the others are copies; a region serves again
    once its arrays are gone, and outlives close() while one is held."""
    envs = counting(4, env_kwargs={"obs_len": 2048}, copy=True)
    a = np.arange(4)
    try:
        assert envs._decoder.leases is not None
        held = [envs.reset(seed=0)[0]]
        for _ in range(8):
            held.append(envs.step(a)[0])
        kept = [obs.copy() for obs in held]
        assert [_leased(obs) for obs in held] == [True] * LEASE_REGIONS + [False] * (
            len(held) - LEASE_REGIONS
        )
        for t, obs in enumerate(held):
            assert obs[:, 0].tolist() == [t] * 4
            assert obs[:, 1].tolist() == ([0] * 4 if t == 0 else a.tolist())
        obs = held[3]
        obs[:] = -1  # the caller's own array: writing to it changes nothing inside
        for t in range(len(held), len(held) + 6):
            later = envs.step(a)[0]
            assert not np.shares_memory(later, obs)
            assert later[:, 0].tolist() == [t] * 4
        for obs, expected in zip(held[:3], kept):
            assert_same(obs, expected)
        view, expected_view = held[1][2], kept[1][2]
        del held, obs, later  # every region but view's comes back
        lent = [envs.step(a)[0] for _ in range(LEASE_REGIONS - 1)]
        assert all(_leased(obs) for obs in lent)
        assert not _leased(envs.step(a)[0]), "view still holds the last region"
        # A device bridge pins the ring (it reads it with copy=False), not the regions.
        address, size = envs.handoff().region
        layout = envs._pool.layout
        assert size == layout.ring_end <= layout.region_offsets[0][0] < envs._pool.segment.size
    finally:
        envs.close()
    assert_same(view, expected_view)


def test_same_step_final_obs_is_a_private_writable_copy():
    """final_obs never aliases the ring (item 34) and is a writable object array."""
    envs = counting(
        2, env_kwargs={"episode_len": 2}, copy=False, ring_depth=2, autoreset_mode="SameStep"
    )
    try:
        envs.reset(seed=0)
        envs.step(np.array([1, 1]))
        obs, _, term, _, infos = envs.step(np.array([2, 3]))
        assert term.all()
        final = infos["final_obs"]
        assert final.dtype == object and final.shape == (2,) and final.flags.writeable
        assert infos["_final_obs"].tolist() == [True, True]
        assert [f.tolist() for f in final] == [[2, 2], [2, 3]]
        assert obs.tolist() == [[0, 0], [0, 0]], "the returned obs is the reset obs"
        for _ in range(3):
            envs.step(np.array([1, 1]))
        assert [f.tolist() for f in final] == [[2, 2], [2, 3]]
        final[0] = None  # VectorizeTransformObservation rewrites elements in place
    finally:
        envs.close()


# ------------------------------------------------------------- make_vec


def test_make_vec():
    envs = shmvec.make_vec(
        "CartPole-v1",
        4,
        vector_kwargs={"num_workers": 2, "autoreset_mode": "SameStep", "context": "fork"},
    )
    sync = gym.make_vec(
        "CartPole-v1", 4, vectorization_mode="sync",
        vector_kwargs={"autoreset_mode": AutoresetMode.SAME_STEP},
    )  # fmt: skip
    try:
        assert isinstance(envs, ShmVectorEnv)
        assert envs.num_envs == 4 and envs.num_workers == 2
        assert envs.spec is not None and envs.spec.id == "CartPole-v1"
        assert envs.unwrapped.spec is envs.spec
        assert repr(envs) == "ShmVectorEnv(CartPole-v1, num_envs=4)"
        assert envs.metadata["autoreset_mode"] is AutoresetMode.SAME_STEP
        assert envs.observation_space == sync.observation_space
        assert_same(envs.reset(seed=3), sync.reset(seed=3))
        actions = copy.deepcopy(sync.action_space)
        actions.seed(0)
        for _ in range(40):
            a = actions.sample()
            assert_same(envs.step(a), sync.step(a))
    finally:
        envs.close()
        sync.close()


def test_make_vec_with_env_kwargs_and_wrappers():
    envs = shmvec.make_vec(
        "CartPole-v1",
        2,
        vector_kwargs={"context": "fork"},
        wrappers=[gym.wrappers.RecordEpisodeStatistics],
        max_episode_steps=5,
    )
    try:
        envs.reset(seed=0)
        for _ in range(4):
            _, _, term, trunc, infos = envs.step(np.array([0, 1]))
            assert not trunc.any()
        _, _, term, trunc, infos = envs.step(np.array([0, 1]))
        assert (term | trunc).all()
        assert infos["episode"]["l"][infos["_episode"]].tolist() == [5] * int(
            infos["_episode"].sum()
        )
    finally:
        envs.close()


def test_make_vec_rebuilds_from_its_spec():
    """make_vec(envs.spec) builds an equivalent vector env (contract item 18)."""
    envs = shmvec.make_vec("CartPole-v1", 3, vector_kwargs={"num_workers": 2, "context": "fork"})
    try:
        again = shmvec.make_vec(envs.spec)
        try:
            assert isinstance(again, ShmVectorEnv)
            assert again.num_envs == 3 and again.num_workers == 2
            assert again.spec.id == "CartPole-v1"
            assert_same(again.reset(seed=1), envs.reset(seed=1))
        finally:
            again.close()
    finally:
        envs.close()


def test_make_vec_invalid_num_envs():
    with pytest.raises(ValueError):
        shmvec.make_vec("CartPole-v1", 0)


# ------------------------------------------------------ vector wrappers


def _wrapped_pair(wrap, n=4, autoreset_mode=AutoresetMode.NEXT_STEP, env="CartPole-v1"):
    fns = test_envs.gym_fns(env, n, **({"max_episode_steps": 12} if env != "CartPole-v1" else {}))
    shm = ShmVectorEnv(fns, context="fork", num_workers=2, autoreset_mode=autoreset_mode)
    sync = SyncVectorEnv(fns, autoreset_mode=autoreset_mode)
    return wrap(shm), wrap(sync)


_vw = gym.wrappers.vector
WRAPPERS = [
    pytest.param(_vw.RecordEpisodeStatistics, "CartPole-v1", id="RecordEpisodeStatistics"),
    pytest.param(_vw.NormalizeObservation, "CartPole-v1", id="NormalizeObservation"),
    pytest.param(lambda e: _vw.ClipReward(e, -0.5, 0.5), "Pendulum-v1", id="ClipReward"),
    pytest.param(_vw.DictInfoToList, "Taxi-v4", id="DictInfoToList"),
    pytest.param(
        lambda e: _vw.DictInfoToList(_vw.RecordEpisodeStatistics(e)),
        "CartPole-v1",
        id="DictInfoToList+RecordEpisodeStatistics",
    ),
]


def _without_wall_time(result):
    """RecordEpisodeStatistics' ``episode["t"]`` is wall-clock time: not comparable."""
    infos = result[-1]
    for info in infos if isinstance(infos, list) else [infos]:
        if "episode" in info:
            info["episode"] = {k: v for k, v in info["episode"].items() if k != "t"}
            info.pop("_episode_t", None)
    return result


@pytest.mark.parametrize("wrap,env_id", WRAPPERS)
def test_vector_wrappers_match_sync(wrap, env_id):
    shm, sync = _wrapped_pair(wrap, env=env_id)
    try:
        assert shm.observation_space == sync.observation_space
        assert_same(shm.reset(seed=8), sync.reset(seed=8))
        actions = copy.deepcopy(sync.action_space)
        actions.seed(8)
        ends = 0
        for t in range(50):
            a = actions.sample()
            result_shm = _without_wall_time(shm.step(a))
            result_sync = _without_wall_time(sync.step(a))
            assert_same(result_shm, result_sync, f"step {t}")
            ends += int((result_shm[2] | result_shm[3]).sum())
        assert ends > 0
    finally:
        shm.close()
        sync.close()


def test_record_episode_statistics_same_step():
    wrap = gym.wrappers.vector.RecordEpisodeStatistics
    shm, sync = _wrapped_pair(wrap, autoreset_mode=AutoresetMode.SAME_STEP)
    try:
        assert_same(shm.reset(seed=2), sync.reset(seed=2))
        saw_episode = False
        for t in range(60):
            a = np.array([t % 2, 1, 0, (t // 3) % 2])
            r_shm = _without_wall_time(shm.step(a))
            r_sync = _without_wall_time(sync.step(a))
            assert_same(r_shm, r_sync, f"step {t}")
            saw_episode |= "episode" in r_shm[4]
        assert saw_episode
    finally:
        shm.close()
        sync.close()


def test_normalize_observation_rejects_same_step():
    fns = test_envs.gym_fns("CartPole-v1", 2)
    shm = ShmVectorEnv(fns, context="fork", autoreset_mode=AutoresetMode.SAME_STEP)
    try:
        with pytest.raises(ValueError):
            gym.wrappers.vector.NormalizeObservation(shm)
    finally:
        shm.close()


def test_discrete_observation_space_batched_like_sync():
    """FrozenLake: Discrete observations batch to int64 arrays of shape (n,)."""
    fns = test_envs.gym_fns("FrozenLake-v1", 3)
    envs = ShmVectorEnv(fns, context="fork", num_workers=3)
    try:
        obs, _ = envs.reset(seed=0)
        assert obs.shape == (3,) and obs.dtype == np.int64
        assert isinstance(envs.observation_space, gym.spaces.MultiDiscrete)
        assert envs.single_observation_space == Discrete(16)
    finally:
        envs.close()


@pytest.mark.parametrize(
    "space,actions",
    [
        pytest.param(gym.spaces.Box(0, 1, (), np.float32), np.array([0.25, 0.5]), id="f64-to-f32"),
        pytest.param(gym.spaces.Discrete(3), [0, 2], id="list"),
        pytest.param(gym.spaces.Box(0, 1, (2,), np.float32), [[0.5, 0.25], [1.0, 0.0]], id="lists"),
    ],
)
def test_actions_reach_envs_by_value_as_in_gymnasium(space, actions):
    """Contract item 31: each env gets the element iterating the batch gives."""
    fns = [lambda: test_envs.ActionRecorderEnv(space)] * 2
    shm = ShmVectorEnv(fns, num_workers=2)
    reference = gym.vector.AsyncVectorEnv(fns)
    try:
        shm.reset(seed=0)
        reference.reset(seed=0)
        shm.step(actions)
        reference.step(actions)
        assert shm.get_attr("received") == reference.get_attr("received")
    finally:
        shm.close()
        reference.close()


def test_logger_reports_worker_start_and_exit(caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="shmvec"):
        envs = ShmVectorEnv(test_envs.gym_fns("CartPole-v1", 4), num_workers=2)
        envs.close()
    messages = [r.getMessage() for r in caplog.records if r.name == "shmvec"]
    assert any(m.startswith("started worker 0 (pid") and "envs 0..1" in m for m in messages)
    assert any(m.startswith("started worker 1 (pid") and "envs 2..3" in m for m in messages)
    assert sum("exited with 0" in m for m in messages) == 2


def test_logger_is_silent_by_default():
    import logging

    assert any(isinstance(h, logging.NullHandler) for h in logging.getLogger("shmvec").handlers)


class PidRecorder(gym.Wrapper):
    """Puts the pid of the process that stepped the env into the info."""

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        return obs, reward, terminated, truncated, {**info, "pid": os.getpid()}

    def fail_if_boom(self):
        if getattr(self, "boom", False):
            raise RuntimeError("boom")


@pytest.mark.parametrize("mode", ["NextStep", "SameStep", "Disabled"])
def test_num_workers_0_runs_in_process_with_sync_results(mode):
    fns = [lambda: PidRecorder(gym.make("CartPole-v1"))] * 3
    envs = ShmVectorEnv(fns, num_workers=0, autoreset_mode=mode)
    sync = SyncVectorEnv(fns, autoreset_mode=mode)
    try:
        assert envs.in_process
        assert_same(envs.reset(seed=4), sync.reset(seed=4))
        for t in range(120):
            actions = np.array([t % 2, 1, 0])
            got, want = envs.step(actions), sync.step(actions)
            assert_same(got, want)
            if "pid" in got[4]:  # autoreset rows carry the reset info instead
                reported = got[4]["_pid"]
                assert reported.any() and (got[4]["pid"][reported] == os.getpid()).all()
            if mode == "Disabled" and (want[2] | want[3]).any():
                mask = want[2] | want[3]
                assert_same(
                    envs.reset(options={"reset_mask": mask.copy()}),
                    sync.reset(options={"reset_mask": mask.copy()}),
                )
        assert envs.get_attr("spec")[0].id == "CartPole-v1"
    finally:
        envs.close()
        sync.close()
    assert envs.closed


def test_step_in_main_steps_block_0_in_the_main_process():
    fns = [lambda: PidRecorder(gym.make("CartPole-v1"))] * 4
    envs = ShmVectorEnv(fns, num_workers=2, step_in_main=True)
    try:
        assert envs.step_in_main and not envs.in_process
        assert [p.pid == os.getpid() for p in envs._pool.workers] == [True, False]
        envs.reset(seed=0)
        envs.step_async(np.zeros(4, dtype=np.int64))
        pids = envs.step_wait()[4]["pid"]
        assert (pids[:2] == os.getpid()).all() and (pids[2:] != os.getpid()).all()
        # An error in a main-process env comes back like a worker's, naming the env.
        envs.set_attr("boom", [True, False, False, False])
        envs.call_async("fail_if_boom")
        with pytest.raises(RuntimeError, match="boom") as error:
            envs.call_wait()
        assert "raised by env 0 in shmvec worker 0" in "\n".join(error.value.__notes__)
        assert envs.step(np.ones(4, dtype=np.int64))[0].shape == (4, 4)
        busy = envs.stats()["worker_busy_fraction"]
        assert len(busy) == 2 and busy[0] > 0
        workers = list(envs._pool.workers)
    finally:
        envs.close()
    assert [p.exitcode for p in workers] == [0, 0]


def test_num_workers_0_reraises_env_errors_and_recovers():
    envs = ShmVectorEnv(test_envs.gym_fns("CartPole-v1", 2), num_workers=0)
    envs.reset(seed=0)
    with pytest.raises(TypeError, match="Unable to iterate"):
        envs.step(1)
    envs.set_attr("boom", 1)
    assert envs.get_attr("boom") == (1, 1)
    obs, *_ = envs.step(np.zeros(2, dtype=np.int64))
    assert obs.shape == (2, 4)
    envs.close()


class SleepsWhenTold(gym.Wrapper):
    """Sleeps ``delay`` seconds per step once ``delay`` is set (with set_attr)."""

    delay = 0.0

    def step(self, action):
        time.sleep(self.delay)
        return self.env.step(action)


def test_step_timeout_names_the_worker_and_env_that_did_not_finish():
    envs = ShmVectorEnv([lambda: SleepsWhenTold(gym.make("CartPole-v1"))] * 4, num_workers=2)
    try:
        envs.reset(seed=0)
        envs.set_attr("delay", [0.0, 0.0, 0.0, 1.0])
        envs.step_async(np.zeros(4, dtype=np.int64))
        with pytest.raises(multiprocessing.TimeoutError) as error:
            envs.step_wait(timeout=0.2)
        message = str(error.value)
        assert message.startswith("The call to `step_wait` has timed out after 0.2 second(s).")
        assert "worker 1 (envs 2..3, in env 3)" in message and "worker 0" not in message
        envs.set_attr("delay", 0.0)  # waits for the late round, then goes on
        obs, *_ = envs.step(np.zeros(4, dtype=np.int64))
        assert obs.shape == (4, 4)
    finally:
        envs.close()


class TooLongText(gym.Env):
    """Its observations break its own Text space once ``overflow`` is set."""

    observation_space = gym.spaces.Text(max_length=3, charset="abcd")
    action_space = gym.spaces.Discrete(2)
    overflow = False

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return "abc", {}

    def step(self, action):
        return ("abcd" if self.overflow else "ab"), 0.0, False, False, {}


def test_text_longer_than_its_space_is_an_error_naming_the_env():
    envs = ShmVectorEnv([TooLongText] * 2, num_workers=2)
    try:
        assert envs.reset(seed=0)[0] == ("abc", "abc")
        envs.set_attr("overflow", [False, True])
        with pytest.raises(ValueError, match="'abcd' is longer than its space's max_length=3") as e:
            envs.step(np.zeros(2, dtype=np.int64))
        assert "raised by env 1" in "\n".join(getattr(e.value, "__notes__", []))
        envs.set_attr("overflow", False)
        assert envs.step(np.zeros(2, dtype=np.int64))[0] == ("ab", "ab")
    finally:
        envs.close()


# ------------------------------------------------------------- validate_actions


def test_validate_actions_names_the_envs_before_any_env_steps():
    fns = [lambda: gym.make("MountainCarContinuous-v0")] * 4  # Box(-1, 1, (1,), float32)
    envs = ShmVectorEnv(fns, num_workers=2, validate_actions=True)
    try:
        envs.reset(seed=0)
        before = envs.get_attr("state")
        actions = np.array([[0.5], [np.nan], [0.0], [3.0]])  # float64 is fine, NaN/3 are not
        with pytest.raises(ValueError, match=r"outside the action space Box.*env 1: .*nan.*env 3"):
            envs.step(actions)
        assert all(np.array_equal(a, b) for a, b in zip(envs.get_attr("state"), before))
        obs = envs.step(np.zeros((4, 1)))[0]  # in bounds: steps
        assert obs.shape == (4, 2)
    finally:
        envs.close()


def test_validate_actions_discrete_and_async_send():
    envs = ShmVectorEnv(
        test_envs.gym_fns("CartPole-v1", 4), num_workers=2, batch_size=2, validate_actions=True
    )
    try:
        envs.async_reset(seed=0)
        ids = envs.recv()[4]["env_id"]
        with pytest.raises(ValueError, match=rf"env {ids[1]}: .*2"):
            envs.send(np.array([1, 2]), ids)
        envs.send(np.array([1, 0]), ids)  # still awaiting: nothing was sent
        assert envs.recv()[0].shape == (2, 4)
    finally:
        envs.close()


@pytest.mark.filterwarnings("ignore::UserWarning")  # the env checker sees the NaN
def test_without_validate_actions_out_of_bounds_reach_the_env_as_in_gymnasium():
    fns = [lambda: gym.make("MountainCarContinuous-v0")] * 2
    envs, sync = ShmVectorEnv(fns, num_workers=2), SyncVectorEnv(fns)
    try:
        assert_same(envs.reset(seed=1), sync.reset(seed=1))
        actions = np.array([[np.nan], [5.0]], dtype=np.float32)
        assert_same(envs.step(actions), sync.step(actions))
    finally:
        envs.close()
        sync.close()
