"""Start the ranks of a backend test (tests/ontorch/backend_ranks.py) and wait for them."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

RANKS = pathlib.Path(__file__).with_name("backend_ranks.py")

# The ranks share this host: Unix sockets by default (same_host None), loopback TCP as
# ranks of other hosts meet ("tcp"); a suite runs on 2 and 3 ranks, and on 3 over TCP.
SIZES_AND_PATHS = pytest.mark.parametrize(
    "size, same_host", [(2, None), (3, None), (3, "tcp")], ids=["2-unix", "3-unix", "3-tcp"]
)


def went_as_asked(seen: list[dict[str, np.ndarray]], same_host: str | None) -> bool:
    """Every rank's ring connection went the way ``same_host`` says (its ``route``)."""
    return all(
        bytes(got["route"]).decode().startswith("unix:") == (same_host is None) for got in seen
    )


def launch(
    scenario: str,
    size: int,
    folder: pathlib.Path,
    seconds: float = 90.0,
    same_host: str | None = None,
) -> list[int]:
    """Run ``size`` ranks of ``scenario``; their exit codes. ``same_host`` is what the
    ranks give ``configure(same_host=)`` (None: the default, Unix sockets on one host)."""
    env = dict(os.environ)
    if same_host is not None:
        env["GRADSTREAM_TEST_SAME_HOST"] = same_host
    children = [
        subprocess.Popen(
            [sys.executable, str(RANKS), scenario, str(rank), str(size), str(folder)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
        )
        for rank in range(size)
    ]
    codes = []
    for child in children:
        try:
            output, _ = child.communicate(timeout=seconds)
        except subprocess.TimeoutExpired:
            for other in children:
                other.kill()
            raise
        if child.returncode not in (0, 3):
            print(output.decode(errors="replace"))
        codes.append(child.returncode)
    return codes


def arrays(folder: pathlib.Path, rank: int) -> dict[str, np.ndarray]:
    with np.load(folder / f"{rank}.npz") as got:
        return dict(got)


def outcome(folder: pathlib.Path, rank: int) -> dict[str, Any]:
    return json.loads((folder / f"{rank}.json").read_text())
