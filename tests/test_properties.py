"""Property tests: random gymnasium space trees through shmvec's codecs.

``space_trees()`` draws random (nested) fixed-size spaces: Box of every
numeric dtype and small shapes (``()`` and zero-size dimensions included),
Discrete / MultiDiscrete with (negative) ``start`` offsets, MultiBinary with
int and tuple shapes, Text with random lengths and non-ASCII charsets, and
Dict / Tuple up to three levels deep (empty ones included).

* Pure codec round trips (no processes, many examples): what the columns give
  back must be exactly what gymnasium's own ``concatenate`` / ``iterate``
  give for the same values, dtypes included.
* End to end through forked workers: ``ShmVectorEnv`` against
  ``gymnasium.vector.SyncVectorEnv`` bit for bit, with the random space as
  observation space *and* (another one) as action space.
"""

from __future__ import annotations

import copy
import functools
from contextlib import closing
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces
from gymnasium.vector import SyncVectorEnv
from gymnasium.vector.utils import batch_space, concatenate, create_empty_array, iterate
from helpers import assert_same
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis import strategies as st

from shmvec import ShmVectorEnv
from shmvec.codecs import ArrayCodec, DictCodec, TextCodec, TupleCodec, make_codec

pytestmark = [
    pytest.mark.timeout(300),
    # Box bounds drawn as Python floats, cast by gymnasium to float16/32.
    pytest.mark.filterwarnings("ignore:.*precision lowered by casting:UserWarning"),
    # Box.contains on a numpy scalar action (a Box of shape ()).
    pytest.mark.filterwarnings("ignore:.*Casting input x to numpy array:UserWarning"),
]

# --------------------------------------------------------------- strategies

INT_DTYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]
FLOAT_DTYPES = [np.float16, np.float32, np.float64]
BOX_DTYPES = [*INT_DTYPES, *FLOAT_DTYPES, np.bool_]

#: Box sampling draws integers through float64: keep integer bounds exact there.
INT_BOUND = 2**52
FLOAT_BOUND = {np.float16: 1000.0, np.float32: 1e6, np.float64: 1e9}

#: Some fixed non-ASCII characters, so that small charsets often hold one.
NON_ASCII = "éßøЖλ漢字😀\u00a0\u200b"

#: Dimension sizes; a zero-size dimension now and then.
dims = st.sampled_from([1, 1, 2, 2, 3, 0])
small_shapes = st.lists(dims, min_size=0, max_size=3).map(tuple)
nonempty_shapes = st.lists(st.integers(1, 3), min_size=1, max_size=3).map(tuple)


@st.composite
def boxes(draw) -> spaces.Box:
    dtype = draw(st.sampled_from(BOX_DTYPES))
    shape = draw(small_shapes)
    per_element = draw(st.booleans())

    def bounds(elements):
        if dtype is np.bool_:
            low = draw(elements(st.integers(0, 1)))
            high = draw(elements(st.integers(0, 1)))
        elif dtype in INT_DTYPES:
            info = np.iinfo(dtype)
            lo, hi = max(int(info.min), -INT_BOUND), min(int(info.max), INT_BOUND)
            low = draw(elements(st.integers(lo, hi)))
            high = draw(elements(st.integers(lo, hi)))
        else:
            b = FLOAT_BOUND[dtype]
            # Representable in the dtype, so that low <= high survives the cast.
            values = st.floats(-b, b, allow_nan=False).map(lambda x: float(dtype(x)))
            low = draw(elements(values))
            high = draw(elements(values))
        low, high = np.minimum(low, high), np.maximum(low, high)
        return low, high

    if per_element and shape:
        low, high = bounds(lambda s: st.lists(s, min_size=int(np.prod(shape)),
                                              max_size=int(np.prod(shape))))  # fmt: skip
        low = np.asarray(low).reshape(shape)
        high = np.asarray(high).reshape(shape)
        if dtype is np.bool_:
            low, high = low.astype(np.int64), high.astype(np.int64)
        elif dtype in FLOAT_DTYPES:
            low, high = low.astype(np.float64), high.astype(np.float64)
    else:
        low, high = bounds(lambda s: s)
        low, high = low.item(), high.item()
    return spaces.Box(low, high, shape, dtype)


def _int_dtypes_for(low: int, high: int) -> list:
    return [d for d in INT_DTYPES if np.iinfo(d).min <= low and high <= np.iinfo(d).max]


@st.composite
def discretes(draw) -> spaces.Discrete:
    n = draw(st.integers(1, 10))
    start = draw(st.integers(-20, 20) | st.sampled_from([-128, 100, -(2**40)]))
    dtype = draw(st.sampled_from(_int_dtypes_for(start, start + n - 1)))
    return spaces.Discrete(n, start=start, dtype=dtype)


@st.composite
def multi_discretes(draw) -> spaces.MultiDiscrete:
    shape = draw(nonempty_shapes)
    size = int(np.prod(shape))
    nvec = np.array(draw(st.lists(st.integers(1, 6), min_size=size, max_size=size)))
    nvec = nvec.reshape(shape)
    start = None
    if draw(st.booleans()):
        start = np.array(draw(st.lists(st.integers(-10, 10), min_size=size, max_size=size)))
        start = start.reshape(shape)
    low = 0 if start is None else int(start.min())
    high = int((nvec - 1 + (0 if start is None else start)).max())
    dtype = draw(st.sampled_from(_int_dtypes_for(low, high)))
    return spaces.MultiDiscrete(nvec, dtype=dtype, start=start)


multi_binaries = st.one_of(
    st.integers(1, 5).map(spaces.MultiBinary),
    nonempty_shapes.map(lambda shape: spaces.MultiBinary(list(shape))),
)

# Not NUL: gymnasium's Text.sample() drops it (a charset of "\x00" samples "",
# which its own contains() refuses).
characters = st.characters(exclude_categories=("Cs",), exclude_characters="\x00") | (
    st.sampled_from(NON_ASCII)
)


@st.composite
def texts(draw) -> spaces.Text:
    min_length = draw(st.integers(0, 3))
    max_length = draw(st.integers(min_length, 6))
    charset = draw(st.text(characters, min_size=1, max_size=6))
    return spaces.Text(max_length, min_length=min_length, charset=charset)


leaf_spaces = st.one_of(boxes(), discretes(), multi_discretes(), multi_binaries, texts())

dict_keys = st.text(st.characters(exclude_categories=("Cs",)), max_size=4)


def space_trees(max_depth: int = 3, allow_empty: bool = True) -> st.SearchStrategy[spaces.Space]:
    """Random fixed-size space trees, at most ``max_depth`` Dict/Tuple levels.

    ``allow_empty=False`` leaves out empty Dicts and Tuples, which gymnasium's
    ``iterate`` (so SyncVectorEnv's actions) cannot take.
    """
    if max_depth == 0:
        return leaf_spaces
    child = space_trees(max_depth - 1, allow_empty)
    min_size = 0 if allow_empty else 1
    return st.one_of(
        leaf_spaces,
        st.dictionaries(dict_keys, child, min_size=min_size, max_size=3).map(spaces.Dict),
        st.lists(child, min_size=min_size, max_size=3).map(lambda xs: spaces.Tuple(tuple(xs))),
    )


def leaves(space: spaces.Space) -> list[spaces.Space]:
    if isinstance(space, spaces.Dict):
        return [leaf for s in space.spaces.values() for leaf in leaves(s)]
    if isinstance(space, spaces.Tuple):
        return [leaf for s in space.spaces for leaf in leaves(s)]
    return [space]


def depth(space: spaces.Space) -> int:
    if isinstance(space, spaces.Dict):
        return 1 + max((depth(s) for s in space.spaces.values()), default=0)
    if isinstance(space, spaces.Tuple):
        return 1 + max((depth(s) for s in space.spaces), default=0)
    return 0


def seeded(space: spaces.Space, seed: int) -> spaces.Space:
    space = copy.deepcopy(space)
    space.seed(seed)
    return space


seeds = st.integers(0, 2**32 - 1)

# ------------------------------------------------- the strategy covers enough


def _has_leaf(predicate):
    return lambda space: any(predicate(leaf) for leaf in leaves(space))


def _box_of(dtype):
    return lambda s: isinstance(s, spaces.Box) and s.dtype == np.dtype(dtype)


COVERAGE = {
    **{f"box-{np.dtype(d).name}": _has_leaf(_box_of(d)) for d in BOX_DTYPES},
    "box-shape-()": _has_leaf(lambda s: isinstance(s, spaces.Box) and s.shape == ()),
    "box-zero-size": _has_leaf(lambda s: isinstance(s, spaces.Box) and 0 in s.shape),
    "box-3d": _has_leaf(lambda s: isinstance(s, spaces.Box) and len(s.shape) == 3),
    "discrete-negative-start": _has_leaf(lambda s: isinstance(s, spaces.Discrete) and s.start < 0),
    "discrete-int8": _has_leaf(lambda s: isinstance(s, spaces.Discrete) and s.dtype == np.int8),
    "multidiscrete-negative-start": _has_leaf(
        lambda s: isinstance(s, spaces.MultiDiscrete) and (s.start < 0).any()
    ),
    "multidiscrete-2d": _has_leaf(
        lambda s: isinstance(s, spaces.MultiDiscrete) and s.nvec.ndim == 2
    ),
    "multibinary-int": _has_leaf(
        lambda s: isinstance(s, spaces.MultiBinary) and isinstance(s.n, (int, np.integer))
    ),
    "multibinary-shape": _has_leaf(
        lambda s: isinstance(s, spaces.MultiBinary) and np.ndim(s.n) == 1 and len(s.n) >= 2
    ),
    "text-non-ascii": _has_leaf(
        lambda s: isinstance(s, spaces.Text) and any(ord(c) > 127 for c in s.character_set)
    ),
    "text-max-length-0": _has_leaf(lambda s: isinstance(s, spaces.Text) and s.max_length == 0),
    "discrete-unsigned": _has_leaf(
        lambda s: isinstance(s, spaces.Discrete) and s.dtype.kind == "u"
    ),
    "text-min-length-0": _has_leaf(lambda s: isinstance(s, spaces.Text) and s.min_length == 0),
    "dict": lambda s: isinstance(s, spaces.Dict) and len(s.spaces) >= 2,
    "tuple": lambda s: isinstance(s, spaces.Tuple) and len(s.spaces) >= 2,
    "empty-container": lambda s: isinstance(s, (spaces.Dict, spaces.Tuple)) and not leaves(s),
    "depth-3": lambda s: depth(s) == 3 and bool(leaves(s)),
}


@pytest.mark.parametrize("kind", list(COVERAGE))
def test_strategy_covers(kind):
    """The strategy reaches every space kind the properties are meant to cover."""
    example = find(
        space_trees(),
        COVERAGE[kind],
        # Generation only: any example will do, no need to shrink it.
        settings=settings(max_examples=3000, database=None, deadline=None, phases=[Phase.generate]),
    )
    assert COVERAGE[kind](example)


@given(space=space_trees(), seed=seeds)
@settings(max_examples=100, deadline=None)
def test_strategy_spaces_are_valid(space, seed):
    """Every drawn space is fixed-size in shmvec's sense and samples into itself."""
    codec = make_codec(space)
    assert not codec.pickled
    kinds = {
        spaces.Box: ArrayCodec, spaces.Discrete: ArrayCodec, spaces.MultiDiscrete: ArrayCodec,
        spaces.MultiBinary: ArrayCodec, spaces.Text: TextCodec,
        spaces.Dict: DictCodec, spaces.Tuple: TupleCodec,
    }  # fmt: skip
    assert type(codec) is kinds[type(space)]
    sample = seeded(space, seed).sample()
    assert space.contains(sample)


# ------------------------------------------------------- pure codec round trip


def per_env_values(space: spaces.Space, batch: Any, rows: int) -> list[Any]:
    """``list(iterate(batch_space(space, rows), batch))``, also for empty Dicts
    and Tuples (where gymnasium's ``iterate`` raises): each env's value, as
    gymnasium hands it out of a batch (AsyncVectorEnv's actions)."""
    if isinstance(space, spaces.Dict):
        per_key = {k: per_env_values(s, batch[k], rows) for k, s in space.spaces.items()}
        return [{k: v[row] for k, v in per_key.items()} for row in range(rows)]
    if isinstance(space, spaces.Tuple):
        assert len(batch) == len(space.spaces)
        parts = [per_env_values(s, b, rows) for s, b in zip(space.spaces, batch)]
        return [tuple(p[row] for p in parts) for row in range(rows)]
    values = list(iterate(batch_space(space, rows), batch))
    assert len(values) == rows
    return values


def _zero_d_as_scalars(value: Any) -> Any:
    """``value`` with its 0-d arrays as numpy scalars (as iterating a batch gives)."""
    if isinstance(value, np.ndarray):
        return value[()] if value.ndim == 0 else value
    if isinstance(value, dict):
        return {k: _zero_d_as_scalars(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_zero_d_as_scalars(v) for v in value)
    return value


def _scribble(views: list[np.ndarray], rng: np.random.Generator) -> None:
    """Fills the columns with random bytes, as a reused ring slot would hold."""
    for view in views:
        raw = view.view(np.uint8)
        raw[...] = rng.integers(0, 256, raw.shape, dtype=np.uint8)


def _columns(codec, rows: int, rng: np.random.Generator) -> list[np.ndarray]:
    views = [np.empty((rows, *spec.shape), spec.dtype) for spec in codec.columns()]
    _scribble(views, rng)
    return views


@given(space=space_trees(), seed=seeds, rows=st.integers(1, 4))
@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
def test_codec_round_trip(space, seed, rows):
    codec = make_codec(space)
    rng = np.random.default_rng(seed)
    sampler = seeded(space, seed)
    samples = [sampler.sample() for _ in range(rows)]
    expected = concatenate(space, samples, create_empty_array(space, rows))
    per_env = per_env_values(space, expected, rows)

    # Observation side: one row per env, then the whole batch.
    views = _columns(codec, rows, rng)
    for row, value in enumerate(samples):
        codec.write(views, row, value)
    batch = codec.read_batch(views, copy=True)
    assert_same(batch, expected, "read_batch")
    # copy=True must not alias the columns.
    _scribble(views, rng)
    assert_same(batch, expected, "read_batch after the columns changed")

    # Action side: the batch in, each env's value out, as private copies.
    views = _columns(codec, rows, rng)
    assert codec.is_exact(expected)
    codec.write_batch(views, expected)
    got = [codec.read(views, row) for row in range(rows)]
    for row in range(rows):
        assert_same(got[row], per_env[row], f"read row {row}")
    _scribble(views, rng)
    for row in range(rows):
        assert_same(got[row], per_env[row], f"read row {row} after the columns changed")

    # Rows written one by one (the worker's path) read back as the samples
    # themselves, but for Box(shape=()), which gymnasium's iterate hands out as
    # a numpy scalar (and so does the codec).
    views = _columns(codec, rows, rng)
    for row, value in enumerate(samples):
        codec.write(views, row, value)
    for row in range(rows):
        value = codec.read(views, row)
        assert_same(value, per_env[row], f"write/read row {row}")
        assert_same(value, _zero_d_as_scalars(samples[row]), f"write/read row {row} vs sample")

    # A subset of rows (async send): those rows change, the others do not.
    subset = np.flatnonzero(rng.integers(0, 2, rows).astype(bool))
    if subset.size:
        views = _columns(codec, rows, rng)
        codec.write_batch(views, expected)
        before = [codec.read(views, row) for row in range(rows)]
        other_sampler = seeded(space, seed ^ 1)
        others = [other_sampler.sample() for _ in subset]
        sub_batch = concatenate(space, others, create_empty_array(space, len(subset)))
        sub_per_env = per_env_values(space, sub_batch, len(subset))
        codec.write_rows(views, subset, sub_batch)
        for row in range(rows):
            want = sub_per_env[list(subset).index(row)] if row in subset else before[row]
            assert_same(codec.read(views, row), want, f"write_rows row {row}")


# -------------------------------------------------- end to end, forked workers


def canonical(value: Any) -> str:
    """An exact, type- and dtype-revealing description of a value (for infos)."""
    if isinstance(value, np.ndarray):
        return f"ndarray[{value.dtype.str}{value.shape}]{value.tobytes().hex()}"
    if isinstance(value, np.generic):
        return f"{type(value).__name__}:{value.tobytes().hex()}"
    if isinstance(value, dict):
        inner = ",".join(f"{k!r}:{canonical(v)}" for k, v in value.items())
        return f"dict{{{inner}}}"
    if isinstance(value, tuple):
        return f"tuple({','.join(canonical(v) for v in value)})"
    return f"{type(value).__name__}:{value!r}"


class RandomSpaceEnv(gym.Env):
    """Observations drawn from a private, seeded copy of the observation space.

    The copy is reseeded from ``np_random`` at every reset, so the same reset
    seeds give the same observations in SyncVectorEnv (all envs share the
    space objects in one process) and in ShmVectorEnv's workers. The action
    received is echoed, exactly described, in the step's info; episodes end
    at random (terminated or truncated) to go through autoresets.
    """

    def __init__(self, observation_space: spaces.Space, action_space: spaces.Space) -> None:
        self.observation_space = observation_space
        self.action_space = action_space
        self._sampler = copy.deepcopy(observation_space)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self._sampler = copy.deepcopy(self.observation_space)
        self._sampler.seed(int(self.np_random.integers(2**32)))
        return self._sampler.sample(), {"resets": 1}

    def step(self, action):
        rng = self.np_random
        end = int(rng.integers(0, 6))
        info = {"action": canonical(action), "valid": bool(self.action_space.contains(action))}
        return self._sampler.sample(), float(rng.normal()), end == 0, end == 1, info


E2E_STEPS = 5


@given(
    obs_space=space_trees(),
    act_space=space_trees(max_depth=2, allow_empty=False),
    num_envs=st.integers(3, 4),
    seed=st.integers(0, 2**31 - 1),
)
@settings(
    max_examples=25,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@pytest.mark.parametrize("copy_obs", [True, False], ids=["copy", "view"])
def test_shm_equals_sync(copy_obs, obs_space, act_space, num_envs, seed):
    env_fn = functools.partial(RandomSpaceEnv, obs_space, act_space)
    sync = SyncVectorEnv([env_fn] * num_envs)
    shm = ShmVectorEnv([env_fn] * num_envs, context="fork", num_workers=2, copy=copy_obs)
    with closing(sync), closing(shm):
        assert shm.single_observation_space == sync.single_observation_space
        assert shm.observation_space == sync.observation_space
        obs_a, info_a = sync.reset(seed=seed)
        obs_b, info_b = shm.reset(seed=seed)
        assert_same(obs_b, obs_a, "reset obs")
        assert_same(info_b, info_a, "reset info")
        history = [(copy.deepcopy(obs_a), obs_b)]  # copy=True: results stay as they were
        assert sync.action_space == shm.action_space
        actions = seeded(sync.action_space, seed)
        for t in range(E2E_STEPS):
            action = actions.sample()
            result_a = sync.step(action)
            result_b = shm.step(action)
            for name, a, b in zip(("obs", "rewards", "terminations", "truncations", "infos"),
                                  result_a, result_b):  # fmt: skip
                assert_same(b, a, f"step {t} {name}")
            valid = result_b[4].get("valid")
            if valid is not None:
                # Every env that stepped (not autoresetting) got a valid action.
                assert valid[result_b[4]["_valid"]].all(), f"step {t}: invalid action delivered"
            history.append((copy.deepcopy(result_a[0]), result_b[0]))
        if copy_obs:
            for t, (a, b) in enumerate(history):
                assert_same(b, a, f"obs {t} at the end (copy=True)")
