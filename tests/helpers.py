"""Comparison helpers shared by the test files."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Bit-for-bit equality of two (possibly nested) values, types included.

    ndarrays must agree in dtype, shape and content (object arrays element by
    element, recursively); dicts in their key sets (order ignored); tuples and
    lists element by element; scalars in type and value.
    """
    where = path or "<root>"
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        assert isinstance(a, np.ndarray) and isinstance(b, np.ndarray), (
            f"{where}: {type(a).__name__} vs {type(b).__name__}"
        )
        assert a.dtype == b.dtype, f"{where}: dtype {a.dtype} vs {b.dtype}"
        assert a.shape == b.shape, f"{where}: shape {a.shape} vs {b.shape}"
        if a.dtype == object:
            for index in np.ndindex(a.shape):
                assert_same(a[index], b[index], f"{path}[{index}]")
        else:
            assert np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"), (
                f"{where}: values differ\n{a}\nvs\n{b}"
            )
        return
    assert type(a) is type(b), f"{where}: type {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, dict):
        assert set(a) == set(b), f"{where}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for key in a:
            assert_same(a[key], b[key], f"{path}[{key!r}]")
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b), f"{where}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and np.isnan(a):
        assert np.isnan(b), f"{where}: {a!r} vs {b!r}"
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def dev_shm_files() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except FileNotFoundError:
        return set()


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


@contextlib.contextmanager
def example_module(name: str) -> Iterator[Any]:
    """``examples/<name>.py`` imported as a module for as long as the context lasts."""
    spec = importlib.util.spec_from_file_location(f"shmvec_example_{name}", example_path(name))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    sys.path.insert(0, EXAMPLES)  # the examples' shared module, as when run as scripts
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(EXAMPLES)
        sys.modules.pop(spec.name, None)


def example_path(name: str) -> str:
    return os.path.join(EXAMPLES, f"{name}.py")


def open_pool(num_envs: int, num_workers: int, batch_size: int, observation_space: Any,
              num_slots: int = 2) -> Any:  # fmt: skip
    """A ``WorkerPool`` with its segment open and no worker started (Discrete(2) actions)."""
    from gymnasium import spaces

    from shmvec.batching import split_blocks
    from shmvec.engine.options import EngineOptions
    from shmvec.engine.pool import WorkerPool
    from shmvec.spin import NO_SPIN
    from shmvec.worker import WorkerSpec

    spec = WorkerSpec(
        index=0, first_env=0, env_fns=[], num_envs=num_envs, num_workers=num_workers,
        num_slots=num_slots, batch_size=batch_size, observation_space=observation_space,
        action_space=spaces.Discrete(2), observation_mode="same", shared_memory=True,
        autoreset_mode=0, spin=NO_SPIN, main_pid=os.getpid(), use_death_signal=False,
    )  # fmt: skip
    blocks = split_blocks(num_envs, num_workers)
    pool = WorkerPool(spec, [None] * num_envs, blocks, EngineOptions(in_process=True))
    pool.open()
    return pool
