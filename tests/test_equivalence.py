"""ShmVectorEnv equals gymnasium's SyncVectorEnv bit for bit.

Same env_fns, same seeds, same actions: observations, rewards, terminations,
truncations (values and dtypes) and infos (recursively, ``_key`` masks,
``final_obs`` object arrays and nested ``final_info`` included) must be
identical at every step, in every autoreset mode, for every worker layout,
with ``copy`` and ``shared_memory`` on and off, under fork and spawn.
"""

from __future__ import annotations

import copy
from contextlib import closing

import envs as test_envs
import numpy as np
import pytest
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from helpers import assert_same
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shmvec.layout
from shmvec import ShmVectorEnv

pytestmark = pytest.mark.timeout(120)

MODES = [
    pytest.param(AutoresetMode.NEXT_STEP, id="next_step"),
    pytest.param(AutoresetMode.SAME_STEP, id="same_step"),
    pytest.param(AutoresetMode.DISABLED, id="disabled"),
]

# (num_workers, num_envs, copy, shared_memory, seed kind)
LAYOUTS = [
    pytest.param(1, 3, True, True, "int", id="w1-n3-copy-shm"),
    pytest.param(2, 4, False, True, "list", id="w2-n4-view-shm"),
    pytest.param(3, 7, True, False, "list", id="w3-n7-copy-pickled"),
    pytest.param(3, 6, False, False, "int", id="w3-n6-view-pickled"),
]


def seeds_for(kind: str, num_envs: int, base: int = 11):
    if kind == "int":
        return base
    return [base * 7 + 13 * i for i in range(num_envs)]


def assert_step_same(shm_result, sync_result, where: str) -> None:
    obs_b, rew_b, term_b, trunc_b, info_b = shm_result
    obs_a, rew_a, term_a, trunc_a, info_a = sync_result
    for name, value in (("rewards", rew_b), ("terminations", term_b), ("truncations", trunc_b)):
        assert isinstance(value, np.ndarray), f"{where}: {name} is {type(value)}"
    assert rew_b.dtype == np.float64, f"{where}: rewards dtype {rew_b.dtype}"
    assert term_b.dtype == np.bool_, f"{where}: terminations dtype {term_b.dtype}"
    assert trunc_b.dtype == np.bool_, f"{where}: truncations dtype {trunc_b.dtype}"
    assert_same(obs_b, obs_a, f"{where} obs")
    assert_same(rew_b, rew_a, f"{where} rewards")
    assert_same(term_b, term_a, f"{where} terminations")
    assert_same(trunc_b, trunc_a, f"{where} truncations")
    assert_same(info_b, info_a, f"{where} infos")


def run_equivalence(
    make_fns,
    num_envs: int,
    autoreset_mode: AutoresetMode,
    *,
    steps: int = 40,
    seed=11,
    partial_reset_at: int | None = 17,
    sample_actions=None,
    **shm_kwargs,
) -> dict:
    """Steps Sync and Shm side by side and compares every result.

    ``sample_actions(t)``: the batch of actions of step ``t`` (default: samples
    of the batched action space).

    In DISABLED mode the envs that ended are reset with a ``reset_mask`` in
    both (SyncVectorEnv refuses to step them otherwise). At step
    ``partial_reset_at`` a masked reset with per-env seeds and extra options
    is done in both. Returns counters that show the run was not vacuous.
    """
    sync = SyncVectorEnv(make_fns(num_envs), autoreset_mode=autoreset_mode)
    shm = ShmVectorEnv(make_fns(num_envs), autoreset_mode=autoreset_mode, **shm_kwargs)
    stats = {"ended": 0, "masked_resets": 0, "info_steps": 0}
    try:
        assert shm.num_envs == sync.num_envs == num_envs
        assert shm.single_observation_space == sync.single_observation_space
        assert shm.observation_space == sync.observation_space
        assert shm.single_action_space == sync.single_action_space
        assert shm.action_space == sync.action_space
        assert shm.metadata["autoreset_mode"] is autoreset_mode

        obs_b, info_b = shm.reset(seed=seed)
        obs_a, info_a = sync.reset(seed=seed)
        assert_same(obs_b, obs_a, "reset obs")
        assert_same(info_b, info_a, "reset infos")
        assert obs_b in shm.observation_space

        action_space = copy.deepcopy(sync.action_space)
        action_space.seed(1234)
        rng = np.random.default_rng(99)
        ended = np.zeros(num_envs, dtype=bool)
        for t in range(steps):
            mask = None
            seeds = None
            if autoreset_mode == AutoresetMode.DISABLED and ended.any():
                mask = ended.copy()
            elif t == partial_reset_at:
                mask = rng.integers(0, 2, num_envs).astype(bool)
                mask[rng.integers(0, num_envs)] = True
                mask[rng.integers(0, num_envs)] = False
                if mask.all() or not mask.any():
                    mask = np.arange(num_envs) % 2 == 0
                seeds = [1000 + t * 10 + i for i in range(num_envs)]
            if mask is not None:
                before = copy.deepcopy(obs_b)
                obs_b, info_b = shm.reset(seed=seeds, options={"reset_mask": mask.copy(), "lvl": t})
                obs_a, info_a = sync.reset(
                    seed=seeds, options={"reset_mask": mask.copy(), "lvl": t}
                )
                assert_same(obs_b, obs_a, f"masked reset at step {t} obs")
                assert_same(info_b, info_a, f"masked reset at step {t} infos")
                _assert_rows_kept(
                    shm.single_observation_space, obs_b, before, ~mask, f"masked reset at step {t}"
                )
                stats["masked_resets"] += 1
                ended[mask] = False

            actions = action_space.sample() if sample_actions is None else sample_actions(t)
            result_b = shm.step(actions)
            result_a = sync.step(actions)
            assert_step_same(result_b, result_a, f"step {t}")
            obs_b = result_b[0]
            ended = result_b[2] | result_b[3]
            stats["ended"] += int(ended.sum())
            stats["info_steps"] += bool(result_b[4])
    finally:
        shm.close()
        sync.close()
    return stats


def _assert_rows_kept(space, obs, before, keep: np.ndarray, where: str) -> None:
    """Rows ``keep`` of the batched ``obs`` (of single space ``space``) equal ``before``'s."""
    if isinstance(space, spaces.Dict):
        for key, sub in space.spaces.items():
            _assert_rows_kept(sub, obs[key], before[key], keep, f"{where}[{key!r}]")
    elif isinstance(space, spaces.Tuple):
        for i, sub in enumerate(space.spaces):
            _assert_rows_kept(sub, obs[i], before[i], keep, f"{where}[{i}]")
    elif isinstance(obs, np.ndarray):
        assert np.array_equal(obs[keep], before[keep]), f"{where}: rows {np.flatnonzero(keep)}"
    else:  # Text, Graph, Sequence: a tuple of per-env values
        assert len(obs) == len(keep)
        for i in np.flatnonzero(keep):
            assert_same(obs[i], before[i], f"{where}[{i}]")


# ------------------------------------------------------------ fork, all envs


@pytest.mark.parametrize("num_workers,num_envs,copy_,shared_memory,seed_kind", LAYOUTS)
@pytest.mark.parametrize("autoreset_mode", MODES)
@pytest.mark.parametrize("env_name", list(test_envs.ENV_CASES))
def test_equivalence_fork(
    env_name, autoreset_mode, num_workers, num_envs, copy_, shared_memory, seed_kind
):
    stats = run_equivalence(
        test_envs.ENV_CASES[env_name],
        num_envs,
        autoreset_mode,
        seed=seeds_for(seed_kind, num_envs),
        num_workers=num_workers,
        copy=copy_,
        shared_memory=shared_memory,
        context="fork",
    )
    assert stats["masked_resets"] >= 1


@pytest.mark.parametrize("copy_", [True, False], ids=["copy", "view"])
@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "pickled"])
@pytest.mark.parametrize("num_workers,num_envs", [(1, 2), (2, 6), (3, 9)])
@pytest.mark.parametrize("autoreset_mode", MODES)
def test_custom_env_all_layouts(autoreset_mode, num_workers, num_envs, shared_memory, copy_):
    """The custom env (every fixed-size leaf kind, varying infos) in every layout."""
    stats = run_equivalence(
        test_envs.ENV_CASES["CustomSpaceEnv"],
        num_envs,
        autoreset_mode,
        steps=50,
        seed=seeds_for("list" if copy_ else "int", num_envs),
        num_workers=num_workers,
        copy=copy_,
        shared_memory=shared_memory,
        context="fork",
    )
    # The run must have crossed episode ends and produced infos.
    assert stats["ended"] > 0
    assert stats["info_steps"] > 0


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "pickled"])
@pytest.mark.parametrize("num_workers,num_envs", [(2, 6), (3, 9)])
@pytest.mark.parametrize("autoreset_mode", MODES)
def test_custom_env_step_in_main(autoreset_mode, num_workers, num_envs, shared_memory):
    """The main process steps block 0, worker processes the others: same results."""
    stats = run_equivalence(
        test_envs.ENV_CASES["CustomSpaceEnv"],
        num_envs,
        autoreset_mode,
        steps=50,
        num_workers=num_workers,
        shared_memory=shared_memory,
        step_in_main=True,
    )
    assert stats["ended"] > 0
    assert stats["info_steps"] > 0


@pytest.mark.parametrize("layout", ["c", "fortran", "strided", "float64", "list"])
@pytest.mark.parametrize("step_in_main", [False, True])
def test_observation_memory_layouts(layout, step_in_main):
    """Observations not C-contiguous, or of another dtype, reach the ring row as
    numpy would store them (the contiguous ones are copied with one memcpy)."""
    stats = run_equivalence(
        lambda n: test_envs.class_fns(test_envs.ObsLayoutEnv, n, layout=layout),
        4,
        AutoresetMode.NEXT_STEP,
        steps=20,
        num_workers=2,
        step_in_main=step_in_main,
    )
    assert stats["ended"] > 0


@pytest.mark.parametrize("ring_depth", [2, 3, 5])
def test_custom_env_ring_depths(ring_depth):
    run_equivalence(
        test_envs.ENV_CASES["CustomSpaceEnv"],
        5,
        AutoresetMode.NEXT_STEP,
        steps=30,
        num_workers=2,
        copy=False,
        ring_depth=ring_depth,
        context="fork",
    )


@pytest.mark.parametrize("spin_ns", [0, 20_000])
def test_spin_settings_do_not_change_results(spin_ns):
    run_equivalence(
        test_envs.ENV_CASES["CartPole-v1"],
        4,
        AutoresetMode.SAME_STEP,
        steps=60,
        num_workers=2,
        spin_ns=spin_ns,
        context="fork",
    )


@pytest.mark.parametrize("autoreset_mode", MODES)
def test_pinned_workers_do_not_change_results(autoreset_mode):
    # More workers than CPUs here: round robin, two workers to a CPU.
    run_equivalence(
        test_envs.ENV_CASES["CartPole-v1"],
        8,
        autoreset_mode,
        steps=120,
        num_workers=4,
        pin_workers=True,
        context="fork",
    )


@pytest.fixture
def lease_any_obs(monkeypatch):
    """Lease regions (shmvec/engine/leases.py) for the small observations here too."""
    monkeypatch.setattr(shmvec.layout, "LEASE_MIN_BYTES", 1)


@pytest.mark.parametrize(
    "context,step_in_main", [("fork", False), ("fork", True), ("spawn", False)]
)
@pytest.mark.parametrize("autoreset_mode", MODES)
def test_leased_observations_equal_sync(lease_any_obs, autoreset_mode, context, step_in_main):
    """copy=True observations handed over in lease regions (every leaf kind,
    masked resets, DISABLED's resets) equal SyncVectorEnv's."""
    env = ShmVectorEnv(test_envs.ENV_CASES["CustomSpaceEnv"](2), num_workers=2, context="fork")
    with closing(env):
        assert env._decoder.leases is not None, "the fixture must give this env lease regions"
    stats = run_equivalence(
        test_envs.ENV_CASES["CustomSpaceEnv"],
        6,
        autoreset_mode,
        steps=50,
        num_workers=3,
        context=context,
        step_in_main=step_in_main,
    )
    assert stats["ended"] > 0
    assert stats["masked_resets"] >= 1


# ------------------------------------------------------ spawn / forkserver


@pytest.mark.parametrize("autoreset_mode", MODES)
def test_custom_env_spawn(autoreset_mode):
    run_equivalence(
        test_envs.ENV_CASES["CustomSpaceEnv"],
        4,
        autoreset_mode,
        steps=30,
        num_workers=2,
        context="spawn",
    )


def test_cartpole_spawn_pickled_observations():
    run_equivalence(
        test_envs.ENV_CASES["CartPole-v1"],
        3,
        AutoresetMode.NEXT_STEP,
        steps=40,
        num_workers=3,
        shared_memory=False,
        copy=False,
        context="spawn",
    )


def test_blackjack_forkserver():
    run_equivalence(
        test_envs.ENV_CASES["Blackjack-v1"],
        4,
        AutoresetMode.SAME_STEP,
        steps=30,
        num_workers=2,
        context="forkserver",
    )


def test_lambda_env_fns_spawn():
    """Closures over local variables must work with spawn (cloudpickle)."""
    import gymnasium as gym

    env_id = "CartPole-v1"
    run_equivalence(
        lambda n: [lambda: gym.make(env_id) for _ in range(n)],
        3,
        AutoresetMode.NEXT_STEP,
        steps=25,
        num_workers=2,
        context="spawn",
    )


# --------------------------------------------- spaces without a fixed size


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "pickled"])
@pytest.mark.parametrize("autoreset_mode", MODES)
@pytest.mark.parametrize(
    "env_cls",
    [test_envs.GraphEnv, test_envs.SequenceEnv, test_envs.OneOfEnv, test_envs.WordEnv],
    ids=["graph", "sequence", "oneof", "custom-space"],
)
def test_dynamic_spaces_equal_sync(env_cls, autoreset_mode, shared_memory):
    """Spaces without a fixed size travel pickled and still equal Sync (Graph,
    Sequence inside a Dict, OneOf, and an unregistered custom Space that is
    also the action space: string actions)."""
    stats = run_equivalence(
        lambda n: test_envs.class_fns(env_cls, n),
        5,
        autoreset_mode,
        steps=30,
        num_workers=2,
        shared_memory=shared_memory,
        context="fork",
    )
    assert stats["ended"] > 0


# ----------------------------------------------------------- partial reset


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "pickled"])
@pytest.mark.parametrize("copy_", [True, False], ids=["copy", "view"])
def test_partial_reset_keeps_other_envs(copy_, shared_memory):
    """Envs outside the mask keep their previous obs and add nothing to infos;
    the envs inside it are reset with their own seed and the other options."""
    n = 5
    make = test_envs.ENV_CASES["CustomSpaceEnv"]
    with closing(
        ShmVectorEnv(
            make(n), num_workers=2, copy=copy_, shared_memory=shared_memory, context="fork"
        )
    ) as shm:
        sync = SyncVectorEnv(make(n))
        shm.reset(seed=3)
        sync.reset(seed=3)
        actions = copy.deepcopy(sync.action_space)
        actions.seed(5)
        for _ in range(3):
            a = actions.sample()
            obs, *_ = shm.step(a)
            sync.step(a)
        before = copy.deepcopy(obs)
        mask = np.array([False, True, False, True, False])
        options = {"reset_mask": mask, "level": 7}
        obs, infos = shm.reset(seed=[50, 51, 52, 53, 54], options=options)
        assert "reset_mask" not in options, "reset_mask is popped from the caller's dict"
        assert options == {"level": 7}
        sync_obs, sync_infos = sync.reset(
            seed=[50, 51, 52, 53, 54], options={"reset_mask": mask, "level": 7}
        )
        assert_same(obs, sync_obs, "obs")
        assert_same(infos, sync_infos, "infos")
        _assert_rows_kept(shm.single_observation_space, obs, before, ~mask, "partial reset")
        assert infos["_resets"].tolist() == mask.tolist()
        assert infos["options"]["level"][mask].tolist() == [7, 7]
        assert infos["_options"].tolist() == mask.tolist()
        # The reset envs were seeded with their own seeds.
        assert shm.np_random_seed == tuple(
            s if m else p for s, m, p in zip([50, 51, 52, 53, 54], mask, [3, 4, 5, 6, 7])
        )
        sync.close()


def test_partial_reset_keeps_pending_autoreset():
    """A NEXT_STEP autoreset pending for an env outside the mask stays pending."""
    n = 3
    fns = lambda: test_envs.class_fns(test_envs.CountingEnv, n, episode_len=2)  # noqa: E731
    with closing(ShmVectorEnv(fns(), num_workers=3, context="fork")) as shm:
        sync = SyncVectorEnv(fns())
        for env in (shm, sync):
            env.reset(seed=0)
        a = np.array([1, 2, 3])
        for _ in range(2):
            rb = shm.step(a)
            ra = sync.step(a)
            assert_step_same(rb, ra, "step")
        assert rb[2].all(), "every env ended at step 2"
        mask = np.array([True, False, False])
        obs_b, _ = shm.reset(options={"reset_mask": mask})
        obs_a, _ = sync.reset(options={"reset_mask": mask})
        assert_same(obs_b, obs_a)
        rb = shm.step(a)
        ra = sync.step(a)
        assert_step_same(rb, ra, "after partial reset")
        # env 0 stepped (t=1, reward 1); envs 1 and 2 were autoreset (reward 0).
        assert rb[1].tolist() == [1.0, 0.0, 0.0]
        assert rb[0][:, 0].tolist() == [1, 0, 0]
        sync.close()


def test_full_reset_clears_pending_autoreset():
    """After every env ended, reset() clears the pending autoreset (pickled obs too)."""
    for shared_memory in (True, False):
        fns = test_envs.class_fns(test_envs.CountingEnv, 2, episode_len=1)
        with closing(
            ShmVectorEnv(fns, num_workers=2, shared_memory=shared_memory, context="fork")
        ) as shm:
            shm.reset(seed=0)
            _, _, term, _, _ = shm.step(np.array([1, 1]))
            assert term.all()
            shm.reset(seed=0)
            obs, rew, term, _, _ = shm.step(np.array([2, 3]))
            assert rew.tolist() == [1.0, 1.0], "the step after reset() must step, not reset"
            assert obs.tolist() == [[1, 2], [1, 3]]


# ------------------------------------------------- infos, property-based

_NUMERIC_TYPES = [
    int,
    float,
    bool,
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.uint8,
    np.uint16,
    np.uint32,
    np.uint64,
    np.float16,
    np.float32,
    np.float64,
]
_numbers = st.tuples(st.sampled_from(_NUMERIC_TYPES), st.integers(0, 100), st.booleans()).map(
    lambda t: t[0](
        t[1] + (0.5 if t[2] and t[0] in (float, np.float16, np.float32, np.float64) else 0)
    )
)
_info = st.fixed_dictionaries(
    {},
    optional={
        **{k: _numbers for k in "abcdefghij"},  # more keys than shmvec's 8 info columns
        "s": st.text("xyz", max_size=3),
        "nb": st.booleans().map(np.bool_),
        "arr": st.integers(0, 9).map(lambda v: np.full(2, v, dtype=np.int16)),
        "sub": st.fixed_dictionaries({}, optional={"x": _numbers, "y": _numbers}),
    },
)
_scripts = st.lists(st.lists(_info, min_size=1, max_size=4), min_size=3, max_size=3)


@pytest.mark.parametrize(
    "autoreset_mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP], ids=["next", "same"]
)
def test_random_infos_merge_like_sync(autoreset_mode):
    """Random per-env infos of every numeric scalar type (the typed info
    columns), mixed types under one key, more keys than there are columns,
    strings, np.bool_, arrays and nested dicts: merged exactly as Sync does."""
    fns = test_envs.class_fns(test_envs.ScriptedInfoEnv, 3)
    shm = ShmVectorEnv(fns, num_workers=2, context="fork", autoreset_mode=autoreset_mode)
    sync = SyncVectorEnv(fns, autoreset_mode=autoreset_mode)

    @settings(
        max_examples=25,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(scripts=_scripts, reset_infos=st.lists(_info, min_size=3, max_size=3))
    def check(scripts, reset_infos):
        for env in (shm, sync):
            env.set_attr("script", scripts)
            env.set_attr("reset_info", reset_infos)
        assert_same(shm.reset(seed=0), sync.reset(seed=0), "reset")
        for t in range(7):
            a = np.array([0, 1, 0])
            assert_step_same(shm.step(a), sync.step(a), f"step {t}")

    try:
        check()
    finally:
        shm.close()
        sync.close()
