"""The tables of the docs' performance page (docs/performance.md), made from one
benchmark run's JSON, so that the page shows the figures of a run rather than typed ones:

    python benches/bench.py --json results.json && python benches/perf_page.py results.json

prints them. The page itself is built from benches/results/latest.json by the docs hook
docs/hooks/perf_table.py, which calls ``markdown`` below; to publish a run, copy its JSON
there (``--install`` does that after checking that it makes tables).

The tables: the machine and software the run was on, every ratio with its target and
verdict, then the figures by section (section 2 at chunk 65536 only: the other chunk
sizes are in the JSON).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # suite/, when imported by the docs hook

from suite.results import SECTIONS

LATEST = Path(__file__).resolve().parent / "results" / "latest.json"

GIB = 2**30
SUMMARY_CHUNK = "65536"  # of section 2's chunk sizes, the one the page shows


def _number(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def machine_text(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    memory = f"{m['memory_bytes'] / GIB:.1f} GiB" if m.get("memory_bytes") else "memory unknown"
    return (
        f"`python benches/bench.py` ({doc['mode']} run, median of {doc['config']['repeats']}, "
        f"{doc['runtime_s']:.0f} s), {doc.get('date', 'date unknown')}, on {m['nproc']} CPUs "
        f"({m['cpu_model']}), {memory}, Linux {m['kernel']}; Python {m['python']}, numpy "
        f"{m['numpy']}, pyarrow {m['pyarrow']}, torch {m['torch'] or 'not installed'}, "
        f"gradstream {m['gradstream']}."
    )


def _verdict(ratio: dict[str, Any]) -> str:
    if ratio["op"] == "report":
        return "reported" if ratio["measured"] is not None else "not measured"
    if ratio["met"] is None:
        return "not measured"
    return "met" if ratio["met"] else "**not met**"


def ratios_table(doc: dict[str, Any]) -> list[str]:
    lines = ["| ratio (two figures of this run) | measured | target | |", "|---|---|---|---|"]
    for r in doc["ratios"]:
        note = f" {r['note']}" if r["note"] and r["measured"] is not None else ""
        lines.append(
            f"| {r['name']}{note} | {_number(r['measured'])} | {r['target_text']} | {_verdict(r)} |"
        )
    return lines


def _shown(row: dict[str, Any]) -> bool:
    return row["section"] != "codec" or str(row["key"]).endswith(f"_{SUMMARY_CHUNK}")


def _row_line(row: dict[str, Any]) -> str:
    if row["status"] != "ok":
        return f"| {row['name']} | - | - | - | {row['status']}: {row['note']} |"
    other = ""
    if row["round_trips_per_s"] is not None:
        other = f"{row['round_trips_per_s']:,.0f} round trips/s"
    elif row["peak_over_baseline_mib"] is not None:
        other = f"{row['peak_over_baseline_mib']:,.0f} MiB"
    return (
        f"| {row['name']} | {_number(row['gbps'])} | {_number(row['wire_gbps'])} | {other} | "
        f"{row['note']} |"
    )


def figures_tables(doc: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    for section, title in SECTIONS.items():
        rows = [r for r in doc["rows"] if r["section"] == section and _shown(r)]
        rows.sort(key=lambda r: r["key"] != "memcpy")  # the reference figure first, as printed
        if not rows:
            continue
        if lines:
            lines.append("")
        lines += [
            f"**{title}**",
            "",
            "| figure | GB/s | wire GB/s | other | note |",
            "|---|---|---|---|---|",
        ]
        lines += [_row_line(r) for r in rows]
    return lines


def markdown(doc: dict[str, Any]) -> str:
    return "\n".join([machine_text(doc), "", *ratios_table(doc), "", *figures_tables(doc)]) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python benches/perf_page.py",
        description="Print the performance page's tables from benches/bench.py --json FILE.",
    )
    parser.add_argument("json", metavar="FILE", help="the JSON that bench.py --json wrote")
    parser.add_argument(
        "--install",
        action="store_true",
        help=f"also copy FILE to {LATEST.relative_to(LATEST.parents[2])}, the run the page shows",
    )
    args = parser.parse_args(argv)
    try:
        source = Path(args.json).read_text()
        text = markdown(json.loads(source))
        if args.install:
            LATEST.parent.mkdir(exist_ok=True)
            LATEST.write_text(source)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"perf_page.py: {args.json}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
