"""Text of any length (``shmvec.UnboundedText``) as observations and actions.

The space itself (gymnasium's batching, seeding, pickling), its codec (UTF-8
rows inline up to ``text_bytes``, longer rows spilled), equivalence with
gymnasium's ``SyncVectorEnv`` in sync mode and with each env stepped alone in
async mode, for texts of 0 to 50,000 characters of any Unicode, and the errors
bad text gets in the main process.
"""

from __future__ import annotations

import copy
import pickle

import envs as test_envs
import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces
from gymnasium.vector import AutoresetMode
from gymnasium.vector.utils import batch_space, concatenate, create_empty_array, iterate
from helpers import assert_same
from test_equivalence import run_equivalence

import shmvec
from shmvec import ShmVectorEnv, UnboundedText
from shmvec.batching import batch_infos, unbatch_info
from shmvec.codecs import TEXT_BYTES, Utf8TextCodec, make_codec

pytestmark = pytest.mark.timeout(180)

MODES = [
    pytest.param(AutoresetMode.NEXT_STEP, id="next_step"),
    pytest.param(AutoresetMode.SAME_STEP, id="same_step"),
    pytest.param(AutoresetMode.DISABLED, id="disabled"),
]

#: (num_workers, ShmVectorEnv options): processes, env threads, the main
#: process's own block, and a tiny inline capacity (almost every row spills).
LAYOUTS = [
    pytest.param(2, {}, id="w2"),
    pytest.param(2, {"env_concurrency": 3}, id="w2-threads"),
    pytest.param(2, {"step_in_main": True}, id="w2-main-too"),
    pytest.param(1, {"text_bytes": 0}, id="w1-all-spill"),
]


def chat_fns(n: int, dict_obs: bool = False) -> list:
    return test_envs.class_fns(test_envs.ChatEnv, n, dict_obs=dict_obs)


def text_actions(seed: int, n: int):
    """``sample_actions`` for run_equivalence: ``n`` random texts a step."""
    return lambda t: test_envs.random_texts(np.random.default_rng([seed, t]), n)


# ------------------------------------------------------------------ the space


def test_space_accepts_any_str_and_batches_as_text():
    space = UnboundedText(seed=3)
    assert isinstance(space, spaces.Text)
    for value in ["", "x" * 100_000, "♠♥ € • 中文 😀 \ud800", "\x00"]:
        assert space.contains(value) and value in space
    for value in [b"bytes", None, 3, ["a"], np.array(["a"])]:
        assert not space.contains(value)
    batched = batch_space(space, 3)
    values = ("", "é" * 5000, "😀")
    assert batched.contains(values)
    assert list(iterate(batched, values)) == list(values)
    assert concatenate(space, list(values), create_empty_array(space, 3)) == values
    assert space == UnboundedText() and space != spaces.Text(10)
    assert repr(space) == "UnboundedText()"
    assert not space.is_np_flattenable


def test_space_samples_short_seeded_strings_and_pickles():
    a, b = UnboundedText(sample_length=8, seed=5), UnboundedText(sample_length=8, seed=5)
    samples = [a.sample() for _ in range(50)]
    assert samples == [b.sample() for _ in range(50)]
    assert all(isinstance(s, str) and len(s) <= 8 and s in a for s in samples)
    assert len(set(samples)) > 10
    assert len(a.sample(mask=(3, None))) == 3
    clone = pickle.loads(pickle.dumps(a))
    assert clone == a and clone.sample_length == 8
    assert clone.sample() == a.sample()  # the generator's state travels too
    with pytest.raises(ValueError, match="sample_length"):
        UnboundedText(sample_length=-1)
    with pytest.raises(TypeError, match="sample_length"):
        UnboundedText(sample_length=2.5)


# ------------------------------------------------------------------ the codec


def _views(codec, rows: int) -> list[np.ndarray]:
    return [np.zeros((rows, *spec.shape), spec.dtype) for spec in codec.columns()]


def test_codec_stores_utf8_inline_and_spills_only_longer_rows():
    codec = make_codec(UnboundedText(), text_bytes=8)
    assert isinstance(codec, Utf8TextCodec) and codec.can_spill
    assert [(c.dtype, c.shape) for c in codec.columns()] == [
        (np.dtype(np.int64), ()),
        (np.dtype(np.uint8), (8,)),
    ]
    views = _views(codec, 5)
    # 8 bytes fit, 9 spill; "€" is 3 bytes, "😀" 4, a lone surrogate 3.
    texts = ["", "12345678", "123456789", "€€😀", "\ud800€"]
    spills = {row: codec.write(views, row, text) for row, text in enumerate(texts)}
    assert spills == {0: None, 1: None, 2: {"": "123456789"}, 3: {"": "€€😀"}, 4: None}
    assert views[0].tolist() == [0, 8, 9, 10, 6]
    assert [codec.spilled(views, row) for row in range(5)] == [False, False, True, True, False]
    by_row = {row: spill for row, spill in spills.items() if spill}
    assert codec.read_batch(views, True, by_row) == tuple(texts)
    assert [codec.read(views, row, by_row.get(row)) for row in range(5)] == texts
    with pytest.raises(RuntimeError, match="did not arrive"):
        codec.read_batch(views, True)  # a spilled row without its value: never a wrong str


def test_codec_actions_spill_by_env_inside_a_dict():
    space = spaces.Dict(pos=spaces.Box(-1, 1, (2,)), say=UnboundedText())
    codec = make_codec(space, text_bytes=4)
    assert codec.can_spill
    views = _views(codec, 4)
    actions = {"pos": np.zeros((2, 2), np.float32), "say": ("ok", "too long")}
    spills = codec.write_rows(views, np.array([3, 1]), actions)
    assert spills == {1: {"['say']": "too long"}}
    assert codec.read(views, 3) == {"pos": pytest.approx(np.zeros(2)), "say": "ok"}
    assert codec.spilled(views, 1) and not codec.spilled(views, 3)
    assert codec.read(views, 1, spills[1])["say"] == "too long"


def test_bounded_text_keeps_its_int32_codes():
    codec = make_codec(spaces.Text(5, charset="ab"))
    assert not isinstance(codec, Utf8TextCodec) and not codec.can_spill
    assert [(c.dtype, c.shape) for c in codec.columns()] == [(np.dtype(np.int32), (5,))]


#: Charsets of bounded ``Text``: gymnasium's default, any characters up to U+FFFF,
#: and one past it (the per-character path).
CHARSETS = [
    pytest.param(None, id="alphanumeric"),
    pytest.param("ab é✓\x00中\ufffe", id="unicode"),
    pytest.param("xy😀", id="astral"),
]


@pytest.mark.parametrize("charset", CHARSETS)
def test_bounded_text_codes_round_trip_and_refuse_bad_text(charset):
    space = spaces.Text(300, charset=charset) if charset else spaces.Text(300)
    codec = make_codec(space)
    chars = list(space.character_list)
    rng = np.random.default_rng(0)
    views = [np.zeros((3, 300), np.int32)]  # a fresh segment's rows are zeros
    for _ in range(60):
        row = int(rng.integers(3))
        text = "".join(rng.choice(chars, int(rng.integers(0, 301))))
        codec.write(views, row, text)
        want = [chars.index(c) for c in text]
        assert views[0][row].tolist() == want + [-1] * (300 - len(text))  # padded to the end
        assert codec.read(views, row) == text
    assert codec.read_batch(views, False) == tuple(codec.read(views, r) for r in range(3))
    with pytest.raises(ValueError, match="has character '§', not in the space's charset"):
        codec.write(views, 0, chars[0] + "§")
    with pytest.raises(ValueError, match="longer than its space's max_length=300"):
        codec.write(views, 0, chars[0] * 301)


def test_bounded_text_costs_its_length_not_max_length():
    space = spaces.Text(16384)
    codec = make_codec(space)
    views = [np.full((1, 16384), -1, np.int32)]
    codec.write(views, 0, "a" * 600)
    # Past the padding the row is never read (a code there indexes no character) nor
    # written: a text costs its own length and the previous one's.
    views[0][0, 5000:] = 10**6
    assert codec.read(views, 0) == "a" * 600
    codec.write(views, 0, "hello")
    assert codec.read(views, 0) == "hello" and codec.read_batch(views, False) == ("hello",)
    assert (views[0][0, 5:600] == -1).all() and (views[0][0, 5000:] == 10**6).all()


# --------------------------------------------------------- sync equivalence


@pytest.mark.parametrize("num_workers,options", LAYOUTS)
@pytest.mark.parametrize("autoreset_mode", MODES)
def test_text_env_equals_sync_vector_env(autoreset_mode, num_workers, options):
    """Texts of 0 to 50,000 characters each way, any Unicode: same obs, rewards,
    flags and infos as SyncVectorEnv, masked resets included (a spilled row that
    a masked reset keeps stays as it was)."""
    n = 5
    stats = run_equivalence(
        chat_fns,
        n,
        autoreset_mode,
        steps=24,
        seed=[3 * i + 1 for i in range(n)],
        partial_reset_at=9,
        sample_actions=text_actions(17, n),
        num_workers=num_workers,
        context="fork",
        **options,
    )
    assert stats["ended"] > 0 and stats["masked_resets"] >= 1 and stats["info_steps"] > 0


@pytest.mark.parametrize("copy_", [True, False], ids=["copy", "view"])
@pytest.mark.parametrize("autoreset_mode", MODES)
def test_dict_of_box_and_text_equals_sync_vector_env(autoreset_mode, copy_, monkeypatch):
    """A Dict of a Box and the text, its Box lent from lease regions."""
    monkeypatch.setattr(shmvec.layout, "LEASE_MIN_BYTES", 1)
    n = 4
    stats = run_equivalence(
        lambda k: chat_fns(k, dict_obs=True),
        n,
        autoreset_mode,
        steps=20,
        partial_reset_at=7,
        sample_actions=text_actions(5, n),
        num_workers=2,
        copy=copy_,
        text_bytes=1024,
        context="fork",
    )
    assert stats["ended"] > 0 and stats["masked_resets"] >= 1


def test_spawned_workers_carry_text_bytes():
    n = 3
    run_equivalence(
        chat_fns,
        n,
        AutoresetMode.NEXT_STEP,
        steps=8,
        partial_reset_at=None,
        sample_actions=text_actions(9, n),
        num_workers=2,
        text_bytes=100,
        context="spawn",
    )


# -------------------------------------------------------- async equivalence


def _row(batch, row: int):
    """Row ``row`` of a batched observation of ChatEnv (text or Dict)."""
    if isinstance(batch, dict):
        return {key: _row(value, row) for key, value in batch.items()}
    return batch[row]


@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP])
@pytest.mark.parametrize(
    "dict_obs,options",
    [
        (False, {}),
        (False, {"env_concurrency": 3}),
        (True, {"step_in_main": True}),
        (True, {"text_bytes": 0, "env_concurrency": 2}),
    ],
    ids=["text", "text-threads", "dict-main-too", "dict-all-spill-threads"],
)
def test_async_each_env_matches_stepping_it_alone(mode, dict_obs, options):
    """Async mode: whatever order envs come back in, each env's observations,
    rewards, flags and infos are those it gives alone with the same seed and
    text actions."""
    num_envs, batch_size, results_per_env = 6, 2, 10
    envs = ShmVectorEnv(
        chat_fns(num_envs, dict_obs), num_workers=2, batch_size=batch_size, autoreset_mode=mode,
        context="fork", **options,
    )  # fmt: skip
    alone = [test_envs.ChatEnv(dict_obs) for _ in range(num_envs)]
    expected = {
        e: (env.reset(seed=100 + e)[0], 0.0, False, False, {}) for e, env in enumerate(alone)
    }
    ended = np.zeros(num_envs, dtype=bool)
    sent = np.zeros(num_envs, dtype=int)
    results = np.zeros(num_envs, dtype=int)
    try:
        envs.async_reset(seed=100)
        while results.min() < results_per_env:
            obs, rewards, terminations, truncations, infos = envs.recv(timeout=120)
            ids = infos["env_id"].tolist()
            for row, e in enumerate(ids):
                want_obs, reward, terminated, truncated, info = expected[e]
                assert_same(_row(obs, row), want_obs, f"env {e} obs")
                assert (rewards[row], terminations[row], truncations[row]) == (
                    reward, terminated, truncated,
                ), f"env {e}"  # fmt: skip
                got = unbatch_info(infos, row)
                got.pop("env_id", None)
                # The env's info as one row of a batch: numbers become numpy scalars.
                assert_same(got, unbatch_info(batch_infos([(0, [info])], 1), 0), f"env {e} info")
                results[e] += 1
            # Each env's actions depend on the env and its count only, not on the order.
            actions = tuple(
                test_envs.random_text(np.random.default_rng([e, int(sent[e])])) for e in ids
            )
            envs.send(actions, infos["env_id"])
            for e, action in zip(ids, actions):
                sent[e] += 1
                *result, ended[e] = test_envs.reference_step(alone[e], mode, ended[e], action)
                expected[e] = tuple(result)
    finally:
        envs.close()
    assert results.min() >= results_per_env


# --------------------------------------------------------------- bad input


@pytest.fixture(params=[None, 2], ids=["sync", "async"])
def chat_envs(request):
    envs = ShmVectorEnv(chat_fns(3), num_workers=2, batch_size=request.param, text_bytes=16)
    yield envs
    envs.close()


def _act(envs, actions, env_ids=None):
    if envs.is_async:
        envs.send(actions, env_ids)
    else:
        envs.step(actions)


def test_bad_text_actions_are_clear_errors_in_main(chat_envs):
    envs = chat_envs
    ids = None
    if envs.is_async:
        envs.async_reset(seed=0)
        ids = envs.recv()[4]["env_id"]
    else:
        envs.reset(seed=0)
    rows = len(ids) if ids is not None else 3
    with pytest.raises(TypeError, match=r"env \d+.*is int 7.*UnboundedText\(\) takes a str"):
        _act(envs, ("fine", 7, "x")[:rows], ids)
    with pytest.raises(ValueError, match=f"expected {rows} texts.*got 5"):
        _act(envs, ("a",) * 5, ids)
    with pytest.raises(TypeError, match="one str per env, got str"):
        _act(envs, "ab" * rows, ids)
    # Nothing reached a worker: the envs still step, long texts included.
    long = tuple("é" * (20_000 + k) for k in range(rows))
    if envs.is_async:
        envs.send(long, ids)
        obs = envs.recv(timeout=60)[0]
        assert len(obs) == 2 and all(isinstance(o, str) for o in obs)
    else:
        obs = envs.step(long)[0]
        assert [o.split("|")[-1] for o in obs] == [t[::-1] for t in long]


class NotTextEnv(test_envs.ChatEnv):
    """Observes bytes when it steps: not a str."""

    def step(self, action):
        obs, *rest = super().step(action)
        return b"bytes", *rest


def test_non_str_observation_names_env_and_space():
    envs = ShmVectorEnv([test_envs.ChatEnv, NotTextEnv], num_workers=2)
    try:
        envs.reset(seed=1)
        with pytest.raises(TypeError, match=r"observation is bytes b'bytes'.*UnboundedText") as e:
            envs.step(("a", "b"))
        assert "env 1" in "\n".join(getattr(e.value, "__notes__", []))
    finally:
        envs.close()


def test_text_bytes_is_checked():
    for bad, error in [(-1, ValueError), (2.0, TypeError), (True, TypeError), ("4", TypeError)]:
        with pytest.raises(error, match="text_bytes"):
            ShmVectorEnv(chat_fns(1), text_bytes=bad)
    envs = ShmVectorEnv(chat_fns(2), num_workers=1, text_bytes=np.int64(32))
    try:
        assert envs.text_bytes == 32 and isinstance(envs.text_bytes, int)
        assert ShmVectorEnv.__init__.__kwdefaults__["text_bytes"] == TEXT_BYTES
    finally:
        envs.close()


def test_async_mode_accepts_text_in_dict_and_tuple_action_spaces():
    class TupleActionEnv(gym.Env):
        observation_space = spaces.Box(0, 1, (1,), np.float32)
        action_space = spaces.Tuple((spaces.Discrete(3), spaces.Dict(say=UnboundedText())))

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            return np.zeros(1, np.float32), {}

        def step(self, action):
            k, said = action
            return np.zeros(1, np.float32), float(k) + len(said["say"]), False, False, {}

    envs = ShmVectorEnv([TupleActionEnv] * 4, num_workers=2, batch_size=2, text_bytes=8)
    expected: dict[int, float] = {}  # env -> the reward its last action gives
    checked = 0
    try:
        envs.async_reset(seed=0)
        for turn in range(8):
            _, rewards, _, _, infos = envs.recv(timeout=60)
            ids = infos["env_id"].tolist()
            for row, e in enumerate(ids):
                if e in expected:
                    assert rewards[row] == expected.pop(e), f"env {e}"
                    checked += 1
            texts = tuple("😀" * (turn * 3 + k) for k in range(2))  # 8 bytes inline, then spills
            envs.send((np.array([1, 2]), {"say": texts}), infos["env_id"])
            for k, e in enumerate(ids):
                expected[e] = float(k + 1) + len(texts[k])
    finally:
        envs.close()
    assert checked >= 10


def test_deepcopied_batched_space_samples_text_actions():
    envs = ShmVectorEnv(chat_fns(2), num_workers=1)
    try:
        space = copy.deepcopy(envs.action_space)
        space.seed(0)
        envs.reset(seed=0)
        actions = space.sample()
        assert isinstance(actions, tuple) and all(isinstance(a, str) for a in actions)
        obs = envs.step(actions)[0]
        assert [o.split("|")[-1] for o in obs] == [a[::-1] for a in actions]
    finally:
        envs.close()
