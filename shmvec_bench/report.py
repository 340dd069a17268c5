"""The report: a markdown table, the CSV, the plot and a line naming the machine."""

from __future__ import annotations

import csv
import dataclasses
import os
import platform
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

from shmvec_bench.runner import Case, Measurement
from shmvec_bench.workloads import CPU_BOUND


def _fmt(value: float | None, spec: str) -> str:
    return "" if value is None or value != value else format(value, spec)


def _ratio(value: float | None) -> str:
    return f"{_fmt(value, '.2f')}{'x' if value else ''}"


#: Columns shown after steps/s, vs sync and vs async when any row has a value:
#: (header, cell). ``{cores}`` in a header is filled in by ``markdown_table``.
OPTIONAL_COLUMNS: tuple[tuple[str, Callable[[Measurement], str]], ...] = (
    ("efficiency (of {cores} x single)", lambda m: _fmt(m.efficiency, ".0%")),
    ("median step (µs)", lambda m: _fmt(m.median_step_us, ",.1f")),
    ("RSS (MiB)", lambda m: _fmt(m.rss_mib, ",.0f")),
    ("batch", lambda m: str(m.batch) if m.batch not in (None, m.num_envs) else ""),
    ("policy µs", lambda m: _fmt(m.policy_wait_us, ",.0f") if m.policy_us else ""),
    ("vs min(envs, policy)", lambda m: _ratio(m.vs_bound)),
    ("main wait", lambda m: _fmt(m.main_wait_frac, ".0%")),
    ("main CPU µs/round", lambda m: _fmt(m.main_cpu_us_per_round, ",.1f")),
    ("main CPU µs/row", lambda m: _fmt(m.main_cpu_us_per_row, ",.2f")),
    ("vs wait bound", lambda m: _fmt(m.vs_wait_bound, ".0%")),
)


def markdown_table(measurements: Sequence[Measurement], cores: int | None = None) -> str:
    """The results as a GitHub markdown table; optional columns only where filled.

    ``cores`` names the efficiency column's bound: ``cores`` x the ``single`` row.
    """
    cells = [[cell(m) for _, cell in OPTIONAL_COLUMNS] for m in measurements]
    shown = [i for i in range(len(OPTIONAL_COLUMNS)) if any(row[i] for row in cells)]
    headers = [OPTIONAL_COLUMNS[i][0].format(cores=cores or "cores") for i in shown]
    lines = [
        "| workload | backend | envs | workers | steps/s | vs sync | vs async |"
        + "".join(f" {h} |" for h in headers),
        "|---|---|---:|---:|---:|---:|---:|" + "---:|" * len(shown),
    ]
    for m, row in zip(measurements, cells):
        rate = f"**{m.error}**" if m.error else _fmt(m.steps_per_s, ",.0f")
        lines.append(
            f"| {m.workload} | {m.backend} | {m.num_envs} | {m.num_workers} | {rate} "
            f"| {_ratio(m.vs_sync)} | {_ratio(m.vs_async)} |"
            + "".join(f" {row[i]} |" for i in shown)
        )
    return "\n".join(lines)


def write_csv(measurements: Sequence[Measurement], path: Path) -> None:
    """One row per measurement, columns as in ``Measurement``."""
    write_rows(Measurement, measurements, path)


def write_rows(cls: type, rows: Sequence[Any], path: Path) -> None:
    """``rows`` (instances of the dataclass ``cls``) as a CSV file, a column per field."""
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=[f.name for f in dataclasses.fields(cls)])
        writer.writeheader()
        for row in rows:
            writer.writerow(dataclasses.asdict(row))


#: Bar colours: shmvec's backends in blues, gymnasium's in greys, the rest by cycle.
BACKEND_COLORS = {
    "shmvec": "#1f5fa8",
    "shmvec-main": "#4f8fd6",
    "shmvec-async": "#0f3d73",
    "shmvec-nocopy": "#8fbde8",
    "shmvec-sb3": "#6aa9e0",
    "sync": "#7f7f7f",
    "async": "#bdbdbd",
    "async-nocopy": "#d9d9d9",
}
#: Bar plots: a bound higher than this times the tallest bar is drawn at that height.
BOUND_CEILING = 2.0
_OTHER_COLORS = ("#e6862d", "#3c9b4a", "#b8413d", "#8b62b8", "#8c564b", "#d17fbf")


def _color(backend: str, others: dict[str, str]) -> str:
    if backend in BACKEND_COLORS:
        return BACKEND_COLORS[backend]
    return others.setdefault(backend, _OTHER_COLORS[len(others) % len(_OTHER_COLORS)])


def _si(value: float) -> str:
    """``86,606`` -> ``86.6k``: three significant digits and an SI suffix."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}"


def is_sweep(measurements: Sequence[Measurement]) -> bool:
    """Whether a workload has several rows per backend (a sweep of num_envs, workers
    or policy waits, drawn as lines) rather than one (drawn as grouped bars)."""
    rows = [m for m in measurements if m.backend not in ("single", "policy")]
    keys = {(m.workload, m.backend) for m in rows}
    sizes = {(m.workload, m.num_envs) for m in rows}
    return len(keys) < len(rows) or len(sizes) > len({m.workload for m in rows})


def write_plot(
    measurements: Sequence[Measurement], path: Path, cores: int, title: str = ""
) -> bool:
    """The plot of a run: grouped bars when each workload has one row per backend
    (``--quick``), else steps/s against num_envs, one line per backend, one panel
    per workload.

    Returns False (after saying why on stderr) when matplotlib is not installed,
    and False when no measurement succeeded.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed; skipping the plot", file=sys.stderr)
        return False

    ok = [m for m in measurements if m.error is None and m.backend != "policy"]
    if not [m for m in ok if m.backend != "single"]:
        return False
    fig = _bars(plt, ok, cores) if not is_sweep(ok) else _lines(plt, ok, cores)
    save_figure(plt, fig, path, title)
    return True


def save_figure(plt, fig, path: Path, title: str = "") -> None:
    """Writes ``fig`` to ``path`` (PNG, 120 dpi) under ``title``, and closes it."""
    if title:
        fig.suptitle(title, fontsize="small", color="#444444")
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def _bars(plt, ok: Sequence[Measurement], cores: int):
    """One group per workload, one bar per backend: steps/s relative to gymnasium's
    SyncVectorEnv where every workload has a ``sync`` row (a linear axis all
    workloads share), else steps/s on a log axis. Each bar is labelled."""
    rows = [m for m in ok if m.backend != "single"]
    workloads = list(dict.fromkeys(m.workload for m in rows))
    backends = list(dict.fromkeys(m.backend for m in rows))
    by_key = {(m.workload, m.backend): m for m in rows}
    relative = all(m.vs_sync for m in rows)
    single = {m.workload: m.steps_per_s for m in ok if m.backend == "single"}
    sync = {m.workload: m.steps_per_s for m in rows if m.backend == "sync"}

    width = 0.8 / len(backends)
    tallest: list[float] = []
    # About 0.6 inch per bar: room for its label (``1.46x`` over ``8.51k/s``).
    group_in = max(2.0, 0.75 * len(backends))
    fig, ax = plt.subplots(figsize=(1.0 + group_in * len(workloads), 5))
    others: dict[str, str] = {}
    for i, backend in enumerate(backends):
        xs, heights, labels = [], [], []
        for g, workload in enumerate(workloads):
            m = by_key.get((workload, backend))
            if m is None:
                continue
            xs.append(g + (i - (len(backends) - 1) / 2) * width)
            heights.append(m.vs_sync if relative else m.steps_per_s)
            rate = f"{_si(m.steps_per_s)}/s"
            labels.append(f"{m.vs_sync:.2f}x\n{rate}" if relative else rate)
        bars = ax.bar(xs, heights, width * 0.92, label=backend, color=_color(backend, others))
        tallest.append(max(heights, default=0.0))
        ax.bar_label(bars, labels, padding=2, fontsize=7, linespacing=1.0)

    # The bound on a CPU-bound workload: every core stepping one env as fast as
    # the single env of the same run does.
    # A bound far above the bars (many cores) is drawn at the top of the axis with
    # its value, rather than squashing the bars under it.
    bound_name = f"{cores} cores x one env (the bound)"
    bound_label = bound_name
    ceiling = BOUND_CEILING * max(tallest)
    for g, workload in enumerate(workloads):
        if workload in CPU_BOUND and workload in single and (sync.get(workload) or not relative):
            bound = cores * single[workload] / (sync[workload] if relative else 1.0)
            shown = min(bound, ceiling) if relative else bound
            ax.hlines(shown, g - 0.45, g + 0.45, colors="black", linestyles=":", label=bound_label)
            text = f"{bound:.2f}x" if relative else f"{_si(bound)}/s"
            arrow = " \u2191" if shown < bound else ""
            ax.annotate(
                f"{text}{arrow}", (g + 0.45, shown), xytext=(0, 2), textcoords="offset points",
                ha="right", va="bottom", fontsize=7, style="italic",
            )  # fmt: skip
            bound_label = "_nolegend_"
    if relative:
        ax.axhline(1.0, color="#7f7f7f", linewidth=0.8, zorder=0)
        ax.set_ylabel("steps/s as a multiple of Sync's")
        ax.set_title(
            "Steps/s relative to gymnasium's SyncVectorEnv in the same run (higher is better)",
            fontsize="medium",
        )
    else:
        ax.set_yscale("log")
        ax.set_ylabel("steps/s")
        ax.set_title("Steps/s (higher is better)", fontsize="medium")
        ax.yaxis.set_major_formatter(lambda y, _: _si(y))
    envs = {m.workload: m.num_envs for m in rows}
    ticks = [f"{w}\n{envs[w]} env{'s' if envs[w] > 1 else ''}" for w in workloads]
    ax.set_xticks(range(len(workloads)), ticks)
    ax.set_xlim(-0.5, len(workloads) - 0.5)
    ax.grid(True, axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    ax.spines[["top", "right"]].set_visible(False)
    # The legend right of the axes, clear of the bars and their labels.
    handles, names = ax.get_legend_handles_labels()
    order = sorted(range(len(names)), key=lambda i: names[i] == bound_name)
    ax.legend(
        [handles[i] for i in order], [names[i] for i in order], fontsize="small",
        loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False,
    )  # fmt: skip
    ax.set_ylim(bottom=0 if relative else None, top=ax.get_ylim()[1] * (1.08 if relative else 2.0))
    return fig


def _lines(plt, ok: Sequence[Measurement], cores: int):
    """Steps/s against num_envs per backend, log axes, one panel per workload."""
    from matplotlib.ticker import FuncFormatter

    workloads = list(dict.fromkeys(m.workload for m in ok if m.backend != "single"))
    # Three panels a row, or two where that leaves fewer empty (four workloads).
    ncols = (
        min((3, 2), key=lambda c: (-len(workloads) % c, -c))
        if len(workloads) > 3
        else len(workloads)
    )
    nrows = -(-len(workloads) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.5 * ncols, 4.2 * nrows), squeeze=False)
    for ax in axes.flat[len(workloads) :]:
        ax.set_visible(False)
    others: dict[str, str] = {}
    for ax, workload in zip(axes.flat, workloads):
        rows = [m for m in ok if m.workload == workload]
        # With a --num-workers sweep a backend has several rows per num_envs: a line each.
        sweep = len({(m.backend, m.num_envs, m.policy_us) for m in rows}) < len(rows)

        def line(m: Measurement, sweep: bool = sweep) -> str:
            label = m.backend
            if sweep and m.backend.startswith("shmvec"):
                label = f"{m.backend} ({m.num_workers} workers)"
            return f"{label}, policy {m.policy_us:g} us" if m.policy_us else label

        for label in dict.fromkeys(line(m) for m in rows if m.backend != "single"):
            points = sorted((m.num_envs, m.steps_per_s) for m in rows if line(m) == label)
            backend = next(m.backend for m in rows if line(m) == label)
            color = _color(backend, others) if label == backend else None
            ax.plot(*zip(*points), marker="o", label=label, color=color)
        single = next((m.steps_per_s for m in rows if m.backend == "single"), None)
        # Only where the env's own work bounds the rate: a do-nothing env's single
        # rate is a bare function call, far above any backend's line.
        if single and workload in CPU_BOUND:
            ax.axhline(single, color="black", linestyle="--", linewidth=1, label="one env")
            ax.axhline(
                cores * single, color="black", linestyle=":", linewidth=1.2,
                label=f"{cores} x one env (the bound)",
            )  # fmt: skip
        ax.set_xscale("log", base=2)
        sizes = sorted({m.num_envs for m in rows if m.backend != "single"})
        ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.minorticks_off()
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: _si(y)))
        ax.yaxis.set_minor_formatter(FuncFormatter(_minor_label(ax)))
        ax.set_title(workload)
        ax.set_xlabel("num_envs")
        ax.set_ylabel("steps/s")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    return fig


def _minor_label(ax):
    """Labels the 2x and 5x minor ticks of a log axis that spans under two decades
    (else only the powers of ten, which the major formatter labels)."""

    def label(y: float, _pos) -> str:
        low, high = ax.get_ylim()
        if high / max(low, 1e-12) >= 100:
            return ""
        lead = round(y / 10 ** np.floor(np.log10(y)))
        return _si(y) if lead in (2, 5) else ""

    return label


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
