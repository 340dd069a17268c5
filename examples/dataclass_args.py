"""A dataclass of arguments as a command line, for the examples' scripts.

``parse_dataclass(Args, argv, description)`` makes ``--num-envs 8`` (or
``--num_envs``), ``--flag``/``--no-flag`` for booleans and ``--x None`` for
``X | None`` fields; each field's docstring is its help.
"""

from __future__ import annotations

import argparse
import ast
import inspect
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


def parse_dataclass(cls: type[T], argv: list[str] | None, description: str) -> T:
    """``cls(**arguments)`` from ``argv`` (default: ``sys.argv[1:]``)."""
    docs = field_docs(cls)
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    for f in fields(cls):
        flags = [f"--{f.name.replace('_', '-')}"]
        if "_" in f.name:
            flags.append(f"--{f.name}")
        convert, base = parser_type(f.type)
        options: dict[str, Any] = {
            "dest": f.name,
            "default": f.default,
            "help": docs.get(f.name, ""),
        }
        if base is bool:
            options["action"] = argparse.BooleanOptionalAction
        else:
            options.update(type=convert, metavar=base.__name__.upper())
        parser.add_argument(*flags, **options)
    return cls(**vars(parser.parse_args(argv)))
