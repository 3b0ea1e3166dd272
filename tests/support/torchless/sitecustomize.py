"""Hides torch from a Python process whose ``PYTHONPATH`` holds this folder (Python
imports ``sitecustomize`` at start-up), as if it were not installed: the finder of
``sys.path`` no longer finds it, so ``import torch`` raises ``ModuleNotFoundError``,
``importlib.util.find_spec("torch")`` returns None, and ``sys.modules`` holds no entry.
tests/onray/test_receivers.py runs a Ray job so, its driver and its workers alike, to
test gradstream.ray without torch in a venv that has it (Ray 2.60 behaves otherwise
with torch: docs/guides/ray.md, "Torch")."""

from importlib.machinery import ModuleSpec, PathFinder
from typing import Any

_find_spec = PathFinder.find_spec


def _find_spec_but_torch(
    cls: type, name: str, path: Any = None, target: Any = None
) -> ModuleSpec | None:
    if name.partition(".")[0] == "torch":
        return None
    return _find_spec(name, path, target)


# A classmethod, as the original: PathFinder.find_spec stays a method bound to the class
# (pytest keeps it as a class attribute of its import hook).
PathFinder.find_spec = classmethod(_find_spec_but_torch)  # type: ignore[method-assign,assignment]
