"""Torch bridge: ShmVectorEnv batches as torch tensors on a chosen device.

Install with ``pip install shmvec[torch]``.

``device="cpu"``: zero-copy views; ``device="cuda"``: from the segment registered
as pinned memory, a small result by a blocking copy per array, a larger one by
one DMA copy of its span with one CUDA event per ring slot before the workers may
write it again (docs/guides/torch.md has the whole rule).

Example:
    >>> import gymnasium as gym
    >>> import shmvec
    >>> from shmvec.torch import TorchVectorEnv
    >>> envs = TorchVectorEnv(shmvec.ShmVectorEnv([lambda: gym.make("CartPole-v1")] * 4))
    >>> obs, infos = envs.reset(seed=0)
    >>> obs.dtype, tuple(obs.shape)
    (torch.float32, (4, 4))
    >>> actions = torch.zeros(4, dtype=torch.int64)
    >>> obs, rewards, terminations, truncations, infos = envs.step(actions)
    >>> envs.close()
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any, NamedTuple

import numpy as np
import torch
from gymnasium.vector import VectorWrapper

from shmvec.vector_env import ShmVectorEnv

#: Results under this many bytes per step are copied array by array, each copy
#: blocking: at a few KiB a DMA's latency (~20 µs) and the span's bookkeeping cost
#: more than the copies (docs/performance.md, the GPU hand-off).
SMALL_RESULT_BYTES = 64 << 10
#: Spans from this size on are copied on the bridge's own stream, so that they can
#: overlap GPU work queued before them (docs/guides/torch.md; no A/B sets the size).
SIDE_STREAM_BYTES = 1 << 20


class TorchVectorEnv(VectorWrapper):
    """Wraps a ShmVectorEnv: torch tensors out, torch (or numpy) actions in.

    Args:
        env: a ShmVectorEnv (``env.unwrapped`` must be one).
        device: where observations, rewards and done flags go.
        reward_dtype: dtype of the reward tensor (float32, as policies use).
        side_stream_bytes: on CUDA, results of at least this many bytes per
            step are copied on a stream of their own (see the module's doc).
        small_result_bytes: on CUDA, results under this many bytes per step
            are copied array by array, each copy blocking.
    """

    def __init__(
        self,
        env: ShmVectorEnv,
        device: str | torch.device = "cpu",
        reward_dtype: torch.dtype = torch.float32,
        side_stream_bytes: int = SIDE_STREAM_BYTES,
        small_result_bytes: int = SMALL_RESULT_BYTES,
    ) -> None:
        super().__init__(env)
        shm = env.unwrapped
        if not isinstance(shm, ShmVectorEnv):
            raise TypeError(f"TorchVectorEnv needs a ShmVectorEnv, got {type(shm).__name__}")
        self.shm = shm
        self.device = torch.device(device)
        self.reward_dtype = reward_dtype
        self.side_stream_bytes = side_stream_bytes
        self.small_result_bytes = small_result_bytes
        self._handoff = shm.handoff()
        slab = self._handoff.action_slab()
        self._slab = None if slab is None else torch.from_numpy(slab)
        self._registered = False
        if self.device.type == "cuda":
            self._init_cuda()

    def _init_cuda(self) -> None:
        shm = self.shm
        shm.copy = False
        handoff = self._handoff
        address, size = handoff.region
        torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(address, size, 0))
        self._registered = True
        self._packer = SpanPacker(handoff.region, self.device, self.reward_dtype)
        self._stream = torch.cuda.Stream(self.device)
        self._events = [torch.cuda.Event() for _ in range(handoff.num_slots)]
        self._pending = [False] * handoff.num_slots
        handoff.on_slot_reuse(self._wait_for_copy)

    def _wait_for_copy(self, slot: int) -> None:
        """The workers may write ``slot`` only once its device copy is done."""
        if self._pending[slot]:
            self._events[slot].synchronize()
            self._pending[slot] = False

    # ------------------------------------------------------------- conversions

    def _to_device(self, value: Any, non_blocking: bool) -> Any:
        """numpy leaves to tensors on the device (strings and objects stay)."""
        if isinstance(value, np.ndarray) and value.dtype != object:
            tensor = torch.from_numpy(value)
            if self.device.type == "cpu":
                return tensor
            out = torch.empty(tensor.shape, dtype=tensor.dtype, device=self.device)
            out.copy_(tensor, non_blocking=non_blocking)
            return out
        if isinstance(value, dict):
            return {k: self._to_device(v, non_blocking) for k, v in value.items()}
        if isinstance(value, tuple) and not any(isinstance(v, str) for v in value):
            return tuple(self._to_device(v, non_blocking) for v in value)
        return value

    def _tensors(self, obs, rewards, terminations, truncations, non_blocking=True) -> list:
        converted = [self._to_device(obs, non_blocking)]
        if rewards is not None:
            converted += [
                self._to_device(rewards, non_blocking).to(self.reward_dtype),
                self._to_device(terminations, non_blocking),
                self._to_device(truncations, non_blocking),
            ]
        return converted

    def _convert(self, slot: int, obs, rewards=None, terminations=None, truncations=None):
        """Tensors of one result. On CUDA: a small result by a blocking copy per
        leaf (done on return, so the slot is free at once); a larger one by one
        span copy when it is ring views, else one copy per leaf, with an event
        that the slot's reuse waits for; large spans on the bridge's stream."""
        if self.device.type == "cpu":
            return self._tensors(obs, rewards, terminations, truncations)
        result = [obs] if rewards is None else [obs, rewards, terminations, truncations]
        nbytes = _nbytes(result)
        if nbytes < self.small_result_bytes:
            return self._tensors(obs, rewards, terminations, truncations, non_blocking=False)
        span = self._packer.span(result) if self.env is self.shm else None
        if span is not None:
            nbytes = span.end - span.start
        current = torch.cuda.current_stream(self.device)
        if nbytes < self.side_stream_bytes:
            converted = self._copy(span, result)
            self._events[slot].record(current)
            self._pending[slot] = True
            return converted
        with torch.cuda.stream(self._stream):
            converted = self._copy(span, result)
            self._events[slot].record(self._stream)
        self._pending[slot] = True
        current.wait_event(self._events[slot])
        for tensor in _leaves(converted):
            tensor.record_stream(current)  # allocated on the bridge's stream
        return converted

    def _copy(self, span: Span | None, result: list) -> list:
        if span is not None:
            return self._packer.copy(span)
        return self._tensors(*result, *([None] * (4 - len(result))))

    def _write_actions(self, actions: Any) -> bool:
        """Copies tensor actions into the slab; False if the env must write them.

        Only when this bridge wraps the ShmVectorEnv itself: vector wrappers in
        between must see every step.
        """
        slab = self._slab
        if not (self.env is self.shm and slab is not None and isinstance(actions, torch.Tensor)):
            return False
        if tuple(actions.shape) != tuple(slab.shape):
            raise ValueError(
                f"actions have shape {tuple(actions.shape)}, expected {tuple(slab.shape)}"
            )
        if not torch.can_cast(actions.dtype, slab.dtype):
            raise TypeError(
                f"actions have dtype {actions.dtype}, which cannot be cast safely to the "
                f"action space's dtype {slab.dtype}"
            )
        slab.copy_(actions)  # device -> pinned slab: a direct DMA, then it is done
        return True

    # ---------------------------------------------------------------- the API

    def reset(self, *, seed=None, options=None):
        """``(obs, infos)`` with ``obs`` as tensors on the device."""
        obs, infos = self.env.reset(seed=seed, options=options)
        return self._convert(self._result_slot(), obs)[0], infos

    def step(self, actions):
        """Steps with torch or numpy actions; returns tensors (infos stay numpy)."""
        if self._write_actions(actions):
            obs, rewards, terminations, truncations, infos = self._handoff.step_written()
        else:
            obs, rewards, terminations, truncations, infos = self.env.step(_to_numpy(actions))
        return (*self._convert(self._result_slot(), obs, rewards, terminations, truncations), infos)

    def async_reset(self, seed=None, options=None, env_ids=None) -> None:
        """``ShmVectorEnv.async_reset``; ``recv()`` returns the results as tensors."""
        self.shm.async_reset(
            seed=seed, options=options, env_ids=None if env_ids is None else _to_numpy(env_ids)
        )

    def send(self, actions, env_ids=None) -> None:
        """``ShmVectorEnv.send`` with torch or numpy actions and env ids."""
        self.shm.send(_to_numpy(actions), None if env_ids is None else _to_numpy(env_ids))

    def recv(
        self, timeout: float | None = None, *, partial: bool = False, take_ready: bool = False
    ):
        """``ShmVectorEnv.recv`` as tensors; ``infos["env_id"]`` stays numpy."""
        obs, rewards, terminations, truncations, infos = self.shm.recv(
            timeout, partial=partial, take_ready=take_ready
        )
        return (*self._convert(self._result_slot(), obs, rewards, terminations, truncations), infos)

    def _result_slot(self) -> int:
        return self._handoff.last_slot

    def close(self, **kwargs: Any) -> None:
        """Waits for copies in flight, unregisters the pinned segment, closes."""
        if self._registered:
            torch.cuda.synchronize(self.device)
            torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(self._handoff.region[0]))
            self._registered = False
        super().close(**kwargs)


class Span(NamedTuple):
    """Where one step's result lies in the segment: bytes ``start``..``end``,
    and ``layout``, the result's tree with a ``_Leaf`` at each leaf."""

    start: int
    end: int
    layout: list


class _Leaf(NamedTuple):
    offset: int  # in the segment
    nbytes: int
    dtype: torch.dtype
    shape: tuple


class SpanPacker:
    """One step's result, when it is views of one ring slot, as one copy.

    The slot's columns (observation leaves, rewards, terminated, truncated) lie
    one after another in the segment, so the bytes from the first to the end of
    the last are one span: copied into one device buffer, each leaf is a view
    of it at the same offset. Works for any ``device`` (the tests use the CPU).
    """

    def __init__(self, region: tuple[int, int], device: torch.device, reward_dtype) -> None:
        address, size = region
        self.address, self.size = address, size
        host = (ctypes.c_uint8 * size).from_address(address)
        self.host = torch.from_numpy(np.ctypeslib.as_array(host))
        self.device = device
        self.reward_dtype = reward_dtype

    def span(self, result: list) -> Span | None:
        """The span of ``result`` (``[obs]`` or ``[obs, rewards, terminations,
        truncations]``), or None when a leaf is not a contiguous numeric array
        inside the segment."""
        leaves: list[_Leaf] = []

        def place(leaf: Any) -> Any:
            if isinstance(leaf, dict):
                return {k: place(v) for k, v in leaf.items()}
            if isinstance(leaf, tuple):
                return tuple(place(v) for v in leaf)
            if not (isinstance(leaf, np.ndarray) and leaf.dtype != object):
                raise _NotInRing  # a string (Text), a pickled value
            offset = leaf.__array_interface__["data"][0] - self.address
            if not (leaf.flags.c_contiguous and 0 <= offset <= self.size - leaf.nbytes):
                raise _NotInRing  # a strided view, or an array a wrapper made
            leaves.append(_Leaf(offset, leaf.nbytes, _torch_dtype(leaf.dtype), leaf.shape))
            return leaves[-1]

        try:
            layout = [place(leaf) for leaf in result]
        except _NotInRing:
            return None
        if not leaves:
            return None
        start = min(leaf.offset for leaf in leaves)
        end = max(leaf.offset + leaf.nbytes for leaf in leaves)
        return Span(start, end, layout)

    def copy(self, span: Span) -> list:
        """The leaves of the result as views of one copy of ``span`` on the
        device (on the current stream); rewards cast to ``reward_dtype``."""
        buffer = torch.empty(span.end - span.start, dtype=torch.uint8, device=self.device)
        buffer.copy_(self.host[span.start : span.end], non_blocking=True)

        def view(leaf: Any) -> Any:
            if isinstance(leaf, dict):
                return {k: view(v) for k, v in leaf.items()}
            if not isinstance(leaf, _Leaf):  # a Tuple space's tuple
                return tuple(view(v) for v in leaf)
            offset = leaf.offset - span.start
            return buffer[offset : offset + leaf.nbytes].view(leaf.dtype).view(leaf.shape)

        converted = [view(leaf) for leaf in span.layout]
        if len(converted) > 1:
            converted[1] = converted[1].to(self.reward_dtype)
        return converted


class _NotInRing(Exception):
    """A leaf of a result that the span copy cannot take."""


@functools.cache
def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype)).dtype


def _nbytes(result: list) -> int:
    return sum(leaf.nbytes for leaf in _leaves(result) if isinstance(leaf, np.ndarray))


def _to_numpy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    if isinstance(value, dict):
        return {k: _to_numpy(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_to_numpy(v) for v in value)
    return value


def _leaves(tree: Any):
    if isinstance(tree, (torch.Tensor, np.ndarray)):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _leaves(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _leaves(v)
