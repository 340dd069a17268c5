"""Fast checks of the awaitable envs' benchmark (shmvec_bench.rollouts.awaitable): each way
completes trajectories on a tiny run, the awaitable way with one dispatcher thread, and the
CLI prints its table and writes its CSV."""

from __future__ import annotations

import csv
import importlib.util

import pytest

from shmvec_bench.rollouts.awaitable import WAYS, main, measure

#: gem-llm's game where it is installed, else FrozenLake as text (gymnasium only).
GAME = "guess" if importlib.util.find_spec("gem") is not None else "frozenlake"


@pytest.mark.parametrize("way", WAYS)
def test_every_way_completes_trajectories(way):
    m = measure(GAME, way, coroutines=16, warmup_s=0.3, seconds=1.0)
    assert m.outcome == "ok", m.outcome
    assert m.trajectories > 0 and m.steps_per_s >= m.trajectories_per_s > 0
    if way == "awaitable":
        assert m.threads == 2  # the event loop's and the dispatcher's


def test_cli_writes_its_table_and_csv(tmp_path, capsys):
    assert main([
        "--workloads", GAME, "--ways", "awaitable", "threads", "--coroutines", "8",
        "--warmup", "0.2", "--seconds", "0.5", "--repeats", "1", "--out", str(tmp_path),
    ]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert f"| {GAME} | awaitable |" in out and f"| {GAME} | threads |" in out
    rows = list(csv.DictReader(open(tmp_path / "awaitable.csv")))
    assert {r["way"] for r in rows} == {"awaitable", "threads"} and len(rows) == 4
