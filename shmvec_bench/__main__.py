"""``python -m shmvec_bench``: the ``shmvec-bench`` command."""

from shmvec_bench.cli import main

raise SystemExit(main())
