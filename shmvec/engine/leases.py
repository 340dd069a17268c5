"""ObsLeases: a batch of observations handed over without a copy.

With ``copy=True``, ``step``, ``reset`` and ``recv`` return observations the
caller owns. Instead of copying them out of the ring slot, a batch whose
observations are large (``layout.lease_regions``) is written into a *lease
region* of the segment that nobody holds, and the caller gets arrays over
that region: together they keep it (one ``RegionLease``) until the last of
them is gone, and only then may a later batch be written there. While every
region is held (the caller keeps several batches), batches are written into
their ring slot and copied out, as without regions.

Data flow, sync mode: ``RoundDriver`` takes a region (``next_region``) when
it posts a round and names it in the command's arg (protocol.REGION_SHIFT);
the workers write that round's observations there; ``read`` wraps the region
for the caller, or the next ``next_region`` frees it if they were never read
(an error, a timed-out round). Async mode: ``AsyncWire`` binds each ring
slot to a region the same way (the segment's slot-regions table) before it
releases the slot to the workers, who write the observations of the rows
they claim there; ``recv`` wraps the region of the slot it returns.

Who may call what: the main process's one thread. Regions come back to
``free`` from whichever thread drops the caller's last array.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shmvec import _worker_loop
from shmvec.codecs import Codec, Spills
from shmvec.layout import SegmentLayout


class ObsLeases:
    """The lease regions of one segment.

    Args:
        segment: the mapped segment (``shmvec._core.Segment``).
        layout: its layout, with ``region_offsets``.
        obs_codec: the observation space's codec.
    """

    def __init__(self, segment, layout: SegmentLayout, obs_codec: Codec) -> None:
        self.segment = segment
        self.codec = obs_codec
        regions = range(len(layout.region_offsets))
        self.free = list(reversed(regions))  # pop() takes the lowest first
        buffer = memoryview(segment)
        self.views = [layout.region_views(buffer, r) for r in regions]
        self.spans = [layout.region_span(r) for r in regions]
        # Per region, per leaf: (offset in the region, shape, dtype).
        self.leaves = [
            [(v.ctypes.data - segment.address - start, v.shape, v.dtype) for v in views]
            for views, (start, _) in zip(self.views, self.spans)
        ]

    def next_region(self, unread: int | None, lend: bool) -> int | None:
        """The region for the next batch: a free one if ``lend`` (results are
        copies) and one is free, else None (the ring slot's own columns). The
        region ``unread``, whose batch was never read, is free again after
        this choice, so the next batch never lands where the last one was."""
        region = self.free.pop() if lend and self.free else None
        if unread is not None:
            self.free.append(unread)
        return region

    def read(self, region: int, rows: int | None = None, spills: Spills | None = None) -> Any:
        """The observations written into ``region`` (its first ``rows``; None:
        all), as arrays over it: the region is held until the last of them (and
        of their views) is gone. ``spills``: the rows' spilled text
        (shmvec/codecs.py)."""
        start, stop = self.spans[region]
        lease = _worker_loop.RegionLease(
            self.segment, self.segment.address + start, stop - start, self.free, region
        )
        arrays = [
            np.ndarray(
                shape if rows is None else (rows, *shape[1:]),
                dtype,
                buffer=memoryview(lease),
                offset=offset,
            )
            for offset, shape, dtype in self.leaves[region]
        ]
        return self.codec.read_batch(arrays, False, spills)
