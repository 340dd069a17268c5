"""The C++ core's native test (csrc/tests/core_test.cc), built without sanitizers.

dev/sanitize.sh (in the repository, not the sdist) runs the same program under
ASan+UBSan and TSan; this test keeps it compiling and passing in the normal
suite. It builds only the core and the test program (no Python modules): ~10 s
on 2 cores. Skipped when
cmake, a C++ compiler or pybind11 (which CMakeLists.txt looks for) is missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.timeout(300)


def _missing_tools() -> str | None:
    if shutil.which("cmake") is None:
        return "cmake is not installed"
    if not any(shutil.which(cxx) for cxx in (os.environ.get("CXX", "c++"), "g++", "clang++")):
        return "no C++ compiler"
    if not (ROOT / "csrc" / "tests" / "core_test.cc").exists():
        return "no csrc/ (not a source checkout)"
    try:
        import pybind11  # noqa: F401
    except ImportError:
        return "pybind11 is not installed"
    return None


@pytest.mark.skipif(_missing_tools() is not None, reason=str(_missing_tools()))
def test_core_test_program_passes(tmp_path):
    import pybind11

    build = tmp_path / "build"
    configure = [
        "cmake",
        "-S",
        str(ROOT),
        "-B",
        str(build),
        "-DSHMVEC_BUILD_TESTS=ON",
        "-DCMAKE_BUILD_TYPE=Release",
        f"-DPython_EXECUTABLE={sys.executable}",
        f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
    ]
    if shutil.which("ninja"):
        configure += ["-G", "Ninja"]
    for command in (
        configure,
        ["cmake", "--build", str(build), "--target", "shmvec_core_test", "-j", "2"],
    ):
        done = subprocess.run(command, capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, f"{command[:2]} failed:\n{done.stdout}\n{done.stderr}"
    # --quick: 500 rounds per scenario instead of 5000, threads and processes.
    done = subprocess.run(
        [str(build / "shmvec_core_test"), "--quick"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, f"core test failed:\n{done.stdout}\n{done.stderr}"
    assert "all core tests passed" in done.stdout
