"""The gymnasium layer shared by ShmVectorEnv and RayVectorEnv (shmvec/batching.py)."""

from __future__ import annotations

import numpy as np
import pytest
from gymnasium.vector.vector_env import VectorEnv

from shmvec import infos as info_columns
from shmvec.batching import (
    batch_infos,
    check_env_ids,
    check_reset_mask,
    expand_options,
    expand_seeds,
    rows_with_info,
    split_blocks,
    take_reset_mask,
    unbatch_info,
    unbatch_infos,
)


@pytest.mark.parametrize("num_envs, parts", [(1, 1), (7, 3), (8, 4), (5, 5), (10, 3)])
def test_split_blocks_is_contiguous_even_and_larger_first(num_envs, parts):
    blocks = split_blocks(num_envs, parts)
    assert [e for b in blocks for e in b] == list(range(num_envs))
    sizes = [len(b) for b in blocks]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_check_env_ids_says_what_is_wrong():
    assert check_env_ids([2, 0], 3).dtype == np.int64
    with pytest.raises(TypeError, match="1-D array of ints"):
        check_env_ids([0.5], 3)
    with pytest.raises(ValueError, match=r"env_ids \[3\] out of range"):
        check_env_ids([0, 3], 3)
    with pytest.raises(ValueError, match=r"env_ids \[-1, 5\] out of range"):
        check_env_ids([-1, 0, 5], 3)
    assert check_env_ids([], 3).tolist() == []
    with pytest.raises(ValueError, match=r"env_ids \[1\] appear more than once"):
        check_env_ids([1, 1], 3)


def test_reset_mask_checks_raise_gymnasiums_error_types():
    check_reset_mask(np.array([True, False]), 2)
    with pytest.raises(TypeError, match="numpy array"):
        check_reset_mask([True, False], 2)
    with pytest.raises(TypeError, match="dtype=np.bool_"):
        check_reset_mask(np.array([1, 0]), 2)
    with pytest.raises(ValueError, match="shape"):
        check_reset_mask(np.array([True]), 2)
    with pytest.raises(ValueError, match="at least one True"):
        check_reset_mask(np.array([False, False]), 2)


def test_take_reset_mask_pops_it_from_the_options_once():
    mask = np.array([True, False])
    options = {"reset_mask": mask, "x": 1}
    assert take_reset_mask(options, None) is mask and options == {"x": 1}
    with pytest.raises(ValueError, match="given twice"):
        take_reset_mask({"reset_mask": mask}, mask)


def test_seeds_and_options_expand_per_env_and_per_group():
    assert expand_seeds(10, 4, group_size=2) == [10, 10, 11, 11]
    assert expand_seeds([1, 2], 4, group_size=2) == [1, 1, 2, 2]
    assert expand_seeds(None, 2) == [None, None]
    with pytest.raises(ValueError, match="num_envs=3"):
        expand_seeds([1, 2], 3)
    assert expand_options([{"a": 1}, None], 4, group_size=2) == [{"a": 1}, {"a": 1}, None, None]
    with pytest.raises(TypeError, match=r"options\[0\]"):
        expand_options([1], 1)


class _Rows:
    _add_info = VectorEnv._add_info

    def __init__(self, num_envs: int) -> None:
        self.num_envs = num_envs


def test_batch_infos_is_add_info_and_unbatch_info_inverts_it():
    per_row = {0: {"lives": 3, "flag": True}, 2: {"lives": 1, "episode": {"r": 1.5}}}
    expected: dict = {}
    for row, info in per_row.items():
        expected = _Rows(3)._add_info(expected, info, row)
    batched = batch_infos([(row, [info]) for row, info in per_row.items()], 3)
    assert batched.keys() == expected.keys()
    for key in expected:
        if isinstance(expected[key], dict):
            continue
        assert (
            np.array_equal(batched[key], expected[key])
            and batched[key].dtype == expected[key].dtype
        )
    assert rows_with_info(batched) == [0, 2]
    assert unbatch_info(batched, 0) == {"lives": 3, "flag": True}
    assert type(unbatch_info(batched, 0)["flag"]) is bool  # a Python bool, as given
    assert unbatch_info(batched, 2) == {"lives": 1, "episode": {"r": 1.5}}
    assert unbatch_info(batched, 1) == {}


def test_unbatch_infos_gives_unmasked_keys_to_every_env():
    infos = {"a": np.array([1, 2]), "_a": np.array([True, False]), "b": [7, 8]}
    assert unbatch_infos(infos, 2) == [{"a": 1, "b": 7}, {"b": 8}]


@pytest.mark.parametrize("numbering", ["alike", "per worker"])
def test_info_columns_merge_like_add_info(numbering):
    # Two workers of 3 rows; keys in every row (one type), in some rows, and
    # with mixed types (cast into the first row's type, as _add_info does).
    per_row = [
        {"lives": 3, "frame": np.int64(10), "mixed": 1},
        {"lives": 2, "frame": np.int64(11), "mixed": 2.5},
        {"lives": 1, "frame": np.int64(12)},
        {"lives": 0, "frame": np.int64(13), "score": np.float32(0.5)},
        {"lives": 5, "frame": np.int64(14), "mixed": np.float32(3.25)},
        {"lives": 4, "frame": np.int64(15)},
    ]
    keys = ["lives", "frame", "mixed", "score"]
    schemas = [{k: c for c, k in enumerate(keys)} for _ in range(2)]
    if numbering == "per worker":
        schemas[1] = {k: c for c, k in enumerate(reversed(keys))}
    groups = [slice(0, 3), slice(3, 6)]
    codes = np.zeros((6, info_columns.INFO_COLUMNS), np.uint8)
    cells = np.zeros((6, info_columns.INFO_COLUMNS), np.uint64)
    for row, info in enumerate(per_row):
        schema = schemas[row // 3]
        for key, value in info.items():
            code = info_columns.CODES[type(value)]
            codes[row, schema[key]] = code
            cells[row : row + 1, schema[key]].view(info_columns._CELL_VIEWS[code])[0] = value
    expected: dict = {}
    for row, info in enumerate(per_row):
        expected = _Rows(6)._add_info(expected, info, row)
    gathered = info_columns.gather(schemas, lambda: groups, codes, cells, 6)
    merged = info_columns.merge_columns({}, gathered, 6)
    # merge_uniform: one C scan for the keys that every row reports with one type.
    fast = info_columns.merge_uniform(schemas, lambda: groups, codes, cells, 6)
    for result in (merged, fast):
        assert list(result.keys()) == list(expected.keys())
        for key in expected:
            assert result[key].dtype == expected[key].dtype, key
            assert np.array_equal(result[key], expected[key]), key
