"""Types of shmvec._worker_loop (compiled from _worker_loop.pyx)."""

from collections.abc import Callable
from typing import Any, final

import numpy as np
import numpy.typing as npt

from shmvec.codecs import Codec
from shmvec.layout import SlotViews

# A result, as Stepper.advance returns it: (obs, reward, terminated, truncated,
# infos to merge or None).
_Result = tuple[Any, float, bool, bool, list[dict[str, Any]] | None]
# A barrier command: (generation, kind, arg).
_Command = tuple[int, int, int]
# A buffer of one element of the worker's line (a 1-element numpy view).
_Word = npt.NDArray[np.uint32] | memoryview
_Word64 = npt.NDArray[np.uint64] | memoryview
_Bytes = npt.NDArray[np.uint8] | memoryview

class WorkerBarrier:
    def __init__(self, address: int, num_workers: int) -> None: ...
    def set_spin(self, cap_ns: int, adaptive: bool) -> None: ...
    def wait_command(self, last_generation: int, timeout_ns: int) -> _Command | None: ...
    def arrive(self, message: bool = False) -> None: ...
    def generation_now(self) -> int: ...

class InfoColumns:
    def __init__(
        self, schema: dict[str, int], codes: npt.NDArray[np.uint8], cells: npt.NDArray[np.uint64]
    ) -> None: ...

class SlotColumns:
    @property
    def obs(self) -> Any: ...
    def __init__(
        self,
        views: SlotViews,
        index: int = 0,
        regions_table: npt.NDArray[np.uint32] | None = None,
        regions: list[Any] | None = None,
    ) -> None: ...
    def obs_columns(self) -> Any: ...

def count_ended(slot: SlotColumns, rows: int = -1) -> int: ...
def uniform_codes(codes: npt.NDArray[np.uint8], columns: list[int], rows: int) -> list[int]: ...
def row_messages(slot: SlotColumns) -> bool: ...

class RegionLease:
    def __init__(
        self, segment: Any, address: int, size: int, free: list[int], region: int
    ) -> None: ...
    # The buffer protocol (typing_extensions.Buffer), on every Python version.
    def __buffer__(self, flags: int, /) -> memoryview: ...

@final
class Stepper:
    actions_by_value: bool
    # env id -> the spilled text of its action ({path: text}), from the worker's pipe.
    take_spill: Callable[[int], dict[str, str]] | None
    def __init__(self, action_codec: Codec, obs_codec: Codec, mode: int) -> None: ...
    def write(
        self, obs_views: Any, slot: SlotColumns, row: int, result: _Result
    ) -> dict[str, str] | None: ...
    def skip_action(self, action_views: list[Any], env_id: int) -> None: ...

def reset_result(
    env: Any, seed: int | None, options: dict[str, Any] | None, extra: dict[str, Any] | None = None
) -> _Result: ...
def set_step_deadline(seconds: float) -> None: ...
def on_step_deadline(signum: int, frame: Any) -> None: ...
def arm_step_deadline() -> None: ...
def disarm_step_deadline() -> None: ...

class EnvBook:
    def __init__(
        self,
        awaiting: npt.NDArray[np.uint8],
        commands: npt.NDArray[np.uint8],
        last_command: npt.NDArray[np.uint8],
        env_worker: npt.NDArray[np.int64],
        bell_addresses: list[int],
    ) -> None: ...
    def idle_ids(self, env_ids: object) -> npt.NDArray[np.int64] | None: ...
    def start(self, ids: npt.NDArray[np.int64], command: int) -> None: ...
    def received(self, row_env_ids: npt.NDArray[np.int32]) -> npt.NDArray[np.int64]: ...

class WorkerDoorbell:
    def __init__(self, address: int) -> None: ...
    def set_spin(self, cap_ns: int, adaptive: bool) -> None: ...
    def wait(self, last: int, timeout_ns: int) -> int | None: ...

class WorkerRing:
    def __init__(self, address: int, num_slots: int, batch_size: int) -> None: ...
    def claim(self) -> tuple[int, int]: ...
    def publish(self, slot: int) -> None: ...

@final
class Block:
    @property
    def stepper(self) -> Stepper: ...
    @property
    def envs(self) -> list[Any]: ...
    @property
    def first_row(self) -> int: ...
    @property
    def first_index(self) -> int: ...
    @property
    def barrier(self) -> WorkerBarrier: ...
    generation: int
    action_views: list[Any]
    slots: list[SlotColumns]
    regions: list[list[np.ndarray]]
    info_columns: list[InfoColumns]
    autoreset: _Bytes
    flag: _Word
    current_env: _Word
    finished: _Word
    busy_ns: _Word64
    env_started: _Word64 | None
    ring: WorkerRing | None
    commands: _Bytes | None
    restarted: _Bytes | None
    on_error: Callable[[int, BaseException], _Result] | None
    send: Callable[[dict[str, Any]], None]
    build_message: Callable[[list, list, Any, list], dict[str, Any]]
    take_reset_args: Callable[[int], tuple[int | None, dict[str, Any] | None]]
    restart: Callable[[int, int], _Result]
    row_lock: Any
    deadline: bool
    abandoned: bool
    in_env: bool
    on_deadline: Callable[[int], _Result] | None
    def __init__(
        self, stepper: Stepper, envs: list[Any], first_row: int, barrier: WorkerBarrier
    ) -> None: ...
    def part(self, i: int, current_env: _Word, env_started: _Word64 | None = None) -> Block: ...
    def step_block(
        self, action_views: list[Any], obs_views: Any, slot: int
    ) -> tuple[
        list[tuple[int, list[dict[str, Any]]]],
        list[tuple[int, BaseException, str]],
        list[tuple[str, int]],
        list[tuple[int, dict[str, str]]],
    ]: ...
    def finish_round(self, message: dict[str, Any] | None, started: int) -> None: ...
    def enter_env(self, row: int) -> None: ...
    def serve_rounds(self, timeout_ns: int, max_rounds: int) -> tuple[int, _Command | None]: ...
    def step_pending(self) -> None: ...
    def report(
        self, result: _Result | None, error: tuple[int, BaseException, str] | None = None
    ) -> None: ...
