"""A dataclass of arguments as a command line, for the examples' scripts.

``parse_dataclass(Args, argv, description)`` makes ``--num-envs 8`` (or
``--num_envs``), ``--flag``/``--no-flag`` for booleans and ``--x None`` for
``X | None`` fields; each field's docstring is its help. ``help_text(__doc__)``
is a script's docstring up to its first section, for ``--help``.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import sys
import textwrap
import typing
from dataclasses import fields
from typing import Any, TypeVar

T = TypeVar("T")


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (read from its source)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, following in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def parser_type(annotation: Any):
    """``int``, ``float``, ``str`` or their ``X | None`` forms to an argparse type."""
    if isinstance(annotation, str):
        annotation = eval(annotation, vars(typing), {})  # noqa: S307 - our own annotations
    args = typing.get_args(annotation)
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), annotation) if args else annotation

    def convert(text: str):
        if optional and text.lower() == "none":
            return None
        return base(text)

    convert.__name__ = base.__name__
    return convert, base


def help_text(docstring: str) -> str:
    """A module docstring for ``--help``: the text before its first section
    heading (a line of dashes), without RST's double backquotes."""
    lines = docstring.strip("\n").splitlines()
    heading = next(
        (i for i, line in enumerate(lines) if i and set(line.strip()) == {"-"}), len(lines) + 1
    )
    return "\n".join(lines[: heading - 1]).rstrip().replace("``", "")


def _normalize(argv: list[str], names: set[str]) -> list[str]:
    """``--num_envs``/``--no-anneal_lr`` as ``--num-envs``/``--no-anneal-lr``: both
    spellings work, and ``--help`` lists only the dashed one."""
    out = []
    for arg in argv:
        flag, eq, value = arg.partition("=")
        bare = flag.removeprefix("--no-") if flag.startswith("--no-") else flag[2:]
        if flag.startswith("--") and bare in names:
            flag = flag.replace("_", "-")
        out.append(flag + eq + value)
    return out


def parse_dataclass(cls: type[T], argv: list[str] | None, description: str) -> T:
    """``cls(**arguments)`` from ``argv`` (default: ``sys.argv[1:]``).

    ``description`` is printed as written (``RawDescriptionHelpFormatter``);
    each option's help is its field's docstring and its default.
    """
    docs = field_docs(cls)
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    for f in fields(cls):
        convert, base = parser_type(f.type)
        doc = docs.get(f.name, "").replace("%", "%%")
        # A None default is explained by the docstring ("None: never").
        shown = f.default is not None or "None" not in doc
        options: dict[str, Any] = {
            "dest": f.name,
            "default": f.default,
            "help": f"{doc} (default: %(default)s)" if shown else doc,
        }
        if base is bool:
            options["action"] = argparse.BooleanOptionalAction
        else:
            options.update(type=convert, metavar=base.__name__.upper())
        action = parser.add_argument(f"--{f.name.replace('_', '-')}", **options)
        action.help = options["help"]  # Python < 3.11's BooleanOptionalAction adds a default
    if argv is None:
        argv = sys.argv[1:]
    return cls(**vars(parser.parse_args(_normalize(argv, {f.name for f in fields(cls)}))))


if __name__ == "__main__":
    sys.exit("dataclass_args.py is a module of ppo.py and ppo_atari.py: run one of those")
