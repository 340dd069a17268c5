"""``python -m shmvec --version``: the installed version and where its modules come from."""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

#: This package's folder: the one ``python -m shmvec`` runs, whatever ``import
#: shmvec`` finds (from the folder that holds a clone named ``shmvec``, that is
#: the clone itself, as a namespace package without ``__version__``).
PACKAGE_DIR = Path(__file__).resolve().parent


def package_version() -> str:
    """The version set in this package's ``__init__.py``, read without importing
    it (as pyproject.toml reads it); the installed distribution's if that fails."""
    try:
        tree = ast.parse((PACKAGE_DIR / "__init__.py").read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                isinstance(target, ast.Name) and target.id == "__version__"
                for target in node.targets
            ):
                return str(ast.literal_eval(node.value))
    except (OSError, SyntaxError, ValueError):
        pass
    from importlib.metadata import version

    return version("shmvec")


def main(argv: list[str] | None = None) -> int:
    """Parses ``argv``; prints the version (``--version``) or the build's modules (``--info``)."""
    version = package_version()
    parser = argparse.ArgumentParser(
        prog="python -m shmvec",
        description="shmvec: gymnasium vector environments over shared memory and futexes.",
    )
    parser.add_argument("--version", action="version", version=f"shmvec {version}")
    parser.add_argument(
        "--info", action="store_true", help="print the version and the compiled modules' paths"
    )
    args = parser.parse_args(argv)
    if not args.info:
        parser.print_help()
        return 0
    from shmvec import _core, _worker_loop

    print(f"shmvec {version} ({PACKAGE_DIR})")
    print(f"_core: {_core.__file__}")
    print(f"_worker_loop: {_worker_loop.__file__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
