"""Each row's info as its env returned it: ``RowInfos`` over a batch of infos, and
``infos_by_row`` to get them from whichever vector env returned the batch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shmvec.batching import unbatch_info
from shmvec.infos import MISSING, column_value

__all__ = ["RowInfos", "infos_by_row"]


class RowInfos:
    """One batch's infos row by row, each as its env returned it.

    gymnasium's batched infos (``VectorEnv._add_info``) keep values, not types:
    a Python ``int``, ``float`` or ``bool`` comes back from its row as a numpy
    scalar, and a row whose value has another type than the first row's is cast
    into the first one's (``1.5`` after an ``int`` becomes ``1``). A vector env
    that has each row's own info (``ShmVectorEnv.row_infos()``) keeps it here:
    the dicts its workers pickled, and for numeric info columns each value's
    type code (shmvec/infos.py). ``unbatched(infos)`` is the fallback for any
    other vector env: ``unbatch_info`` of each row.

    Args:
        batched: the batched infos these rows are of (the dict the vector env
            returned).
        items: ``[(row, [info, ...])]``, the pickled infos, in row order.
        columns: the numeric info columns' sources (``infos.ColumnSources``).
    """

    def __init__(self, batched: dict, items: list | None = None, columns: dict | None = None):
        self.batched = batched
        self._items = items or []
        self._columns = columns or {}
        self._by_row: dict[int, list[dict]] | None = None
        self._unbatched = False

    @classmethod
    def unbatched(cls, infos: dict) -> RowInfos:
        """Rows cut out of ``infos`` by ``unbatch_info`` (numpy scalars where the
        batch has arrays): for a vector env that keeps no rows of its own."""
        rows = cls(infos)
        rows._unbatched = True
        return rows

    def info(
        self, row: int, skip: frozenset[str] = frozenset(), only: Sequence[str] | None = None
    ) -> dict[str, Any]:
        """Row ``row``'s info: without the keys ``skip`` (and their ``_key`` masks);
        with ``only``, its keys of ``only`` alone."""
        if self._unbatched:
            batched = self.batched
            if only is not None:
                picked = [k for k in only if k in batched]
                kept = {k: batched[k] for k in picked}
                kept |= {f"_{k}": batched[f"_{k}"] for k in picked if f"_{k}" in batched}
            else:
                kept = {k: v for k, v in batched.items() if k not in skip}
            return unbatch_info(kept, row) if kept else {}
        if self._by_row is None:
            self._by_row = {}
            for r, dicts in self._items:
                self._by_row.setdefault(r, []).extend(dicts)
        info: dict[str, Any] = {}
        for d in self._by_row.get(row, ()):
            _merge_info(info, d)
        if self._columns:
            for key, source in self._columns.items():
                value = column_value(source, row)
                if value is not MISSING:
                    info[key] = value
        if only is not None:
            return {k: info[k] for k in only if k in info}
        if skip:
            return {k: v for k, v in info.items() if k not in skip}
        return info


def _merge_info(into: dict, info: dict) -> None:
    """``info`` merged into ``into`` as ``_add_info`` merges a row's dicts: a later
    key replaces an earlier one, nested dicts (but ``final_obs``) are merged."""
    for key, value in info.items():
        old = into.get(key)
        if isinstance(value, dict) and isinstance(old, dict) and key != "final_obs":
            merged = dict(old)
            _merge_info(merged, value)
            into[key] = merged
        else:
            into[key] = value


def infos_by_row(envs: Any, infos: dict) -> RowInfos:
    """The rows of ``infos``, the batched infos ``envs`` has just returned: as each
    env returned them where ``envs`` keeps them (``row_infos()``, of the same
    batch), else ``RowInfos.unbatched(infos)``."""
    keeps = getattr(envs, "row_infos", None)
    if keeps is not None:
        rows = keeps()
        if rows is not None and rows.batched is infos:
            return rows
    return RowInfos.unbatched(infos)
