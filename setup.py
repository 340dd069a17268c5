"""Builds shmvec's two extension modules with CMake (see CMakeLists.txt)."""

import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).parent.resolve()


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    """Configures and builds the CMake project once, for every extension."""

    def run(self) -> None:
        # Both modules come from one CMake build: build it for the first one.
        self.build_cmake(self.extensions[0])

    def build_cmake(self, ext: Extension) -> None:
        out_dir = Path(self.get_ext_fullpath(ext.name)).parent.resolve()
        build_dir = Path(self.build_temp).resolve() / "cmake"
        build_dir.mkdir(parents=True, exist_ok=True)
        import pybind11

        config = [
            "cmake",
            "-S",
            str(ROOT),
            "-B",
            str(build_dir),
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DCMAKE_BUILD_TYPE={os.environ.get('SHMVEC_BUILD_TYPE', 'Release')}",
        ]
        if os.environ.get("SHMVEC_SANITIZE"):
            config.append(f"-DSHMVEC_SANITIZE={os.environ['SHMVEC_SANITIZE']}")
        try:
            import ninja  # noqa: F401

            config += ["-G", "Ninja"]
        except ImportError:
            pass
        subprocess.run(config, check=True)
        subprocess.run(["cmake", "--build", str(build_dir), "-j", "2"], check=True)


setup(
    ext_modules=[CMakeExtension("shmvec._core"), CMakeExtension("shmvec._worker_loop")],
    cmdclass={"build_ext": CMakeBuild},
)
