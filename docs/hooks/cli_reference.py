"""MkDocs hook: the command-line reference, made from the argparse parser itself.

docs/reference/cli.md holds the marker ``<!-- cli-reference -->``; at build time this
hook replaces it with every subcommand's usage, description, flags (with their choices,
defaults and help) and epilog, read from ``gradstream.cli.build_parser()``. A flag added,
removed or reworded in the code is therefore on the page after the next build, and never
typed twice. tests/docs/test_cli_reference.py checks that every option string of every
subcommand appears in the rendered text.
"""

from __future__ import annotations

import argparse
import html
from typing import Any

MARKER = "<!-- cli-reference -->"


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _cell(text: str) -> str:
    """Text for one cell of a markdown table: no pipes, no newlines, no raw HTML."""
    return html.escape(" ".join(text.split()), quote=False).replace("|", "\\|")


def _flag(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`"
    names = ", ".join(f"`{name}`" for name in action.option_strings)
    if action.nargs == 0:
        return names
    if action.choices is not None:
        return f"{names} `{{{','.join(str(c) for c in action.choices)}}}`"
    return f"{names} `{action.metavar or action.dest.upper()}`"


def _default(action: argparse.Action) -> str:
    if action.required and action.option_strings:
        return "required"
    if action.nargs == 0 or action.default in (None, argparse.SUPPRESS, False):
        return ""
    return f"`{action.default}`"


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if action.help is None or action.help == argparse.SUPPRESS:
        return ""
    text = action.help
    if "%(" in text:
        text = parser._get_formatter()._expand_help(action)
    return _cell(text)


def _prose(text: str | None) -> list[str]:
    """A description or epilog: its paragraphs as text, its indented lines (examples)
    as a console block."""
    if not text:
        return []
    out: list[str] = []
    code: list[str] = []
    for line in text.splitlines():
        if line.startswith("  "):
            code.append(line.strip())
            continue
        if code:
            out += ["```console", *code, "```", ""]
            code = []
        if line.strip():
            out += [html.escape(line.strip(), quote=False), ""]
    if code:
        out += ["```console", *code, "```", ""]
    return out


def command_markdown(name: str, parser: argparse.ArgumentParser) -> list[str]:
    usage = " ".join(parser.format_usage().split())
    assert usage.startswith("usage: ")
    lines = [f"## `{parser.prog}`", "", "```text", usage[len("usage: ") :], "```", ""]
    lines += _prose(parser.description)
    actions = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    rows = ["| argument | default | what it does |", "|---|---|---|"]
    rows += [f"| {_flag(a)} | {_default(a)} | {_help(parser, a)} |" for a in actions]
    lines += ["`-h`, `--help` prints this help and exits.", "", *rows, ""]
    lines += _prose(parser.epilog)
    return lines


def cli_markdown() -> str:
    from gradstream.cli import build_parser

    parser = build_parser()
    lines = ["## `gradstream`", "", "```text", " ".join(parser.format_usage().split())[7:]]
    lines += ["```", "", *_prose(parser.description), *_prose(parser.epilog)]
    for name, sub in _subparsers(parser).items():
        lines += command_markdown(name, sub)
    return "\n".join(lines) + "\n"


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, cli_markdown())
