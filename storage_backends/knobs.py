"""Documented config fields: the comment beside a dataclass field is its documentation.

A config dataclass documents each knob where it is declared, in a comment on the field's
lines or on the comment lines just above it. `field_docs` reads those comments from the
source, so the command lines' help (`tierkv-server --help`, `tierkv-engine --help`), the
docs and the YAML keys all come from one place.
"""

from __future__ import annotations

import ast
import functools
import inspect
import io
import textwrap
import tokenize
from dataclasses import MISSING, Field, fields
from typing import Any


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """{field name: its comment text} for each field of a dataclass that has one."""
    src = textwrap.dedent(inspect.getsource(cls))
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = src.splitlines()
    body = ast.parse(src).body[0]
    assert isinstance(body, ast.ClassDef)
    docs: dict[str, str] = {}
    for node in body.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above: list[str] = []
        n = node.lineno - 1
        while n >= 1 and lines[n - 1].strip().startswith("#"):
            above.insert(0, comments[n])
            n -= 1
        end = node.end_lineno or node.lineno
        beside = [comments[i] for i in range(node.lineno, end + 1) if i in comments]
        text = " ".join(above + beside)
        if text:
            docs[node.target.id] = text
    return docs


def default_of(f: Field[Any]) -> Any:
    """A field's default value, calling its factory; MISSING when it has none."""
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING


def knob_default(cls: type, name: str) -> Any:
    """The default of config `cls`'s knob `name` (a slots dataclass has no class attribute)."""
    return default_of({f.name: f for f in fields(cls)}[name])


def knob_help(cls: type, name: str, shown: Any = MISSING) -> str:
    """argparse help for the knob `name` of config `cls`: its documentation and its default
    (`shown`, else the field's; sizes read as `1GiB`). '%' is escaped for argparse."""
    doc = field_docs(cls).get(name)
    if doc is None:
        raise KeyError(f"{cls.__name__}.{name} has no documentation comment")
    if shown is MISSING:
        shown = knob_default(cls, name)
    return f"{doc} (default: {format_default(name, shown)})".replace("%", "%%")


def format_default(name: str, value: Any) -> str:
    if value is None or value == "" or value == {}:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if name.endswith("_bytes") and isinstance(value, int) and value >= 1024:
        for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
            if value % size == 0:
                return f"{value // size}{unit}"
    return str(value)
