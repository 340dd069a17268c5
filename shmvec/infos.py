"""Numeric scalar infos as typed columns instead of pickles.

Many envs report the same numeric scalars every step (Atari's ``lives``,
``episode_frame_number``, ``frame_number``). A worker writes such an info
(a dict whose values are all ``int``, ``float``, ``bool`` or numpy integer and
float scalars) into the ring slot: per env and column, one type code byte
(0 = absent) and one 8-byte cell. Column numbers are chosen by each worker
the first time it sees a key and announced once in that round's message, so
the steady state sends nothing through the pipe.

The main process rebuilds exactly what ``VectorEnv._add_info`` would have
built from the same dicts: the batch dtype is the type of the first env (in
env order) that reports the key, later values are cast into it, and
``_key`` masks mark who reported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

#: Columns per env. Atari needs 3; an info with a new key beyond this many
#: is pickled instead.
INFO_COLUMNS = 8

#: The scalar types that travel as columns; the code of ``t`` is its index + 1.
#: ``np.bool_`` is absent on purpose: ``_add_info`` batches it into an object
#: array (it is not an ``np.number``).
SCALAR_TYPES: tuple[type, ...] = (
    int, float, bool,
    np.int8, np.int16, np.int32, np.int64,
    np.uint8, np.uint16, np.uint32, np.uint64,
    np.float16, np.float32, np.float64,
)  # fmt: skip
CODES: dict[type, int] = {t: i + 1 for i, t in enumerate(SCALAR_TYPES)}

# Per code: the dtype _add_info batches the value into (np.zeros(n, dtype=type(v)))
# and the view of the 8-byte cell that holds it losslessly.
_BATCH_DTYPES: list[Any] = [None] + [np.dtype(t) for t in SCALAR_TYPES]
_CELL_VIEWS: list[Any] = [None] + [
    np.dtype(np.float64) if d.kind == "f" else np.dtype(np.uint64) if d.kind == "u"
    else np.dtype(np.int64)
    for d in _BATCH_DTYPES[1:]
]  # fmt: skip
CELL_KINDS = [None] + [d.kind for d in _CELL_VIEWS[1:]]  # "f", "u" or "i", by code


#: Where each row's value of a column key comes from (``RowInfos``, shmvec/row_infos.py):
#: ``(code, batch)`` when every row reported the key with one type (``batch``: its
#: batched array, which holds each value exactly), else ``(codes, cells)``, copies of
#: the batch's rows.
ColumnSources = dict[Any, tuple[Any, np.ndarray]]
#: ``column_value`` of a row that did not report the key.
MISSING = object()


def column_value(source: tuple[Any, np.ndarray], row: int) -> Any:
    """Row ``row``'s value of one ``ColumnSources`` entry, as its env returned it
    (``MISSING`` if it did not report the key)."""
    code, values = source
    if isinstance(code, int):
        return SCALAR_TYPES[code - 1](values[row].item())
    row_code = int(code[row])
    if not row_code:
        return MISSING
    return _decode(row_code, values[row : row + 1])


def _decode(code: int, cell: np.ndarray) -> Any:
    """The scalar stored in ``cell`` (a uint64), as its original type."""
    return SCALAR_TYPES[code - 1](cell.view(_CELL_VIEWS[code]).item())


def gather(
    schemas: list[dict], groups: Callable[[], list], codes: np.ndarray, cells: np.ndarray, rows: int
) -> dict[Any, tuple[np.ndarray, np.ndarray]]:
    """Per key: (codes, cells) arrays of length ``rows``, from every worker's columns.

    Each worker numbers its columns on its own. When they all numbered them
    alike (the steady state: every env reports the same keys), a key's column
    is read for all rows at once; else ``groups()[w]`` selects the rows worker
    ``w`` wrote (a slice or index array). The arrays may be views of
    ``codes``/``cells``: read them before the ring slot is reused.
    """
    gathered: dict[Any, tuple[np.ndarray, np.ndarray]] = {}
    first = schemas[0]
    if all(schema == first for schema in schemas):
        for key, col in first.items():
            key_codes = codes[:rows, col]
            if key_codes.any():
                gathered[key] = (key_codes, cells[:rows, col])
        return gathered
    for schema, group in zip(schemas, groups()):
        for key, col in schema.items():
            group_codes = codes[group, col]
            if not group_codes.any():
                continue
            if key not in gathered:
                gathered[key] = (np.zeros(rows, np.uint8), np.zeros(rows, np.uint64))
            key_codes, key_cells = gathered[key]
            key_codes[group] = group_codes
            key_cells[group] = cells[group, col]
    return gathered


def merge_uniform(
    schemas: list[dict],
    groups: Callable[[], list],
    codes: np.ndarray,
    cells: np.ndarray,
    rows: int,
    sources: ColumnSources | None = None,
) -> dict:
    """``merge_columns(gather(...))`` with no other infos, faster where every
    worker numbered its columns alike and every row reports a key with one
    type (the steady state of Atari's infos): one C scan of the type codes
    instead of several numpy passes a key. ``sources``, if given, gets where
    each row's value of each key comes from."""
    first = schemas[0]
    if not all(schema == first for schema in schemas):
        gathered = gather(schemas, groups, codes, cells, rows)
        if sources is not None:
            sources.update(copied_sources(gathered))
        return merge_columns({}, gathered, rows)
    # _worker_loop imports this module's constants, so it is imported here, once
    # both are loaded, whichever was imported first.
    from shmvec._worker_loop import uniform_codes

    infos: dict = {}
    uniform = uniform_codes(codes, list(first.values()), rows)
    for (key, col), code in zip(first.items(), uniform):
        if code:
            infos[key] = cells[:rows, col].view(_CELL_VIEWS[code]).astype(_BATCH_DTYPES[code])
            infos[f"_{key}"] = np.ones(rows, dtype=bool)
            if sources is not None:
                sources[key] = (int(code), infos[key])
            continue
        key_codes = codes[:rows, col]
        if key_codes.any():
            gathered = {key: (key_codes, cells[:rows, col])}
            if sources is not None:
                sources.update(copied_sources(gathered))
            merge_columns(infos, gathered, rows)
    return infos


def copied_sources(gathered: dict) -> ColumnSources:
    """``ColumnSources`` of ``gather``'s arrays, copied (they may be ring views)."""
    return {key: (codes.copy(), cells.copy()) for key, (codes, cells) in gathered.items()}


def merge_columns(infos: dict, gathered: dict, num_envs: int) -> dict:
    """Adds the column infos to ``infos`` as ``_add_info`` would (no other infos)."""
    for key, (key_codes, key_cells) in gathered.items():
        present = key_codes != 0
        rows = np.flatnonzero(present)
        first = int(key_codes[rows[0]])
        array = np.zeros(num_envs, dtype=_BATCH_DTYPES[first])
        if (key_codes[rows] == first).all():
            array[rows] = key_cells[rows].view(_CELL_VIEWS[first]).astype(array.dtype)
        else:  # mixed types: cast one by one, exactly as _add_info assigns
            for row in rows.tolist():
                array[row] = _decode(int(key_codes[row]), key_cells[row : row + 1])
        infos[key] = array
        infos[f"_{key}"] = present
    return infos


def column_dicts(gathered: dict) -> list[tuple[int, list[dict]]]:
    """The per-env info dicts behind the columns, for merging with pickled infos."""
    per_row: dict[int, dict] = {}
    for key, (key_codes, key_cells) in gathered.items():
        for row in np.flatnonzero(key_codes).tolist():
            per_row.setdefault(row, {})[key] = _decode(
                int(key_codes[row]), key_cells[row : row + 1]
            )
    return [(row, [per_row[row]]) for row in sorted(per_row)]
