"""Makes ``tests/`` importable as top-level modules (``import envs``), also in
workers started with spawn/forkserver, which get PYTHONPATH from the
environment."""

from __future__ import annotations

import os
import sys

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)
_paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
if TESTS_DIR not in _paths:
    os.environ["PYTHONPATH"] = os.pathsep.join([TESTS_DIR, *_paths])


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", "slow: minutes-long runs, skipped unless SHMVEC_SLOW=1 is set"
    )
