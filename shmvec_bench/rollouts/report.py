"""The rollout report: a markdown table, the CSV, the plot (grouped bars per workload)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from shmvec_bench.report import _color, _fmt, _si, save_figure, write_rows
from shmvec_bench.rollouts.runner import RolloutMeasurement

#: The rows every ratio is taken against: the best of these in the same workload.
SHMVEC = ("shmvec", "shmvec-loop")
LOCKSTEP = ("ragen-serial", "verl-procs", "gym-async", "gem-vec")


def ratios(rows: Sequence[RolloutMeasurement]) -> dict[tuple[str, str, str], str]:
    """Per (workload, policy, backend label): groups/s over the best baseline's of the same
    workload and policy (``vs best``), and over the best lock-step baseline's."""
    out = {}
    for m in rows:
        peers = [
            r
            for r in rows
            if (r.workload, r.policy, r.num_envs) == (m.workload, m.policy, m.num_envs)
            and r.backend not in SHMVEC
            and r.outcome == "ok"
        ]
        best = max((r.groups_per_s for r in peers), default=0.0)
        lock = max((r.groups_per_s for r in peers if r.backend in LOCKSTEP), default=0.0)
        cell = ""
        if m.backend in SHMVEC and m.outcome == "ok" and best:
            cell = f"{m.groups_per_s / best:.2f}x"
            if lock:
                cell += f" / {m.groups_per_s / lock:.2f}x"
        out[(m.workload, m.policy, m.label)] = cell
    return out


def markdown_table(rows: Sequence[RolloutMeasurement]) -> str:
    """The results as a markdown table, one row per (workload, policy, backend)."""
    cells = ratios(rows)
    lines = [
        "| workload | policy | backend | envs | groups/s | vs best / lock-step | steps/s "
        "| policy idle | get_batch p50 / p99 (s) | trajectory p50 / p99 (s) "
        "| PSS MiB / 1k envs | CPU ms / step | straggler share launched / trained | outcome |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for m in rows:
        outcome = m.outcome if m.outcome == "ok" else f"**{m.outcome}**"
        if m.lost_groups:
            outcome += f"; lost groups {m.lost_groups}"
        if m.kills:
            outcome += f"; {m.kills} env processes killed"
        if m.failed_trajectories:
            outcome += f"; {m.failed_trajectories} failed trajectories returned"
        if m.accounting:
            outcome += f"; {m.accounting}"
        straggle = ""
        if m.workload.endswith("straggler"):
            straggle = (
                f"{_fmt(m.straggler_launched_share, '.0%')} / "
                f"{_fmt(m.straggler_trained_share, '.0%')}"
            )
        lines.append(
            f"| {m.workload} | {m.policy} | {m.label} | {m.num_envs} "
            f"| {_fmt(m.groups_per_s, ',.2f')} | {cells[(m.workload, m.policy, m.label)]} "
            f"| {_fmt(m.steps_per_s, ',.0f')} | {_fmt(m.policy_idle_share, '.0%')} "
            f"| {_fmt(m.get_batch_p50_s, '.2f')} / {_fmt(m.get_batch_p99_s, '.2f')} "
            f"| {_fmt(m.traj_p50_s, '.2f')} / {_fmt(m.traj_p99_s, '.2f')} "
            f"| {_fmt(m.pss_mib_per_1k_envs, ',.0f')} | {_fmt(m.cpu_s_per_step * 1e3, '.2f')} "
            f"| {straggle} | {outcome} |"
        )
    return "\n".join(lines)


def server_table(rows: Sequence[RolloutMeasurement]) -> str:
    """The ``--policy server`` rows' own figures: groups/s against each peer runner, the
    requests, the client's CPU, the server's busy share and batch, interruptions."""
    served = [m for m in rows if m.policy == "server"]
    peers = ("skyrl-asyncio", "roll-threads")
    lines = [
        "| workload | backend | envs | groups/s | vs " + " / ".join(peers) + " | requests/s "
        "| request p50 / p99 (s) | client CPU ms / request | server busy | server requests "
        "running / queued (mean) | server cores | interrupted (tokens kept) "
        "| tokens by lag (versions:tokens) | outcome |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for m in served:
        base = {
            r.backend: r.groups_per_s
            for r in served
            if (r.workload, r.num_envs) == (m.workload, m.num_envs) and r.outcome == "ok"
        }
        vs = " / ".join(
            f"{m.groups_per_s / base[p]:.2f}x" if base.get(p) and m.outcome == "ok" else "-"
            for p in peers
        )
        outcome = m.outcome if m.outcome == "ok" else f"**{m.outcome}**"
        if m.failed_trajectories:
            outcome += f"; {m.failed_trajectories} failed trajectories returned"
        if m.request_faults:
            kinds = m.request_fault_kinds if m.runs <= 1 else f"all runs: {m.request_fault_kinds}"
            outcome += f"; {m.request_faults} failed requests retried ({kinds})"
        if m.policy_failures:
            runs = "" if m.runs <= 1 else "all runs: "
            outcome += f"; trajectories failed by the policy ({runs}{m.policy_failures})"
        lines.append(
            f"| {m.workload} | {m.label} | {m.num_envs} | {_fmt(m.groups_per_s, ',.2f')} "
            f"| {vs if m.backend in SHMVEC else ''} | {_fmt(m.requests_per_s, ',.1f')} "
            f"| {_fmt(m.request_p50_s, '.2f')} / {_fmt(m.request_p99_s, '.2f')} "
            f"| {_fmt(m.client_cpu_ms_per_request, '.2f')} | {_fmt(m.server_busy_share, '.0%')} "
            f"| {_fmt(m.server_running_mean, '.1f')} / {_fmt(m.server_queued_mean, '.1f')} "
            f"| {_fmt(m.server_cores, '.2f')} "
            f"| {m.interrupted:,} ({m.tokens_interrupted:,}) | {m.token_lags} | {outcome} |"
        )
    return "\n".join(lines)


def write_csv(rows: Sequence[RolloutMeasurement], path: Path) -> None:
    """One row per measurement (every repeat, and the medians with ``runs > 1``)."""
    write_rows(RolloutMeasurement, rows, path)


def write_plot(rows: Sequence[RolloutMeasurement], path: Path, title: str = "") -> bool:
    """Complete groups/s, one group of bars per (workload, policy), one bar per backend,
    log axis; failed runs are left out. False (and a note) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed; skipping the plot", file=sys.stderr)
        return False
    ok = [m for m in rows if m.outcome == "ok" and m.groups_per_s > 0]
    if not ok:
        return False
    cases = list(dict.fromkeys((m.workload, m.policy, m.num_envs) for m in ok))
    backends = list(dict.fromkeys(m.label for m in ok))
    by_key = {(m.workload, m.policy, m.num_envs, m.label): m for m in ok}
    width = 0.8 / len(backends)
    fig, ax = plt.subplots(figsize=(1.5 + max(2.0, 0.6 * len(backends)) * len(cases), 5))
    others: dict[str, str] = {}
    for i, backend in enumerate(backends):
        xs, heights, labels = [], [], []
        for c, case in enumerate(cases):
            m = by_key.get((*case, backend))
            if m is None:
                continue
            xs.append(c + (i - (len(backends) - 1) / 2) * width)
            heights.append(m.groups_per_s)
            labels.append(_si(m.groups_per_s))
        bars = ax.bar(xs, heights, width * 0.92, label=backend, color=_color(backend, others))
        ax.bar_label(bars, labels, padding=2, fontsize=7, rotation=90)
    ax.set_yscale("log")
    ax.set_ylabel("complete groups/s")
    ax.set_title("Complete groups of trajectories per second (higher is better)", fontsize="medium")
    ax.set_xticks(range(len(cases)), [f"{w}\n{p}, {n} envs" for w, p, n in cases])
    ax.grid(True, axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    ax.spines[["top", "right"]].set_visible(False)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    ax.set_ylim(top=ax.get_ylim()[1] * 3)
    save_figure(plt, fig, path, title)
    return True
