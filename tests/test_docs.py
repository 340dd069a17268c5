"""The code examples of the docs and of the public docstrings run, and print what they show.

Docs pages: every fenced block marked ``pycon`` in README.md and docs/**/*.md is a doctest;
the blocks of one page share their names, in page order. Docstrings: the ``>>>`` examples of
the public modules, through ``doctest.DocTestFinder``. torch, Stable-Baselines3 and Ray
examples run where those are installed. The README's quickstart runs as it is, and every
name a public module exports has an entry in the API reference.
"""

from __future__ import annotations

import ast
import doctest
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [
    page
    for page in sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
    if "_build" not in page.parts
]

#: ```pycon ... ``` fences (MyST and GitHub both render them as Python sessions).
PYCON_BLOCK = re.compile(r"^```pycon\n(.*?)^```", re.M | re.S)

#: Public modules whose docstrings hold examples, and what each needs beyond shmvec.
MODULES = {
    "shmvec.vector_env": None,
    "shmvec.registration": None,
    "shmvec.codecs": None,
    "shmvec.torch": "torch",
    "shmvec.sb3": "stable_baselines3",
    "shmvec.ray": "ray",
    "shmvec.rollouts": None,
    "shmvec.awaitable": None,
    "shmvec.text_envs": None,
}

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _run(test: doctest.DocTest) -> None:
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    output: list[str] = []
    runner.run(test, out=output.append)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, "".join(output)


def test_readme_quickstart_runs() -> None:
    # The README's first code block is what a new user copies first.
    text = (ROOT / "README.md").read_text()
    quickstart = text[text.index("## Quickstart") :]
    block = re.search(r"^```python\n(.*?)^```", quickstart, re.M | re.S)
    namespace: dict = {}
    exec(compile(block.group(1), "README.md", "exec"), namespace)
    assert namespace["obs"].shape == (32, 4)
    assert namespace["envs"].closed


def _pages_with_examples() -> list[Path]:
    return [page for page in PAGES if PYCON_BLOCK.search(page.read_text())]


def test_pages_with_examples_are_found() -> None:
    # The quickstart holds examples: if none is found, the block pattern is wrong.
    assert ROOT / "docs" / "quickstart.md" in _pages_with_examples()


@pytest.mark.parametrize(
    "page", _pages_with_examples(), ids=lambda page: str(page.relative_to(ROOT))
)
def test_page_examples(page: Path) -> None:
    text = page.read_text()
    # Pad with newlines so that the line numbers of a failure are the page's.
    parts, line = [], 0
    for match in PYCON_BLOCK.finditer(text):
        start = text.count("\n", 0, match.start(1))
        parts.append("\n" * (start - line) + match.group(1))
        line = start + match.group(1).count("\n")
    source = "".join(parts)
    test = doctest.DocTestParser().get_doctest(
        source, {"__name__": "__docs__"}, str(page.relative_to(ROOT)), str(page), 0
    )
    assert test.examples, f"{page}: a pycon block without examples"
    _run(test)


@pytest.mark.parametrize(("module_name", "needs"), list(MODULES.items()), ids=list(MODULES))
def test_docstring_examples(module_name: str, needs: str | None) -> None:
    if needs is not None:
        pytest.importorskip(needs)
    module = importlib.import_module(module_name)
    tests = [
        test
        for test in doctest.DocTestFinder(exclude_empty=True).find(module, module_name)
        if test.examples
    ]
    assert tests, f"{module_name} has no examples (remove it from MODULES)"
    for test in tests:
        _run(test)


#: Modules whose ``__all__`` the API reference must cover, and their reference pages.
REFERENCE = {
    "shmvec": "shmvec.md",
    "shmvec.sb3": "sb3.md",
    "shmvec.ray": "ray.md",
    "shmvec.rollouts": "rollouts.md",
    "shmvec.rollouts.server": "rollouts.md",
    "shmvec.rollouts.tokens": "rollouts.md",
    "shmvec.text_envs": "text_envs.md",
    "shmvec.integrations.trl": "trl.md",
    "shmvec.integrations.verl": "integrations.md",
}
AUTODOC = re.compile(r"^\.\. auto(?:class|function|exception):: ([\w.]+)", re.M)


def _exported(module_name: str) -> list[str]:
    """``__all__`` of a module, read without importing it (its extras may be missing)."""
    base = ROOT / module_name.replace(".", "/")
    path = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return list(ast.literal_eval(node.value))
    raise AssertionError(f"{path} has no __all__")


def test_api_reference_covers_public_names() -> None:
    documented = {
        name
        for page in (ROOT / "docs" / "api").glob("*.md")
        for name in AUTODOC.findall(page.read_text())
    }
    missing = [
        f"{module}.{name}"
        for module in REFERENCE
        for name in _exported(module)
        if f"{module}.{name}" not in documented
    ]
    assert "shmvec.torch.TorchVectorEnv" in documented
    assert not missing, f"no API reference entry for {missing}"
