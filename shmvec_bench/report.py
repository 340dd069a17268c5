"""The report: a markdown table, the CSV, the plot and a line naming the machine."""

from __future__ import annotations

import csv
import dataclasses
import os
import platform
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import gymnasium as gym
import numpy as np

from shmvec_bench.runner import Case, Measurement


def _fmt(value: float | None, spec: str) -> str:
    return "" if value is None or value != value else format(value, spec)


def _ratio(value: float | None) -> str:
    return f"{_fmt(value, '.2f')}{'x' if value else ''}"


#: Columns shown after the first nine when any row has a value: (header, cell).
OPTIONAL_COLUMNS: tuple[tuple[str, Callable[[Measurement], str]], ...] = (
    ("RSS (MiB)", lambda m: _fmt(m.rss_mib, ",.0f")),
    ("batch", lambda m: str(m.batch) if m.batch not in (None, m.num_envs) else ""),
    ("policy µs", lambda m: _fmt(m.policy_wait_us, ",.0f") if m.policy_us else ""),
    ("vs min(envs, policy)", lambda m: _ratio(m.vs_bound)),
    ("main wait", lambda m: _fmt(m.main_wait_frac, ".0%")),
    ("main CPU µs/round", lambda m: _fmt(m.main_cpu_us_per_round, ",.1f")),
    ("main CPU µs/row", lambda m: _fmt(m.main_cpu_us_per_row, ",.2f")),
    ("vs wait bound", lambda m: _fmt(m.vs_wait_bound, ".0%")),
)


def markdown_table(measurements: Sequence[Measurement]) -> str:
    """The results as a GitHub markdown table; optional columns only where filled."""
    cells = [[cell(m) for _, cell in OPTIONAL_COLUMNS] for m in measurements]
    shown = [i for i in range(len(OPTIONAL_COLUMNS)) if any(row[i] for row in cells)]
    extra_header = "".join(f" {OPTIONAL_COLUMNS[i][0]} |" for i in shown)
    lines = [
        "| workload | backend | envs | workers | steps/s | vs sync | vs async "
        "| efficiency | median step (µs) |" + extra_header,
        "|---|---|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(shown),
    ]
    for m, row in zip(measurements, cells):
        rate = f"**{m.error}**" if m.error else _fmt(m.steps_per_s, ",.0f")
        lines.append(
            f"| {m.workload} | {m.backend} | {m.num_envs} | {m.num_workers} | {rate} "
            f"| {_ratio(m.vs_sync)} | {_ratio(m.vs_async)} "
            f"| {_fmt(m.efficiency, '.0%')} | {_fmt(m.median_step_us, ',.1f')} |"
            + "".join(f" {row[i]} |" for i in shown)
        )
    return "\n".join(lines)


def write_csv(measurements: Sequence[Measurement], path: Path) -> None:
    """One row per measurement, columns as in ``Measurement``."""
    fields = [f.name for f in dataclasses.fields(Measurement)]
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        for m in measurements:
            writer.writerow(dataclasses.asdict(m))


def write_plot(
    measurements: Sequence[Measurement], path: Path, cores: int, title: str = ""
) -> bool:
    """Steps/s against num_envs per backend, log y, one subplot per workload.

    Returns False (after saying why on stderr) when matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed; skipping the plot", file=sys.stderr)
        return False

    ok = [m for m in measurements if m.error is None and m.backend != "policy"]
    workloads = list(dict.fromkeys(m.workload for m in ok))
    if not workloads:
        return False
    ncols = min(2, len(workloads))
    nrows = -(-len(workloads) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6 * ncols, 4.5 * nrows), squeeze=False)
    for ax in axes.flat[len(workloads) :]:
        ax.set_visible(False)
    for ax, workload in zip(axes.flat, workloads):
        rows = [m for m in ok if m.workload == workload]
        # With a --num-workers sweep a backend has several rows per num_envs: a line each.
        sweep = len({(m.backend, m.num_envs, m.policy_us) for m in rows}) < len(rows)

        def line(m: Measurement, sweep: bool = sweep) -> str:
            label = m.backend
            if sweep and m.backend.startswith("shmvec"):
                label = f"{m.backend} ({m.num_workers} workers)"
            return f"{label}, policy {m.policy_us:g} us" if m.policy_us else label

        for label in dict.fromkeys(line(m) for m in rows):
            if label == "single":
                continue
            points = sorted((m.num_envs, m.steps_per_s) for m in rows if line(m) == label)
            ax.plot(*zip(*points), marker="o", label=label)
        single = next((m.steps_per_s for m in rows if m.backend == "single"), None)
        if single:
            ax.axhline(single, color="gray", linestyle="--", label="single env")
            ax.axhline(cores * single, color="gray", linestyle=":", label=f"{cores} x single")
        ax.set_xscale("log", base=2)
        sizes = sorted({m.num_envs for m in rows})
        ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.set_yscale("log")
        ax.set_title(workload)
        ax.set_xlabel("num_envs")
        ax.set_ylabel("steps/s")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    if title:
        fig.suptitle(title, fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def machine_summary(cores: int, load_before: float) -> str:
    """One line naming what the figures were measured on, and how busy it was."""
    import shmvec

    return (
        f"{platform.node()} | {platform.processor() or platform.machine()} | cores={cores} | "
        f"load {load_before:.2f} -> {load_average():.2f} | "
        f"python {platform.python_version()} | gymnasium {gym.__version__} | "
        f"numpy {np.__version__} | shmvec {shmvec.__version__}"
    )


def load_average() -> float:
    """The 1-minute load average (0.0 where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


def warn_if_busy(cores: int) -> float:
    """Says on stderr when other processes already use a good part of the cores.

    Returns the load average it judged by.
    """
    load = load_average()
    if load > 0.25 * cores:
        print(
            f"note: load average is {load:.2f} on {cores} cores; other processes compete "
            "for the CPU and the figures will be low and noisy",
            file=sys.stderr,
        )
    return load


class Progress:
    """tqdm's bar when tqdm is installed, else one line per measurement on stderr."""

    def __init__(self, total: int):
        self.total, self.done = total, 0
        try:
            from tqdm import tqdm
        except ImportError:
            self.bar = None
        else:
            self.bar = tqdm(total=total, file=sys.stderr, unit="run", dynamic_ncols=True)

    def start(self, case: Case) -> None:
        if self.bar is not None:
            self.bar.set_description(f"{case.workload} {case.backend} x{case.num_envs}")

    def finish(self, m: Measurement) -> None:
        self.done += 1
        result = m.error or f"{m.steps_per_s:,.0f} steps/s"
        line = f"[{self.done}/{self.total}] {m.workload} {m.backend} envs={m.num_envs}: {result}"
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
            self.bar.update()
        else:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# --------------------------------------------------------------------------- CLI
