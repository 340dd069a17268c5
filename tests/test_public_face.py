"""The package's public face: every constructor option documented, the version
from any directory, the typing markers shipped."""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
import sys
import types
from enum import Enum
from pathlib import Path

import pytest

import shmvec
from shmvec import __main__ as cli

ROOT = Path(__file__).resolve().parents[1]
#: One entry of a Google-style "Args:" section: ``name (type, default value): ...``.
ARG_ENTRY = re.compile(r"^ {4}(\w+) \((.+?)(?:, default (.+?))?\): ", re.S | re.M)


def _constructor_doc() -> str:
    """ShmVectorEnv's docstring with its indentation removed, as Python 3.13 stores
    it (earlier versions keep the source's indentation)."""
    return inspect.cleandoc(shmvec.ShmVectorEnv.__doc__ or "")


def _args_section(doc: str) -> dict[str, tuple[str, str | None]]:
    """``{name: (type, default)}`` of a cleaned docstring's "Args:" section."""
    section = doc.split("Args:", 1)[1]
    section = re.split(r"\n\S", section, maxsplit=1)[0]  # up to the next section
    # An entry may wrap inside its parentheses: join each entry's lines first.
    entries = re.split(r"\n(?= {4}\w+ \()", section)
    found = {}
    for entry in entries:
        flat = " ".join(line.strip() for line in entry.splitlines())
        match = ARG_ENTRY.match(" " * 4 + flat)
        if match:
            found[match[1]] = (match[2], match[3])
    return found


def _written(default: object) -> str:
    if isinstance(default, Enum):
        return f"{type(default).__name__}.{default.name}"
    return '"' + default + '"' if isinstance(default, str) else repr(default)


def test_every_constructor_option_is_in_the_docstring_table():
    documented = _args_section(_constructor_doc())
    parameters = inspect.signature(shmvec.ShmVectorEnv.__init__).parameters
    options = [p for name, p in parameters.items() if name != "self"]
    missing = [p.name for p in options if p.name not in documented]
    assert not missing, f"options missing from ShmVectorEnv's docstring: {missing}"
    assert list(documented) == [p.name for p in options], "documented in signature order"
    for p in options:
        type_text, default_text = documented[p.name]
        assert type_text == p.annotation, f"{p.name}: documented as {type_text}"
        if p.default is inspect.Parameter.empty:
            assert default_text is None, f"{p.name} has no default"
        else:
            assert default_text == _written(p.default), f"{p.name}: default {p.default!r}"


def test_every_constructor_option_is_in_the_options_page():
    # docs/options.md: the user's table, one row per option, in signature order.
    page = (ROOT / "docs" / "options.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \|", page, re.M)
    parameters = [
        p for p in inspect.signature(shmvec.ShmVectorEnv.__init__).parameters if p != "self"
    ]
    missing = [name for name in parameters if name not in rows]
    assert not missing, f"options missing from docs/options.md: {missing}"
    assert [r for r in rows if r in parameters] == parameters, "listed in signature order"


def test_the_table_parser_sees_a_missing_option():
    doc = _constructor_doc()
    without = re.sub(r"\n {4}ring_depth \(.*?\n", "\n", doc)
    assert "ring_depth" in _args_section(doc) and "ring_depth" not in _args_section(without)


def test_version_from_any_directory(tmp_path):
    # A folder named shmvec in the working directory (as in the folder holding a
    # clone) must not hide the version.
    (tmp_path / "shmvec").mkdir()
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    for cwd in (tmp_path, ROOT.parent, ROOT):
        out = subprocess.run(
            [sys.executable, "-m", "shmvec", "--version"],
            cwd=cwd, env=env, capture_output=True, text=True, check=True,
        )  # fmt: skip
        assert out.stdout.strip() == f"shmvec {shmvec.__version__}", cwd


#: ``python -m shmvec --version`` where ``import shmvec`` finds a folder named shmvec
#: (a namespace package) and ``shmvec.__main__`` comes from an editable install's
#: finder, as from the folder that holds a clone named shmvec.
EDITABLE_FROM_PARENT = """
import importlib.util, runpy, sys
from pathlib import Path

CHECKOUT = sys.argv[1]

class EditableFinder:  # as setuptools' editable finder: shmvec.* from the checkout
    @staticmethod
    def find_spec(fullname, path=None, target=None):
        if fullname.split(".")[0] != "shmvec":
            return None
        base = Path(CHECKOUT, *fullname.split("."))
        if (base / "__init__.py").exists():
            return importlib.util.spec_from_file_location(
                fullname, base / "__init__.py", submodule_search_locations=[str(base)]
            )
        if base.with_suffix(".py").exists():
            return importlib.util.spec_from_file_location(fullname, base.with_suffix(".py"))
        return None

sys.meta_path.append(EditableFinder)
sys.argv = ["shmvec", "--version"]
runpy.run_module("shmvec", run_name="__main__", alter_sys=True)
"""


def test_version_from_the_folder_holding_a_clone(tmp_path):
    (tmp_path / "shmvec").mkdir()  # the clone, seen from its parent: no __init__.py
    out = subprocess.run(
        [sys.executable, "-S", "-c", EDITABLE_FROM_PARENT, str(ROOT)],  # -S: no other finder
        cwd=tmp_path, env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"shmvec {shmvec.__version__}"


def test_version_when_shmvec_is_a_namespace_package(monkeypatch, capsys):
    # What `import shmvec` gives from the folder that holds a clone named shmvec.
    monkeypatch.setitem(sys.modules, "shmvec", types.ModuleType("shmvec"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"shmvec {shmvec.__version__}"


def test_typing_markers_ship():
    assert (ROOT / "shmvec" / "py.typed").exists()
    assert (ROOT / "shmvec" / "_core.pyi").exists()
    manifest = (ROOT / "MANIFEST.in").read_text()
    assert "shmvec/py.typed" in manifest and "shmvec/*.pyi" in manifest
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'shmvec = \[[^\]]*"py\.typed"[^\]]*"\*\.pyi"', pyproject)


def _stub_names(path: Path) -> dict[str, set[str]]:
    """``{name: members}`` of a stub's top-level classes, functions (no members)."""
    names: dict[str, set[str]] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef):
            members = set()
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    members.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    members.add(item.target.id)
                elif isinstance(item, ast.Assign):
                    members.update(t.id for t in item.targets if isinstance(t, ast.Name))
            names[node.name] = members
        elif isinstance(node, ast.FunctionDef):
            names[node.name] = set()
    return names


def test_core_stub_names_every_public_name_of_the_module():
    from shmvec import _core

    stub = _stub_names(ROOT / "shmvec" / "_core.pyi")
    public = {name for name in dir(_core) if not name.startswith("_")}
    assert set(stub) == public
    for name, members in stub.items():
        cls = getattr(_core, name)
        if not isinstance(cls, type):
            continue
        # A pybind11 enum: its members (its name/value properties are the Enum's own).
        own = set(getattr(cls, "__members__", {})) or {m for m in vars(cls) if m[0] != "_"}
        stubbed = members - {"__init__", "__buffer__"}
        assert own == stubbed, f"{name}: {sorted(own ^ stubbed)} differ"
