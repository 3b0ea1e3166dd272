"""The peer comparison benchmark: gradstream against the machine's limits and its peers.

    python benches/bench.py [--quick] [--json FILE]      (make bench BENCH_ARGS=...)

One command, one process tree: this process measures what runs in memory (memcpy, CRC,
encode/decode) itself and forks pairs of child processes for everything that crosses a
socket (always TCP on 127.0.0.1; every child is killed if it fails, stalls or outlives
its deadline, and dies with this process). Every figure is the median of several repeats
(--quick: 3, full: 5), and every comparison is a ratio of two figures measured in this
same run: the machines are shared and noisy, so absolute numbers move between runs while
ratios within one run hold. To make them hold better still, figures that are compared are
measured in rounds, one repeat of each in turn (A B C A B C ...), rather than one after
the other (A A A B B B ...), so that a slow stretch of the machine hits all of them alike:
the encode/decode rows of one layout and chunk size (native, reference, and a memcpy), and
all the rows that cross a socket (raw TCP, every end-to-end peer; then the ping-pongs),
whose process pairs stay alive, idle, between their turns. No BLAS is involved anywhere,
so OPENBLAS_NUM_THREADS and the like make no difference.

Rates are GB/s (10^9 bytes) of gradient bytes (4 bytes per float32 value) unless a column
says "wire" (bytes on the socket: the seed layout puts ~8 bytes per value on the wire, the
compact layout ~4).

Sections:

1. the machine's limits: numpy memcpy (np.copyto into a reused, pre-faulted buffer; a
   copy into a new array, page faults included, is shown too), crc32fast (through
   GradientChunk.compute_checksum on bytes) and zlib.crc32, and raw loopback TCP between
   two processes (one sendall of the whole gradient, recv_into a pre-faulted buffer of the
   same size; the same buffer filled by 1 MiB recv_into calls, the compact socket path's
   baseline; shown too: into a new array each time, and the same byte count through 1 MiB
   buffers that stay in the caches, the kernel's ceiling);
2. encode_frames / decode_frames in memory at chunk sizes 4096, 65536 and 1,048,576, native
   and reference, seed and compact layouts where the build has them (the reference on the
   same number of values: it is fast enough, and rates over different sizes would not
   compare, page faults and caches differ);
3. end to end over loopback between two processes: the native socket path (into out=, and
   the default receive_from into a new array), the native asyncio-streams path
   (asyncio.open_connection on the default loop, and under uvloop when it is installed),
   the reference over the socket and over the same streams, and what a user would pick
   instead: pickle over a raw socket (in-band, and protocol 5 with out-of-band buffers)
   and torch.distributed gloo send/recv (skipped when torch is not installed; it is never
   a dependency). Every peer receives into buffers reused from turn to turn where it
   allows that; a row's note says where a peer is handicapped;
4. small gradients: round trips per second of a 1,000-value gradient (A sends, B receives
   and sends it back), native, reference, and a raw-socket ping-pong of the same number
   of bytes as the native frames; and through a native connection (hello, seal, ack)
   against a raw ping-pong of its sealed frames' bytes, each message answered by a
   56-byte ack as an accepted transfer is; A times windows of a fixed duration;
5. peak RSS over baseline of the native socket path, sending and receiving (fresh
   processes per repeat, ru_maxrss minus VmRSS before the transfer, as in
   benches/stream_memory.py);
6. gs.Connection against the bare socket path: benches/connections.py's measurement
   (bare, plain, authkey and TLS connections in interleaved rounds, compact layout, the
   end-to-end size), run from here so that one command prints every ratio;
7. the transfer drivers (docs/performance.md): each optional way onto a socket against
   the path that serves its case without it, in the same rounds as the rows of sections
   3 and 4 (the caller-thread driver of the socket path and of connections against
   tokio alone, in small-gradient round trips; the asyncio handover against the generic
   asyncio path, in round trips and end to end). A driver is kept while it is >= 1.1 x
   that path. `--drivers` runs these rows alone.

After the table come the ratios, each with its target and "met" / "NOT MET" (or
"reported": a figure the issue asks to see beside the targets); --json FILE holds every
row, ratio and the machine, and benches/perf_page.py makes the tables of docs/performance.md from
it.

How an end-to-end transfer is timed (sections 1 and 3): sender and receiver stay connected
for all the repeats of a row. When its turn comes, the receiver, its event loop running
and ready to receive, sends one "go" byte to the sender on the same connection (for gloo:
both leave a barrier). The sender reads CLOCK_MONOTONIC as soon as it has the go byte (t0)
and starts encoding and sending; the receiver reads CLOCK_MONOTONIC when it holds the
whole array (t1). CLOCK_MONOTONIC is one system-wide clock on Linux, so t1 - t0 is measured
across the two processes: it spans the sender's first byte to the receiver's last,
including encoding, the socket, decoding and allocation of the result, and excludes
process start, the connection set-up and the bit-for-bit verification that follows every
transfer. All connections have TCP_NODELAY set (it matters for the ping-pong; the raw rows
get it too).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from .config import Config, layout_support, make_config, make_gradient
from .connection_rows import bench_connections
from .inmemory import Memcpy, bench_codec, bench_limits
from .machine import machine, print_machine
from .ratios import (
    DRIVER_ROWS,
    P2P_ROWS,
    compute_ratios,
    driver_ratios,
    p2p_ratios,
    print_ratios,
)
from .results import Results
from .rss import bench_rss
from .small import bench_small
from .transfers import bench_transfers, plan_transfers

__all__ = ["add_arguments", "main", "run"]

PROG = "python benches/bench.py"
DESCRIPTION = (
    "Measure gradstream against the machine's limits and its peers, in one process tree on "
    "127.0.0.1: a table of medians, then the ratios it checks, each of two figures of the "
    "same run: native encode/decode against memcpy and against the reference, the end-to-end "
    "socket path against raw loopback TCP and torch.distributed gloo, the asyncio-streams "
    "path against the reference, small-gradient round trips against a raw ping-pong and the "
    "reference, and peak RSS against the gradient's size."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smaller gradients and 3 repeats (a few minutes) instead of 5",
    )
    parser.add_argument(
        "--json", metavar="FILE", default=None, help="also write every row and ratio to FILE"
    )
    parser.add_argument(
        "--drivers",
        action="store_true",
        help="only section 7: each transfer driver against the path without it",
    )
    parser.add_argument(
        "--p2p",
        action="store_true",
        help="only the point-to-point rows: socket path, connection, gloo, raw TCP",
    )
    # For the test suite: sizes small enough for seconds.
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--elements", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=None, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    """The benchmark; 0 when every row ran or was skipped, 1 when one failed."""
    if args.elements is not None and args.elements < 1:
        print(f"{PROG}: error: --elements must be >= 1", file=sys.stderr)
        return 2
    if args.repeats is not None and args.repeats < 1:
        print(f"{PROG}: error: --repeats must be >= 1", file=sys.stderr)
        return 2
    started = time.perf_counter()
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    cfg = make_config(args.quick, args.tiny, args.elements, args.repeats)
    info = machine()
    print_machine(info)
    print(cfg.describe(), flush=True)
    available = {impl: layout_support(impl) for impl in ("native", "reference")}
    for impl, why in available.items():
        if why is not None:
            print(f"note: compact-layout rows of {impl} are skipped: {why}", flush=True)
    print("measuring (each row on stderr as it completes) ...", flush=True)

    res = Results()
    if args.drivers:
        return _run_subset(args, cfg, res, available, started, "--drivers")
    if args.p2p:
        return _run_subset(args, cfg, res, available, started, "--p2p")
    memcpy = Memcpy(cfg.limit_bytes)
    bench_limits(cfg, res, memcpy)
    grad = make_gradient(max(cfg.e2e_elements, cfg.codec_elements))
    bench_codec(cfg, res, grad[: cfg.codec_elements], available, memcpy)
    res.add(memcpy.row())
    del memcpy
    gc.collect()
    grad = grad[: cfg.e2e_elements]
    plans = plan_transfers(cfg, grad, available)
    bench_transfers(cfg, res, plans, grad)
    del grad, plans
    gc.collect()
    bench_small(cfg, res)
    bench_connections(cfg, res)
    bench_rss(cfg, res)

    res.print_table()
    ratios = compute_ratios(res, cfg)
    print_ratios(ratios)
    runtime = time.perf_counter() - started
    failed = [r.key for r in res.rows.values() if r.status == "failed"]
    print(
        f"\ntotal run time {runtime:.1f} s"
        + (f"; FAILED rows: {', '.join(failed)}" if failed else "")
    )
    if args.json:
        doc = {
            "benchmark": "benches/bench.py",
            "mode": cfg.mode,
            "date": date,
            "config": asdict(cfg),
            "machine": info,
            "layouts": {impl: why or "available" for impl, why in available.items()},
            "rows": [asdict(r) for r in res.rows.values()],
            "ratios": [asdict(r) for r in ratios],
            "runtime_s": runtime,
        }
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}", flush=True)
    return 1 if failed else 0


def _run_subset(
    args: argparse.Namespace,
    cfg: Config,
    res: Results,
    available: dict[str, str | None],
    started: float,
    flag: str,
) -> int:
    """Some rows alone, in rounds: section 7 (--drivers: each driver and the path without
    it) or the point-to-point rows (--p2p)."""
    rows, ratios_of = (
        (DRIVER_ROWS, driver_ratios) if flag == "--drivers" else (P2P_ROWS, p2p_ratios)
    )
    grad = make_gradient(cfg.e2e_elements)
    plans = [p for p in plan_transfers(cfg, grad, available) if p.key in rows]
    bench_transfers(cfg, res, plans, grad)
    del grad, plans
    gc.collect()
    if flag == "--drivers":
        bench_small(cfg, res, only=DRIVER_ROWS)
    res.print_table()
    ratios = ratios_of(res)
    print_ratios(ratios)
    runtime = time.perf_counter() - started
    print(f"\ntotal run time {runtime:.1f} s")
    if args.json:
        doc = {
            "benchmark": f"benches/bench.py {flag}",
            "mode": cfg.mode,
            "config": asdict(cfg),
            "machine": machine(),
            "rows": [asdict(r) for r in res.rows.values()],
            "ratios": [asdict(r) for r in ratios],
            "runtime_s": runtime,
        }
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    failed = [r.key for r in res.rows.values() if r.status == "failed"]
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=DESCRIPTION,
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except KeyboardInterrupt:
        return 130
