"""The rollout loop taking a per-row policy's rows as they come (``recv(take_ready=True)``)
against full batches only, for ``shmvec-bench rollouts --layer-policy rows`` (an
``AsyncPolicy`` per row over a batching model of a GPU decode batch), 256 envs, the ``tool``
and ``cpu200us`` workloads, alternated::

    python dev/take_ready_rows_ab.py [SECONDS [ROUNDS]]     # default: 15 s, 2 rounds
"""

from __future__ import annotations

import sys

from shmvec.rollouts import policies
from shmvec_bench.rollouts.runner import measure


def main() -> None:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 15.0
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    for workload in ("tool", "cpu200us"):
        for r in range(rounds):
            for way, per_row in (("full-batches", False), ("take-ready", True)):
                policies.AsyncPolicyRunner.per_row = per_row  # the loop reads it per recv
                m = measure(
                    workload, "shmvec", "latency", num_envs=256, group_size=8, seconds=seconds,
                    timeout=300, max_lag=None, policy_mode="rows", seed=r,
                )  # fmt: skip
                print(
                    f"{workload} round {r} {way:12s}: {m.outcome}: {m.groups_per_s:.2f} "
                    f"groups/s, {m.steps_per_s:.0f} steps/s, CPU {m.cpu_s_per_step * 1e3:.3f} "
                    f"ms/step, policy idle {m.policy_idle_share:.0%}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
