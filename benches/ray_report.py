"""The report of ``ray_bench``: the machine and software a run was on, each ratio of two
of its rows beside its target, and the printed text."""

from __future__ import annotations

import contextlib
import os
import platform
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np

# Issue 13: >= 1.5 x Ray's object store across nodes (the parameter server in every round).
TARGET = 1.5
# Issue 24: one node, through the maker's Unix socket, against the object store's
# zero-copy get (one memcpy in all).
ONE_NODE_TARGET = 0.5


def machine() -> dict[str, Any]:
    """The machine and software the run is on, and its load at the start."""
    import ray

    import gradstream

    try:
        import torch

        torch_version: str | None = torch.__version__
    except ImportError:
        torch_version = None
    mem = None
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "memory_bytes": mem,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "ray": ray.__version__,
        "torch": torch_version,
        "gradstream": gradstream.__version__,
        "loadavg_start": os.getloadavg(),
    }


def ratios(rows: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each ratio of two rows of this run beside its target, and its verdict."""
    wanted = [
        (
            "across nodes, 256 MiB actor to actor: object-store time / GRADSTREAM time",
            "cross.transfer.os",
            "cross.transfer.gs",
            TARGET,
        ),
        (
            "across nodes, parameter-server step: object-store server time / gradstream's, "
            "the lowest of the rounds (each round: the two servers' steps back to back)",
            "cross.ps.os",
            "cross.ps.gs",
            TARGET,
        ),
        (
            "across nodes, 256 MiB actor to actor: gloo time / GRADSTREAM time",
            "cross.transfer.gloo",
            "cross.transfer.gs",
            None,
        ),
        (
            "one node, 256 MiB actor to actor: object-store time / GRADSTREAM time",
            "one.transfer.os",
            "one.transfer.gs",
            ONE_NODE_TARGET,
        ),
        # What limits the row above: the object store hands back a view of memory it
        # keeps; a receiver that hands back a new array pays at least numpy's copy into
        # one, its pages faulted in. Both shown, no target.
        (
            "one node: object-store transfer time / a numpy copy into a new array in the "
            "receiving actor (the best any receiver of a new array can reach)",
            "one.transfer.os",
            "one.transfer.copy",
            None,
        ),
        (
            "one node: a numpy copy into a new array / GRADSTREAM time (how close to that "
            "floor GRADSTREAM comes)",
            "one.transfer.copy",
            "one.transfer.gs",
            None,
        ),
    ]
    ratios = []
    for name, num, den, target in wanted:
        if num not in rows and den not in rows:
            continue
        measured = None
        if num in rows and den in rows:
            measured = rows[num]["seconds"] / rows[den]["seconds"]
            if ".ps." in num:
                # Held in every round, not in the median: the rounds' ratios, lowest.
                pairs = zip(rows[num]["samples"], rows[den]["samples"], strict=True)
                measured = min(theirs / ours for theirs, ours in pairs)
        verdict = (
            "not measured"
            if measured is None
            else "reported"
            if target is None
            else "met"
            if measured >= target
            else "NOT MET"
        )
        ratios.append(
            {
                "name": name,
                "measured": measured,
                "target": target,
                "verdict": verdict,
            }
        )
    return ratios


def print_result(result: dict[str, Any], elapsed: float, quick: bool, per_step: str) -> None:
    """The run's report; ``per_step``: what a parameter-server step moves."""
    m = result["machine"]
    print()
    print(
        f"benches/ray_bench.py ({'--quick' if quick else 'full run'}, {elapsed:.0f} s), "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, on {m['nproc']} CPUs, "
        f"{(m['memory_bytes'] or 0) / (1 << 30):.1f} GiB, Linux {m['kernel']}; "
        f"Python {m['python']}, numpy {m['numpy']}, Ray {m['ray']}, "
        f"torch {m['torch'] or 'not installed'}, gradstream {m['gradstream']}; "
        f"load average {m['loadavg_start'][0]:.1f} at the start, "
        f"{m['loadavg_end'][0]:.1f} at the end."
    )
    print(
        "GB/s: the gradient's bytes per second, 1 GB = 1e9 bytes (a parameter-server step: "
        f"{per_step})."
    )
    print()
    print(f"{'seconds':>8} {'GB/s':>6}  row")
    wrap = textwrap.TextWrapper(width=100, initial_indent=" " * 17, subsequent_indent=" " * 17)
    for row in result["rows"]:
        samples = ", ".join(f"{s:.3f}" for s in row["samples"])
        print(f"{row['seconds']:>8.3f} {row['gbps']:>6.2f}  {row['name']}")
        detail = f"{row['how']} of {len(row['samples'])} ({samples} s)"
        print(wrap.fill(detail + (f"; {row['note']}" if row["note"] else "")))
    print()
    print(f"{'measured':>8}  {'target':<8} {'verdict':<12} ratio (two figures of this run)")
    for ratio in result["ratios"]:
        measured = "-" if ratio["measured"] is None else f"{ratio['measured']:.2f}"
        target = "reported" if ratio["target"] is None else f">= {ratio['target']:g}"
        print(f"{measured:>8}  {target:<8} {ratio['verdict']:<12} {ratio['name']}")
    print()
    for note in result["notes"]:
        print(textwrap.fill(f"note: {note}", width=100, subsequent_indent="  "))
