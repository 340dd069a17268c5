"""The CPUs a process may use: affinity, cgroup CPU quota (v1, v2, nested), Ray actor CPUs.

The parsers read a fake tree (``proc/self/{cgroup,mountinfo}`` and the mount
points under a root) built per test; the last test runs a real process in a
half-CPU cgroup it creates, where it can (root, a writable cpu controller).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from shmvec import cpus
from shmvec.cpus import CpuBudget, cgroup_cpu_quota, cpu_budget, quota_cpus, ray_actor_cpus
from shmvec.options import TuningOptions
from shmvec.spin import (
    MANY_CORES_SPIN_CAP_NS,
    NO_SPIN,
    SHARED_SPIN_NS,
    SPIN_CAP_NS,
    Spin,
    default_spin,
)

V2_MOUNT = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate"
V1_CPU_MOUNT = (
    "32 31 0:29 {root} /sys/fs/cgroup/cpu,cpuacct rw,relatime shared:9 - cgroup cgroup "
    "rw,cpu,cpuacct"
)
V1_OTHER_MOUNT = "34 31 0:31 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset"
PROC_MOUNT = "22 1 0:5 / /proc rw,nosuid - proc proc rw"


class FakeRoot:
    """A root directory with /proc/self and cgroup files in it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.proc = root / "proc" / "self"
        self.proc.mkdir(parents=True)

    def membership(self, *lines: str) -> FakeRoot:
        (self.proc / "cgroup").write_text("".join(line + "\n" for line in lines))
        return self

    def mounts(self, *lines: str) -> FakeRoot:
        (self.proc / "mountinfo").write_text("".join(line + "\n" for line in lines))
        return self

    def file(self, path: str, text: str) -> FakeRoot:
        target = self.root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text + "\n")
        return self

    def quota(self) -> float | None:
        return cgroup_cpu_quota(self.proc, self.root)


@pytest.fixture
def fake(tmp_path: Path) -> FakeRoot:
    return FakeRoot(tmp_path)


def _v2(fake: FakeRoot, path: str) -> FakeRoot:
    return fake.membership(f"0::{path}").mounts(PROC_MOUNT, V2_MOUNT)


def _v1(fake: FakeRoot, path: str, root: str = "/") -> FakeRoot:
    return fake.membership("5:cpuset:/", f"4:cpu,cpuacct:{path}", "0::/").mounts(
        PROC_MOUNT, V1_OTHER_MOUNT, V1_CPU_MOUNT.format(root=root)
    )


def test_v2_half_a_cpu(fake):
    _v2(fake, "/app").file("/sys/fs/cgroup/app/cpu.max", "50000 100000")
    assert fake.quota() == 0.5


def test_v2_max_is_no_limit(fake):
    _v2(fake, "/app").file("/sys/fs/cgroup/app/cpu.max", "max 100000")
    assert fake.quota() is None


def test_v2_a_parents_limit_applies(fake):
    _v2(fake, "/kubepods/pod1/ctr")
    fake.file("/sys/fs/cgroup/kubepods/pod1/ctr/cpu.max", "max 100000")
    fake.file("/sys/fs/cgroup/kubepods/pod1/cpu.max", "150000 100000")
    fake.file("/sys/fs/cgroup/kubepods/cpu.max", "400000 100000")
    assert fake.quota() == 1.5


def test_v2_the_tightest_of_child_and_parent(fake):
    _v2(fake, "/a/b")
    fake.file("/sys/fs/cgroup/a/b/cpu.max", "25000 50000")
    fake.file("/sys/fs/cgroup/a/cpu.max", "200000 100000")
    assert fake.quota() == 0.5


def test_v2_a_limit_outside_the_mount_is_not_read(fake):
    # A container's /sys/fs/cgroup shows its own cgroup at the mount point.
    fake.membership("0::/").mounts(V2_MOUNT)
    fake.file("/sys/fs/cgroup/cpu.max", "200000 100000")
    fake.file("/sys/cpu.max", "10000 100000")  # above the mount: never read
    assert fake.quota() == 2.0


def test_v1_quota_and_period(fake):
    _v1(fake, "/docker/abc")
    fake.file("/sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "50000")
    fake.file("/sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000")
    assert fake.quota() == 0.5


def test_v1_minus_one_is_no_limit_and_a_parent_applies(fake):
    _v1(fake, "/docker/abc")
    base = "/sys/fs/cgroup/cpu,cpuacct"
    fake.file(f"{base}/docker/abc/cpu.cfs_quota_us", "-1")
    fake.file(f"{base}/docker/abc/cpu.cfs_period_us", "100000")
    fake.file(f"{base}/docker/cpu.cfs_quota_us", "300000")
    fake.file(f"{base}/docker/cpu.cfs_period_us", "100000")
    fake.file(f"{base}/cpu.cfs_quota_us", "-1")
    fake.file(f"{base}/cpu.cfs_period_us", "100000")
    assert fake.quota() == 3.0


def test_v1_mount_rooted_at_the_containers_cgroup(fake):
    # Without a cgroup namespace a container's mount shows only its own cgroup.
    _v1(fake, "/docker/abc", root="/docker/abc")
    fake.file("/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us", "250000")
    fake.file("/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us", "100000")
    assert fake.quota() == 2.5


def test_v1_cgroup_not_under_the_mount_is_no_limit(fake):
    _v1(fake, "/elsewhere", root="/docker/abc")
    fake.file("/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us", "50000")
    fake.file("/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us", "100000")
    assert fake.quota() is None


def test_v1_and_v2_together_the_tighter(fake):
    fake.membership("4:cpu,cpuacct:/", "0::/app").mounts(V1_CPU_MOUNT.format(root="/"), V2_MOUNT)
    fake.file("/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us", "300000")
    fake.file("/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us", "100000")
    fake.file("/sys/fs/cgroup/app/cpu.max", "120000 100000")
    assert fake.quota() == 1.2


def test_escaped_mount_point(fake):
    fake.membership("0::/").mounts("30 23 0:26 / /cg\\040root rw - cgroup2 cgroup2 rw")
    fake.file("/cg root/cpu.max", "50000 100000")
    assert fake.quota() == 0.5


@pytest.mark.parametrize(
    "content", ["", "garbage", "50000", "50000 0", "0 100000", "x 100000", "1 2 3"]
)
def test_malformed_cpu_max_is_no_limit(fake, content):
    _v2(fake, "/app").file("/sys/fs/cgroup/app/cpu.max", content)
    assert fake.quota() is None


def test_missing_files_are_no_limit(fake):
    assert fake.quota() is None  # neither cgroup nor mountinfo
    fake.membership("0::/app")
    assert fake.quota() is None  # no mountinfo
    fake.mounts(V2_MOUNT)
    assert fake.quota() is None  # no cpu.max anywhere
    _v1(fake, "/x").file("/sys/fs/cgroup/cpu,cpuacct/x/cpu.cfs_quota_us", "50000")
    assert fake.quota() is None  # a quota without its period


def test_unreadable_files_are_no_limit(fake, monkeypatch):
    _v2(fake, "/app").file("/sys/fs/cgroup/app/cpu.max", "50000 100000")
    real = Path.read_text

    def refuse(self, *args, **kwargs):
        if self.name == "cpu.max":
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", refuse)
    assert fake.quota() is None


def test_a_directory_where_a_file_should_be_is_no_limit(fake):
    _v2(fake, "/app")
    (fake.root / "sys/fs/cgroup/app/cpu.max").mkdir(parents=True)
    assert fake.quota() is None


def test_a_path_outside_the_namespace_is_no_limit(fake):
    _v2(fake, "/../other").file("/sys/fs/cgroup/cpu.max", "50000 100000")
    assert fake.quota() is None


def test_fractional_quota_rounds_down_at_least_one():
    assert [quota_cpus(q) for q in (0.01, 0.5, 1.0, 1.5, 1.99, 2.0, 7.9)] == [1, 1, 1, 1, 1, 2, 7]


def test_budget_is_the_fewest_of_affinity_and_quota(fake, monkeypatch):
    monkeypatch.setattr(cpus, "_affinity_cpus", lambda: 4)
    _v2(fake, "/app").file("/sys/fs/cgroup/app/cpu.max", "50000 100000")
    assert cpu_budget(fake.proc, fake.root) == CpuBudget(1, quota_limited=True)
    fake.file("/sys/fs/cgroup/app/cpu.max", "250000 100000")
    assert cpu_budget(fake.proc, fake.root) == CpuBudget(2, quota_limited=True)
    fake.file("/sys/fs/cgroup/app/cpu.max", "400000 100000")  # as many as the affinity
    assert cpu_budget(fake.proc, fake.root) == CpuBudget(4, quota_limited=False)
    fake.file("/sys/fs/cgroup/app/cpu.max", "max 100000")
    assert cpu_budget(fake.proc, fake.root) == CpuBudget(4, quota_limited=False)


def test_quota_limited_process_shares_cores():
    # On 8 cores with 7 or 8 workers main spins too...
    many = Spin(MANY_CORES_SPIN_CAP_NS, adaptive=True)
    assert default_spin(7, cpus=8) == (many, many)
    assert default_spin(8, cpus=8) == (many, many)
    # ...but under a quota of 8 CPUs a spinning main spends the workers' time.
    adaptive = Spin(SPIN_CAP_NS, adaptive=True)
    assert default_spin(7, cpus=8, quota_limited=True) == (NO_SPIN, adaptive)
    assert default_spin(8, cpus=8, quota_limited=True) == (NO_SPIN, adaptive)
    assert default_spin(9, cpus=8, quota_limited=True) == (NO_SPIN, Spin(SHARED_SPIN_NS, False))
    assert default_spin(1, cpus=4, quota_limited=True) == (NO_SPIN, adaptive)


def test_default_spin_reads_the_budget(monkeypatch):
    import shmvec.spin

    monkeypatch.setattr(shmvec.spin, "cpu_budget", lambda: CpuBudget(2, quota_limited=True))
    assert default_spin(1) == (NO_SPIN, Spin(SPIN_CAP_NS, adaptive=True))
    monkeypatch.setattr(shmvec.spin, "cpu_budget", lambda: CpuBudget(2, quota_limited=False))
    assert default_spin(1) == (Spin(SPIN_CAP_NS, adaptive=True),) * 2


def test_default_workers_follow_the_budget(monkeypatch):
    import shmvec.options

    monkeypatch.setattr(shmvec.options, "available_cpus", lambda: 1)
    assert TuningOptions().sizes(32, None).num_workers == 1


def _fake_ray(actor_id: str | None, resources: dict, initialized: bool = True):
    context = types.SimpleNamespace(
        get_actor_id=lambda: actor_id, get_assigned_resources=lambda: resources
    )
    return types.SimpleNamespace(
        is_initialized=lambda: initialized, get_runtime_context=lambda: context
    )


def test_ray_actor_cpus_bound_the_budget(monkeypatch, fake):
    monkeypatch.setattr(cpus, "_affinity_cpus", lambda: 16)
    monkeypatch.setitem(sys.modules, "ray", _fake_ray("ab12", {"CPU": 2.0}))
    assert ray_actor_cpus() == 2.0
    assert cpu_budget(fake.proc, fake.root) == CpuBudget(2, quota_limited=False)
    monkeypatch.setitem(sys.modules, "ray", _fake_ray("ab12", {"CPU": 0.5}))
    assert cpu_budget(fake.proc, fake.root).cpus == 1


@pytest.mark.parametrize(
    "ray",
    [
        _fake_ray(None, {"CPU": 1.0}),  # the driver, not an actor
        _fake_ray("ab12", {}),  # an actor without CPUs (Ray's default)
        _fake_ray("ab12", {"CPU": 1.0}, initialized=False),
    ],
)
def test_no_ray_bound_outside_an_actor_with_cpus(monkeypatch, ray):
    monkeypatch.setitem(sys.modules, "ray", ray)
    assert ray_actor_cpus() is None


@pytest.mark.timeout(180)
def test_real_ray_actor_cpus():
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("a Ray session of another test is running")
    ray.init(
        num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=100 << 20
    )
    try:

        @ray.remote
        class Probe:
            def cpus(self):
                from shmvec.cpus import ray_actor_cpus
                from shmvec.spin import available_cpus

                return ray_actor_cpus(), available_cpus()

        assert ray.get(Probe.options(num_cpus=1).remote().cpus.remote()) == (1.0, 1)
        assert ray.get(Probe.remote().cpus.remote())[0] is None  # no CPUs reserved
        assert ray_actor_cpus() is None  # the driver
    finally:
        ray.shutdown()


def test_ray_is_not_imported():
    code = "import sys, shmvec.spin as s; s.available_cpus(); print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _writable_cpu_cgroup() -> Path | None:
    """A directory where a child cgroup with its own CPU quota can be made, or None."""
    if os.geteuid() != 0:
        return None
    mounts = (Path("/proc/self/mountinfo").read_text()).splitlines()
    for fstype, _, mount_point, options in cpus._cgroup_mounts(mounts):
        base = Path(mount_point)
        if fstype == "cgroup" and "cpu" in options and (base / "cpu.cfs_quota_us").exists():
            return base if os.access(base, os.W_OK) else None
        if fstype == "cgroup2" and os.access(base, os.W_OK):
            control = base / "cgroup.subtree_control"
            if control.exists() and "cpu" in control.read_text().split():
                return base
    return None


CHILD = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    procs, = sys.argv[1:]
    Path(procs).write_text("0")  # this process joins the cgroup
    import gymnasium as gym
    import shmvec
    from shmvec.cpus import cpu_budget
    envs = shmvec.ShmVectorEnv([lambda: gym.make("CartPole-v1")] * 8)
    print(cpu_budget().cpus, envs.num_workers, cpu_budget().quota_limited)
    envs.close()
    """
)


@pytest.mark.timeout(120)
def test_default_workers_in_a_half_cpu_cgroup():
    base = _writable_cpu_cgroup()
    if base is None:
        pytest.skip("needs root and a writable cgroup cpu controller")
    group = base / f"shmvec-test-{os.getpid()}"
    group.mkdir()
    try:
        if (group / "cpu.max").exists():
            (group / "cpu.max").write_text("50000 100000")
        else:
            (group / "cpu.cfs_period_us").write_text("100000")
            (group / "cpu.cfs_quota_us").write_text("50000")
        out = subprocess.run(
            [sys.executable, "-c", CHILD, str(group / "cgroup.procs")],
            capture_output=True,
            text=True,
            timeout=100,
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["1", "1", str(len(os.sched_getaffinity(0)) > 1)]
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            (base / "cgroup.procs").write_text(pid)
        group.rmdir()
