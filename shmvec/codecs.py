"""Codecs: the values of one gymnasium space to fixed-size columns and back.

Every leaf space whose values have a fixed size gets a *column*: an array with
one row per env. Dict and Tuple spaces are trees of columns. A space that
cannot be fixed-size (Graph, Sequence, OneOf, custom spaces), or any space
when ``shared_memory=False``, is *pickled*: its per-env values travel on the
slow channel (the worker's pipe) and are batched with gymnasium's own
``concatenate``, so they are never silently wrong.

``UnboundedText`` (shmvec/text.py) gets two columns: each row's UTF-8 length
and ``text_bytes`` bytes inline. A longer value *spills*: that row's length
word says so, and the value itself travels on the slow channel with the
row's message (``write`` returns it; ``read_batch``/``read`` take it back).

Where the columns lie in the shared segment is shmvec/layout.py's business.

Example:
    >>> import numpy as np
    >>> from gymnasium.spaces import Box, Dict, Discrete
    >>> codec = make_codec(Dict(pos=Box(-1, 1, (2,)), k=Discrete(3)))
    >>> [c.shape for c in codec.columns()]
    [(2,), ()]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from gymnasium import spaces
from gymnasium.vector.utils import batch_space, concatenate, create_empty_array, iterate

from shmvec.batching import ARRAY_SPACES
from shmvec.text import UnboundedText

#: Inline UTF-8 bytes per ``UnboundedText`` row unless ``text_bytes=`` says
#: otherwise: a 5.7K-character chat turn of mostly ASCII fits; a longer value
#: spills to the slow channel (docs/design/text.md).
TEXT_BYTES = 4096

#: A row's spilled text values, by the path of their field in the space ("" for
#: a top-level ``UnboundedText``, ``"['chat']"`` in a Dict...).
RowSpill = dict[str, str]
#: Spilled values of a batch, by row (actions: by env id).
Spills = dict[int, RowSpill]


@dataclass(frozen=True)
class ColumnSpec:
    """One fixed-size field: ``dtype`` and per-env ``shape``."""

    dtype: np.dtype
    shape: tuple[int, ...]


class Codec:
    """Moves the values of one space between Python objects and columns.

    Column views are arrays of shape ``(rows, *spec.shape)``; ``views`` is the
    list of them in ``columns()`` order, consumed from the front by each codec.

    Spills (``UnboundedText`` values longer than their inline bytes): ``write``,
    ``write_batch`` and ``write_rows`` return what spilled, for the caller to
    send on the slow channel; ``read_batch`` and ``read`` take it back.
    """

    pickled = False
    can_spill = False  # whether a value may spill (an UnboundedText leaf)

    def columns(self) -> list[ColumnSpec]:
        return []

    def write(self, views: list[np.ndarray], row: int, value: Any) -> RowSpill | None:
        """[worker] Stores one env's value at ``row``; returns what spilled (None: nothing)."""
        raise NotImplementedError

    def read_batch(self, views: list[np.ndarray], copy: bool, spills: Spills | None = None) -> Any:
        """[main] The batched value of all rows, as gymnasium batches it;
        ``spills``: the spilled values of its rows."""
        raise NotImplementedError

    def write_batch(self, views: list[np.ndarray], value: Any) -> Spills | None:
        """[main] Stores a batched value (actions), checking shape and dtype;
        returns what spilled, by row."""
        raise NotImplementedError

    def read(self, views: list[np.ndarray], row: int, spill: RowSpill | None = None) -> Any:
        """[worker] One env's value (an action), as a private copy; ``spill``:
        the row's spilled values (``spilled`` says whether it has any)."""
        raise NotImplementedError

    def write_rows(self, views: list[np.ndarray], rows: np.ndarray, value: Any) -> Spills | None:
        """[main] Stores a batch of values (actions) at ``rows`` only; returns
        what spilled, by row (an element of ``rows``)."""
        raise NotImplementedError

    def spilled(self, views: list[np.ndarray], row: int) -> bool:
        """[worker] Whether the value at ``row`` has spilled parts."""
        return False

    def is_exact(self, value: Any) -> bool:
        """[main] Whether the columns hold a batch exactly as given (same dtypes).

        Raises TypeError for a dtype the space's cannot take (float for int).
        """
        return True

    def write_exact(self, views: list[np.ndarray], value: Any) -> bool:
        """[main] The fast path of ``write_batch``: stores ``value`` only if it is
        an array of exactly the column's dtype and shape; False if it did not."""
        return False


class ArrayCodec(Codec):
    """Box, Discrete, MultiDiscrete and MultiBinary: one column."""

    def __init__(self, space: spaces.Space, path: str) -> None:
        self.space = space
        self.path = path
        self.spec = ColumnSpec(np.dtype(space.dtype), tuple(space.shape or ()))

    def columns(self) -> list[ColumnSpec]:
        return [self.spec]

    def write(self, views, row, value):
        shape = value.shape if type(value) is np.ndarray else np.shape(value)
        if shape != self.spec.shape:
            raise ValueError(
                f"observation{self.path} has shape {shape}, but its space "
                f"{self.space} has shape {self.spec.shape}"
            )
        views[0][row] = value

    def read_batch(self, views, copy, spills=None):
        return views[0].copy() if copy else views[0]

    def write_batch(self, views, value):
        self._check_and_copy(views[0], value)

    def write_exact(self, views, value):
        column = views[0]
        if type(value) is not np.ndarray or value.dtype != column.dtype:
            return False
        if value.shape != column.shape:
            return False
        column[...] = value  # np.copyto costs three times as much
        return True

    def is_exact(self, value):
        array = value if type(value) is np.ndarray else np.asarray(value)
        if array.dtype == self.spec.dtype:
            return type(value) is np.ndarray
        if not np.can_cast(array.dtype, self.spec.dtype, casting="same_kind"):
            raise TypeError(
                f"actions{self.path} have dtype {array.dtype}, which cannot be cast "
                f"safely to the action space's dtype {self.spec.dtype}"
            )
        return False

    def write_rows(self, views, rows, value):
        out = np.empty((len(rows), *self.spec.shape), self.spec.dtype)
        self._check_and_copy(out, value)
        views[0][rows] = out

    def _check_and_copy(self, out: np.ndarray, value) -> None:
        array = np.asarray(value)
        if array.ndim == 0:  # gymnasium's iterate() says the same
            raise TypeError(f"Unable to iterate over the following elements: {value}")
        if array.shape != out.shape:
            raise ValueError(
                f"actions{self.path} have shape {array.shape}, expected {out.shape} "
                f"for the action space {self.space} over {out.shape[0]} envs"
            )
        if not np.can_cast(array.dtype, out.dtype, casting="same_kind"):
            raise TypeError(
                f"actions{self.path} have dtype {array.dtype}, which cannot be cast "
                f"safely to the action space's dtype {out.dtype}"
            )
        np.copyto(out, array, casting="same_kind")

    def read(self, views, row, spill=None):
        value = views[0][row]
        # Rows of a shaped column are views of the slab: hand out a copy, as
        # gymnasium hands each env its own pickled copy.
        return value.copy() if self.spec.shape else value


class TextCodec(Codec):
    """Text as fixed-length int32 character codes (indices into the space's
    ``character_list``), padded with -1 from the end of the text.

    Encoding and decoding are numpy passes over the text's own characters
    (UTF-32 code points mapped through the charset), and the padding is found
    by searching from the start in growing chunks: a value costs its length,
    not the space's ``max_length`` (a 516-character text in
    ``Text(max_length=16384)``: docs/design/text.md).
    """

    def __init__(self, space: spaces.Text, path: str) -> None:
        self.space = space
        self.path = path
        self.charset = list(space.character_list)
        self.codes = {c: i for i, c in enumerate(self.charset)}
        # For charsets of single characters (gymnasium's): code -> code point, and
        # code point -> code (-1: not in the charset), a table up to the largest code
        # point plus one -1 that every larger point is clamped to. Other charsets (or
        # one with a character past U+FFFF, whose table would be megabytes) take the
        # per-character path.
        self._points: np.ndarray | None = None
        self._table: np.ndarray | None = None
        if self.charset and all(isinstance(c, str) and len(c) == 1 for c in self.charset):
            points = np.array([ord(c) for c in self.charset], dtype=np.uint32)
            if points.max() < 0x10000:
                self._points = points
                self._table = np.full(int(points.max()) + 2, -1, dtype=np.int32)
                self._table[points] = np.arange(len(points), dtype=np.int32)

    def columns(self):
        return [ColumnSpec(np.dtype(np.int32), (self.space.max_length,))]

    def _encode(self, value: Any) -> np.ndarray | list[int]:
        """The codes of ``value``; ValueError naming a character not in the charset."""
        if self._table is None or not isinstance(value, str):
            try:
                return [self.codes[c] for c in value]
            except KeyError as e:
                raise ValueError(
                    f"text{self.path} {value!r} has character {e.args[0]!r}, not in the "
                    "space's charset"
                ) from None
        table = self._table
        points = np.frombuffer(value.encode("utf-32-le", "surrogatepass"), np.uint32)
        codes = table[np.minimum(points, len(table) - 1)]
        bad = codes < 0
        if bad.any():
            char = value[int(bad.argmax())]
            raise ValueError(
                f"text{self.path} {value!r} has character {char!r}, not in the space's charset"
            )
        return codes

    def write(self, views, row, value):
        if len(value) > self.space.max_length:
            raise ValueError(
                f"text{self.path} {value!r} is longer than its space's "
                f"max_length={self.space.max_length}"
            )
        codes = self._encode(value)
        out = views[0][row]
        n = len(codes)
        old_end = _padding_start(out)  # the previous text's end: pad only up to it
        out[:n] = codes
        if n < len(out):
            out[n : max(old_end, n + 1)] = -1

    def _decode(self, codes: np.ndarray) -> str:
        n = _padding_start(codes)
        if self._points is None:
            charset = self.charset
            return "".join(charset[c] for c in codes[:n].tolist() if c >= 0)
        return self._points[codes[:n]].tobytes().decode("utf-32-le", "surrogatepass")

    def read_batch(self, views, copy, spills=None):
        return tuple(self._decode(row) for row in views[0])

    def write_batch(self, views, value):
        self.write_rows(views, range(views[0].shape[0]), value)

    def write_rows(self, views, rows, value):
        if len(value) != len(rows):
            raise ValueError(f"actions{self.path}: expected {len(rows)} texts, got {len(value)}")
        for row, text in zip(rows, value):
            self.write(views, row, text)

    def read(self, views, row, spill=None):
        return self._decode(views[0][row])


#: The first chunk ``_padding_start`` searches: most texts end within it; each
#: next chunk is 4 times longer, so a search reads at most about 4 times the
#: text's length past the first chunk.
_FIRST_CHUNK = 1024


def _padding_start(codes: np.ndarray) -> int:
    """The index of the first negative code of the 1-D ``codes`` (its length if none)."""
    start, size, n = 0, _FIRST_CHUNK, len(codes)
    while start < n:
        stop = min(start + size, n)
        pad = codes[start:stop] < 0
        first = int(pad.argmax())
        if pad[first]:
            return start + first
        start, size = stop, size * 4
    return n


class Utf8TextCodec(Codec):
    """``UnboundedText``: per row, the value's UTF-8 length (int64) and
    ``capacity`` bytes inline. A value of more bytes spills: its length word
    says how many, its bytes stay out of the segment and the value travels
    with the row's message. Lone surrogates survive (``surrogatepass``).
    """

    can_spill = True

    def __init__(self, space: spaces.Text, path: str, capacity: int) -> None:
        self.space = space
        self.path = path
        self.capacity = capacity

    def columns(self):
        return [
            ColumnSpec(np.dtype(np.int64), ()),
            ColumnSpec(np.dtype(np.uint8), (self.capacity,)),
        ]

    def _encode(self, value: Any, where: str) -> bytes:
        if not isinstance(value, str):
            raise TypeError(
                f"{where}{self.path} is {type(value).__name__} {_short(value)}, but its space "
                f"{self.space} takes a str"
            )
        return value.encode("utf-8", "surrogatepass")

    def _store(self, views, row: int, data: bytes) -> bool:
        """Stores ``data`` at ``row``; False if it spills."""
        n = len(data)
        views[0][row] = n
        if n > self.capacity:
            return False
        views[1][row, :n] = np.frombuffer(data, np.uint8)
        return True

    def write(self, views, row, value):
        if self._store(views, row, self._encode(value, "observation")):
            return None
        return {self.path: value}

    def _decode(self, views, row: int, n: int) -> str:
        return views[1][row, :n].tobytes().decode("utf-8", "surrogatepass")

    def _spilled_value(self, spill: RowSpill | None, row: int) -> str:
        try:
            return spill[self.path]  # type: ignore[index]
        except (KeyError, TypeError):
            raise RuntimeError(
                f"shmvec internal error: text{self.path} of row {row} spilled, but its "
                "value did not arrive"
            ) from None

    def read_batch(self, views, copy, spills=None):
        capacity = self.capacity
        return tuple(
            self._decode(views, row, n)
            if n <= capacity
            else self._spilled_value((spills or {}).get(row), row)
            for row, n in enumerate(views[0].tolist())
        )

    def read(self, views, row, spill=None):
        n = int(views[0][row])
        if n <= self.capacity:
            return self._decode(views, row, n)
        return self._spilled_value(spill, row)

    def spilled(self, views, row):
        return bool(views[0][row] > self.capacity)

    def write_batch(self, views, value):
        return self.write_rows(views, range(views[0].shape[0]), value)

    def write_rows(self, views: list[np.ndarray], rows: Any, value: Any) -> Spills | None:
        if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
            raise TypeError(
                f"actions{self.path} must be a sequence of one str per env, got "
                f"{type(value).__name__} {_short(value)}"
            )
        if len(value) != len(rows):
            raise ValueError(
                f"actions{self.path}: expected {len(rows)} texts (one per env), got {len(value)}"
            )
        data = [self._encode(text, f"the action of env {row}: actions") for row, text in
                zip(rows, value)]  # fmt: skip
        spills: Spills = {}
        for row, text, encoded in zip(rows, value, data):
            if not self._store(views, row, encoded):
                spills[int(row)] = {self.path: str(text)}
        return spills or None


def _short(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _merge_spills(into: Spills | None, more: Spills | None) -> Spills | None:
    """``into`` with ``more``'s rows' values added (either may be None)."""
    if not more:
        return into
    if into is None:
        return more
    for row, values in more.items():
        into.setdefault(row, {}).update(values)
    return into


class DictCodec(Codec):
    def __init__(
        self, space: spaces.Dict | spaces.Tuple, path: str, children: dict[Any, Codec]
    ) -> None:
        self.space = space
        self.path = path
        self.children = children
        self.widths = [len(c.columns()) for c in children.values()]
        self.can_spill = any(c.can_spill for c in children.values())

    def columns(self):
        return [spec for child in self.children.values() for spec in child.columns()]

    def _split(self, views):
        start = 0
        for (key, child), width in zip(self.children.items(), self.widths):
            yield key, child, views[start : start + width]
            start += width

    def write(self, views, row, value):
        spill = None
        for key, child, sub in self._split(views):
            more = child.write(sub, row, value[key])
            if more:
                spill = more if spill is None else {**spill, **more}
        return spill

    def read_batch(self, views, copy, spills=None):
        return {key: child.read_batch(sub, copy, spills) for key, child, sub in self._split(views)}

    def write_batch(self, views, value):
        spills = None
        for key, child, sub in self._split(views):
            spills = _merge_spills(spills, child.write_batch(sub, value[key]))
        return spills

    def write_rows(self, views, rows, value):
        spills = None
        for key, child, sub in self._split(views):
            spills = _merge_spills(spills, child.write_rows(sub, rows, value[key]))
        return spills

    def spilled(self, views, row):
        return self.can_spill and any(
            child.spilled(sub, row) for _, child, sub in self._split(views) if child.can_spill
        )

    def is_exact(self, value):
        exact = [child.is_exact(value[key]) for key, child in self.children.items()]
        return all(exact)  # every child checked: each may raise its TypeError

    def read(self, views, row, spill=None):
        return {key: child.read(sub, row, spill) for key, child, sub in self._split(views)}


class TupleCodec(DictCodec):
    def __init__(self, space: spaces.Tuple, path: str, children: list[Codec]) -> None:
        super().__init__(space, path, dict(enumerate(children)))

    def read_batch(self, views, copy, spills=None):
        return tuple(super().read_batch(views, copy, spills).values())

    def read(self, views, row, spill=None):
        return tuple(super().read(views, row, spill).values())


class PickledCodec(Codec):
    """A space without fixed-size values: per-env values go through the pipe.

    ``write``/``read`` use a plain list of per-env values instead of columns.
    """

    pickled = True

    def __init__(self, space: spaces.Space) -> None:
        self.space = space

    def write(self, views, row, value):
        views[row] = value

    def read_batch(self, values, copy, spills=None):
        n = len(values)
        return concatenate(self.space, values, create_empty_array(self.space, n))

    def write_batch(self, values, value):
        items = list(iterate(batch_space(self.space, len(values)), value))
        if len(items) != len(values):
            raise ValueError(f"expected {len(values)} actions, got {len(items)}")
        values[:] = items
        return None

    def read(self, values, row, spill=None):
        return values[row]


def is_fixed_size(space: spaces.Space) -> bool:
    """True when every leaf of ``space`` can live in a column."""
    if isinstance(space, (*ARRAY_SPACES, spaces.Text)):
        return True
    if isinstance(space, spaces.Dict):
        return all(is_fixed_size(s) for s in space.spaces.values())
    if isinstance(space, spaces.Tuple):
        return all(is_fixed_size(s) for s in space.spaces)
    return False


def make_codec(
    space: spaces.Space, shared_memory: bool = True, text_bytes: int = TEXT_BYTES
) -> Codec:
    """The codec for ``space``: columns if it is fixed-size, else pickled;
    ``text_bytes``: the inline bytes of each ``UnboundedText`` row."""
    if not shared_memory or not is_fixed_size(space):
        return PickledCodec(space)
    return _make_fixed(space, "", text_bytes)


def _make_fixed(space: spaces.Space, path: str, text_bytes: int) -> Codec:
    if isinstance(space, spaces.Dict):
        return DictCodec(
            space,
            path,
            {k: _make_fixed(s, f"{path}[{k!r}]", text_bytes) for k, s in space.spaces.items()},
        )
    if isinstance(space, spaces.Tuple):
        return TupleCodec(
            space,
            path,
            [_make_fixed(s, f"{path}[{i}]", text_bytes) for i, s in enumerate(space.spaces)],
        )
    if isinstance(space, UnboundedText):
        return Utf8TextCodec(space, path, text_bytes)
    if isinstance(space, spaces.Text):
        return TextCodec(space, path)
    return ArrayCodec(space, path)


def check_text_bytes(text_bytes: Any) -> int:
    """``text_bytes`` checked: an int >= 0 (0: every non-empty text spills)."""
    if isinstance(text_bytes, bool) or not isinstance(text_bytes, (int, np.integer)):
        raise TypeError(f"text_bytes must be an int >= 0, got {text_bytes!r}")
    if text_bytes < 0:
        raise ValueError(f"text_bytes must be an int >= 0, got {text_bytes}")
    return int(text_bytes)
