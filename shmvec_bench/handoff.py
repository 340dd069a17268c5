"""The GPU hand-off: what moving each step's observations to the device costs.

``shmvec-bench --workloads handoff`` (or ``--device cuda``) steps CartPole x64,
Pong x32 (a do-nothing env with Pong's 4x84x84 uint8 observations when ale-py
is not installed) and 1 MiB observations x16, each in one
``ShmVectorEnv(copy=False)``, four ways:

- ``env alone``: ``step`` with numpy actions, nothing moved: the baseline;
- ``from_numpy``: ``torch.from_numpy(obs).to(device)`` (a pageable copy);
- ``pinned``: a copy into a pinned buffer, then ``.to(device, non_blocking=True)``;
- ``TorchVectorEnv``: ``shmvec.torch.TorchVectorEnv(env, device=device)``, whose
  ring is pinned in place.

Every way delivers the same payload to the device, each step's observations,
rewards and terminated/truncated flags, as a PPO loop needs them (CleanRL's
``ppo.py`` moves all four). Every step is followed by a GPU op on the
observations and a synchronize, and the actions come from the device as a PPO
loop's do (``actions.cpu().numpy()``
for the plain copies; ``TorchVectorEnv`` takes the device tensor). The hand-off
bandwidth is the observation bytes per step over the time a way adds to the
baseline's step; beside it, the device's plain pinned ``cudaMemcpy`` bandwidth
(a 256 MiB pinned tensor ``.to("cuda", non_blocking=True)``, CUDA events).
Without CUDA it runs on the CPU (pinned copies skipped, no bandwidth: nothing
crosses a bus) and says so; its figures are then the loop's own overhead.
"""

from __future__ import annotations

import csv
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shmvec_bench.workloads import WORKLOADS

#: (workload, num_envs); ``pong`` becomes ``pongsize`` without ale-py.
CASES = (("cartpole", 64), ("pong", 32), ("largeobs", 16))
#: The ways of handing off, in column order.
WAYS = ("env alone", "from_numpy", "pinned", "TorchVectorEnv")
#: The pinned cudaMemcpy reference: bytes per copy and copies timed (median taken).
MEMCPY_BYTES = 256 * 2**20
MEMCPY_REPEATS = 10


def _time_loop(step: Callable[[int], Any], seconds: float, warmup_s: float) -> float:
    """Runs ``step(i)`` for a warm-up, then for ``seconds``; mean microseconds per step."""
    for phase_s in (warmup_s, seconds):
        count, start = 0, time.perf_counter()
        end = start + phase_s
        now = start
        while now < end:
            step(count)
            count += 1
            now = time.perf_counter()
    return (now - start) / count * 1e6


#: Elements of each env's observation the GPU op reads: enough to depend on the
#: copy (the op waits for it), few enough that the op itself costs ~nothing on
#: either device and the figure is the hand-off's.
OP_ELEMENTS = 64


def _actions_from(torch, obs, num_actions: int):
    """A GPU op on the observations (a sum per env) and actions derived from it."""
    value = obs.flatten(1)[:, :OP_ELEMENTS].float().sum(dim=1)
    return (value * 1000).long().abs() % num_actions


def _sync(torch, device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_case(
    torch, workload: str, num_envs: int, device, seconds: float, warmup_s: float
) -> dict[str, Any]:
    """Per-step microseconds of each way (and the hand-off's GB/s) for one case."""
    import shmvec
    from shmvec.torch import TorchVectorEnv

    env = shmvec.ShmVectorEnv([WORKLOADS[workload]] * num_envs, copy=False)
    cuda = device.type == "cuda"
    row: dict[str, Any] = {"workload": workload, "num_envs": num_envs}
    try:
        obs, _ = env.reset(seed=0)
        num_actions = int(env.single_action_space.n)
        row["obs_bytes"] = obs.nbytes
        space = env.action_space
        space.seed(0)
        actions = [space.sample() for _ in range(64)]
        first = env.step(actions[0])[:4]
        state = {"result": first}

        def env_alone(i: int) -> None:
            env.step(actions[i % 64])

        def from_numpy(i: int) -> None:
            on_device = [torch.from_numpy(a).to(device) for a in state["result"]]
            chosen = _actions_from(torch, on_device[0], num_actions)
            _sync(torch, device)
            state["result"] = env.step(chosen.cpu().numpy())[:4]

        pinned = [
            torch.empty(a.shape, dtype=torch.from_numpy(a).dtype, pin_memory=cuda) for a in first
        ]

        def pinned_copy(i: int) -> None:
            on_device = []
            for buffer, array in zip(pinned, state["result"]):
                buffer.copy_(torch.from_numpy(array))
                on_device.append(buffer.to(device, non_blocking=True))
            chosen = _actions_from(torch, on_device[0], num_actions)
            _sync(torch, device)  # also: the pinned buffers may be written again
            state["result"] = env.step(chosen.cpu().numpy())[:4]

        row["env alone"] = _time_loop(env_alone, seconds, warmup_s)
        row["from_numpy"] = _time_loop(from_numpy, seconds, warmup_s)
        if cuda:
            row["pinned"] = _time_loop(pinned_copy, seconds, warmup_s)
        # Last: with CUDA, TorchVectorEnv pins the segment in place, which would
        # make the plain copies above pinned ones too.
        envs = TorchVectorEnv(env, device=device)
    except BaseException:
        env.close(terminate=True)
        raise
    try:
        tensor_obs, _ = envs.reset(seed=0)
        state = {"obs": tensor_obs}

        def torch_env(i: int) -> None:
            chosen = _actions_from(torch, state["obs"], num_actions)
            _sync(torch, device)
            state["obs"] = envs.step(chosen)[0]

        row["TorchVectorEnv"] = _time_loop(torch_env, seconds, warmup_s)
    finally:
        envs.close()
    for way in WAYS[1:] if cuda else ():  # on the CPU nothing is handed off
        added = row.get(way, 0.0) - row["env alone"]
        if way in row and added > 0:
            row[f"{way} GB/s"] = row["obs_bytes"] / added / 1e3  # bytes per µs -> GB/s
    return row


def pinned_memcpy_gb_s(torch, device) -> float:
    """The device's plain pinned host -> device bandwidth: the median of
    ``MEMCPY_REPEATS`` copies of ``MEMCPY_BYTES``, timed with CUDA events."""
    host = torch.empty(MEMCPY_BYTES, dtype=torch.uint8, pin_memory=True)
    host.fill_(1)
    host.to(device, non_blocking=True)  # the first copy pays the allocator
    times = []
    for _ in range(MEMCPY_REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        host.to(device, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return MEMCPY_BYTES / statistics.median(times) / 1e9


def _cell(row: dict, way: str) -> str:
    if way not in row:
        return "skipped (no CUDA)"
    rate = row.get(f"{way} GB/s")
    return f"{row[way]:,.1f}" + (f" ({rate:.2f} GB/s)" if rate else "")


def run_handoff(device_name: str | None, seconds: float, warmup_s: float, out: Path) -> int:
    """Times every case on ``device_name`` (default: cuda if there is one), prints a
    table, writes ``out/handoff.csv``; returns 0, or 1 if torch is missing."""
    if importlib.util.find_spec("torch") is None:
        print("error: the hand-off benchmark needs torch (pip install torch)", file=sys.stderr)
        return 1
    import torch

    cuda_ok = torch.cuda.is_available()
    device = torch.device(device_name or ("cuda" if cuda_ok else "cpu"))
    if device.type == "cuda" and not cuda_ok:
        device = torch.device("cpu")
    if device.type != "cuda":
        print("CUDA not available: CPU figures only" if not cuda_ok else f"device: {device}")
    has_ale = importlib.util.find_spec("ale_py") is not None
    rows = []
    for workload, num_envs in CASES:
        if workload == "pong" and not has_ale:
            workload = "pongsize"
        rows.append(measure_case(torch, workload, num_envs, device, seconds, warmup_s))
    memcpy = pinned_memcpy_gb_s(torch, device) if device.type == "cuda" else None

    print(f"\nhand-off per step on {device} (µs; GB/s = observation bytes / time added to "
          "'env alone')\n")  # fmt: skip
    print("| workload | envs | obs bytes/step | " + " | ".join(WAYS) + " |")
    print("|---|---:|---:|" + "---:|" * len(WAYS))
    for row in rows:
        cells = " | ".join(_cell(row, way) for way in WAYS)
        print(f"| {row['workload']} | {row['num_envs']} | {row['obs_bytes']:,} | {cells} |")
    if memcpy is not None:
        print(f"\npinned cudaMemcpy on {torch.cuda.get_device_name(device)}: {memcpy:.2f} GB/s "
              f"({MEMCPY_BYTES >> 20} MiB, CUDA events, median of {MEMCPY_REPEATS})")  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    # The ways' columns are microseconds per step.
    fields = ["workload", "num_envs", "obs_bytes", *WAYS, *(f"{w} GB/s" for w in WAYS[1:])]
    with open(out / "handoff.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=[*fields, "device", "pinned_memcpy_gb_s"])
        writer.writeheader()
        for row in rows:
            writer.writerow({**row, "device": str(device), "pinned_memcpy_gb_s": memcpy})
    print(f"\nwrote {out / 'handoff.csv'}")
    return 0
