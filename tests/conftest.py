"""Shared fixtures: every semantic test runs against both implementations."""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest


def load_impl(name: str) -> ModuleType:
    """An implementation by name: "reference" is the pure-Python gradstream.reference;
    "native" is the package top level, which re-exports the Rust classes, and is skipped
    until the extension is built."""
    if name == "reference":
        return importlib.import_module("gradstream.reference")
    try:
        importlib.import_module("gradstream._native")
    except ImportError as exc:
        pytest.skip(f"native extension not built: {exc}")
    return importlib.import_module("gradstream")


@pytest.fixture(params=["reference", "native"])
def impl(request: pytest.FixtureRequest) -> ModuleType:
    """The module whose GradientStreamSession / GradientChunk are under test."""
    return load_impl(request.param)
