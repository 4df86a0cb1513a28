"""Every flag of both command lines says what it does and its default (the help comes from the
config dataclasses' documented fields, storage_backends.knobs)."""

from __future__ import annotations

import argparse

from tierkv.cacheserver.cli import build_parser as server_parser
from tierkv.cacheserver.cli import client_parser
from tierkv.engine.cli import build_parser as engine_parser


def walk(p: argparse.ArgumentParser, path: str) -> list[tuple[str, argparse.Action]]:
    out = []
    for a in p._actions:  # argparse keeps no public list of a parser's actions
        if isinstance(a, argparse._SubParsersAction):
            for name, sub in a.choices.items():
                out += walk(sub, f"{path} {name}")
        elif not isinstance(a, argparse._HelpAction):
            out.append((path, a))
    return out


def parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    return [
        ("tierkv-engine", engine_parser()),
        ("tierkv-server", server_parser()),
        ("tierkv-server stats", client_parser("stats", "")),
        ("tierkv-server health", client_parser("health", "")),
    ]


def test_every_flag_has_help_with_a_default() -> None:
    actions = [x for name, p in parsers() for x in walk(p, name)]
    flags = [(path, a) for path, a in actions if a.option_strings]
    assert len(flags) > 80  # both CLIs, every subcommand
    missing = [
        f"{path} {a.option_strings[0]}"
        for path, a in flags
        if not a.help
        or len(a.help) < 25
        or ("(required)" not in a.help if a.required else "(default: " not in a.help)
    ]
    assert not missing, missing
    for path, a in actions:  # positionals say what they are
        assert a.help, (path, a.dest)


def test_server_flags_are_its_knobs() -> None:
    """One flag per knob of ServerConfig, its environment variable named in its help."""
    from tierkv.cacheserver.config import knobs

    helps = {a.dest: a.help for _, a in walk(server_parser(), "") if a.option_strings}
    for k in knobs():
        assert f"env TIERKV_{k.name.upper()}" in helps[k.name], k.name


def test_help_renders() -> None:
    for _, p in parsers():
        text = p.format_help()
        assert "(default: " in text or p._subparsers is not None
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for sub in a.choices.values():
                    assert "(default: " in sub.format_help()


def test_the_server_docs_table_is_the_knobs() -> None:
    """docs/server.md's table of knobs is made from the same documentation as --help."""
    from pathlib import Path

    from tierkv.cacheserver.config import knobs_markdown

    text = (Path(__file__).resolve().parent.parent / "docs" / "server.md").read_text()
    table = text.split("knobs_markdown() -->\n", 1)[1].split("\n<!-- /knobs -->", 1)[0]
    assert table == knobs_markdown(), "regenerate it with knobs_markdown()"
