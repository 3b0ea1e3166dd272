"""The reference pages hold everything they promise: every flag of every command (the
docs hook that writes docs/reference/cli.md from the argparse parser), and every error
class of gradstream.errors with its fields (docs/reference/errors.md's table)."""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import re
from pathlib import Path
from types import ModuleType

import gradstream.errors
from gradstream.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]


def _hook(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "docs" / "hooks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def test_the_cli_page_lists_every_flag_of_every_command_with_its_help() -> None:
    page = (ROOT / "docs" / "reference" / "cli.md").read_text()
    assert page.count("<!-- cli-reference -->") == 1
    text = _hook("cli_reference").cli_markdown()
    commands = _commands()
    assert {"recv", "send", "demo"} <= set(commands)
    for name, parser in commands.items():
        section = text[text.index(f"## `gradstream {name}`") :]
        section = section[: section.index("\n## ", 1) if "\n## " in section[1:] else None]
        for action in parser._actions:
            for option in action.option_strings:
                assert f"`{option}`" in section, (name, option)
            if action.help and not isinstance(action, argparse._HelpAction):
                first_words = " ".join(action.help.split()[:4])
                assert first_words in " ".join(section.split()), (name, action.dest)
            if action.choices is not None:
                assert "{" + ",".join(map(str, action.choices)) + "}" in section, action.dest


def test_the_errors_page_lists_every_error_class_with_its_fields() -> None:
    page = (ROOT / "docs" / "reference" / "errors.md").read_text()
    rows = {
        m[1]: [f.strip(" `") for f in m[3].split(",") if f.strip()]
        for m in re.finditer(r"^\| `(\w+)` \|([^|]*)\|([^|]*)\|", page, re.M)
    }
    assert set(rows) == set(gradstream.errors.__all__)
    for name in gradstream.errors.__all__:
        cls = getattr(gradstream.errors, name)
        fields = {
            field
            for klass in cls.__mro__
            if klass.__module__ == "gradstream.errors"
            for field in inspect.get_annotations(klass)
        }
        if issubclass(cls, OSError) and not fields:
            fields = {"errno", "strerror"}  # OSError's own
        shown = {f.split(" ")[0].strip("`") for f in rows[name]}
        assert shown == fields, name
        assert name in dir(gradstream), name
