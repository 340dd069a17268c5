"""Torch bridge: ShmVectorEnv batches as torch tensors on a chosen device.

Install with ``pip install shmvec[torch]``.

- ``device="cpu"``: tensors are zero-copy views (``torch.from_numpy``) of what
  the env returns. With the env's ``copy=False`` they are views of the result
  ring, valid for ``ring_depth - 1`` further steps (the ring's rule); with
  ``copy=True`` they own their memory.
- ``device="cuda"``: the whole segment is registered as pinned memory in place
  (``cudaHostRegister``), so a ring slot is copied to the device by DMA, with
  no pageable bounce: the copies run ``non_blocking`` on a dedicated stream
  and record one CUDA event per ring slot; the current stream waits on that
  event (no host sync), and before the workers may write a slot again the main
  process waits for the slot's event. Actions given as CUDA tensors are copied
  device -> pinned action slab directly. The env is switched to ``copy=False``:
  host copies would only add a pageable hop. The segment is unregistered in
  ``close()``, before it can be unmapped.

Workers never touch CUDA, so creating the env after CUDA was initialized in the
main process is safe with the default ``fork`` start method: the children only
step envs. An env that itself uses CUDA needs ``context="spawn"`` (or
``"forkserver"``), as with any forked process.

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

from typing import Any

import numpy as np
import torch
from gymnasium.vector import VectorWrapper

from shmvec.vector_env import ShmVectorEnv


class TorchVectorEnv(VectorWrapper):
    """Wraps a ShmVectorEnv: torch tensors out, torch (or numpy) actions in.

    Args:
        env: a ShmVectorEnv (``env.unwrapped`` must be one).
        device: where observations, rewards and done flags go.
        reward_dtype: dtype of the reward tensor (float32, as policies use).
    """

    def __init__(
        self,
        env: ShmVectorEnv,
        device: str | torch.device = "cpu",
        reward_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(env)
        shm = env.unwrapped
        if not isinstance(shm, ShmVectorEnv):
            raise TypeError(f"TorchVectorEnv needs a ShmVectorEnv, got {type(shm).__name__}")
        self.shm = shm
        self.device = torch.device(device)
        self.reward_dtype = reward_dtype
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

    def _to_device(self, value: Any) -> Any:
        """numpy leaves to tensors on the device (strings and objects stay)."""
        if isinstance(value, np.ndarray) and value.dtype != object:
            tensor = torch.from_numpy(value)
            if self.device.type == "cpu":
                return tensor
            out = torch.empty(tensor.shape, dtype=tensor.dtype, device=self.device)
            out.copy_(tensor, non_blocking=True)
            return out
        if isinstance(value, dict):
            return {k: self._to_device(v) for k, v in value.items()}
        if isinstance(value, tuple) and not any(isinstance(v, str) for v in value):
            return tuple(self._to_device(v) for v in value)
        return value

    def _tensors(self, obs, rewards, terminations, truncations) -> list:
        converted = [self._to_device(obs)]
        if rewards is not None:
            converted += [
                self._to_device(rewards).to(self.reward_dtype),
                self._to_device(terminations),
                self._to_device(truncations),
            ]
        return converted

    def _convert(self, slot: int, obs, rewards=None, terminations=None, truncations=None):
        """Tensors of one result; on CUDA, copied on the bridge's stream."""
        if self.device.type == "cpu":
            return self._tensors(obs, rewards, terminations, truncations)
        current = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._stream):
            converted = self._tensors(obs, rewards, terminations, truncations)
            self._events[slot].record(self._stream)
        self._pending[slot] = True
        current.wait_event(self._events[slot])
        for tensor in _leaves(converted):
            tensor.record_stream(current)  # allocated on the bridge's stream
        return converted

    def _write_actions(self, actions: Any) -> bool:
        """Copies tensor actions into the slab; False if the env must write them.

        Only when this bridge wraps the ShmVectorEnv itself: vector wrappers in
        between must see every step.
        """
        direct = self.env is self.shm and self._slab is not None
        if not (direct and isinstance(actions, torch.Tensor)):
            return False
        slab = self._slab
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

    def send(self, actions, env_ids=None) -> None:
        """``ShmVectorEnv.send`` with torch or numpy actions and env ids."""
        self.shm.send(_to_numpy(actions), None if env_ids is None else _to_numpy(env_ids))

    def recv(self, timeout: float | None = None):
        """``ShmVectorEnv.recv`` as tensors; ``infos["env_id"]`` stays numpy."""
        obs, rewards, terminations, truncations, infos = self.shm.recv(timeout)
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


def _to_numpy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    if isinstance(value, dict):
        return {k: _to_numpy(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_to_numpy(v) for v in value)
    return value


def _leaves(tree: Any):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _leaves(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _leaves(v)
