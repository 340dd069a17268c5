"""``python -m shmvec_bench.rollouts``: the ``shmvec-bench rollouts`` command."""

from shmvec_bench.rollouts.cli import main

raise SystemExit(main())
