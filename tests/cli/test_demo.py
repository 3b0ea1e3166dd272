"""`gradstream demo` (`make demo`, python/gradstream/demo.py): the same gradient sent by
gradstream, raw TCP and pickle between two processes, each checked bit for bit, with the
times, GB/s and the ratios; run small here, as a user would run it, then its failure
report and its checks in-process.
"""

from __future__ import annotations

import re
import sys
from typing import Any

import numpy as np
import pytest

from gradstream import demo
from support.cli import assert_one_line_error, run

LABELS = [f"{name} ({how})" for _, name, how in demo.WAYS]
TIMED = re.compile(r"^(?P<label>.+?)\s+(?P<s>[0-9.]+) s\s+(?P<rate>[0-9.]+) GB/s  bit-equal$")
RATIO = re.compile(r"^gradstream/(?P<other>raw TCP|pickle): (?P<x>[0-9.]+)x the throughput$")


def test_the_demo_sends_one_gradient_three_ways_and_checks_each() -> None:
    result = run("demo", "--mib", "8", "--repeats", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("gradient: 2,097,152 float32 values (8 MiB), random normal")
    timed = [TIMED.match(line) for line in lines[1:4]]
    assert all(timed), lines
    assert [m["label"] for m in timed if m] == LABELS
    assert all(float(m["s"]) > 0 and float(m["rate"]) > 0 for m in timed if m)
    assert lines[4].startswith("gradstream's frames: 16.0 MiB on the wire")
    ratios = [RATIO.match(line) for line in lines[5:7]]
    assert [m["other"] for m in ratios if m] == ["raw TCP", "pickle"]
    # Each ratio is the other way's time over gradstream's, as printed (3 decimals).
    seconds = {m["label"]: float(m["s"]) for m in timed if m}
    ours = seconds[LABELS[0]]
    for m, label in zip(ratios, LABELS[1:], strict=True):
        assert m is not None
        assert float(m["x"]) == pytest.approx(seconds[label] / ours, rel=0.2, abs=0.02)
    assert lines[7:] == ["verified"]


def test_python_m_gradstream_demo_is_the_same_demo() -> None:
    import subprocess

    result = subprocess.run(
        [sys.executable, "-m", "gradstream.demo", "--mib", "0.25", "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.rstrip().endswith("verified")
    assert result.stdout.count("bit-equal") == 3


@pytest.mark.parametrize("args", [["--mib", "0"], ["--mib", "x"], ["--repeats", "0"]])
def test_bad_sizes_are_usage_errors(args: list[str]) -> None:
    result = run("demo", *args)
    assert result.returncode == 2
    assert_one_line_error(result.stderr, "error:")


def test_a_failed_way_fails_the_demo(monkeypatch: Any, capsys: Any) -> None:
    def fake(way: str, values: np.ndarray, expected: Any, repeats: int) -> Any:
        if way == "pickle":
            return demo._Result([0.5], ["differs: float64[3] arrived, not float32[3]"])
        return demo._Result([0.1] * repeats, ["bit-equal"] * repeats)

    monkeypatch.setattr(demo, "_run_way", fake)
    monkeypatch.setattr(demo, "_wire_note", lambda elements: "wire")
    assert demo.run(mib=0.001, repeats=2) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "VERIFICATION FAILED"
    assert any(line.endswith("FAILED: differs: float64[3] arrived, not float32[3]") for line in out)
    assert "gradstream/raw TCP: 1.00x the throughput" in out
    assert not any(line.startswith("gradstream/pickle") for line in out)


def test_bit_equal_tells_every_bit() -> None:
    a = np.array([0.0, 1.0, np.nan], np.float32)
    assert demo.bit_equal(a.copy(), a)
    assert not demo.bit_equal(np.array([-0.0, 1.0, np.nan], np.float32), a)
    nan2 = a.copy()
    nan2.view(np.uint32)[2] ^= 1  # another NaN payload
    assert not demo.bit_equal(nan2, a)
    assert not demo.bit_equal(a.astype(np.float64), a)
    assert not demo.bit_equal(a[:2], a)
