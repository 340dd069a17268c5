"""Actions on their way to the workers: into the action slab, or by value.

Actions of exactly the columns' dtype are written into the action slab, where
the workers read them. Anything else (a list, float64 for a float32 Box, a
space without fixed-size columns) reaches each env as gymnasium hands it over:
the element that iterating the batch gives, pickled, one per env
(protocol.BY_VALUE_BIT). Text longer than its inline bytes (``UnboundedText``)
spills: the writes return it, by env, for the caller to send to the env's
worker on its pipe (``Worker.take_spill`` reads it).
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

from shmvec.batching import check_actions
from shmvec.codecs import ArrayCodec, Codec, PickledCodec, Spills

__all__ = ["ActionWriter"]


class ActionWriter:
    """Writes a vector env's actions where its workers read them; called from the
    thread that steps the vector env."""

    def __init__(
        self,
        codec: Codec,
        views: list[np.ndarray],
        spaces: tuple[gym.Space, gym.Space],
        validate: bool,
    ) -> None:
        """``spaces``: the single and the batched action space; ``validate``:
        check every action against the single space first (``validate_actions``)."""
        self.codec, self.views = codec, views
        self.single_space, self.batch_space = spaces
        self.validate = validate
        self._pickled = PickledCodec(self.single_space)

    def write_batch(self, actions: Any, num_envs: int) -> tuple[list[Any] | None, Spills | None]:
        """Writes one action per env. Returns ``(per_env, spills)``: the per-env
        pickles when the actions travel by value (``None``: they are in the
        slab), and the text that spilled, by env (``None``: none)."""
        codec = self.codec
        if not self.validate and codec.write_exact(self.views, actions):
            return None, None
        if self.validate:
            check_actions(self.single_space, self.batch_space, actions, range(num_envs))
        if codec.pickled or not codec.is_exact(actions):
            per_env: list[Any] = [None] * num_envs
            self._pickled.write_batch(per_env, actions)
            return per_env, None
        return None, codec.write_batch(self.views, actions)

    def write_rows(self, env_ids: np.ndarray, actions: Any) -> Spills | None:
        """Writes ``actions[i]`` into env ``env_ids[i]``'s row of the slab;
        returns the text that spilled, by env (``None``: none)."""
        if self.validate:
            check_actions(self.single_space, self.batch_space, actions, env_ids)
        return self.codec.write_rows(self.views, env_ids, actions)

    def slab(self) -> np.ndarray | None:
        """The slab when actions are one array column, else None."""
        return self.views[0] if isinstance(self.codec, ArrayCodec) else None
