"""What a rollout runner is and how it is registered."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from shmvec_bench.rollouts.records import GroupRecord, RunContext


class Runner(Protocol):
    env_steps: int

    def get_batch(self) -> list[GroupRecord]: ...

    def env_pids(self) -> list[int]: ...

    def stats(self) -> dict[str, Any] | None: ...

    def close(self, terminate: bool = False) -> None: ...


@dataclass(frozen=True)
class Backend:
    """A registered runner."""

    name: str
    open: Callable[[RunContext], Runner]
    #: One line for ``--help`` and the report.
    summary: str
    #: The framework file(s) it mirrors.
    mirrors: str
    #: A module that must be importable, or None.
    requires: str | None = None
    #: Whether every batch is a fresh rollout behind a barrier (no warm-up batch needed).
    lockstep: bool = False

    def is_importable(self) -> bool:
        return self.requires is None or importlib.util.find_spec(self.requires) is not None


REGISTRY: dict[str, Backend] = {}


def register(name: str, **options: Any) -> Callable:
    def add(cls):
        REGISTRY[name] = Backend(name, cls, **options)
        return cls

    return add


def no_pids() -> list[int]:
    return []


def this_process() -> int:
    return os.getpid()
