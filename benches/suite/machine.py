"""What the figures were measured on."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import platform
from pathlib import Path
from typing import Any

import numpy as np

from .config import GIB


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _mem_total() -> int | None:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return None


def _version(module: str) -> str | None:
    if importlib.util.find_spec(module) is None:
        return None
    try:
        return str(importlib.import_module(module).__version__)
    except Exception as exc:
        return f"unimportable ({type(exc).__name__})"


def machine() -> dict[str, Any]:
    from gradstream import __version__

    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "nproc": affinity or os.cpu_count(),
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "memory_bytes": _mem_total(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "pyarrow": _version("pyarrow"),
        "torch": _version("torch"),
        "gradstream": __version__,
    }


def print_machine(info: dict[str, Any]) -> None:
    mem = info["memory_bytes"]
    print(
        f"machine: {info['nproc']} CPUs ({info['cpu_model']}), "
        f"{mem / GIB:.1f} GiB memory, Linux {info['kernel']}"
        if mem
        else "machine: ?"
    )
    print(
        f"software: Python {info['python']}, numpy {info['numpy']}, pyarrow {info['pyarrow']}, "
        f"gradstream {info['gradstream']}, torch {info['torch'] or 'not installed'}",
        flush=True,
    )
