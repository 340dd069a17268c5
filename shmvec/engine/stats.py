"""Stats: what ``ShmVectorEnv.stats()`` reports, counted as the rounds go."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

logger = logging.getLogger("shmvec")


class Stats:
    """Steps, episodes, time the main process waited, restarts and env resets."""

    def __init__(self) -> None:
        self.steps = 0
        self.episodes = 0
        self.wait_s = 0.0
        self.restarts = 0
        self.env_resets = 0
        self.env_deadlines: dict[int, int] = {}  # worker -> envs past step_deadline
        self.started = time.perf_counter()
        # A check called when ``steps`` reaches ``check_at``; it returns the next
        # count (engine/waiting_check.py). Between calls a batch costs one comparison.
        self.check: Callable[[int], int] | None = None
        self.check_at = 1 << 62

    def watch(self, check: Callable[[int], int]) -> None:
        """Calls ``check(steps)`` from the next batch on, then when ``steps`` reaches
        the count it returned."""
        self.check, self.check_at = check, 0

    def count(self, rows: int, ended: int) -> None:
        """Counts a batch of ``rows`` results, ``ended`` of which ended an episode."""
        self.steps += rows
        self.episodes += ended
        if self.steps >= self.check_at:  # check_at is never reached without a check
            self.check_at = self.check(self.steps)  # type: ignore[misc]

    def note_env_resets(self, infos: dict, env_ids: np.ndarray) -> None:
        """``on_env_error="reset"``: counts and logs the envs reset after an error."""
        rows = np.flatnonzero(infos["_env_error"])
        self.env_resets += len(rows)
        for row in rows.tolist():
            logger.warning("env %d was reset after %s", env_ids[row], infos["env_error"][row])

    def note_deadlines(self, infos: dict, env_ids: np.ndarray, workers: np.ndarray) -> None:
        """``step_deadline``: counts (per worker: ``workers[row]`` for each row)
        and logs the envs replaced after running past it."""
        rows = np.flatnonzero(infos["_step_deadline"])
        for row in rows.tolist():
            worker = int(workers[row])
            self.env_deadlines[worker] = self.env_deadlines.get(worker, 0) + 1
            logger.warning(
                "env %d ran past step_deadline=%s s: replaced by a new env",
                env_ids[row], infos["step_deadline"][row],
            )  # fmt: skip

    def note_block_deadlines(self, infos: dict, blocks: list[range]) -> None:
        """``note_deadlines`` for a batch of every env in env order, worker
        ``k`` stepping ``blocks[k]`` (sync mode)."""
        workers = np.repeat(np.arange(len(blocks)), [len(block) for block in blocks])
        self.note_deadlines(infos, np.arange(len(workers)), workers)

    def log_summary(self, busy_ns: np.ndarray) -> None:
        """Logs the report at DEBUG (when a vector env closes)."""
        if logger.isEnabledFor(logging.DEBUG):
            stats = self.report(busy_ns)
            logger.debug(
                "closing: %d steps, %.0f steps/s, main waited %.0f%%, workers busy %s",
                stats["steps"], stats["steps_per_s"], 100 * stats["main_wait_fraction"],
                ", ".join(f"{100 * f:.0f}%" for f in stats["worker_busy_fraction"]),
            )  # fmt: skip

    def report(
        self, busy_ns: np.ndarray, cpu_s: Sequence[float] = (), env_threads: Sequence[int] = ()
    ) -> dict[str, Any]:
        """The dict of ``ShmVectorEnv.stats()``; per worker: ``busy_ns`` (time
        serving commands), ``cpu_s`` (its process's CPU time) and ``env_threads``."""
        elapsed = time.perf_counter() - self.started
        return {
            "steps": self.steps,
            "steps_per_s": self.steps / elapsed if elapsed > 0 else 0.0,
            "episodes": self.episodes,
            "main_wait_fraction": self.wait_s / elapsed if elapsed > 0 else 0.0,
            "worker_busy_fraction": (busy_ns / 1e9 / elapsed).tolist() if elapsed > 0 else [],
            "worker_cpu_fraction": [c / elapsed if elapsed > 0 else 0.0 for c in cpu_s],
            "worker_env_threads": list(env_threads),
            "elapsed_s": elapsed,
            "worker_restarts": self.restarts,
            "env_resets": self.env_resets,
            "env_deadlines": [self.env_deadlines.get(k, 0) for k in range(len(busy_ns))],
        }
