"""benches/wan.py (the long-path rows of ``make bench``) at a tiny size: it runs the
relay, the receiver and the sender in three processes, prints each row (three streams
and three raw flows among them) and the ratios,
and the bytes the relay carried are what the payloads make them (the int8 wire's a
quarter of float32's, plus a block's scale and offset: a size, never a time, is
asserted)."""

from __future__ import annotations

import re
import subprocess
import sys

from support import ROOT


def test_the_wan_benchmark_runs_and_prints_every_row() -> None:
    script = ROOT / "benches" / "wan.py"
    done = subprocess.run(
        [sys.executable, str(script), "--mib", "8", "--rtt", "0.005", "--streams", "3"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    row = (
        r"^(raw TCP|raw, 3 flows|float32|int8 wire|3 streams|reset at 50 %)"
        r"\s+([0-9.]+)\s+([0-9]+)\s+([0-9]+)$"
    )
    rows = {name: (float(s), int(mb)) for name, s, _, mb in re.findall(row, done.stdout, re.M)}
    assert set(rows) == {
        "raw TCP",
        "raw, 3 flows",
        "float32",
        "int8 wire",
        "3 streams",
        "reset at 50 %",
    }
    # Every byte went through the relay, on one flow or three; striping adds no bytes.
    assert rows["raw TCP"][1] == rows["raw, 3 flows"][1] == 8 * 2**20 // 10**6
    assert rows["3 streams"][1] == rows["float32"][1], done.stdout
    bytes_ratio = re.search(r"wire bytes ([0-9.]+) \(target <= 0.26\)", done.stdout)
    assert bytes_ratio is not None, done.stdout
    assert 0.25 <= float(bytes_ratio.group(1)) <= 0.26
    assert re.search(r"int8 wire / float32: time [0-9.]+ \(target <= 0.35\)", done.stdout)
    assert re.search(r"float32 / raw TCP, time: [0-9.]+$", done.stdout, re.M)
    ratios = r"3 streams / one stream, speed: [0-9.]+ .* / raw TCP with 3 flows, speed: [0-9.]+"
    assert re.search(ratios, done.stdout), done.stdout
    # The reset row: the gradient came whole after a resume, some chunks sent again (at
    # this size and window every chunk may be in flight at the reset, so at most all).
    reset = re.search(
        r"reset at 50 % \(3 streams\): bit for bit (yes|NO), resumes ([0-9]+), chunks sent "
        r"again ([0-9]+) of ([0-9]+)",
        done.stdout,
    )
    assert reset is not None, done.stdout
    assert reset.group(1) == "yes" and int(reset.group(2)) >= 1, done.stdout
    assert 0 < int(reset.group(3)) <= int(reset.group(4)), done.stdout


def test_a_bad_size_is_a_usage_error_and_a_failing_child_ends_the_run() -> None:
    """A refused --mib is a usage error before any child starts; a relay that cannot
    start (a window of 0) ends the run with an error, its receiver gone with it (an
    error once left a child waiting on its pipe for ever)."""
    script = ROOT / "benches" / "wan.py"
    run = [sys.executable, str(script), "--mib", "1"]
    done = subprocess.run([*run[:-1], "0"], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2, done.stderr
    assert "--mib must be >= 1, got 0" in done.stderr
    done = subprocess.run(
        [*run, "--window", "0"], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode != 0
    assert "window >= 1" in done.stderr, done.stderr
