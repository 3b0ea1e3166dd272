"""benches/connections.py (the connection rows of ``make bench``) at a tiny size: it runs
its five contestants in two processes, each moves the gradient, and it prints a rate for
each (and the CPU time each side spent) and the three target ratios (which a tiny, noisy
run may miss: the exit status is 0 or 1, never a crash)."""

from __future__ import annotations

import re
import subprocess
import sys

from support import ROOT


def test_the_connection_benchmark_runs_and_prints_every_row() -> None:
    script = ROOT / "benches" / "connections.py"
    done = subprocess.run(
        [sys.executable, str(script), "--elements", "200000", "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode in (0, 1), done.stderr
    cpu = r"CPU s per GiB: receiver [0-9.]+, sender [0-9.]+"
    row = rf"^\s+(raw|bare|plain|authkey|tls)\s+([0-9.]+) GB/s   {cpu}$"
    rates = dict(re.findall(row, done.stdout, re.M))
    assert set(rates) == {"raw", "bare", "plain", "authkey", "tls"}, done.stdout
    assert all(float(rate) > 0 for rate in rates.values())
    assert re.search(r"bare / raw = [0-9.]+ \(target >= 0.9\)", done.stdout)
    assert re.search(r"plain / bare = [0-9.]+ \(target >= 0.95\)", done.stdout)
    assert re.search(r"tls / plain = [0-9.]+ \(target >= 0.6\)", done.stdout)
