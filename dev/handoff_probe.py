"""Where the GPU hand-off's time goes, on a machine with CUDA.

Three measurements, each printed as a table:

1. Host -> device bandwidth of one 16 MiB copy from each kind of host memory:
   torch's pinned allocator, pageable memory, and memory pinned in place with
   ``cudaHostRegister`` (an anonymous mapping, a memfd mapping as shmvec's
   segment is, the same with transparent huge pages, and the segment of a
   ``TorchVectorEnv`` itself). CUDA events, median of 20; each copy follows a
   CPU write of the buffer, as a step's results do.
2. The phases of one step, ``TorchVectorEnv`` against a plain
   ``torch.from_numpy(...).to(device)`` of the same results: actions to the
   host, the vector env's step, finding the span, the device copy (with a
   synchronize after each phase, so each is timed alone), per workload.
3. The env's own step before and after its segment is pinned in place, which
   says whether pinning slows the workers' writes.

With ``--profile``, instead: torch's profiler over 300 steps of CartPole x64
through ``TorchVectorEnv`` and through ``from_numpy().to()``, the ops that take
the main thread's time in each, most first.

With ``--ab``, instead: whole loop steps (a GPU op on the observations, a
synchronize, the step) alternated in rounds between a plain
``from_numpy().to()`` of an unpinned env and ways of the bridge's copy on a
pinned one (as shipped; a span copy at every size, blocking, on the current
or on its own stream), medians per way; and the
DMA of a step's span timed with CUDA events right after the workers wrote it
and again at once, which says whether freshly written memory copies slower.

    python dev/handoff_probe.py [--seconds S] [--profile | --ab]
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import time

import numpy as np
import torch

import shmvec
from shmvec.torch import SIDE_STREAM_BYTES, SMALL_RESULT_BYTES, TorchVectorEnv
from shmvec_bench.workloads import WORKLOADS

MIB16 = 16 * 2**20
CASES = (("cartpole", 64), ("pong", 32), ("largeobs", 16))


def _register(address: int, size: int) -> None:
    torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(address, size, 0))


def _unregister(address: int) -> None:
    torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(address))


def _h2d_gb_s(host: torch.Tensor, repeats: int = 20) -> float:
    device = torch.empty(host.shape, dtype=host.dtype, device="cuda")
    device.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    times = []
    for i in range(repeats):
        host[::4096].fill_(i)  # the CPU writes the buffer first, as the workers do
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        device.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return host.numel() * host.element_size() / statistics.median(times) / 1e9


def _mapping(fd: int | None, huge: bool) -> mmap.mmap:
    if fd is None:
        m = mmap.mmap(-1, MIB16, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    else:
        os.ftruncate(fd, MIB16)
        m = mmap.mmap(fd, MIB16, flags=mmap.MAP_SHARED)
    if huge and hasattr(mmap, "MADV_HUGEPAGE"):
        m.madvise(mmap.MADV_HUGEPAGE)
    m.write(b"\1" * MIB16)
    return m


def bandwidths() -> list[tuple[str, float]]:
    rows = [
        (
            "torch pinned (cudaHostAlloc)",
            _h2d_gb_s(torch.ones(MIB16, dtype=torch.uint8).pin_memory()),
        ),
        ("pageable", _h2d_gb_s(torch.ones(MIB16, dtype=torch.uint8))),
    ]
    for name, memfd, huge in (
        ("registered anonymous private mapping", False, False),
        ("registered memfd shared mapping (as the segment)", True, False),
        ("registered memfd shared mapping, MADV_HUGEPAGE", True, True),
    ):
        fd = os.memfd_create("probe") if memfd else None
        m = _mapping(fd, huge)
        address = ctypes.addressof(ctypes.c_char.from_buffer(m))
        _register(address, MIB16)
        try:
            rows.append((name, _h2d_gb_s(torch.frombuffer(m, dtype=torch.uint8))))
        finally:
            torch.cuda.synchronize()
            _unregister(address)  # the mapping stays until the probe exits
    env = shmvec.ShmVectorEnv([WORKLOADS["largeobs"]] * 16, copy=False)
    envs = TorchVectorEnv(env, device="cuda")
    try:
        obs, _ = envs.reset(seed=0)
        envs.step(torch.zeros(16, dtype=torch.int64, device="cuda"))
        span = envs._packer.span([envs.shm.step(np.zeros(16, dtype=np.int64))[0]])
        assert span is not None
        host = envs._packer.host[span.start : span.end]
        rows.append(("the TorchVectorEnv segment (1 MiB x16 obs)", _h2d_gb_s(host)))
    finally:
        envs.close()
    return rows


def _timed(seconds: float, phases: dict[str, float], step) -> float:
    """Runs ``step(phases)`` for ``seconds``; returns steps and leaves mean µs per phase."""
    for key in phases:
        phases[key] = 0.0
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        step(phases)
        count += 1
    for key in phases:
        phases[key] = phases[key] / count * 1e6
    return count


def phases_of(workload: str, num_envs: int, seconds: float) -> dict[str, dict[str, float]]:
    sync = torch.cuda.synchronize
    env = shmvec.ShmVectorEnv([WORKLOADS[workload]] * num_envs, copy=False)
    out: dict[str, dict[str, float]] = {}
    try:
        env.reset(seed=0)
        actions = torch.zeros(num_envs, dtype=torch.int64, device="cuda")
        result = env.step(actions.cpu().numpy())[:4]

        def env_alone(p: dict[str, float]) -> None:
            t0 = time.perf_counter()
            env.step(np.zeros(num_envs, dtype=np.int64))
            p["step"] += time.perf_counter() - t0

        def plain(p: dict[str, float]) -> None:
            nonlocal result
            t0 = time.perf_counter()
            host_actions = actions.cpu().numpy()
            t1 = time.perf_counter()
            result = env.step(host_actions)[:4]
            t2 = time.perf_counter()
            on_device = [torch.from_numpy(a).to("cuda") for a in result]
            sync()
            t3 = time.perf_counter()
            p["actions"] += t1 - t0
            p["step"] += t2 - t1
            p["copy"] += t3 - t2
            del on_device

        out["env alone, not pinned"] = {"step": 0.0}
        _timed(seconds, out["env alone, not pinned"], env_alone)
        out["from_numpy().to()"] = dict.fromkeys(("actions", "step", "copy"), 0.0)
        _timed(seconds, out["from_numpy().to()"], plain)
        envs = TorchVectorEnv(env, device="cuda")
    except BaseException:
        env.close(terminate=True)
        raise
    try:
        envs.reset(seed=0)
        packer = envs._packer

        def bridge(p: dict[str, float]) -> None:
            t0 = time.perf_counter()
            assert envs._write_actions(actions)
            t1 = time.perf_counter()
            res = list(envs._handoff.step_written()[:4])
            t2 = time.perf_counter()
            span = packer.span(res)
            t3 = time.perf_counter()
            converted = envs._convert(envs._result_slot(), *res)
            sync()
            t4 = time.perf_counter()
            p["actions"] += t1 - t0
            p["step"] += t2 - t1
            p["span"] += t3 - t2
            p["copy"] += t4 - t3
            del span, converted

        def whole(p: dict[str, float]) -> None:
            t0 = time.perf_counter()
            obs = envs.step(actions)[0]
            sync()
            p["step+copy"] += time.perf_counter() - t0
            del obs

        out["env alone, pinned"] = {"step": 0.0}
        _timed(seconds, out["env alone, pinned"], env_alone)
        out["TorchVectorEnv"] = dict.fromkeys(("actions", "step", "span", "copy"), 0.0)
        _timed(seconds, out["TorchVectorEnv"], bridge)
        out["TorchVectorEnv.step whole"] = {"step+copy": 0.0}
        _timed(seconds, out["TorchVectorEnv.step whole"], whole)
    finally:
        envs.close()
    return out


def profile(workload: str = "cartpole", num_envs: int = 64, steps: int = 300) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    env = shmvec.ShmVectorEnv([WORKLOADS[workload]] * num_envs, copy=False)
    envs = None
    try:
        env.reset(seed=0)
        actions = torch.zeros(num_envs, dtype=torch.int64, device="cuda")
        result = env.step(actions.cpu().numpy())[:4]

        def plain() -> None:
            nonlocal result
            on_device = [torch.from_numpy(a).to("cuda") for a in result]
            on_device[0].flatten(1)[:, :64].float().sum(dim=1)
            torch.cuda.synchronize()
            result = env.step(actions.cpu().numpy())[:4]

        envs = TorchVectorEnv(env, device="cuda")
        obs = envs.reset(seed=0)[0]

        def bridge() -> None:
            nonlocal obs
            obs.flatten(1)[:, :64].float().sum(dim=1)
            torch.cuda.synchronize()
            obs = envs.step(actions)[0]

        for name, step in (("TorchVectorEnv", bridge), ("from_numpy().to()", plain)):
            for _ in range(50):
                step()
            with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                start = time.perf_counter()
                for _ in range(steps):
                    step()
                took = (time.perf_counter() - start) / steps * 1e6
            print(f"\n{workload} x{num_envs}, {name}: {took:,.1f} µs per step under the profiler\n")
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18)
            print(table)
    finally:
        (envs or env).close()


def _bridge_ways(envs: TorchVectorEnv) -> dict[str, object]:
    """Replacements for ``envs._convert``: the ways of copying a step's results."""
    packer, shipped = envs._packer, envs._convert

    def settings(small: int, side: int):
        def convert(slot, *result):
            envs.small_result_bytes, envs.side_stream_bytes = small, side
            try:
                return shipped(slot, *result)
            finally:
                envs.small_result_bytes = SMALL_RESULT_BYTES
                envs.side_stream_bytes = SIDE_STREAM_BYTES

        return convert

    def blocking_span(slot, *result):
        span = packer.span(list(result))
        buffer = torch.empty(span.end - span.start, dtype=torch.uint8, device="cuda")
        buffer.copy_(packer.host[span.start : span.end])
        out = [
            buffer[leaf.offset - span.start : leaf.offset - span.start + leaf.nbytes]
            .view(leaf.dtype)
            .view(leaf.shape)
            for leaf in span.layout
        ]
        if len(out) > 1:
            out[1] = out[1].to(envs.reward_dtype)
        return out

    return {
        "bridge as shipped": shipped,
        "bridge, span copy at every size": settings(0, SIDE_STREAM_BYTES),
        "bridge, blocking span copy": blocking_span,
        "bridge, span on its own stream": settings(0, 0),
        "bridge, span on the current stream": settings(0, 1 << 62),
    }


def ab(workload: str, num_envs: int, rounds: int, seconds: float) -> None:
    """Alternated whole-step timings of the plain copy and the bridge's ways."""
    from shmvec_bench.handoff import _actions_from

    plain_env = shmvec.ShmVectorEnv([WORKLOADS[workload]] * num_envs, copy=False)
    env = shmvec.ShmVectorEnv([WORKLOADS[workload]] * num_envs, copy=False)
    envs = TorchVectorEnv(env, device="cuda")
    try:
        n = int(plain_env.single_action_space.n)
        plain_env.reset(seed=0)
        plain_result = plain_env.step(np.zeros(num_envs, dtype=np.int64))[:4]
        obs = envs.reset(seed=0)[0]
        ways = _bridge_ways(envs)
        state = {"plain": plain_result, "obs": obs}

        def plain() -> None:
            on_device = [torch.from_numpy(a).to("cuda") for a in state["plain"]]
            chosen = _actions_from(torch, on_device[0], n)
            torch.cuda.synchronize()
            state["plain"] = plain_env.step(chosen.cpu().numpy())[:4]

        def bridge() -> None:
            chosen = _actions_from(torch, state["obs"], n)
            torch.cuda.synchronize()
            state["obs"] = envs.step(chosen)[0]

        times: dict[str, list[float]] = {"plain from_numpy().to()": [], **{w: [] for w in ways}}
        for r in range(rounds + 1):  # round 0 warms up and is dropped
            for way in times:
                if way in ways:
                    envs._convert = ways[way]
                step = plain if way.startswith("plain") else bridge
                count, start = 0, time.perf_counter()
                while time.perf_counter() - start < seconds:
                    step()
                    count += 1
                if r:
                    times[way].append((time.perf_counter() - start) / count * 1e6)
        envs._convert = ways["bridge as shipped"]
        base = statistics.median(times["plain from_numpy().to()"])
        print(f"\n{workload} x{num_envs}: µs per loop step, {rounds} alternated rounds of "
              f"{seconds} s (median; runs)\n")  # fmt: skip
        print("| way | µs per step | vs plain | runs |\n|---|---:|---:|---|")
        for way, runs in times.items():
            median = statistics.median(runs)
            cells = ", ".join(f"{t:,.0f}" for t in runs)
            print(f"| {way} | {median:,.1f} | {base / median:.2f}x | {cells} |")

        # The DMA of a step's span right after the workers wrote it, then again.
        actions = torch.zeros(num_envs, dtype=torch.int64, device="cuda")
        fresh, again, steps = [], [], []
        for _ in range(30):
            envs._write_actions(actions)
            t0 = time.perf_counter()
            result = list(envs._handoff.step_written()[:4])
            steps.append((time.perf_counter() - t0) * 1e6)
            span = envs._packer.span(result)
            host = envs._packer.host[span.start : span.end]
            device = torch.empty(host.shape, dtype=torch.uint8, device="cuda")
            for sink in (fresh, again):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                device.copy_(host, non_blocking=True)
                end.record()
                end.synchronize()
                sink.append(start.elapsed_time(end) * 1e3)
        nbytes = host.numel()
        first, second = statistics.median(fresh), statistics.median(again)
        print(f"\nspan of {nbytes:,} bytes: DMA right after the step {first:,.1f} µs "
              f"({nbytes / first / 1e3:.2f} GB/s), again at once {second:,.1f} µs "
              f"({nbytes / second / 1e3:.2f} GB/s); the step itself "
              f"{statistics.median(steps):,.1f} µs (medians of 30)")  # fmt: skip
    finally:
        envs.close()
        plain_env.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--ab", action="store_true")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    if args.profile:
        profile()
        return
    if args.ab:
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
        for workload, num_envs in CASES:
            ab(workload, num_envs, args.rounds, args.seconds)
        return
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    print("| host memory (16 MiB, written by the CPU before each copy) | H2D GB/s |\n|---|---:|")
    for name, rate in bandwidths():
        print(f"| {name} | {rate:.2f} |")
    for workload, num_envs in CASES:
        print(f"\n{workload} x{num_envs}: µs per step by phase (synchronized after each)\n")
        print("| way | phases | total |\n|---|---|---:|")
        for way, phases in phases_of(workload, num_envs, args.seconds).items():
            cells = ", ".join(f"{k} {v:,.1f}" for k, v in phases.items())
            print(f"| {way} | {cells} | {sum(phases.values()):,.1f} |")


if __name__ == "__main__":
    main()
