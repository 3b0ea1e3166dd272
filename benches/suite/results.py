"""Rows and ratios, and the table they are printed as."""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field


@dataclass
class Row:
    key: str
    section: str
    name: str
    status: str = "ok"  # "ok", "skipped" or "failed"
    note: str = ""
    seconds: float | None = None  # median seconds of one operation
    samples: list[float] = field(default_factory=list)
    elements: int | None = None
    gradient_bytes: int | None = None
    wire_bytes: int | None = None
    gbps: float | None = None  # gradient bytes
    wire_gbps: float | None = None
    ns_per_element: float | None = None
    round_trips_per_s: float | None = None
    peak_over_baseline_mib: float | None = None


@dataclass
class Ratio:
    name: str
    numerator: str  # row keys
    denominator: str | None
    measured: float | None
    op: str  # ">=", "<=", or "report": a figure shown beside the others, with no target
    target: float | None  # None for "report"
    target_text: str
    met: bool | None  # None: not measured, or reported only
    note: str = ""

    @property
    def verdict(self) -> str:
        if self.op == "report":
            return "reported" if self.measured is not None else "not measured"
        return "not measured" if self.met is None else ("met" if self.met else "NOT MET")


SECTIONS = {
    "limits": "1. machine limits",
    "codec": "2. encode_frames / decode_frames in memory",
    "e2e": "3. end to end over loopback TCP, two processes",
    "small": "4. small gradients: round trips of a 1,000-value gradient",
    "rss": "5. peak RSS over baseline, native socket path",
    "connections": "6. gs.Connection against the bare socket path (benches/connections.py)",
}
NAME_WIDTH = 76


def _fmt(value: float | None, spec: str) -> str:
    width = spec.split(".")[0]
    return format("-", f">{width}") if value is None else format(value, spec)


def _table_header() -> str:
    return (
        f"  {'':{NAME_WIDTH}} {'GB/s':>7} {'wire GB/s':>9} {'ns/value':>9} "
        f"{'other':>15} {'median':>10}"
    )


def _format_row(row: Row) -> str:
    if row.status != "ok":
        return f"  {row.name:{NAME_WIDTH}} {row.status}: {row.note}"
    other = ""
    if row.round_trips_per_s is not None:
        other = f"{row.round_trips_per_s:,.0f} rt/s"
    elif row.peak_over_baseline_mib is not None:
        other = f"{row.peak_over_baseline_mib:,.0f} MiB"
    median = "-" if row.seconds is None else f"{row.seconds * 1e3:,.1f} ms"
    line = (
        f"  {row.name:{NAME_WIDTH}} {_fmt(row.gbps, '7.2f')} {_fmt(row.wire_gbps, '9.2f')} "
        f"{_fmt(row.ns_per_element, '9.3f')} {other:>15} {median:>10}"
    )
    return f"{line}  {row.note}" if row.note else line


class Results:
    """The rows, by key. Each is reported on stderr as it is measured; the table (stdout)
    comes at the end, in section order."""

    def __init__(self) -> None:
        self.rows: dict[str, Row] = {}
        self.started = time.perf_counter()

    def add(self, row: Row) -> Row:
        self.rows[row.key] = row
        elapsed = time.perf_counter() - self.started
        print(f"[{elapsed:6.1f} s] {_format_row(row).strip()}", file=sys.stderr, flush=True)
        return row

    def ok(self, key: str) -> Row | None:
        row = self.rows.get(key)
        return row if row is not None and row.status == "ok" else None

    def print_table(self) -> None:
        for section, title in SECTIONS.items():
            rows = [r for r in self.rows.values() if r.section == section]
            rows.sort(key=lambda r: r.key != "memcpy")  # the reference figure first
            if rows:
                print(f"\n{title}")
                print(_table_header())
                for row in rows:
                    print(_format_row(row))
        sys.stdout.flush()


def timed_row(
    key: str,
    section: str,
    name: str,
    samples: list[float],
    *,
    elements: int | None = None,
    gradient_bytes: int | None = None,
    wire_bytes: int | None = None,
    note: str = "",
) -> Row:
    seconds = statistics.median(samples)
    row = Row(key, section, name, note=note, seconds=seconds, samples=samples)
    row.elements, row.gradient_bytes, row.wire_bytes = elements, gradient_bytes, wire_bytes
    if seconds > 0:
        if gradient_bytes is not None:
            row.gbps = gradient_bytes / seconds / 1e9
        if wire_bytes is not None:
            row.wire_gbps = wire_bytes / seconds / 1e9
        if elements:
            row.ns_per_element = seconds / elements * 1e9
    return row
