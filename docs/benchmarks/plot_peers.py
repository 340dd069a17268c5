"""Draws the README's figure from a dated data file of ``shmvec-bench`` results.

    python docs/benchmarks/plot_peers.py docs/benchmarks/data/2026-11-22-2vcpu-peers.csv

Grouped bars: per workload, each backend's steps/s relative to gymnasium's
SyncVectorEnv in the same run, with the ratio written on each bar. Needs matplotlib.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

#: (workload, num_envs, label) of the panels, left to right.
CASES = [
    ("cartpole", 32, "CartPole-v1\n32 envs"),
    ("cpu100us", 32, "CartPole + 100 µs CPU\n32 envs"),
    ("varstep", 32, "CartPole + 10-190 µs CPU\n32 envs"),
    ("largeobs", 8, "1 MB observations\n8 envs"),
]
#: (backend in the data file, label); shmvec's large-observation case is its copy=False run.
BACKENDS = [
    ("shmvec", "shmvec"),
    ("sync", "gymnasium Sync"),
    ("async", "gymnasium Async"),
    ("sb3", "SB3 SubprocVecEnv"),
    ("envpool", "EnvPool"),
    ("pufferlib", "PufferLib"),
]
COLORS = ["#d6336c", "#868e96", "#495057", "#74c0fc", "#2f9e44", "#f08c00"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data", type=Path, help="a CSV written by shmvec-bench")
    parser.add_argument("--out", type=Path, help="the PNG (default: beside the data folder)")
    parser.add_argument("--title", default="2-vCPU VM, 2026-11-22", help="the machine and date")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {
        (r["workload"], int(r["num_envs"]), r["backend"]): float(r["steps_per_s"])
        for r in csv.DictReader(args.data.open())
    }
    fig, ax = plt.subplots(figsize=(10, 4.2), dpi=120)
    width = 0.8 / len(BACKENDS)
    for b, ((backend, label), color) in enumerate(zip(BACKENDS, COLORS)):
        xs, ratios = [], []
        for c, (workload, envs, _) in enumerate(CASES):
            name = "shmvec-nocopy" if backend == "shmvec" and workload == "largeobs" else backend
            value, sync = rows.get((workload, envs, name)), rows.get((workload, envs, "sync"))
            if value and sync:
                xs.append(c - 0.4 + width * (b + 0.5))
                ratios.append(value / sync)
        bars = ax.bar(xs, ratios, width, label=label, color=color)
        ax.bar_label(bars, [f"{r:.2f}x" for r in ratios], fontsize=6.5, padding=1)
    ax.axhline(1.0, color="#868e96", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(CASES)), [label for _, _, label in CASES])
    ax.set_ylabel("steps/s relative to gymnasium Sync")
    ax.set_title(f"Throughput, {args.title} (higher is better)", fontsize=11)
    ax.spines[["top", "right"]].set_visible(False)
    ax.legend(ncol=6, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), frameon=False)
    fig.tight_layout()
    out = args.out or args.data.parent.parent / f"{args.data.stem}.png"
    fig.savefig(out)
    print(out)


if __name__ == "__main__":
    main()
