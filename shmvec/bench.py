"""``shmvec-bench`` and ``python -m shmvec.bench``: the benchmark lives in ``shmvec_bench``."""

from shmvec_bench.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
