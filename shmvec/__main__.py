"""``python -m shmvec --version``: the installed version and where its modules come from."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Parses ``argv``; prints the version (``--version``) or the build's modules (``--info``)."""
    import shmvec

    parser = argparse.ArgumentParser(
        prog="python -m shmvec",
        description="shmvec: gymnasium vector environments over shared memory and futexes.",
    )
    parser.add_argument("--version", action="version", version=f"shmvec {shmvec.__version__}")
    parser.add_argument(
        "--info", action="store_true", help="print the version and the compiled modules' paths"
    )
    args = parser.parse_args(argv)
    if not args.info:
        parser.print_help()
        return 0
    from shmvec import _core, _worker_loop

    print(f"shmvec {shmvec.__version__} ({shmvec.__file__})")
    print(f"_core: {_core.__file__}")
    print(f"_worker_loop: {_worker_loop.__file__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
