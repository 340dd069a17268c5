"""What dead workers left in the async result ring: a pure function of the ring's state.

Async mode (engine/async_wire.py): a worker takes an env's command, steps it,
claims the next ring row, writes the result and the env id there, and
publishes the row (one fetch-add on its slot's count); a worker claims its
rows one after another (``row_lock`` with env threads), so of its rows only
the last one claimed can be unpublished when it dies. Once every live worker
has done all it was given, ``find_lost`` reads what any number of dead
workers left, together:

- each **unwritten** row since the last consumed one (claimed, env id never
  written) is a hole, to be filled by an env of a dead worker that has no row;
- per slot, the rows claimed less the rows published are its holes; those
  not unwritten are **written** rows of dead workers, never published. The
  slot's candidates are the last row of each dead worker (for a replacement
  that died before it was ready, which fills rows out of claim order: each
  row its plan had it publish). When they number exactly its written holes,
  or none is a hole, each row's state is known. Otherwise the count cannot
  tell which of them were published: each of them is rewritten, and as many
  of those rewrites publish as the slot lacks (a slot's count says how many
  rows are in, not which);
- an env of a dead worker with neither a row nor an unwritten hole claims a
  new row.

Rows that stand (published, not rewritten) are ``kept``: the caller rewrites
one whose message was lost.
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from dataclasses import dataclass, field

from shmvec.engine.wire import Row
from shmvec.protocol import UNWRITTEN


@dataclass(frozen=True)
class RingState:
    """The facts ``find_lost`` reads, taken once the live workers are idle."""

    #: (slot, row, env id or UNWRITTEN) of each row claimed since the last
    #: consumed one, in claim order.
    claims: list[tuple[int, int, int]]
    #: Rows that workers published (padding not counted), per slot of ``claims``.
    published: dict[int, int]
    #: env -> its worker, for each env of a dead worker that took its command
    #: and whose result main has not received.
    running: dict[int, int]
    #: Dead workers that were replacements and died before they were ready,
    #: each with the envs whose rows its plan had it publish: any of those may
    #: be unpublished (it fills rows out of claim order), and none of its other rows.
    unready: Mapping[int, Set[int]] = field(default_factory=dict)


@dataclass
class Lost:
    """What the replacements must deliver, by env: ``(how, slot, row)`` with
    ``how`` one of ``"hole"`` (write the row and publish it), ``"rewrite"``
    (write a published row again, not publishing it) or ``"claim"`` (claim a
    new row); and the published rows that stand."""

    deliver: dict[int, tuple[str, int, int]] = field(default_factory=dict)
    kept: dict[int, Row] = field(default_factory=dict)


def find_lost(state: RingState) -> Lost:
    """What each running env of a dead worker must deliver so that each
    delivers exactly one result (see the module's docstring).

    Raises RuntimeError (an internal error) for a state no worker can leave.
    """
    rows: dict[int, Row] = {}  # running env -> its written row
    last: dict[int, int] = {}  # dead worker -> the env of its last written row
    unwritten: list[Row] = []
    claimed: dict[int, int] = {}
    unwritten_in: dict[int, int] = {}
    for slot, row, env in state.claims:
        claimed[slot] = claimed.get(slot, 0) + 1
        if env == UNWRITTEN:
            unwritten.append((slot, row))
            unwritten_in[slot] = unwritten_in.get(slot, 0) + 1
        elif env in state.running:
            if env in rows:
                raise RuntimeError(f"shmvec internal error: env {env} has two unconsumed rows")
            rows[env] = (slot, row)
            last[state.running[env]] = env
    lost = Lost()
    for slot in claimed:
        holes = claimed[slot] - state.published.get(slot, 0) - unwritten_in.get(slot, 0)
        in_slot = [env for env, where in rows.items() if where[0] == slot]
        candidates = [env for env in in_slot if _may_be_unpublished(state, env, last)]
        if not 0 <= holes <= len(candidates):
            raise RuntimeError(
                f"shmvec internal error: slot {slot} lacks {holes} written rows, but "
                f"{len(candidates)} could be unpublished"
            )
        redo = candidates if holes else []
        for env in in_slot:
            if env not in redo:
                lost.kept[env] = rows[env]
        for n, env in enumerate(redo):
            lost.deliver[env] = ("hole" if n < holes else "rewrite", *rows[env])
    rowless = [env for env in sorted(state.running) if env not in rows]
    if len(unwritten) > len(rowless):
        raise RuntimeError(
            f"shmvec internal error: {len(unwritten)} unwritten rows, but only envs "
            f"{rowless} without one"
        )
    for n, env in enumerate(rowless):
        lost.deliver[env] = ("hole", *unwritten[n]) if n < len(unwritten) else ("claim", 0, 0)
    return lost


def _may_be_unpublished(state: RingState, env: int, last: dict[int, int]) -> bool:
    """Whether ``env``'s written row may be one its dead worker never published."""
    worker = state.running[env]
    if worker in state.unready:
        return env in state.unready[worker]
    return last[worker] == env
