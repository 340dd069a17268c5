"""Where every column and control word lies in the shared segment.

``SegmentLayout`` places the action slab, every ring slot's result columns
(observations by the codecs of shmvec/codecs.py, then ``RESULT_COLUMNS``), the
observation lease regions and the control words (barrier, per-worker lines,
ring, doorbells, env commands), each on its own cache line; ``make_layout``
derives it from a ``WorkerSpec`` the same way in main and in every worker, so
only the spec travels to the workers.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from shmvec import _core
from shmvec.codecs import ColumnSpec, make_codec
from shmvec.infos import INFO_COLUMNS
from shmvec.protocol import (
    LINE_BUSY_NS,
    LINE_CURRENT_ENV,
    LINE_ENV_STARTED_NS,
    LINE_ENV_THREADS,
    LINE_FINISHED,
    LINE_MESSAGE,
    SLOT_MASK,
)

CACHE_LINE = 64
PAGE = 4096
#: Lease regions: the caller may keep this many lent observation batches
#: before batches are copied again (sync mode: ``self.observations`` holds one
#: of them; async mode has one more region per ring slot) ...
LEASE_REGIONS = 4
#: ... within this many bytes of the segment (pages are taken only once used),
LEASE_BYTES = 256 << 20
#: ... for batches of this many bytes of observations or more: below, a copy
#: costs less than a lease (docs/design/lent-observations.md).
LEASE_MIN_BYTES = 64 << 10


def _align(offset: int, alignment: int = CACHE_LINE) -> int:
    return (offset + alignment - 1) // alignment * alignment


class SegmentLayout:
    """Byte offsets of every region of the segment.

    ``header | barrier | worker words | ring words | slot regions | doorbells |
    env commands | action slab | ring slot 0 .. D-1 | lease region 0 .. L-1``,
    each region and each column starting on its own cache line. A ring slot
    holds ``rows`` results (all envs in sync mode, ``batch_size`` in async
    mode): the observation columns, the reward (float64), terminated and
    truncated (uint8), the info columns (see shmvec/infos.py), the env id
    (int32) and a message flag (uint8). A lease region holds one batch's
    observation columns, handed to the caller as the observations themselves
    instead of a copy (shmvec/engine/leases.py; ``lease_regions`` says how many).

    Built identically in the main process and in each worker from the same
    arguments, so only the arguments travel to the workers.
    """

    HEADER_BYTES = CACHE_LINE

    def __init__(
        self,
        num_envs: int,
        num_workers: int,
        action_columns: list[ColumnSpec],
        obs_columns: list[ColumnSpec],
        num_slots: int,
        rows: int,
        word_bytes: WordBytes,
        obs_regions: int = 0,
    ) -> None:
        if num_slots < 2:
            raise ValueError(f"ring_depth must be >= 2, got {num_slots}")
        if num_slots > SLOT_MASK + 1:
            raise ValueError(f"at most {SLOT_MASK + 1} ring slots, got {num_slots}")
        self.num_envs = num_envs
        self.num_workers = num_workers
        self.num_slots = num_slots
        self.rows = rows
        offset = self.HEADER_BYTES
        self.barrier_offset = offset = _align(offset)
        offset += word_bytes.barrier
        # One uint32 per worker, each on its own line: "a message follows".
        self.worker_words_offset = offset = _align(offset)
        offset += num_workers * CACHE_LINE
        self.ring_offset = offset = _align(offset)
        offset += word_bytes.ring
        # One uint32 per ring slot (async mode): 1 + the lease region its rows'
        # observations go to, 0 for its own columns (set by main before it
        # releases the slot; shmvec/engine/async_wire.py).
        self.slot_regions_offset = offset = _align(offset)
        offset += 4 * num_slots
        self.doorbell_offsets = []
        for _ in range(num_workers):
            self.doorbell_offsets.append(_align(offset))
            offset = self.doorbell_offsets[-1] + word_bytes.doorbell
        self.env_commands_offset = offset = _align(offset)
        offset += num_envs
        self.action_columns = action_columns
        self.action_offsets, offset = self._place(offset, action_columns, num_envs)
        self.obs_columns = obs_columns
        slot_columns = [*obs_columns, *RESULT_COLUMNS.values()]
        self.slot_columns = slot_columns
        self.slot_offsets = []
        for _ in range(num_slots):
            offsets, offset = self._place(offset, slot_columns, rows)
            self.slot_offsets.append(offsets)
        self.ring_end = _align(offset, PAGE)  # where lease regions begin (bridges pin up to here)
        self.region_offsets = []
        for _ in range(obs_regions):
            # Page-aligned: a region's pages serve one caller's arrays at a time.
            offsets, offset = self._place(_align(offset, PAGE), obs_columns, rows)
            self.region_offsets.append(offsets)
        self.total_bytes = _align(offset, PAGE)

    @staticmethod
    def _place(offset: int, columns: list[ColumnSpec], rows: int) -> tuple[list[int], int]:
        offsets = []
        for spec in columns:
            offset = _align(offset)
            offsets.append(offset)
            offset += rows * spec.dtype.itemsize * math.prod(spec.shape)
        return offsets, offset

    @staticmethod
    def _views(buffer, offsets, columns, rows) -> list[np.ndarray]:
        return [
            np.ndarray((rows, *spec.shape), spec.dtype, buffer=buffer, offset=off)
            for off, spec in zip(offsets, columns)
        ]

    def slot_regions(self, buffer) -> np.ndarray:
        """uint32 per ring slot: where its rows' observations go (async mode)."""
        return np.ndarray(
            (self.num_slots,), np.uint32, buffer=buffer, offset=self.slot_regions_offset
        )

    def region_views(self, buffer, region: int) -> list[np.ndarray]:
        """The observation columns of lease region ``region``."""
        return self._views(buffer, self.region_offsets[region], self.obs_columns, self.rows)

    def region_span(self, region: int) -> tuple[int, int]:
        """Lease region ``region``'s bytes: (first offset, end offset)."""
        offsets = self.region_offsets[region]
        spec = self.obs_columns[-1]
        return offsets[0], offsets[-1] + self.rows * spec.dtype.itemsize * math.prod(spec.shape)

    def worker_words(self, buffer) -> np.ndarray:
        """uint32 per worker, 1 when a pickled message follows its round (the
        first of its cache line's words: shmvec/protocol.py, ``LINE_*``)."""
        return self._line_words(buffer, np.uint32, LINE_MESSAGE)

    def worker_env_threads(self, buffer) -> np.ndarray:
        """uint32 per worker: how many of its envs it steps at once (1: serially)."""
        return self._line_words(buffer, np.uint32, LINE_ENV_THREADS)

    def worker_current_env(self, buffer) -> np.ndarray:
        """uint32 per worker: 1 + the env it is stepping, 0 between envs."""
        return self._line_words(buffer, np.uint32, LINE_CURRENT_ENV)

    def worker_finished_generation(self, buffer) -> np.ndarray:
        """uint32 per worker: the last barrier generation it finished."""
        return self._line_words(buffer, np.uint32, LINE_FINISHED)

    def _line_words(self, buffer, dtype, column: int) -> np.ndarray:
        """Word ``column`` of each worker's line, viewed as ``dtype``."""
        itemsize = np.dtype(dtype).itemsize
        lines = (self.num_workers, CACHE_LINE // itemsize)
        words = np.ndarray(lines, dtype, buffer=buffer, offset=self.worker_words_offset)
        return words[:, column]

    def worker_busy_ns(self, buffer) -> np.ndarray:
        """uint64 per worker: nanoseconds it spent serving commands (its own line)."""
        return self._line_words(buffer, np.uint64, LINE_BUSY_NS)

    def worker_env_started_ns(self, buffer) -> np.ndarray:
        """uint64 per worker (async mode): CLOCK_MONOTONIC ns when it began its
        current env (``env_timeout``)."""
        return self._line_words(buffer, np.uint64, LINE_ENV_STARTED_NS)

    def env_commands(self, buffer) -> np.ndarray:
        """uint8 per env (async mode): what the env's worker must do next."""
        return np.ndarray(
            (self.num_envs,), np.uint8, buffer=buffer, offset=self.env_commands_offset
        )

    def action_views(self, buffer) -> list[np.ndarray]:
        return self._views(buffer, self.action_offsets, self.action_columns, self.num_envs)

    def slot_views(self, buffer, slot: int) -> SlotViews:
        """The arrays of one ring slot."""
        views = self._views(buffer, self.slot_offsets[slot], self.slot_columns, self.rows)
        obs = len(self.obs_columns)
        return SlotViews(obs=views[:obs], **dict(zip(RESULT_COLUMNS, views[obs:])))


def lease_regions(obs_columns: list[ColumnSpec], rows: int, ring_slots: int = 0) -> int:
    """How many lease regions of ``rows`` rows a segment gets: in sync mode up to
    ``LEASE_REGIONS``; in async mode ``ring_slots`` more (one is bound to each
    ring slot that workers may fill), or none if the budget cannot spare one."""
    nbytes = rows * sum(spec.dtype.itemsize * math.prod(spec.shape) for spec in obs_columns)
    if nbytes < LEASE_MIN_BYTES:
        return 0
    regions = min(LEASE_REGIONS + ring_slots, LEASE_BYTES // nbytes)
    return regions if regions > ring_slots else 0


class WordBytes(NamedTuple):
    """Sizes of the C++ control structures (from shmvec._core)."""

    barrier: int
    ring: int
    doorbell: int


class SlotViews(NamedTuple):
    """One ring slot: a batch of results, one row each (``RESULT_COLUMNS``)."""

    obs: list[np.ndarray]  # the observation codec's columns
    rewards: np.ndarray
    terminations: np.ndarray
    truncations: np.ndarray
    info_codes: np.ndarray
    info_cells: np.ndarray
    env_ids: np.ndarray
    messages: np.ndarray


# A ring slot's columns after the observation's, by SlotViews field (its
# constructor rejects a name it lacks), per row.
RESULT_COLUMNS = {
    "rewards": ColumnSpec(np.dtype(np.float64), ()),
    "terminations": ColumnSpec(np.dtype(np.uint8), ()),
    "truncations": ColumnSpec(np.dtype(np.uint8), ()),
    "info_codes": ColumnSpec(np.dtype(np.uint8), (INFO_COLUMNS,)),  # shmvec/infos.py
    "info_cells": ColumnSpec(np.dtype(np.uint64), (INFO_COLUMNS,)),
    "env_ids": ColumnSpec(np.dtype(np.int32), ()),  # which env wrote the row (async mode)
    "messages": ColumnSpec(np.dtype(np.uint8), ()),  # 1: a pickled message follows (async)
}


def make_layout(spec: Any) -> SegmentLayout:
    """The segment's layout for ``spec`` (a ``shmvec.worker.WorkerSpec``),
    derived the same way in main and workers."""
    return SegmentLayout(
        spec.num_envs,
        spec.num_workers,
        make_codec(spec.action_space, True, spec.text_bytes).columns(),
        make_codec(spec.observation_space, spec.shared_memory, spec.text_bytes).columns(),
        spec.num_slots,
        spec.batch_size,
        WordBytes(
            _core.StepBarrier.nbytes,
            _core.ResultRing.nbytes(spec.num_slots),
            _core.Doorbell.nbytes,
        ),
        obs_regions=spec.obs_regions,
    )
