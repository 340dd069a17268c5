"""ObsLeases: lease regions handed to the caller as the observations themselves."""

from __future__ import annotations

import gc

import numpy as np
from gymnasium import spaces

from shmvec import _core
from shmvec.codecs import make_codec
from shmvec.engine.leases import ObsLeases
from shmvec.layout import SegmentLayout, WordBytes

WORDS = WordBytes(_core.StepBarrier.nbytes, _core.ResultRing.nbytes(2), _core.Doorbell.nbytes)


def _leases(space: spaces.Space, rows: int = 4, regions: int = 3) -> ObsLeases:
    codec = make_codec(space)
    layout = SegmentLayout(
        rows, 2, make_codec(spaces.Discrete(2)).columns(), codec.columns(), 2, rows, WORDS,
        obs_regions=regions,
    )  # fmt: skip
    segment = _core.Segment.create_private(layout.total_bytes)
    return ObsLeases(segment, layout, codec)


BOX = spaces.Box(-1.0, 1.0, (5,), np.float32)


def test_regions_are_lent_lowest_first_and_only_while_results_are_copies():
    leases = _leases(BOX)
    assert leases.next_region(None, lend=False) is None
    assert [leases.next_region(None, lend=True) for _ in range(4)] == [0, 1, 2, None]


def test_an_unread_region_is_free_again_but_not_for_the_very_next_batch():
    leases = _leases(BOX)
    first = leases.next_region(None, lend=True)
    second = leases.next_region(first, lend=True)  # the first batch was never read
    assert (first, second) == (0, 1)
    assert leases.next_region(second, lend=True) == 0


def test_a_read_region_is_held_until_the_last_array_over_it_is_gone():
    leases = _leases(BOX)
    region = leases.next_region(None, lend=True)
    (column,) = leases.views[region]
    column[:] = np.arange(20, dtype=np.float32).reshape(4, 5)
    obs = leases.read(region)
    assert np.array_equal(obs, np.arange(20, dtype=np.float32).reshape(4, 5))
    assert obs.base is not None and region not in leases.free
    row = obs[2]  # a view keeps it too
    del obs
    gc.collect()
    assert region not in leases.free
    assert row.tolist() == [10.0, 11.0, 12.0, 13.0, 14.0]
    del row
    gc.collect()
    assert region in leases.free
    assert leases.next_region(None, lend=True) == region


def test_a_dict_of_columns_is_read_from_one_region():
    space = spaces.Dict({"a": BOX, "b": spaces.Box(0, 255, (2, 3), np.uint8)})
    leases = _leases(space, rows=3, regions=2)
    region = leases.next_region(None, lend=True)
    for value, column in enumerate(leases.views[region], start=1):
        column[...] = value
    obs = leases.read(region)
    assert set(obs) == {"a", "b"}
    assert obs["a"].shape == (3, 5) and np.all(obs["a"] == 1)
    assert obs["b"].shape == (3, 2, 3) and obs["b"].dtype == np.uint8 and np.all(obs["b"] == 2)
    start, stop = leases.spans[region]
    base = leases.segment.address
    for key in obs:
        offset = obs[key].ctypes.data - base
        assert start <= offset and offset + obs[key].nbytes <= stop
    del obs
    gc.collect()
    assert region in leases.free
