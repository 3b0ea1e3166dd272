"""MkDocs hook: the performance page's tables, made from a benchmark run's JSON.

docs/performance.md holds the marker ``<!-- perf-tables -->``; at build time this hook
replaces it with ``benches/perf_page.py``'s tables of ``benches/results/latest.json``
(written by ``benches/bench.py --json`` and put there by ``perf_page.py --install``). The
figures on the page are therefore always those of one recorded run, never typed.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

MARKER = "<!-- perf-tables -->"
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benches" / "perf_page.py"


def perf_markdown() -> str:
    spec = importlib.util.spec_from_file_location("perf_page", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text: str = module.markdown(json.loads(module.LATEST.read_text()))
    return text


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, perf_markdown())
