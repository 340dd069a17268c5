"""``UnboundedText``: a gymnasium ``Text`` space of strings of any length.

LLM-agent envs (text games, tool calls, chat histories) observe and act in
strings of many kilobytes, with any Unicode character. ``gymnasium.spaces.Text``
needs a ``max_length`` and a charset, and stores 4 bytes per character up to
that bound; a pickled space has no bound but is pickled every step.
``UnboundedText`` has neither bound nor charset: ``contains`` accepts any
``str``. It is a ``Text`` subclass, so gymnasium batches it as ``Text`` (a
tuple of ``str``) and ``SyncVectorEnv``/``AsyncVectorEnv(shared_memory=False)``
run the same envs.

In ``shmvec.ShmVectorEnv`` each row is stored as UTF-8 bytes in the
shared-memory segment, up to ``text_bytes`` bytes inline; a longer value spills,
that row only, to the worker's pipe (docs/design/text.md).

Example:
    >>> from shmvec import UnboundedText
    >>> space = UnboundedText(seed=0)
    >>> space.contains("♠ any length, any character ✓" * 1000)
    True
    >>> space.contains(b"bytes")
    False
    >>> len(space.sample()) <= space.sample_length
    True
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
from gymnasium.spaces import Text

__all__ = ["UnboundedText"]


class UnboundedText(Text):
    """Strings of any length and any characters.

    Args:
        sample_length (int, default 16): ``sample()`` draws a length from 0 to
            this, then that many alphanumeric characters (a sample is a test
            value, not a model of the env's text).
        seed: the seed of ``sample()``'s generator, as for any space.

    ``min_length`` is 0 and ``max_length`` is ``sys.maxsize``: gymnasium
    utilities that size arrays by ``max_length`` (``flatten``, and
    ``AsyncVectorEnv``'s ``shared_memory=True``) do not apply to it.
    """

    def __init__(self, sample_length: int = 16, *, seed: int | np.random.Generator | None = None):
        if isinstance(sample_length, bool) or not isinstance(sample_length, (int, np.integer)):
            raise TypeError(f"sample_length must be an int, got {sample_length!r}")
        if sample_length < 0:
            raise ValueError(f"sample_length must be >= 0, got {sample_length}")
        self.sample_length = int(sample_length)
        super().__init__(sys.maxsize, min_length=0, seed=seed)

    def sample(self, mask: Any = None, probability: Any = None) -> str:
        """A random alphanumeric string of 0 to ``sample_length`` characters;
        ``mask``/``probability`` as for ``Text``, with the length at most
        ``sample_length`` when not given."""
        if mask is None and probability is None:
            length = int(self.np_random.integers(0, self.sample_length + 1))
            chars = self.np_random.choice(self.character_list, size=length)
            return "".join(chars)
        given = mask if mask is not None else probability
        if given[0] is None:
            length = int(self.np_random.integers(0, self.sample_length + 1))
            given = (length, given[1])
        if mask is not None:
            return super().sample(mask=given)
        return super().sample(probability=given)

    def contains(self, x: Any) -> bool:
        """True for any ``str``."""
        return isinstance(x, str)

    @property
    def is_np_flattenable(self) -> bool:
        """False: no fixed-size array holds every value."""
        return False

    def __repr__(self) -> str:
        return "UnboundedText()"

    def __eq__(self, other: object, /) -> bool:
        return isinstance(other, UnboundedText)

    def __hash__(self) -> int:
        return hash(UnboundedText)
