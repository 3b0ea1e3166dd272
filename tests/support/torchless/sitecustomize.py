"""Hides torch from a Python process whose ``PYTHONPATH`` holds this folder (Python
imports ``sitecustomize`` at start-up): ``import torch`` then raises
``ModuleNotFoundError`` and ``importlib.util.find_spec("torch")`` returns None, as
when torch is not installed. tests/onray/test_receivers.py runs a Ray job so, its
driver and its workers alike, to test gradstream.ray without torch in a venv that has
it (Ray 2.60 behaves otherwise with torch: docs/guides/ray.md, "Torch")."""

import sys

sys.modules["torch"] = None  # type: ignore[assignment]
