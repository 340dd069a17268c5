"""The counts behind :meth:`ServerPolicy.stats() <shmvec.rollouts.server.ServerPolicy.stats>`:
requests, turns, tokens, request faults, failed and ended trajectories by kind, and request
latencies (:class:`ServerStats`)."""

from __future__ import annotations

import threading
from collections import Counter, deque
from typing import Any

import numpy as np

from shmvec.rollouts.server_client import InFlightLimit
from shmvec.rollouts.server_outages import CancelledAttempts, Outages

#: Request latencies kept for ``stats()``'s percentiles.
LATENCIES_KEPT = 10_000
#: The counts ``stats()`` always has (0 until counted).
COUNTS = (
    "requests", "turns", "tokens", "interrupted", "tokens_interrupted",
    "compared_turns", "drift_turns",
)  # fmt: skip


class ServerStats:
    """One policy's counts, added to on its event loop and read whole from any thread (one
    lock over both)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._faults: Counter[str] = Counter()
        self._failed: Counter[str] = Counter()
        self._ended: Counter[str] = Counter()
        self._latencies: deque[float] = deque(maxlen=LATENCIES_KEPT)

    def count(self, key: str, n: int = 1) -> None:
        """Adds ``n`` to the count ``key`` (one of ``COUNTS``)."""
        with self._lock:
            self._counts[key] += n

    def fault(self, kind: str) -> None:
        """Counts a failed request of ``kind`` (``ServerFault.kind``)."""
        with self._lock:
            self._faults[kind] += 1

    def fail(self, kind: str) -> None:
        """Counts a turn failed (``PolicyFailure``) by a fault of ``kind``."""
        with self._lock:
            self._failed[kind] += 1

    def end(self, kind: str) -> None:
        """Counts a trajectory ended (``EndTrajectory``) for ``kind``."""
        with self._lock:
            self._ended[kind] += 1

    def latency(self, seconds: float) -> None:
        """Keeps an answered request's latency (the last ``LATENCIES_KEPT``)."""
        with self._lock:
            self._latencies.append(seconds)

    def snapshot(
        self, attempts: CancelledAttempts, outages: Outages, limit: InFlightLimit
    ) -> dict[str, Any]:
        """The counts, with the policy's cancelled attempts, outages and in-flight figures."""
        with self._lock:
            latencies = np.array(self._latencies) if self._latencies else None
            return {
                **dict.fromkeys(COUNTS, 0),
                **self._counts,
                "faults": dict(self._faults),
                "failed": dict(self._failed),
                "ended": dict(self._ended),
                "abandoned": attempts.abandoned,
                "outages": outages.count,
                "outage_s": outages.seconds(),
                "in_flight": limit.in_flight,
                "in_flight_limit": limit.limit,
                "in_flight_peak": limit.peak,
                "latency_p50_s": float(np.percentile(latencies, 50))
                if latencies is not None
                else 0.0,
                "latency_p99_s": float(np.percentile(latencies, 99))
                if latencies is not None
                else 0.0,
            }
