"""Batched values cut into rows and joined again, whatever the space: arrays (one
row each), tuples of strings (text), and dicts of those."""

from __future__ import annotations

from typing import Any

import numpy as np


def rows_of(batch: Any) -> list[Any]:
    """A batched value (array, tuple of texts, dict of those) as one value per row."""
    if isinstance(batch, np.ndarray):
        return [row.copy() if row.ndim else row for row in batch] if batch.ndim > 1 else list(batch)
    if isinstance(batch, dict):
        columns = {key: rows_of(value) for key, value in batch.items()}
        n = len(next(iter(columns.values()))) if columns else 0
        return [{key: column[i] for key, column in columns.items()} for i in range(n)]
    return list(batch)


def join_batches(batches: list[Any]) -> Any:
    """Batched values (of the same space) as one batch, in order."""
    if len(batches) == 1:
        return batches[0]
    first = batches[0]
    if isinstance(first, np.ndarray):
        return np.concatenate(batches)
    if isinstance(first, dict):
        return {key: join_batches([b[key] for b in batches]) for key in first}
    return tuple(value for batch in batches for value in batch)


def take_rows(batch: Any, rows: list[int]) -> Any:
    """Rows ``rows`` of a batched value, batched the same way."""
    if isinstance(batch, np.ndarray):
        return batch[rows]
    if isinstance(batch, dict):
        return {key: take_rows(value, rows) for key, value in batch.items()}
    return tuple(batch[i] for i in rows)
