"""SegmentLayout: every region of the segment on its own lines, none overlapping."""

from __future__ import annotations

import numpy as np
import pytest
from gymnasium import spaces

from shmvec import _core
from shmvec.codecs import make_codec
from shmvec.layout import CACHE_LINE, PAGE, SegmentLayout, WordBytes, lease_regions


def _words(num_slots: int) -> WordBytes:
    return WordBytes(
        _core.StepBarrier.nbytes, _core.ResultRing.nbytes(num_slots), _core.Doorbell.nbytes
    )


OBS = spaces.Dict(
    {"image": spaces.Box(0, 255, (3, 7), np.uint8), "pos": spaces.Box(-1, 1, (3,), np.float64)}
)
ACTION = spaces.MultiDiscrete([3, 5])


def _layout(num_envs=6, num_workers=2, num_slots=3, rows=6, regions=2) -> SegmentLayout:
    return SegmentLayout(
        num_envs, num_workers, make_codec(ACTION).columns(), make_codec(OBS).columns(),
        num_slots, rows, _words(num_slots), obs_regions=regions,
    )  # fmt: skip


def _arrays(layout: SegmentLayout, buffer) -> dict[str, np.ndarray]:
    """Every array the layout places, by name."""
    arrays = {f"action{i}": v for i, v in enumerate(layout.action_views(buffer))}
    for slot in range(layout.num_slots):
        views = layout.slot_views(buffer, slot)
        for i, obs in enumerate(views.obs):
            arrays[f"slot{slot}.obs{i}"] = obs
        for name in ("rewards", "terminations", "truncations", "info_codes", "info_cells"):
            arrays[f"slot{slot}.{name}"] = getattr(views, name)
        arrays[f"slot{slot}.env_ids"] = views.env_ids
        arrays[f"slot{slot}.messages"] = views.messages
    for region in range(len(layout.region_offsets)):
        for i, column in enumerate(layout.region_views(buffer, region)):
            arrays[f"region{region}.obs{i}"] = column
    arrays["env_commands"] = layout.env_commands(buffer)
    arrays["slot_regions"] = layout.slot_regions(buffer)
    return arrays


@pytest.mark.parametrize("sync", [True, False])
def test_columns_are_line_aligned_disjoint_and_inside_the_segment(sync):
    layout = _layout(rows=6 if sync else 2)
    buffer = bytearray(layout.total_bytes)
    base = np.frombuffer(buffer, np.uint8).ctypes.data
    spans = []
    for name, array in _arrays(layout, buffer).items():
        start = array.ctypes.data - base
        assert start % CACHE_LINE == 0, name
        assert start + array.nbytes <= layout.total_bytes, name
        spans.append((start, start + array.nbytes, name))
    words = [(layout.barrier_offset, "barrier"), (layout.ring_offset, "ring")]
    words += [(offset, f"doorbell{i}") for i, offset in enumerate(layout.doorbell_offsets)]
    for offset, name in words:
        assert offset % CACHE_LINE == 0 and offset >= SegmentLayout.HEADER_BYTES, name
    spans.sort()
    for (_, end, name), (start, _, other) in zip(spans, spans[1:]):
        assert end <= start, f"{name} overlaps {other}"
    assert layout.total_bytes % PAGE == 0


def test_slots_have_the_rows_of_a_round_and_lease_regions_follow_the_ring():
    layout = _layout(num_envs=6, rows=2, regions=2)
    buffer = bytearray(layout.total_bytes)
    views = layout.slot_views(buffer, 1)
    assert views.rewards.shape == (2,) and views.obs[0].shape[0] == 2
    assert [v.shape for v in layout.action_views(buffer)] == [(6, 2)]
    for region in range(2):
        start, stop = layout.region_span(region)
        assert start >= layout.ring_end and start % PAGE == 0 and stop <= layout.total_bytes
    assert layout.ring_end % PAGE == 0


def test_writes_to_one_slot_leave_the_others_alone():
    layout = _layout()
    buffer = bytearray(layout.total_bytes)
    slots = [layout.slot_views(buffer, k) for k in range(layout.num_slots)]
    slots[1].rewards[:] = 7.0
    slots[1].obs[0][:] = 9
    slots[1].env_ids[:] = -1
    for k in (0, 2):
        assert not slots[k].rewards.any() and not slots[k].obs[0].any()
        assert not slots[k].env_ids.any()
    assert (slots[1].rewards == 7.0).all()


def test_worker_words_each_sit_on_their_workers_line():
    layout = _layout(num_workers=3)
    buffer = bytearray(layout.total_bytes)
    flags = layout.worker_words(buffer)
    current = layout.worker_current_env(buffer)
    finished = layout.worker_finished_generation(buffer)
    current[1] = 5
    finished[2] = 9
    assert flags.tolist() == [0, 0, 0]
    assert current.tolist() == [0, 5, 0] and finished.tolist() == [0, 0, 9]
    base = np.frombuffer(buffer, np.uint8).ctypes.data
    lines = {(a[i : i + 1].ctypes.data - base) // CACHE_LINE for a in (flags,) for i in range(3)}
    assert len(lines) == 3


@pytest.mark.parametrize("num_slots", [0, 1])
def test_a_ring_needs_two_slots(num_slots):
    with pytest.raises(ValueError, match="ring_depth must be >= 2"):
        _layout(num_slots=num_slots)


def test_lease_regions_only_for_large_batches_and_one_per_async_slot_more():
    small = make_codec(spaces.Box(0, 1, (4,), np.float32)).columns()
    large = make_codec(spaces.Box(0, 255, (84, 84, 4), np.uint8)).columns()
    assert lease_regions(small, rows=8) == 0
    sync = lease_regions(large, rows=8)
    assert sync > 0
    assert lease_regions(large, rows=8, ring_slots=3) == sync + 3
