"""How many CPUs this process may use: its affinity, its cgroup CPU quota, its Ray actor's CPUs.

``cpu_budget()`` is the one answer that sizes workers and spin
(``shmvec.spin.available_cpus``). It is the smallest of:

- the CPUs in the process's affinity mask (``os.sched_getaffinity``);
- its cgroup CPU quota, quota / period, rounded down and at least 1: the
  tightest over the process's own cgroup and every ancestor's (a parent's limit
  applies to its children too), from cgroup v2 ``cpu.max`` (``"max 100000"``:
  no limit; ``"50000 100000"``: half a CPU) and cgroup v1
  ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (-1: no limit) under the cpu
  controller's mount;
- the CPUs Ray reserved for the actor the process runs in, rounded down and at
  least 1, when ``ray`` is already imported and initialised (it is never
  imported here).

A fractional quota rounds down because main and the workers draw on the same
quota: 1.5 CPUs of quota run one worker beside main, not two. Files that are
missing, unreadable or malformed set no limit. The parsers take the paths they
read (``proc_dir``, ``fs_root``), so that a fake cgroup tree stands in for the
real one.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import NamedTuple

__all__ = ["CpuBudget", "cgroup_cpu_quota", "cpu_budget", "quota_cpus", "ray_actor_cpus"]


class CpuBudget(NamedTuple):
    """The CPUs this process may use, and what bounds them."""

    #: How many CPUs the process may keep busy at once (>= 1).
    cpus: int
    #: True when a cgroup CPU quota is below the affinity's CPU count: the
    #: processes share the quota's time, so a spinning waiter burns what another
    #: process needs even where a core is idle.
    quota_limited: bool


def cpu_budget(
    proc_dir: str | os.PathLike[str] = "/proc/self", fs_root: str | os.PathLike[str] = "/"
) -> CpuBudget:
    """The CPUs this process may use (see the module docstring for the rule)."""
    cpus = _affinity_cpus()
    quota = cgroup_cpu_quota(proc_dir, fs_root)
    limited = quota is not None and quota < cpus
    if quota is not None:
        cpus = min(cpus, quota_cpus(quota))
    actor = ray_actor_cpus()
    if actor is not None:
        cpus = min(cpus, quota_cpus(actor))
    return CpuBudget(cpus, limited)


def quota_cpus(cpus: float) -> int:
    """A fractional CPU count as the workers it sizes: rounded down, at least 1."""
    return max(1, math.floor(cpus))


def _affinity_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cgroup_cpu_quota(
    proc_dir: str | os.PathLike[str] = "/proc/self", fs_root: str | os.PathLike[str] = "/"
) -> float | None:
    """The tightest cgroup CPU quota over the process's cgroup and its ancestors,
    in CPUs (0.5: half a CPU); None where no quota applies or none can be read.

    ``proc_dir`` holds the process's ``cgroup`` and ``mountinfo``; the mount
    points named there are read under ``fs_root``.
    """
    proc = Path(proc_dir)
    memberships = _read_lines(proc / "cgroup")
    mounts = _read_lines(proc / "mountinfo")
    if memberships is None or mounts is None:
        return None
    v2_path, v1_path = _cgroup_paths(memberships)
    limits = []
    for fstype, mount_root, mount_point, options in _cgroup_mounts(mounts):
        if fstype == "cgroup2" and v2_path is not None:
            path, read = v2_path, _v2_limit
        elif fstype == "cgroup" and "cpu" in options and v1_path is not None:
            path, read = v1_path, _v1_limit
        else:
            continue
        directory = _cgroup_dir(Path(fs_root), mount_root, mount_point, path)
        if directory is None:
            continue
        top = Path(fs_root, mount_point.lstrip("/"))
        limits += [limit for d in _up_to(directory, top) if (limit := read(d)) is not None]
    return min(limits, default=None)


def _read_lines(path: Path) -> list[str] | None:
    try:
        return path.read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return None


def _cgroup_paths(lines: list[str]) -> tuple[str | None, str | None]:
    """(the v2 cgroup path, the v1 cpu controller's cgroup path) from /proc/self/cgroup."""
    v2 = v1 = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            v2 = path
        elif "cpu" in controllers.split(","):
            v1 = path
    return v2, v1


def _cgroup_mounts(lines: list[str]) -> list[tuple[str, str, str, list[str]]]:
    """(fstype, root within the hierarchy, mount point, super options) of each cgroup mount."""
    mounts = []
    for line in lines:
        head, sep, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if not sep or len(fields) < 5 or len(rest) < 3 or rest[0] not in ("cgroup", "cgroup2"):
            continue
        options = rest[2].split(",")
        mounts.append((rest[0], _unescape(fields[3]), _unescape(fields[4]), options))
    return mounts


def _unescape(field: str) -> str:
    """A mountinfo path field: spaces, tabs, newlines and backslashes are octal escapes."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def _cgroup_dir(fs_root: Path, mount_root: str, mount_point: str, path: str) -> Path | None:
    """The directory of cgroup ``path`` under a mount of its hierarchy rooted at
    ``mount_root``; None where the mount does not show it."""
    if ".." in path.split("/"):  # outside the cgroup namespace's root
        return None
    root = mount_root.rstrip("/")
    if path != root and not path.startswith(root + "/"):
        return None
    relative = path[len(root) :].strip("/")
    return Path(fs_root, mount_point.lstrip("/"), relative)


def _up_to(directory: Path, top: Path) -> list[Path]:
    """``directory`` and its ancestors up to ``top`` (the mount point), nearest first."""
    chain = [directory]
    while chain[-1] != top and chain[-1].parent != chain[-1]:
        chain.append(chain[-1].parent)
    return chain


def _v2_limit(directory: Path) -> float | None:
    fields = _read_words(directory / "cpu.max")
    if fields is None or len(fields) != 2 or fields[0] == "max":
        return None
    return _ratio(fields[0], fields[1])


def _v1_limit(directory: Path) -> float | None:
    quota, period = (
        _read_words(directory / "cpu.cfs_quota_us"),
        _read_words(directory / "cpu.cfs_period_us"),
    )
    if quota is None or period is None or len(quota) != 1 or len(period) != 1:
        return None
    return _ratio(quota[0], period[0])


def _read_words(path: Path) -> list[str] | None:
    try:
        return path.read_text().split()
    except (OSError, UnicodeDecodeError):
        return None


def _ratio(quota: str, period: str) -> float | None:
    """quota / period in CPUs; None for no limit (a negative quota) or a malformed pair."""
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def ray_actor_cpus() -> float | None:
    """The CPUs Ray reserved for the actor this process runs, or None: not in
    an actor, none reserved (an actor's default), or ``ray`` not imported."""
    ray = sys.modules.get("ray")
    if ray is None:
        return None
    try:
        if not ray.is_initialized():
            return None
        context = ray.get_runtime_context()
        if context.get_actor_id() is None:
            return None
        cpus = context.get_assigned_resources().get("CPU")
    except Exception:  # noqa: BLE001 - a half-started or shutting-down Ray sets no bound
        return None
    return float(cpus) if cpus else None
