"""Resident memory of a process and all its descendants.

Example:
    >>> import os
    >>> tree_rss_mib(os.getpid()) > 0
    True
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable


def descendants(pid: int) -> list[int]:
    """The pids of every process below ``pid`` (children, their children, ...)."""
    try:
        import psutil
    except ImportError:
        pass
    else:
        with_children = psutil.Process(pid).children(recursive=True)
        return [p.pid for p in with_children]
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
        except OSError:  # exited while we looked
            continue
        # The command name (field 2) may hold spaces and parentheses: split after its ')'.
        parent = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def rss_kib(pid: int) -> int:
    """``VmRSS`` of one process in KiB (0 if it has exited or is a zombie)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree_rss_mib(pid: int | None = None) -> float:
    """Total ``VmRSS`` of ``pid`` (default: this process) and its descendants, MiB.

    Shared pages (a shared-memory segment, copy-on-write pages after fork) count
    once per process that maps them, as ``VmRSS`` does; compare backends with that
    in mind. NaN where ``/proc`` is missing (not Linux).
    """
    pid = os.getpid() if pid is None else pid
    if not os.path.isdir("/proc"):
        return float("nan")
    return _sum_mib([pid, *descendants(pid)])


def _sum_mib(pids: Iterable[int]) -> float:
    return sum(rss_kib(p) for p in pids) / 1024


def pss_kib(pid: int) -> int:
    """``Pss`` of one process in KiB from ``/proc/<pid>/smaps_rollup`` (0 if unreadable).

    Proportional set size: each shared page counts ``1/n`` in each of the ``n``
    processes that map it, so the PSS of a process tree adds up to the memory it
    really uses (a shared segment and copy-on-write pages counted once).
    """
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            for line in fh:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree_pss_mib(pid: int | None = None) -> float:
    """Total ``Pss`` of ``pid`` (default: this process) and its descendants, MiB
    (NaN where ``/proc`` is missing)."""
    pid = os.getpid() if pid is None else pid
    if not os.path.isdir("/proc"):
        return float("nan")
    return sum(pss_kib(p) for p in [pid, *descendants(pid)]) / 1024


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process so far, all its threads (0 if gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            stat = fh.read()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_s(pid: int | None = None) -> dict[int, float]:
    """CPU seconds so far of ``pid`` (default: this process) and each descendant, by pid.

    This process's own from its CPU clock (nanoseconds: a short window of a runner that
    mostly waits still shows its CPU), the others' from ``/proc`` (in clock ticks, 10 ms)."""
    own = os.getpid()
    pid = own if pid is None else pid
    if not os.path.isdir("/proc"):
        return {}
    return {p: time.process_time() if p == own else cpu_s(p) for p in [pid, *descendants(pid)]}
