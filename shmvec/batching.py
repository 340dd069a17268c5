"""The gymnasium layer shared by ShmVectorEnv and RayVectorEnv.

Block splitting, env-id, reset-mask and action checks, seed and option
expansion, infos batched (``VectorEnv._add_info`` over rows) and unbatched
(its inverse), all with gymnasium's own error types and messages; and
``VectorEnvBase``, the state-machine face both vector envs share.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from gymnasium.error import AlreadyPendingCallError, ClosedEnvironmentError, NoAsyncCallError
from gymnasium.vector.async_vector_env import AsyncState
from gymnasium.vector.utils import iterate
from gymnasium.vector.vector_env import VectorEnv

#: What ``reset`` takes as ``seed``: one int for all envs, one per env or group, or None.
Seeds = int | list[int | None] | None
#: What ``reset`` takes as ``options``: one dict for all envs, one per env or group, or None.
Options = dict[str, Any] | list[dict[str, Any] | None] | None
#: The spaces whose batch is one array (one column of shared memory).
ARRAY_SPACES = (spaces.Box, spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary)


def split_blocks(num_envs: int, num_parts: int) -> list[range]:
    """Contiguous, as-even-as-possible blocks of env ids, the larger ones first."""
    base, extra = divmod(num_envs, num_parts)
    starts = [k * base + min(k, extra) for k in range(num_parts + 1)]
    return [range(a, b) for a, b in zip(starts, starts[1:])]


def send_env_ids(env_ids: Any, last: np.ndarray | None, num_envs: int) -> np.ndarray:
    """``send``'s ``env_ids`` checked (``check_env_ids``); None: ``last``, the envs of the
    last ``recv`` (ValueError before any)."""
    if env_ids is None:
        if last is None:
            raise ValueError("send() needs env_ids: no recv() has returned any yet")
        env_ids = last
    return check_env_ids(env_ids, num_envs)


def check_env_ids(env_ids: Any, num_envs: int) -> np.ndarray:
    """``env_ids`` as int64; TypeError if not 1-D ints, ValueError if out of range
    or repeated."""
    ids = np.asarray(env_ids)
    if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
        raise TypeError(f"env_ids must be a 1-D array of ints, got {env_ids!r}")
    ids = ids.astype(np.int64)
    # One bincount checks both (called for every async send): it refuses
    # negative ids, and counts ids past the end in extra bins.
    try:
        counts = np.bincount(ids, minlength=num_envs)
    except ValueError:
        counts = None
    if counts is None or len(counts) > num_envs:
        bad = ids[(ids < 0) | (ids >= num_envs)]
        raise ValueError(f"env_ids {bad.tolist()} out of range [0, {num_envs})")
    if ids.size and counts.max() > 1:
        raise ValueError(f"env_ids {np.flatnonzero(counts > 1).tolist()} appear more than once")
    return ids


def take_reset_mask(options: Any, reset_mask: np.ndarray | None) -> np.ndarray | None:
    """The checked-later reset mask: ``options["reset_mask"]`` (popped, as gymnasium
    does) or the ``reset_mask`` argument; ValueError if both are given."""
    if isinstance(options, dict) and "reset_mask" in options:
        if reset_mask is not None:
            raise ValueError("reset_mask given twice: in options and as an argument")
        reset_mask = options.pop("reset_mask")
    return reset_mask


def check_reset_mask(mask: Any, num_envs: int) -> np.ndarray:
    """``mask`` if it is a bool array of shape ``(num_envs,)`` with a True; else
    gymnasium's TypeError or ValueError."""
    if not isinstance(mask, np.ndarray):
        raise TypeError(f"`options['reset_mask']` must be a numpy array, got {type(mask)}")
    if mask.shape != (num_envs,):
        raise ValueError(
            f"`options['reset_mask']` must have shape `({num_envs},)`, got {mask.shape}"
        )
    if mask.dtype != np.bool_:
        raise TypeError(f"`options['reset_mask']` must have `dtype=np.bool_`, got {mask.dtype}")
    if not np.any(mask):
        raise ValueError(
            "`options['reset_mask']` must contain a boolean array with at least one True "
            f"value, got reset_mask={mask}"
        )
    return mask


def check_actions(space: gym.Space, batched: gym.Space, actions: Any, env_ids) -> None:
    """``validate_actions``: a ValueError naming the envs (``env_ids``, in batch
    order) whose action in the batch ``actions`` is not in ``space``."""
    bad = []
    for env, action in zip(env_ids, iterate(batched, actions)):
        if isinstance(space, gym.spaces.Box):  # float64 for a float32 Box is fine
            action = np.asarray(action).astype(space.dtype, casting="same_kind")
        if not space.contains(action):
            bad.append(f"env {env}: {action!r}")
    if bad:
        more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
        raise ValueError(f"actions outside the action space {space}: {'; '.join(bad[:5])}{more}")


def expand_seeds(seed, num_envs: int, group_size: int = 1) -> list:
    """One seed per env from an int (env ``i`` gets ``seed + i // group_size``), a
    list with one per env or per group, or None; envs of a group share theirs."""
    if seed is None:
        return [None] * num_envs
    if isinstance(seed, int):
        return [seed + i // group_size for i in range(num_envs)]
    seeds = list(seed)
    return _per_env(
        seeds,
        num_envs,
        group_size,
        lambda expected: (
            "If seeds are passed as a list the length must match "
            f"num_envs={expected} but got length={len(seeds)}."
        ),
    )


def expand_options(options, num_envs: int, group_size: int = 1) -> list:
    """One options dict (or None) per env from a dict, None, or a list with one
    per env or per group; envs of a group share theirs."""
    if options is None or isinstance(options, dict):
        return [options] * num_envs
    if not isinstance(options, (list, tuple)):
        raise TypeError(f"options must be a dict, a list of dicts or None, got {options!r}")
    for i, entry in enumerate(options):
        if entry is not None and not isinstance(entry, dict):
            raise TypeError(f"options[{i}] must be a dict or None, got {entry!r}")
    return _per_env(
        list(options),
        num_envs,
        group_size,
        lambda expected: (
            f"options as a list needs one entry per env: expected {expected}, got {len(options)}"
        ),
    )


def _per_env(values: list, n: int, g: int, message: Callable[[str], str]) -> list:
    """``values`` with one entry per env, or per group (then expanded to its envs);
    any other length is a ValueError with ``message(expected lengths)``."""
    if g > 1 and len(values) == n // g:
        return [values[i // g] for i in range(n)]
    if len(values) != n:
        raise ValueError(message(f"{n} (or num_envs / group_size = {n // g})" if g > 1 else str(n)))
    return values


class _Rows:
    """``VectorEnv._add_info`` over a batch of ``num_envs`` rows."""

    _add_info: Any = VectorEnv._add_info

    def __init__(self, num_envs: int) -> None:
        self.num_envs = num_envs


def batch_infos(
    items: list[tuple[int, list[dict]]], rows: int, infos: dict | None = None
) -> dict[str, Any]:
    """Per-row info dicts ``[(row, [info, ...])]``, in the order given, merged into
    ``infos`` (default: a new dict), a batch of ``rows`` rows, exactly as
    ``VectorEnv._add_info`` does."""
    batch = _Rows(rows)
    infos = {} if infos is None else infos
    for row, dicts in items:
        for info in dicts:
            infos = batch._add_info(infos, info, row)
    return infos


def rows_with_info(infos: dict) -> list[int]:
    """The rows of a batched info dict that have any masked key."""
    masks = [infos[f"_{key}"] for key in infos if f"_{key}" in infos]
    if not masks:
        return []
    return np.flatnonzero(np.logical_or.reduce(masks)).tolist()


def unbatch_info(infos: dict, row: int, masked_only: bool = True) -> dict:
    """Row ``row``'s info from a batched info dict: the inverse of ``_add_info``.

    A key ``k`` with a mask ``_k`` goes to the rows where the mask is true; a key
    without one to none (``masked_only``) or to every row. Nested dicts
    (``"episode"``, ``"final_info"``) are unbatched recursively.
    """
    info: dict[str, Any] = {}
    for key, value in infos.items():
        mask = infos.get(f"_{key}")
        if mask is None:
            if masked_only or (key.startswith("_") and key[1:] in infos):
                continue
        elif not mask[row]:
            continue
        if isinstance(value, dict):
            info[key] = unbatch_info(value, row, masked_only)
        elif isinstance(value, np.ndarray) and value.dtype == np.bool_ and value.ndim == 1:
            # _add_info makes a bool array only from a Python bool (np.bool_ is not a
            # np.number: it gets an object array); give it back as one.
            info[key] = bool(value[row])
        else:
            info[key] = value[row]
    return info


def unbatch_infos(infos: dict[str, Any], num_envs: int) -> list[dict[str, Any]]:
    """gymnasium's batched infos to one dict per env (SB3's list of infos); a key
    without a ``_key`` mask goes to every env. The same dicts as
    ``unbatch_info(infos, row, masked_only=False)`` for each row, built key by
    key: each mask is read once, and empty infos cost nothing per env."""
    out: list[dict[str, Any]] = [{} for _ in range(num_envs)]
    for key, value in infos.items():
        mask = infos.get(f"_{key}")
        if mask is not None:
            rows = np.flatnonzero(mask).tolist()
        elif key.startswith("_") and key[1:] in infos:
            continue  # a mask
        else:
            rows = range(num_envs)
        if isinstance(value, dict):
            per_env = unbatch_infos(value, num_envs)
            for row in rows:
                out[row][key] = per_env[row]
        elif isinstance(value, np.ndarray) and value.dtype == np.bool_ and value.ndim == 1:
            for row in rows:
                out[row][key] = bool(value[row])  # as unbatch_info
        else:
            for row in rows:
                out[row][key] = value[row]
    return out


#: What async mode uses instead of a sync-mode call.
_ASYNC_INSTEAD = {
    "reset_async": "reset with async_reset()",
    "step_async": "step with send(actions, env_ids)",
}


class VectorEnvBase(VectorEnv):
    """What ShmVectorEnv and RayVectorEnv share of gymnasium's ``VectorEnv`` face:
    ``reset`` over the async state machine, the EnvPool-style API
    (``async_reset``/``send``/``recv``) and its sync-mode case, seed and option
    expansion, the state checks with gymnasium's errors, and the context manager.

    Subclasses set the attributes below and implement the methods that raise
    ``NotImplementedError`` here.
    """

    batch_size: int
    group_size: int
    is_async: bool  # batch_size < num_envs
    closed: bool
    _state: AsyncState
    _sync_reset_pending: bool  # async_reset() in sync mode: the next recv() is reset_wait()

    def reset_async(
        self, seed: Seeds = None, options: Options = None, reset_mask: np.ndarray | None = None
    ) -> None:
        raise NotImplementedError

    def reset_wait(self, timeout: float | None = None) -> tuple[Any, dict[str, Any]]:
        raise NotImplementedError

    def step_async(self, actions: Any) -> None:
        raise NotImplementedError

    def step_wait(self, timeout: float | None = None) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        raise NotImplementedError

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        raise NotImplementedError

    def _async_reset(self, seed: Seeds, options: Options, env_ids: Any) -> None:
        """``async_reset`` in async mode."""
        raise NotImplementedError

    def _send(self, actions: Any, env_ids: Any) -> None:
        """``send`` in async mode."""
        raise NotImplementedError

    def _recv(
        self, timeout: float | None, partial: bool, take_ready: bool
    ) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        """``recv`` in async mode."""
        raise NotImplementedError

    def reset(
        self,
        *,
        seed: Seeds = None,
        options: Options = None,
        reset_mask: np.ndarray | None = None,
    ) -> tuple[Any, dict[str, Any]]:
        """Resets the envs; see ``gymnasium.vector.VectorEnv.reset`` and ``reset_async``.

        In async mode (``batch_size < num_envs``) this is ``async_reset`` then
        ``recv``: it returns the first ``batch_size`` envs to finish resetting.
        """
        if self.is_async:
            if reset_mask is not None:
                raise ValueError("reset_mask needs batch_size == num_envs")
            self.async_reset(seed=seed, options=options)
            obs, _, _, _, infos = self.recv()
            return obs, infos
        self.reset_async(seed=seed, options=options, reset_mask=reset_mask)
        return self.reset_wait()

    def async_reset(self, seed: Seeds = None, options: Options = None, env_ids: Any = None) -> None:
        """Resets envs without waiting; ``recv()`` returns the results.

        ``seed`` and ``options`` are expanded over all envs as in ``reset``
        (groups included), then env ``e`` gets entry ``e``. ``env_ids`` (default:
        all; only all with ``batch_size == num_envs``) names the envs to reset;
        they must be idle: ``recv()`` their results first.
        """
        self._assert_is_running()
        if self.is_async:
            self._async_reset(seed, options, env_ids)
            return
        if env_ids is not None:
            raise ValueError("env_ids in async_reset needs batch_size < num_envs")
        self.reset_async(seed=seed, options=options)
        self._sync_reset_pending = True

    def send(self, actions: Any, env_ids: Any = None) -> None:
        """Hands ``actions[i]`` to env ``env_ids[i]`` and returns at once.

        ``env_ids`` defaults to the envs of the last ``recv()``. Each env must be
        awaiting an action (its last result was received). With ``batch_size ==
        num_envs``, ``env_ids`` must name every env (in any order).
        """
        self._assert_is_running()
        if self.is_async:
            self._send(actions, env_ids)
            return
        self.step_async(in_env_order(self.single_action_space, actions, env_ids, self.num_envs))

    def recv(
        self, timeout: float | None = None, *, partial: bool = False, take_ready: bool = False
    ) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        """The next ``batch_size`` results: ``(obs, rewards, terminations,
        truncations, infos)`` with ``infos["env_id"]``, the env of each row.

        Fewer than ``batch_size`` envs running is a RuntimeError, unless
        ``partial=True``: then ``recv`` waits until every running env has
        returned and gives their results, fewer than ``batch_size`` rows (every
        array and info has that many). With ``batch_size`` or more envs running
        ``partial`` changes nothing; with none running it is the same
        RuntimeError.

        ``take_ready=True`` (async mode, with a ``timeout``): once ``timeout``
        has passed, ``recv`` returns the results that are in, at least one and
        fewer than ``batch_size``, instead of raising ``TimeoutError``; the
        results that come later go to the next ``recv``. It raises only when no
        result at all came within ``timeout``. For a caller that acts on each
        result as it comes (a per-row policy) rather than on full batches.

        With ``batch_size == num_envs`` that is the pending reset (zero rewards)
        or step of every env.
        """
        self._assert_is_running()
        if take_ready and (timeout is None or not self.is_async):
            raise ValueError(
                "recv(take_ready=True) needs async mode (batch_size < num_envs) and a timeout "
                f"(how long to wait for a full batch); got batch_size={self.batch_size} of "
                f"num_envs={self.num_envs}, timeout={timeout}"
            )
        if self.is_async:
            return self._recv(timeout, partial, take_ready)
        if self._sync_reset_pending:
            self._sync_reset_pending = False
            obs, infos = self.reset_wait(timeout)
            zeros = np.zeros(self.num_envs, dtype=bool)
            result = obs, np.zeros(self.num_envs), zeros, zeros.copy(), infos
        else:
            result = self.step_wait(timeout)
        result[4]["env_id"] = np.arange(self.num_envs)
        return result

    # VectorEnv's own are one seed and one generator; AsyncVectorEnv's, as these,
    # one per env (read-only).
    @property
    def np_random_seed(self) -> tuple[int, ...]:  # type: ignore[override]
        """The sub-envs' ``np_random_seed``, as AsyncVectorEnv's."""
        return self.get_attr("np_random_seed")

    @property  # type: ignore[misc]
    def np_random(self) -> tuple[np.random.Generator, ...]:  # type: ignore[override]
        """Copies of the sub-envs' random generators, as AsyncVectorEnv's."""
        return self.get_attr("np_random")

    def get_attr(self, name: str) -> tuple[Any, ...]:
        """The attribute ``name`` of every env (callables are called, as in gymnasium)."""
        return self.call(name)

    def render(self) -> tuple[Any, ...] | None:
        """Each env's ``render()``."""
        return self.call("render")

    def __enter__(self):
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def _expand_seeds(self, seed) -> list:
        return expand_seeds(seed, self.num_envs, self.group_size)

    def _expand_options(self, options) -> list:
        return expand_options(options, self.num_envs, self.group_size)

    def _attr_values(self, values: Any) -> list | tuple:
        """``set_attr``'s values: one per env, or the same value for all."""
        if not isinstance(values, (list, tuple)):
            values = [values] * self.num_envs
        if len(values) != self.num_envs:
            raise ValueError(
                "Values must be a list or tuple with length equal to the number of "
                f"environments. Got `{len(values)}` values for {self.num_envs} environments."
            )
        return values

    def _assert_is_running(self) -> None:
        if self.closed:
            raise ClosedEnvironmentError(
                f"Trying to operate on `{type(self).__name__}`, after a call to `close()`."
            )

    def _assert_idle(self, name: str, end: str = ".") -> None:
        if self._state != AsyncState.DEFAULT:
            raise AlreadyPendingCallError(
                f"Calling `{name}` while waiting for a pending call to "
                f"`{self._state.value}` to complete{end}",
                str(self._state.value),
            )

    def _assert_sync(self, name: str) -> None:
        """A RuntimeError if ``name`` (``reset_async``/``step_async``) needs sync mode."""
        if self.is_async:
            instead = _ASYNC_INSTEAD[name]
            raise RuntimeError(f"with batch_size < num_envs, {instead} and read with recv()")

    def _assert_waiting(self, state: AsyncState, name: str, sender: str) -> None:
        self._assert_is_running()
        if self._state != state:
            raise NoAsyncCallError(
                f"Calling `{name}` without any prior call to `{sender}`.", state.value
            )


def _leaf_batches(space: gym.Space, batch: Any, path: str = "actions"):
    """Yields ``(path, leaf batch)`` for every leaf of a batch of ``space``."""
    if isinstance(space, spaces.Dict):
        for key, sub in space.spaces.items():
            yield from _leaf_batches(sub, batch[key], f"{path}[{key!r}]")
    elif isinstance(space, spaces.Tuple):
        for i, sub in enumerate(space.spaces):
            yield from _leaf_batches(sub, batch[i], f"{path}[{i}]")
    else:
        yield path, batch


def check_rows(space: gym.Space, batch: Any, rows: int) -> None:
    """A ValueError unless every leaf of ``batch`` has ``rows`` rows."""
    for path, leaf in _leaf_batches(space, batch):
        if isinstance(leaf, np.ndarray):
            size = leaf.shape[0] if leaf.ndim else None
        else:
            size = len(leaf) if isinstance(leaf, (list, tuple)) else None
        if size != rows:
            raise ValueError(f"{path} has {size} rows, expected {rows} (one per env)")


def take_rows(space: gym.Space, batch: Any, rows: slice | np.ndarray | range) -> Any:
    """Rows ``rows`` of a batch of ``space`` (arrays, or per-env sequences at leaves)."""
    if isinstance(rows, range):
        rows = slice(rows.start, rows.stop)
    if isinstance(space, spaces.Dict):
        return {key: take_rows(sub, batch[key], rows) for key, sub in space.spaces.items()}
    if isinstance(space, spaces.Tuple):
        return tuple(take_rows(sub, batch[i], rows) for i, sub in enumerate(space.spaces))
    if isinstance(batch, np.ndarray):
        return batch[rows]
    return [batch[i] for i in np.arange(len(batch))[rows]]


def in_env_order(space: gym.Space, actions: Any, env_ids: Any, num_envs: int) -> Any:
    """Sync mode's ``send``: ``actions`` (row ``i`` for env ``env_ids[i]``) in env
    order; ValueError unless ``env_ids`` names every env once."""
    if env_ids is None:
        return actions
    ids = np.asarray(env_ids)
    if ids.ndim != 1 or sorted(ids.tolist()) != list(range(num_envs)):
        raise ValueError(
            "with batch_size == num_envs, send() steps every env: env_ids must name "
            f"each of the {num_envs} envs once, got {ids.tolist()}"
        )
    if np.array_equal(ids, np.arange(num_envs)):
        return actions
    check_rows(space, actions, num_envs)
    return take_rows(space, actions, np.argsort(ids))
