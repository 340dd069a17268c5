"""Builds shmvec's two extension modules with CMake (see CMakeLists.txt).

Before CMake runs, the build checks what it needs (Linux, a C++17 compiler, CMake) and
stops with a message naming what is missing, instead of a CMake trace.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CompileError, PlatformError

ROOT = Path(__file__).parent.resolve()

# Uses three C++17 features the core relies on (inline variables, if constexpr,
# <optional>), so a compiler that only claims -std=c++17 fails here, not in CMake.
CXX17_PROBE = """
#include <optional>
inline constexpr int kAnswer = 42;
int main() {
  std::optional<int> answer = kAnswer;
  if constexpr (sizeof(int) >= 4) return *answer - kAnswer;
  return 1;
}
"""


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


def find_cxx_compiler() -> str:
    """The C++ compiler CMake will pick: $CXX, else c++ (CMake's first choice) or g++/clang++."""
    if os.environ.get("CXX"):
        return os.environ["CXX"]
    for name in ("c++", "g++", "clang++"):
        path = shutil.which(name)
        if path:
            return path
    raise CompileError(
        "shmvec needs a C++17 compiler to build, and none was found: no $CXX, and no c++, "
        "g++ or clang++ on PATH. Install one (Debian/Ubuntu: `apt install g++`; "
        "Fedora/RHEL: `dnf install gcc-c++`), or set CXX to its path."
    )


def check_cxx17(compiler: str) -> None:
    """Raises CompileError naming the compiler if it cannot build a small C++17 program."""
    with tempfile.TemporaryDirectory(prefix="shmvec-cxx17-") as tmp:
        source = Path(tmp) / "probe.cc"
        source.write_text(CXX17_PROBE)
        # $CXX may carry flags ("ccache g++"), as CMake accepts it.
        command = [*compiler.split(), "-std=c++17", str(source), "-o", str(Path(tmp) / "probe")]
        try:
            result = subprocess.run(command, capture_output=True, text=True)
        except OSError as exc:
            raise CompileError(
                f"shmvec needs a C++17 compiler; {compiler!r} could not be run ({exc})."
            ) from exc
    if result.returncode != 0:
        raise CompileError(
            f"shmvec needs a C++17 compiler; {compiler!r} failed to compile a small C++17 "
            f"program (GCC >= 8 or Clang >= 7 works):\n{result.stderr.strip()}"
        )


def check_build_requirements() -> str:
    """Checks the platform, the compiler and CMake; returns the path of cmake."""
    if not sys.platform.startswith("linux"):
        raise PlatformError(
            f"shmvec builds and runs on Linux only (it uses Linux futexes and /dev/shm); "
            f"this platform is {sys.platform!r}."
        )
    check_cxx17(find_cxx_compiler())
    cmake = shutil.which("cmake")
    if cmake is None:
        raise CompileError(
            "shmvec needs CMake >= 3.18 to build, and no cmake is on PATH. `pip install .` "
            "brings its own; with --no-build-isolation, `pip install cmake ninja` first."
        )
    return cmake


class CMakeBuild(build_ext):
    """Configures and builds the CMake project once, for every extension."""

    def run(self) -> None:
        # Both modules come from one CMake build: build it for the first one.
        self.build_cmake(self.extensions[0])

    def build_cmake(self, ext: Extension) -> None:
        cmake = check_build_requirements()
        import pybind11

        out_dir = Path(self.get_ext_fullpath(ext.name)).parent.resolve()
        build_dir = Path(self.build_temp).resolve() / "cmake"
        ninja = shutil.which("ninja")
        # The tools the CMake cache records by absolute path. pip and `python -m build`
        # build in a throwaway environment (its own cmake, ninja, pybind11, Python) and
        # delete it afterwards, yet build_dir lies in the checkout and outlives it: the
        # next install would find a cache naming a ninja that no longer exists. CMake
        # cannot re-point a cache at another generator or make program, so when any of
        # these changed the build dir starts afresh; with the same tools (build_ext
        # --inplace, --no-build-isolation) it is kept and only what changed is rebuilt.
        # The compiler, its flags and $CMAKE_ARGS count as tools too: CMake records the
        # compiler at the first configure and keeps it, silently, when $CXX changes.
        extra_args = shlex.split(os.environ.get("CMAKE_ARGS", ""))
        tools = {
            "cmake": cmake,
            "make_program": ninja,
            "python": sys.executable,
            "pybind11_dir": pybind11.get_cmake_dir(),
            "cxx": find_cxx_compiler(),
            "cxxflags": os.environ.get("CXXFLAGS", ""),
            "ldflags": os.environ.get("LDFLAGS", ""),
            "cmake_args": extra_args,
        }
        tools_file = build_dir / "shmvec-build-tools.json"
        if build_dir.exists() and (
            not tools_file.exists() or json.loads(tools_file.read_text()) != tools
        ):
            shutil.rmtree(build_dir)
        build_dir.mkdir(parents=True, exist_ok=True)

        config = [
            cmake,
            "-S",
            str(ROOT),
            "-B",
            str(build_dir),
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={tools['pybind11_dir']}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DCMAKE_BUILD_TYPE={os.environ.get('SHMVEC_BUILD_TYPE', 'Release')}",
        ]
        if os.environ.get("SHMVEC_SANITIZE"):
            config.append(f"-DSHMVEC_SANITIZE={os.environ['SHMVEC_SANITIZE']}")
        if ninja:
            config += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
        # E.g. a cross build's -DPython_INCLUDE_DIR and -DSHMVEC_EXT_SUFFIX (dev/wheels.py).
        config += extra_args
        subprocess.run(config, check=True)
        tools_file.write_text(json.dumps(tools))
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(len(os.sched_getaffinity(0))))
        subprocess.run([cmake, "--build", str(build_dir), "-j", jobs], check=True)


setup(
    ext_modules=[CMakeExtension("shmvec._core"), CMakeExtension("shmvec._worker_loop")],
    cmdclass={"build_ext": CMakeBuild},
)
