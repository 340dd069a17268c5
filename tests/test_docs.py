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


# The performance page holds the current figures; the guides cite them.
PERFORMANCE = ROOT / "docs" / "performance.md"
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
#: A summary figure: one number, a ratio (x) or a share (%), in bold or not.
FIGURE = re.compile(r"\*{0,2}[0-9][0-9.,]*(x|%)?\*{0,2}")


def _slug(heading: str) -> str:
    """The anchor MyST gives a heading (``myst_heading_anchors``)."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(text: str) -> set[str]:
    anchors: set[str] = set()
    for heading in re.findall(r"^#{1,3} (.+)$", FENCE.sub("", text), re.M):
        slug, n = _slug(heading), 0
        while (slug if n == 0 else f"{slug}-{n}") in anchors:
            n += 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _sections(text: str) -> list[tuple[str, str]]:
    """(heading, body) of each ``##``/``###`` section."""
    parts = re.split(r"^(#{2,3} .+)$", FENCE.sub("", text), flags=re.M)
    return list(zip(parts[1::2], parts[2::2]))


def _summary_rows(text: str) -> list[list[str]]:
    body = dict(_sections(text)).get("## Summary", "")
    lines = [line for line in body.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]


def _paragraphs(text: str) -> list[str]:
    return [p for p in re.split(r"\n\s*\n", FENCE.sub("", text)) if p.strip()]


def _check_performance_page(text: str) -> list[str]:
    problems = []
    if text.count("\n") > 600:
        problems.append(f"{text.count(chr(10))} lines (at most 600)")
    rows = _summary_rows(text)
    if not 0 < len(rows) <= 25:
        problems.append(f"{len(rows)} summary rows (1 to 25)")
    claims = [(row[0], row[1]) for row in rows]
    problems += [f"claim {c} in more than one row" for c in set(claims) if claims.count(c) > 1]
    anchors = _anchors(text)
    for row in rows:
        if len(row) != 5:
            problems.append(
                f"summary row {row}: 5 cells (workload, against, figure, machine and date, details)"
            )
            continue
        problems += [f"summary cell over 25 words: {c!r}" for c in row if len(c.split()) > 25]
        if not FIGURE.fullmatch(row[2]):
            problems.append(f"summary figure {row[2]!r} is not one figure")
        if len(DATE.findall(row[3])) != 1:
            problems.append(f"summary row {row[0]!r}: one machine and date")
        targets = [link[1:] for link in LINK.findall(row[4]) if link.startswith("#")]
        if not targets or any(t not in anchors for t in targets):
            problems.append(f"summary row {row[0]!r}: no link to a section of the page")
    for heading, body in _sections(text):
        has_figures = re.search(r"^\|.*\d.*\|$", body, re.M) and heading != "## Summary"
        if has_figures and "benchmarks/data/" not in body:
            problems.append(f"{heading}: figures without a link to their data file")
    return problems


def test_performance_page_holds_current_figures() -> None:
    # One summary row per claim, each a figure linked to its section; each section's
    # figures link to their data; older runs live in the benchmark log.
    assert _check_performance_page(PERFORMANCE.read_text()) == []


def test_relative_links_resolve() -> None:
    # Every data file, plot and page a docs page links to is in the repository.
    missing = [
        f"{page.relative_to(ROOT)}: {target}"
        for page in PAGES
        for target in LINK.findall(page.read_text())
        if not re.match(r"[a-z]+:|#", target) and not (page.parent / target.split("#")[0]).exists()
    ]
    assert not missing, missing


def _check_cites_one_run(page: Path, max_dates: int | None) -> list[str]:
    text = page.read_text()
    problems = []
    if max_dates is not None and len(DATE.findall(text)) > max_dates:
        problems.append(f"{len(DATE.findall(text))} dates (at most {max_dates})")
    for paragraph in _paragraphs(text):
        runs = set(DATE.findall(paragraph))
        data = {t for t in LINK.findall(paragraph) if "benchmarks/data/" in t}
        if len(runs) > 1 or (page.parent.name == "guides" and len(data) > 1):
            problems.append(
                f"cites {len(runs)} dates and {len(data)} data files: {paragraph[:80]!r}"
            )
    return problems


@pytest.mark.parametrize(
    "page",
    sorted([*(ROOT / "docs" / "guides").glob("*.md"), *(ROOT / "docs" / "design").glob("*.md")]),
    ids=lambda page: str(page.relative_to(ROOT)),
)
def test_pages_cite_one_run_a_paragraph(page: Path) -> None:
    # A guide says when to choose an option, with the current figure linked to the
    # performance page; the runs behind it live there and in the benchmark log.
    max_dates = 3 if page.parent.name == "guides" else None
    assert _check_cites_one_run(page, max_dates) == []
