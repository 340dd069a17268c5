"""Fixtures and reporting for the throughput suite (see test_throughput.py).

Each test opens one backend through ``shmvec_bench.backends``, times a fixed number of
batched steps per round with ``benchmark.pedantic`` and records steps/s in the
benchmark's ``extra_info``. After every test, each shmvec row of the test's
group gets its ratio against every peer of that group measured so far
(``extra_info["vs_<peer>"]``, plus ``parallel_efficiency`` when the group has a
``single`` row and a CPU-bound workload, ``shmvec_bench.workloads.CPU_BOUND``), so
the ratios land in ``--benchmark-json`` output; the terminal summary prints them.
Nothing here asserts a timing target.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from shmvec.spin import available_cpus
from shmvec_bench.backends import opened
from shmvec_bench.workloads import CPU_BOUND


@dataclass
class Throughput:
    """One benchmark's result, as steps/s, with a handle on its ``extra_info``."""

    group: str
    workload: str
    backend: str
    num_envs: int
    steps_per_round: int
    #: Median round time, seconds.
    median_round_s: float
    extra_info: dict = field(repr=False)
    #: Env steps per batched step: num_envs, or the batch of an async backend.
    steps_per_call: int = 0

    @property
    def steps_per_s(self) -> float:
        per_call = self.steps_per_call or self.num_envs
        return per_call * self.steps_per_round / self.median_round_s

    @property
    def step_us(self) -> float:
        """Mean time of one batched step in the median round, microseconds."""
        return self.median_round_s / self.steps_per_round * 1e6


RESULTS = pytest.StashKey[list]()


def is_shmvec(backend: str) -> bool:
    return backend.startswith("shmvec")


def pytest_configure(config: pytest.Config) -> None:
    config.stash[RESULTS] = []


def update_ratios(results: list[Throughput], group: str, cores: int) -> None:
    """Writes each shmvec row's ratios against the group's peers into its extra_info."""
    rows = [r for r in results if r.group == group]
    single = next((r for r in rows if r.backend == "single"), None)
    for row in filter(lambda r: is_shmvec(r.backend), rows):
        for peer in rows:
            if not is_shmvec(peer.backend) and peer.backend != "single":
                row.extra_info[f"vs_{peer.backend}"] = round(row.steps_per_s / peer.steps_per_s, 3)
        if single is not None and row.workload in CPU_BOUND:  # as shmvec-bench's table
            efficiency = row.steps_per_s / (cores * single.steps_per_s)
            row.extra_info["parallel_efficiency"] = round(efficiency, 3)
            row.extra_info["cores"] = cores


@pytest.fixture
def throughput(benchmark, request) -> Callable[..., Throughput | None]:
    """``run(workload, backend, num_envs, steps, rounds)``: open, time, close, record.

    Every round is ``steps`` batched ``step`` calls with actions drawn before
    timing; one warm-up round comes first. Returns None when benchmarking is
    disabled (``--benchmark-disable``), where the body runs once untimed.
    """
    results = request.config.stash[RESULTS]

    def run(workload: str, backend: str, num_envs: int, steps: int, rounds: int):
        with opened(backend, workload, num_envs) as stepper:
            if stepper.every_env_back is not None:  # async: slow resets stay out of the rounds
                stepper.every_env_back()
            step, actions = stepper.step, stepper.actions

            def one_round() -> None:
                for i in range(steps):
                    step(actions[i % len(actions)])

            benchmark.pedantic(one_round, rounds=rounds, warmup_rounds=1, iterations=1)
            num_workers = stepper.num_workers
            num_envs = stepper.num_envs
            per_call = stepper.steps_per_call or num_envs
        if benchmark.stats is None:
            return None
        result = Throughput(
            group=benchmark.group or workload,
            workload=workload,
            backend=backend,
            num_envs=num_envs,
            steps_per_round=steps,
            median_round_s=benchmark.stats.stats.median,
            extra_info=benchmark.extra_info,
            steps_per_call=per_call,
        )
        benchmark.extra_info.update(
            workload=workload,
            backend=backend,
            num_envs=num_envs,
            num_workers=num_workers,
            steps_per_round=steps,
            steps_per_s=round(result.steps_per_s, 1),
            step_us=round(result.step_us, 2),
        )
        results.append(result)
        update_ratios(results, result.group, available_cpus())
        return result

    return run


@pytest.hookimpl(trylast=True)  # after pytest-benchmark's own tables
def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    """Prints steps/s of every row and shmvec's ratios against the peers of its group."""
    results: list[Throughput] = config.stash.get(RESULTS, [])
    if not results:
        return
    write = terminalreporter.write_line
    terminalreporter.write_sep("-", f"shmvec vs peers, same run ({available_cpus()} cores)")
    write(f"{'group':<18} {'backend':<14} {'envs':>5} {'steps/s':>12} {'step us':>10}  ratios")
    for group in dict.fromkeys(r.group for r in results):
        for row in (r for r in results if r.group == group):
            ratios = ", ".join(
                f"{key}={value}"
                for key, value in row.extra_info.items()
                if key.startswith("vs_") or key == "parallel_efficiency"
            )
            write(
                f"{group:<18} {row.backend:<14} {row.num_envs:>5} "
                f"{row.steps_per_s:>12,.0f} {row.step_us:>10,.1f}  {ratios}"
            )
