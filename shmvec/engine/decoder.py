"""ResultDecoder: ring slot rows and worker messages to gymnasium's results.

Data flow: workers leave a round's (or an async batch's) results in a ring
slot's columns and, when there is more, in messages; the decoder turns them
into the observation batch, the (rewards, terminations, truncations) arrays
and the infos dict, with one info merge for whole batches and async rows.
Text that spilled out of its row (shmvec/codecs.py, ``Utf8TextCodec``) comes
in the messages' ``"spills"`` and is put back in its row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from shmvec import _worker_loop
from shmvec import infos as info_columns
from shmvec.batching import batch_infos
from shmvec.codecs import Spills
from shmvec.engine.leases import ObsLeases
from shmvec.errors import add_note
from shmvec.row_infos import RowInfos


class ResultDecoder:
    """Decodes results; owns each worker's info column schema.

    Args:
        obs_codec: the observation space's codec (shmvec/codecs.py).
        slots: the ring slots' views.
        blocks: each worker's env ids.
        copy: return copies (True) or views of the ring.
        leases: the segment's lease regions (large observations), or None.
    """

    def __init__(
        self, obs_codec, slots: list, blocks: list[range], copy: bool, leases: ObsLeases | None
    ) -> None:
        self.obs_codec = obs_codec
        self.slots = slots
        self.leases = leases
        self.blocks = blocks
        self.num_envs = blocks[-1].stop
        self.copy = copy
        self.schemas: list[dict] = [{} for _ in blocks]  # per worker: info key -> column
        block_groups = [slice(rows.start, rows.stop) for rows in blocks]
        self.block_groups = lambda: block_groups  # a sync round's rows per worker, on demand
        self.pickled_obs: list | None = None  # last obs of each env, pickled spaces
        # Sync mode: the spilled text of the last batch read, by env, and what a
        # masked reset carries over of it (carry_over_obs).
        self.last_spills: Spills = {}
        self.carried_spills: Spills = {}
        # per slot: (rewards, terminations, truncations), the flags as bool
        self._outcomes = [
            (v.rewards, v.terminations.view(np.bool_), v.truncations.view(np.bool_)) for v in slots
        ]
        self.columns = [_worker_loop.SlotColumns(v) for v in slots]
        self.slot_rows = len(slots[0].rewards)  # rows of a ring slot: a whole batch
        # The last batch's infos and what its rows came from (pickled dicts, column
        # sources), made into RowInfos when asked for (row_infos()).
        self._last_infos: tuple = ({}, None, None)
        self._row_infos: RowInfos | None = None

    def learn_columns(self, index: int, message: dict) -> None:
        """Worker ``index``'s info columns announced in ``message``."""
        self.schemas[index].update(message.get("info_columns", ()))

    def merge_infos(self, views, groups: Callable[[], list], messages, rows: int) -> dict[str, Any]:
        """The infos of ``rows`` rows of ``views``: pickled ones from ``messages``
        and numeric columns (``groups()[w]``: the rows worker ``w`` wrote, asked
        for only when workers number their columns differently), merged in row
        order as ``VectorEnv._add_info`` would."""
        pickled = [item for m in messages for item in m.get("infos", ())]
        has_columns = any(self.schemas)
        if not pickled:
            if not has_columns:
                return self._kept({})
            sources: dict = {}
            infos = info_columns.merge_uniform(
                self.schemas, groups, views.info_codes, views.info_cells, rows, sources
            )
            self._last_infos, self._row_infos = (infos, None, sources), None
            return infos
        gathered = {}
        if has_columns:
            gathered = info_columns.gather(
                self.schemas, groups, views.info_codes, views.info_cells, rows
            )
        items = sorted(pickled + info_columns.column_dicts(gathered), key=lambda item: item[0])
        infos = batch_infos(items, rows)
        self._last_infos, self._row_infos = (infos, items, None), None
        return infos

    def _kept(self, infos: dict) -> dict:
        """``infos``, of rows that reported nothing, kept as the last batch's."""
        self._last_infos, self._row_infos = (infos, None, None), None
        return infos

    def row_infos(self) -> RowInfos:
        """The last batch's infos row by row, as each env returned them."""
        if self._row_infos is None:
            self._row_infos = RowInfos(*self._last_infos)
        return self._row_infos

    def batch_infos(self, slot: int, messages: dict[int, dict]) -> dict[str, Any]:
        """A sync round's infos, ``messages`` by worker."""
        if not messages and not any(self.schemas):
            return self._kept({})
        for index, message in messages.items():
            self.learn_columns(index, message)
        views = self.slots[slot]
        return self.merge_infos(views, self.block_groups, messages.values(), self.num_envs)

    def batch_obs(self, slot: int, messages: dict[int, dict], region: int | None = None) -> Any:
        """A sync round's observations, from lease region ``region`` if not None."""
        if self.obs_codec.can_spill:
            spills = self.carried_spills
            self.carried_spills = {}
            for message in messages.values():
                spills.update(message.get("spills", ()))
            self.last_spills = spills
            if region is not None and self.leases is not None:
                return self.leases.read(region, spills=spills)
            return self.obs_codec.read_batch(self.slots[slot].obs, self.copy, spills)
        if region is not None and self.leases is not None:
            return self.leases.read(region)
        if self.obs_codec.pickled:
            values = self.pickled_obs or [None] * self.num_envs
            for message in messages.values():
                for row, value in message.get("obs", {}).items():
                    values[row] = value
            self.pickled_obs = values
            return self.obs_codec.read_batch(values, self.copy)
        return self.obs_codec.read_batch(self.slots[slot].obs, self.copy)

    def carry_over_obs(self, rows: np.ndarray, columns: list, previous: list) -> None:
        """Envs left out of a masked reset keep their previous observation:
        ``rows`` of ``previous`` (the last round's columns) into ``columns``."""
        if self.obs_codec.pickled:
            return  # batch_obs keeps the last value of every env
        for new, old in zip(columns, previous):
            new[rows] = old[rows]
        if self.obs_codec.can_spill:
            self.carried_spills = {r: v for r, v in self.last_spills.items() if rows[r]}

    def rows_obs(self, views, messages: dict[int, dict], rows: int, region: int | None) -> Any:
        """An async batch's observations, of the first ``rows`` rows of the slot
        ``views``, ``messages`` by row; from lease region ``region`` if not None."""
        full = rows == self.slot_rows
        spills = None
        if self.obs_codec.can_spill:
            spills = {}
            for message in messages.values():
                spills.update(message.get("spills", ()))
        if region is not None and self.leases is not None:
            return self.leases.read(region, None if full else rows, spills)
        if self.obs_codec.pickled:
            values = [None] * rows
            for row, message in messages.items():
                values[row] = next(iter(message["obs"].values()))
            return self.obs_codec.read_batch(values, self.copy)
        columns = views.obs if full else [column[:rows] for column in views.obs]
        return self.obs_codec.read_batch(columns, self.copy, spills)

    def outcomes(
        self, slot: int, rows: int | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rewards, terminations, truncations) of ring slot ``slot`` (its first
        ``rows``; None: all): copies if ``copy``, the flags as bool."""
        rewards, terminations, truncations = self._outcomes[slot]
        if rows is not None and rows != self.slot_rows:
            rewards, terminations, truncations = (
                rewards[:rows], terminations[:rows], truncations[:rows]
            )  # fmt: skip
        if self.copy:
            return rewards.copy(), terminations.copy(), truncations.copy()
        return rewards, terminations, truncations

    def ended(self, slot: int, rows: int | None = None) -> int:
        """How many rows of ring slot ``slot`` (its first ``rows``; None: all)
        ended an episode."""
        return _worker_loop.count_ended(self.columns[slot], -1 if rows is None else rows)

    def remote_error(self, errors: list) -> BaseException:
        """The first env error, with the env, the worker and the remote traceback."""
        row, exc, tb = errors[0]
        worker = next((i for i, b in enumerate(self.blocks) if row in b), None)
        add_note(exc, f"raised by env {row} in shmvec worker {worker}; remote traceback:\n{tb}")
        for other_row, other, _ in errors[1:]:
            add_note(exc, f"env {other_row} also raised {type(other).__name__}: {other}")
        return exc


def raise_errors(messages, decoder: ResultDecoder) -> None:
    """Re-raises the first env error in ``messages`` (an iterable of dicts)."""
    errors = [e for m in messages for e in m.get("errors", ())]
    if errors:
        raise decoder.remote_error(errors)
