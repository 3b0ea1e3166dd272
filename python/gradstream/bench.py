"""`gradstream bench`: the throughput benchmark (issue 4), native against its limits and peers.

    gradstream bench [--quick] [--json FILE]
    python benches/bench.py [same options]
    python -m gradstream bench [same options]

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
   same size: the figure the targets use; shown too: into a new array each time, and the
   same byte count through 1 MiB buffers that stay in the caches, the kernel's ceiling);
2. encode_frames / decode_frames in memory at chunk sizes 4096, 65536 and 1,048,576, native
   and reference, seed and compact layouts where the build has them (the reference on the
   same number of values: it is fast enough, and rates over different sizes would not
   compare, page faults and caches differ);
3. end to end over loopback between two processes: the native socket path, the native
   asyncio-streams path, the reference, and what a user would pick instead: pickle over a
   raw socket (in-band, and protocol 5 with out-of-band buffers) and torch.distributed gloo
   send/recv (skipped when torch is not installed; it is never a dependency);
4. small gradients: round trips per second of a 1,000-value gradient (A sends, B receives
   and sends it back), native, reference, and a raw-socket ping-pong of the same number
   of bytes as the native frames; A times windows of a fixed duration;
5. peak RSS over baseline of the native socket path, sending and receiving (fresh
   processes per repeat, ru_maxrss minus VmRSS before the transfer, as in
   benches/stream_memory.py).

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
import asyncio
import contextlib
import ctypes
import datetime
import gc
import importlib
import importlib.util
import json
import multiprocessing as mp
import os
import pickle
import platform
import queue
import resource
import signal
import socket
import statistics
import struct
import sys
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["add_arguments", "main", "run"]

F32 = npt.NDArray[np.float32]

MIB = 2**20
GIB = 2**30
CHUNK_SIZES = (4096, 65536, 1_048_576)
LAYOUTS = ("seed", "compact")
SEED = 4
# Gradients are a random block of this many values repeated (random values for 1 GiB take
# seconds to draw); the odd length keeps a misplaced chunk from matching by accident.
BLOCK = 1_000_003
COMPARE_STEP = 1 << 24
HOT_BUFFER = 1 << 20  # bytes: a socket buffer that stays in the CPU caches
GO = b"g"


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class Config:
    mode: str  # "full", "quick" or "tiny" (the test's size)
    repeats: int
    limit_bytes: int  # memcpy and CRC buffers
    codec_elements: int  # encode/decode, native and reference alike
    e2e_elements: int  # end-to-end rows and raw TCP
    rss_elements: int
    pingpong_elements: int
    pingpong_seconds: float  # per repeat
    stall_timeout: float  # session timeout in the children: seconds without progress
    deadline: float  # seconds one turn (one repeat of one row) may take

    def describe(self) -> str:
        return (
            f"{self.mode} run, median of {self.repeats}; encode/decode "
            f"{self.codec_elements:,} values ({_size(self.codec_elements * 4)}); end to end "
            f"{self.e2e_elements:,} values ({_size(self.e2e_elements * 4)}); peak RSS "
            f"{_size(self.rss_elements * 4)}"
        )


def make_config(
    quick: bool, tiny: bool, elements: int | None, repeats: int | None = None
) -> Config:
    if tiny:
        cfg = Config(
            mode="tiny",
            repeats=3,
            limit_bytes=8 * MIB,
            codec_elements=1 << 18,
            e2e_elements=1 << 20,
            rss_elements=1 << 20,
            pingpong_elements=1000,
            pingpong_seconds=0.05,
            stall_timeout=30.0,
            deadline=30.0,
        )
    elif quick:
        cfg = Config(
            mode="quick",
            repeats=3,
            limit_bytes=256 * MIB,
            codec_elements=16 * MIB,
            e2e_elements=64 * MIB,
            rss_elements=64 * MIB,
            pingpong_elements=1000,
            pingpong_seconds=0.3,
            stall_timeout=60.0,
            deadline=90.0,
        )
    else:
        cfg = Config(
            mode="full",
            repeats=5,
            limit_bytes=256 * MIB,
            codec_elements=64 * MIB,
            e2e_elements=256 * MIB,
            rss_elements=256 * MIB,
            pingpong_elements=1000,
            pingpong_seconds=1.0,
            stall_timeout=60.0,
            deadline=180.0,
        )
    changes: dict[str, Any] = {}
    if elements is not None:
        changes.update(codec_elements=elements, e2e_elements=elements, rss_elements=elements)
    if repeats is not None:
        changes["repeats"] = repeats
    if changes:
        cfg = Config(**{**asdict(cfg), **changes})
    return cfg


# --------------------------------------------------------------------------- results


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
    op: str  # ">=" or "<="
    target: float
    target_text: str
    met: bool | None  # None: not measured
    note: str = ""


def _size(n_bytes: int) -> str:
    if n_bytes >= GIB and n_bytes % GIB == 0:
        return f"{n_bytes // GIB} GiB"
    if n_bytes >= MIB:
        return f"{n_bytes / MIB:g} MiB"
    return f"{n_bytes / 1024:g} KiB"


SECTIONS = {
    "limits": "1. machine limits",
    "codec": "2. encode_frames / decode_frames in memory",
    "e2e": "3. end to end over loopback TCP, two processes",
    "small": "4. small gradients: round trips of a 1,000-value gradient",
    "rss": "5. peak RSS over baseline, native socket path",
}
NAME_WIDTH = 60


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


def _timed_row(
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


# --------------------------------------------------------------------------- helpers


def _gradient(n: int) -> F32:
    """n float32 values: a random normal block repeated (cheap to make at 1 GiB)."""
    block = np.random.default_rng(SEED).standard_normal(min(n, BLOCK), dtype=np.float32)
    out = np.empty(n, dtype=np.float32)
    for start in range(0, n, BLOCK):
        stop = min(start + BLOCK, n)
        out[start:stop] = block[: stop - start]
    return out


def _same(a: Any, b: F32) -> bool:
    """Bit-for-bit equality of two float32 vectors, in steps (no n-sized temporaries)."""
    a = np.asarray(a)
    if a.dtype != np.float32 or a.size != b.size:
        return False
    x, y = a.reshape(-1).view(np.uint32), b.reshape(-1).view(np.uint32)
    return all(
        np.array_equal(x[i : i + COMPARE_STEP], y[i : i + COMPARE_STEP])
        for i in range(0, x.size, COMPARE_STEP)
    )


def _now_ns() -> int:
    """CLOCK_MONOTONIC: one clock for every process of the machine."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    gc.collect()
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def _session_class(impl: str) -> Any:
    if impl == "native":
        from . import _native

        return _native.GradientStreamSession
    from . import reference

    return reference.GradientStreamSession


def _progress_class(impl: str) -> Any:
    if impl == "native":
        from . import _native

        return _native.TransferProgress
    from . import reference

    return reference.TransferProgress


def layout_support(impl: str) -> str | None:
    """None when `impl` takes layout="compact"; otherwise why not (for the skip note)."""
    try:
        _session_class(impl)("bench-probe", layout="compact")
    except (TypeError, ValueError) as exc:
        return f"{impl} GradientStreamSession(..., layout='compact') is not available yet ({exc})"
    return None


@dataclass(frozen=True)
class SessionSpec:
    impl: str  # "native" or "reference"
    chunk_size: int = 65536
    layout: str | None = None  # None: the keyword is not passed (the seed layout)
    timeout: float | None = None

    def make(self) -> Any:
        kwargs: dict[str, Any] = {}
        if self.layout is not None:
            kwargs["layout"] = self.layout
        if self.timeout is not None:
            kwargs["timeout"] = self.timeout
        return _session_class(self.impl)("gradstream-bench", self.chunk_size, **kwargs)


def _layout_arg(layout: str, available: dict[str, str | None], impl: str) -> str | None:
    """The layout keyword to pass: none for the seed layout of a build without layouts."""
    return None if layout == "seed" and available[impl] is not None else layout


# --------------------------------------------------------------------------- child processes
# A contestant is a pair of child processes (a trigger and a partner) connected by TCP.
# The trigger waits on a pipe for its turn (a repeat number; None: stop), runs one repeat
# with its partner and reports on the shared queue. run_rounds gives every contestant of a
# list one turn per round, and kills every child on the way out, whatever happened.

Task = tuple[str, Callable[..., None], tuple[Any, ...]]


class ChildError(Exception):
    """A child process failed, died or missed its deadline."""


def _die_with_parent() -> None:
    """Linux: SIGKILL this child if the benchmark process dies (no orphans left behind)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class _Tagged:
    """The shared queue, seen from one contestant's child: every message gets its key."""

    def __init__(self, out: Any, tag: str) -> None:
        self.out = out
        self.tag = tag

    def put(self, message: tuple[Any, ...]) -> None:
        self.out.put((self.tag, *message))


def _child_entry(
    tag: str,
    role: str,
    fn: Callable[..., None],
    out: Any,
    ctl: Any,
    args: tuple[Any, ...],
    foreign: tuple[socket.socket, ...],
) -> None:
    _die_with_parent()
    for s in foreign:  # the partner's end: holding it would hide the partner's close
        s.close()
    try:
        fn(_Tagged(out, tag), ctl, *args)
    except BaseException as exc:
        out.put((tag, "error", role, f"{type(exc).__name__}: {exc}"))
        out.close()
        out.join_thread()
        os._exit(1)


def _turns(ctl: Any) -> Iterator[int]:
    """The repeat numbers the parent hands out, until it says stop."""
    while True:
        rep = ctl.recv()
        if rep is None:
            return
        yield int(rep)


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    """A connected TCP pair on 127.0.0.1 (client, server side), TCP_NODELAY on both."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname()[:2])
        conn, _ = server.accept()
    for s in (client, conn):
        s.setblocking(True)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return client, conn


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Contestant:
    key: str
    trigger: Task  # gets the control pipe: fn(out, ctl, [sock,] *args)
    partner: Task  # fn(out, None, [sock,] *args)
    per_turn: int  # messages the pair sends per repeat
    connect: bool = True  # give each one end of a fresh TCP connection (as [sock])
    messages: list[tuple[Any, ...]] = field(default_factory=list)
    error: str | None = None
    procs: list[Any] = field(default_factory=list)


def _kill(c: Contestant) -> None:
    for p in c.procs:
        if p.exitcode is None:
            p.kill()
    for p in c.procs:
        p.join(5)


def _await_turn(out: Any, c: Contestant, by_key: dict[str, Contestant], deadline: float) -> None:
    got = 0
    end = time.monotonic() + deadline
    while got < c.per_turn:
        left = end - time.monotonic()
        if left <= 0:
            raise ChildError(f"no result within {deadline:g} s")
        try:
            msg = out.get(timeout=min(left, 0.5))
        except queue.Empty:
            gone = [p for p in c.procs if p.exitcode is not None]
            if not any(p.exitcode != 0 for p in gone) and len(gone) < len(c.procs):
                continue  # running, or a partner that finished its part
            try:  # its last words may still be on the way
                msg = out.get(timeout=2)
            except queue.Empty:
                codes = ", ".join(f"{p.name} exit {p.exitcode}" for p in gone)
                raise ChildError(f"child exited without a result ({codes})") from None
        tag, kind, *rest = msg
        owner = by_key.get(tag)
        if kind == "error":
            if owner is c:
                raise ChildError(f"{rest[0]}: {rest[1]}")
            if owner is not None and owner.error is None:  # an idle contestant broke
                owner.error = f"{rest[0]}: {rest[1]}"
                _kill(owner)
            continue
        if owner is c:
            c.messages.append((kind, *rest))
            got += 1


def run_rounds(contestants: Sequence[Contestant], repeats: int, deadline: float) -> None:
    """Start every contestant's pair, then `repeats` rounds of one turn each; a contestant
    that fails gets its error set and its children killed, the others go on."""
    ctx = mp.get_context("fork")
    out: Any = ctx.Queue()
    by_key = {c.key: c for c in contestants}
    ctls: dict[str, Any] = {}
    try:
        for c in contestants:
            # Made just before the fork, closed here just after: no other child inherits
            # this connection, so each end sees the other close.
            socks: tuple[socket.socket, ...] = _tcp_pair() if c.connect else ()
            receiving, ctls[c.key] = ctx.Pipe(duplex=False)
            try:
                for (role, fn, args), ctl, mine, foreign in (
                    (c.trigger, receiving, socks[:1], socks[1:]),
                    (c.partner, None, socks[1:], socks[:1]),
                ):
                    p = ctx.Process(
                        target=_child_entry,
                        args=(c.key, role, fn, out, ctl, (*mine, *args), foreign),
                        name=f"bench-{c.key}-{role}",
                        daemon=True,
                    )
                    p.start()
                    c.procs.append(p)
            finally:
                receiving.close()
                for s in socks:
                    s.close()
        for rep in range(repeats):
            for c in contestants:
                if c.error is not None:
                    continue
                try:
                    ctls[c.key].send(rep)
                    _await_turn(out, c, by_key, deadline)
                except (ChildError, OSError) as exc:
                    c.error = str(exc) or type(exc).__name__
                    _kill(c)
        for c in contestants:
            if c.error is None:
                with contextlib.suppress(OSError):
                    ctls[c.key].send(None)
        end = time.monotonic() + 30
        for c in contestants:
            for p in c.procs:
                p.join(max(0.1, end - time.monotonic()))
        for c in contestants:  # a child that fails or hangs on the way out is a bug too
            stuck = [p for p in c.procs if p.exitcode != 0]
            if c.error is None and stuck:
                c.error = "did not stop cleanly: " + ", ".join(
                    f"{p.name} {'still running' if p.exitcode is None else f'exit {p.exitcode}'}"
                    for p in stuck
                )
    finally:
        for c in contestants:
            _kill(c)
        for ctl in ctls.values():
            ctl.close()
        out.close()


def _pair_times(messages: list[tuple[Any, ...]], repeats: int) -> tuple[list[float], int]:
    """("t0", rep, ns) from senders and ("t1", rep, ns, wire_bytes, ok) from receivers ->
    seconds per repeat and the wire bytes of one transfer."""
    t0 = {m[1]: m[2] for m in messages if m[0] == "t0"}
    t1 = {m[1]: m for m in messages if m[0] == "t1"}
    seconds = []
    wire = 0
    for rep in range(repeats):
        if rep not in t0 or rep not in t1:
            raise ChildError(f"repeat {rep} has no timing")
        _, _, end, wire, ok = t1[rep]
        if not ok:
            raise ChildError(f"repeat {rep}: the received gradient differs from the sent one")
        seconds.append((end - t0[rep]) / 1e9)
    return seconds, int(wire)


def _recv_exactly(sock: socket.socket, view: memoryview) -> int:
    """Fill view from sock; the bytes read (fewer only at the end of the stream)."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            break
        got += n
    return got


def _go(sock: socket.socket) -> bool:
    """Wait for the receiver's go byte; False when it closed the connection instead."""
    data = sock.recv(1)
    if data not in (GO, b""):
        raise ChildError(f"bad go byte {data!r}")
    return data == GO


# ------------------------------------------------------------- end-to-end children: gradstream


class _Link:
    """A connection as a gradstream stream (socket or asyncio streams) plus the go byte."""

    def __init__(self, sock: socket.socket, path: str) -> None:
        self.sock = sock
        self.path = path
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        if self.path == "streams":
            self.reader, self.writer = await asyncio.open_connection(sock=self.sock)

    @property
    def stream(self) -> Any:
        return self.sock if self.path == "socket" else (self.reader, self.writer)

    async def send_go(self) -> None:
        if self.writer is None:
            self.sock.sendall(GO)
        else:
            self.writer.write(GO)
            await self.writer.drain()

    async def go(self) -> bool:
        if self.reader is None:
            return _go(self.sock)
        try:
            return await self.reader.readexactly(1) == GO
        except asyncio.IncompleteReadError:
            return False

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(OSError):
                await self.writer.wait_closed()
        else:
            self.sock.close()


def _gs_sender(
    out: Any, _: Any, sock: socket.socket, spec: SessionSpec, path: str, grad: F32
) -> None:
    session = spec.make()

    async def run() -> None:
        link = _Link(sock, path)
        await link.open()
        rep = 0
        while await link.go():
            t0 = _now_ns()
            await session.stream_to(grad, link.stream)
            out.put(("t0", rep, t0))
            rep += 1
        await link.close()

    asyncio.run(run())


def _gs_receiver(
    out: Any, ctl: Any, sock: socket.socket, spec: SessionSpec, path: str, grad: F32
) -> None:
    session = spec.make()
    progress_class = _progress_class(spec.impl)

    async def run() -> None:
        link = _Link(sock, path)
        await link.open()
        # One buffer for every round, as a training loop keeps its gradient buffer (the
        # raw TCP row likewise receives into a reused buffer).
        dest = np.ones_like(grad)
        for rep in _turns(ctl):
            progress = progress_class()
            await link.send_go()
            got = await session.receive_from(link.stream, progress=progress, out=dest)
            t1 = _now_ns()
            out.put(("t1", rep, t1, progress.bytes, got is dest and _same(got, grad)))
            dest.fill(0.0)  # a stale copy must not pass the check next round
        await link.close()

    asyncio.run(run())


# ------------------------------------------------------------- end-to-end children: raw, pickle


def _raw_sender(out: Any, _: Any, sock: socket.socket, grad: F32, mode: str) -> None:
    """mode "reuse" / "new": one sendall of the whole gradient; "hot": the gradient's size
    as sendalls of one 1 MiB buffer, again and again (it stays in the CPU caches)."""
    view = grad.data.cast("B")
    hot = memoryview(bytes(min(len(view), HOT_BUFFER)))
    rep = 0
    while _go(sock):
        t0 = _now_ns()
        if mode != "hot":
            sock.sendall(view)
        else:
            for start in range(0, len(view), len(hot)):
                sock.sendall(hot[: len(view) - start])
        out.put(("t0", rep, t0))
        rep += 1


def _raw_receiver(out: Any, ctl: Any, sock: socket.socket, grad: F32, mode: str) -> None:
    """mode "reuse": recv_into one pre-faulted gradient-sized buffer; "new": into a new
    array each time; "hot": into one 1 MiB buffer, again and again (the bytes are lost)."""
    size = HOT_BUFFER if mode == "hot" else grad.size * 4
    dst = np.empty(size // 4, dtype=np.float32)
    dst.fill(0)  # pre-faulted (np.zeros would map its pages lazily)
    for rep in _turns(ctl):
        if mode == "new":
            dst = np.empty(grad.size, dtype=np.float32)
        sock.sendall(GO)
        if mode == "hot":
            view, got = dst.data.cast("B"), 0
            while got < grad.nbytes:
                step = _recv_exactly(sock, view[: min(len(view), grad.nbytes - got)])
                if step == 0:
                    break
                got += step
            ok = got == grad.nbytes
        else:
            got = _recv_exactly(sock, dst.data.cast("B"))
            ok = got == grad.nbytes and _same(dst, grad)
        t1 = _now_ns()
        out.put(("t1", rep, t1, got, ok))


def _pickle_sender(out: Any, _: Any, sock: socket.socket, grad: F32, oob: bool) -> None:
    rep = 0
    while _go(sock):
        t0 = _now_ns()
        if oob:
            buffers: list[pickle.PickleBuffer] = []
            meta = pickle.dumps(grad, protocol=5, buffer_callback=buffers.append)
            raws = [b.raw() for b in buffers]
            head = struct.pack(f"<QQ{len(raws)}Q", len(meta), len(raws), *(r.nbytes for r in raws))
            sock.sendall(head)
            sock.sendall(meta)
            for r in raws:
                sock.sendall(r)
        else:
            data = pickle.dumps(grad, protocol=5)
            sock.sendall(struct.pack("<Q", len(data)))
            sock.sendall(data)
        out.put(("t0", rep, t0))
        rep += 1


def _recv_buffer(sock: socket.socket, size: int) -> bytearray:
    buf = bytearray(size)
    if _recv_exactly(sock, memoryview(buf)) != size:
        raise ChildError("the sender closed the connection")
    return buf


def _pickle_receiver(out: Any, ctl: Any, sock: socket.socket, grad: F32, oob: bool) -> None:
    for rep in _turns(ctl):
        sock.sendall(GO)
        if oob:
            meta_len, count = struct.unpack("<QQ", _recv_buffer(sock, 16))
            sizes = struct.unpack(f"<{count}Q", _recv_buffer(sock, 8 * count))
            meta = _recv_buffer(sock, meta_len)
            bufs = [_recv_buffer(sock, size) for size in sizes]
            got = pickle.loads(meta, buffers=bufs)
            wire = 16 + 8 * count + meta_len + sum(sizes)
        else:
            (size,) = struct.unpack("<Q", _recv_buffer(sock, 8))
            got = pickle.loads(_recv_buffer(sock, size))
            wire = 8 + size
        t1 = _now_ns()
        out.put(("t1", rep, t1, wire, _same(got, grad)))
        del got


# ------------------------------------------------------------- end-to-end children: gloo


def _gloo_worker(out: Any, ctl: Any, rank: int, port: int, grad: F32, timeout: float) -> None:
    """torch.distributed gloo send/recv. Rank 1 (the receiver, the trigger) tells rank 0 to
    go on or stop with a one-value tensor, then both leave a barrier and the timing starts."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only
    torch: Any = importlib.import_module("torch")
    dist: Any = importlib.import_module("torch.distributed")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=timeout),
    )
    try:
        flag = torch.zeros(1, dtype=torch.int32)
        if rank == 0:
            tensor = torch.from_numpy(grad)
            rep = 0
            while True:
                dist.recv(flag, src=1)
                if int(flag[0]) == 0:
                    break
                dist.barrier()
                t0 = _now_ns()
                dist.send(tensor, dst=1)
                out.put(("t0", rep, t0))
                rep += 1
        else:
            for rep in _turns(ctl):
                # A receiver must hold the tensor before recv; allocated before the barrier.
                buf = torch.empty(grad.size, dtype=torch.float32)
                dist.send(torch.ones(1, dtype=torch.int32), dst=0)
                dist.barrier()
                dist.recv(buf, src=0)
                t1 = _now_ns()
                out.put(("t1", rep, t1, grad.nbytes, _same(buf.numpy(), grad)))
                del buf
            dist.send(flag, dst=0)  # zero: stop
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- section 1


class Memcpy:
    """numpy memcpy of `size` bytes into a reused, pre-faulted buffer. Sampled in section 1
    and again once per round of section 2, so that its figure spans the codec's stretch.
    Each sample is the second of two copies back to back: on these VMs the first copy after
    other work (or a pause) takes up to twice as long, and the limit is the steady rate."""

    def __init__(self, size: int) -> None:
        self.src = _gradient(size // 4)
        self.dst = np.zeros_like(self.src)
        self.samples: list[float] = []

    def sample(self) -> None:
        np.copyto(self.dst, self.src)
        self.samples.append(_timed(lambda: np.copyto(self.dst, self.src))[1])

    def row(self) -> Row:
        return _timed_row(
            "memcpy",
            "limits",
            f"numpy memcpy {_size(self.src.nbytes)} (np.copyto, reused buffer)",
            self.samples,
            elements=self.src.size,
            gradient_bytes=self.src.nbytes,
            note=f"{len(self.samples)} samples, spread over section 2 (each a 2nd copy)",
        )


def bench_limits(cfg: Config, res: Results, memcpy: Memcpy) -> None:
    size = cfg.limit_bytes
    label = _size(size)
    for _ in range(cfg.repeats):
        memcpy.sample()
    src = memcpy.src
    t = [_timed(src.copy)[1] for _ in range(cfg.repeats)]
    res.add(
        _timed_row(
            "memcpy_new",
            "limits",
            f"numpy copy {label} into a new array (page faults incl.)",
            t,
            elements=src.size,
            gradient_bytes=size,
            note="information only",
        )
    )
    from . import _native

    data = src.tobytes()
    expected = zlib.crc32(data)
    got = None
    t = []
    for _ in range(cfg.repeats):
        got, seconds = _timed(lambda: _native.GradientChunk.compute_checksum(data))
        t.append(seconds)
    row = _timed_row(
        "crc32fast",
        "limits",
        f"crc32fast {label} (GradientChunk.compute_checksum, bytes)",
        t,
        gradient_bytes=size,
    )
    if got != expected:
        row.status, row.note = "failed", f"CRC {got} differs from zlib's {expected:#010x}"
    res.add(row)
    t = [_timed(lambda: zlib.crc32(data))[1] for _ in range(cfg.repeats)]
    res.add(_timed_row("zlib_crc32", "limits", f"zlib.crc32 {label}", t, gradient_bytes=size))


RAW_TCP = (
    ("raw_tcp", "reuse", "raw loopback TCP {}, sendall / recv_into a reused buffer"),
    ("raw_tcp_new", "new", "raw loopback TCP {}, recv_into a new array each time"),
    ("raw_tcp_hot", "hot", "raw loopback TCP {} through 1 MiB buffers (cache-hot)"),
)


# --------------------------------------------------------------------------- section 2


def bench_codec(
    cfg: Config,
    res: Results,
    grad: F32,
    available: dict[str, str | None],
    memcpy: Memcpy,
) -> None:
    """Per layout and chunk size: rounds of native encode, native decode, reference encode,
    reference decode and one memcpy sample."""
    for layout in LAYOUTS:
        for chunk_size in CHUNK_SIZES:
            label = f"{layout}, chunk {chunk_size:,}, {_size(grad.nbytes)}"
            sessions: dict[str, Any] = {}
            for impl in ("native", "reference"):
                why = available[impl]
                if layout == "compact" and why is not None:
                    for op in ("encode", "decode"):
                        key = f"{impl}_{op}_{layout}_{chunk_size}"
                        res.add(Row(key, "codec", f"{impl} {op}_frames, {label}", "skipped", why))
                    continue
                spec = SessionSpec(impl, chunk_size, _layout_arg(layout, available, impl))
                sessions[impl] = spec.make()
            _codec_rounds(cfg, res, grad, sessions, layout, chunk_size, label, memcpy)


def _codec_rounds(
    cfg: Config,
    res: Results,
    g: F32,
    sessions: dict[str, Any],
    layout: str,
    chunk_size: int,
    label: str,
    memcpy: Memcpy,
) -> None:
    """Each round: per implementation, encode and decode into new objects, then into
    buffers reused from round to round (`out=`, as a training loop would), and a memcpy."""
    ops = ("encode", "decode", "encode_out", "decode_out")
    times: dict[str, dict[str, list[float]]] = {i: {op: [] for op in ops} for i in sessions}
    wire_len: dict[str, int] = {}
    problems: dict[str, str] = {}
    reused: dict[str, tuple[bytearray, F32]] = {}
    for rep in range(cfg.repeats):
        memcpy.sample()
        for impl, session in sessions.items():
            if impl in problems:
                continue
            try:
                wire, t_enc = _timed(partial(session.encode_frames, g))
                back, t_dec = _timed(partial(session.decode_frames, wire))
                if impl not in reused:
                    # Fault the pages in once, as a buffer kept across steps would be.
                    reused[impl] = (bytearray(len(wire)), np.ones_like(g))
                frames, values = reused[impl]
                n, t_enc_out = _timed(partial(session.encode_frames, g, out=frames))
                # Decoded from the immutable `bytes`: a mutable buffer (the bytearray) is
                # copied before it is read without the GIL, which is not what is measured.
                _, t_dec_out = _timed(partial(session.decode_frames, wire, out=values))
            except Exception as exc:
                problems[impl] = f"{type(exc).__name__}: {exc}"
                continue
            for op, t in zip(ops, (t_enc, t_dec, t_enc_out, t_dec_out), strict=True):
                times[impl][op].append(t)
            wire_len[impl] = len(wire)
            if rep == cfg.repeats - 1:
                if not _same(back, g) or not _same(values, g):
                    problems[impl] = "decode_frames(encode_frames(g)) differs from g"
                elif n != len(wire) or frames != wire:
                    problems[impl] = "encode_frames(g, out=) wrote other bytes"
            del wire, back
    for impl in sessions:
        for op, samples in times[impl].items():
            key = f"{impl}_{op}_{layout}_{chunk_size}"
            what = op.replace("_out", "_frames(out=), reused buffers")
            if not op.endswith("_out"):
                what = f"{op}_frames"
            name = f"{impl} {what}, {label}"
            if impl in problems:
                res.add(Row(key, "codec", name, "failed", problems[impl]))
                continue
            res.add(
                _timed_row(
                    key,
                    "codec",
                    name,
                    samples,
                    elements=g.size,
                    gradient_bytes=g.nbytes,
                    wire_bytes=wire_len[impl],
                )
            )


# --------------------------------------------------------------------------- section 3


@dataclass
class Planned:
    """A row whose figures come from a contestant (None: skipped, `note` says why)."""

    key: str
    section: str
    name: str
    contestant: Contestant | None
    note: str = ""


def plan_transfers(cfg: Config, grad: F32, available: dict[str, str | None]) -> list[Planned]:
    """The raw TCP rows of section 1 and the rows of section 3, as contestants."""
    label = _size(grad.nbytes)
    plans: list[Planned] = []
    for key, mode, name in RAW_TCP:
        c = Contestant(
            key,
            ("recv", _raw_receiver, (grad, mode)),
            ("send", _raw_sender, (grad, mode)),
            per_turn=2,
        )
        note = "" if mode == "reuse" else "information only"
        plans.append(Planned(key, "limits", name.format(label), c, note))

    timeout = cfg.stall_timeout
    for impl, path in (("native", "socket"), ("native", "streams"), ("reference", "socket")):
        for layout in LAYOUTS:
            key = f"e2e_{impl}_{path}_{layout}"
            what = "asyncio streams" if path == "streams" else "socket"
            name = f"{impl} {what}, {layout} layout, {label}, into out="
            why = available[impl]
            if layout == "compact" and why is not None:
                plans.append(Planned(key, "e2e", name, None, why))
                continue
            spec = SessionSpec(impl, 65536, _layout_arg(layout, available, impl), timeout)
            c = Contestant(
                key,
                ("recv", _gs_receiver, (spec, path, grad)),
                ("send", _gs_sender, (spec, path, grad)),
                per_turn=2,
            )
            plans.append(Planned(key, "e2e", name, c))

    for oob, key, name in (
        (False, "e2e_pickle", f"pickle (protocol 5, in-band) over a raw socket, {label}"),
        (True, "e2e_pickle_oob", f"pickle protocol 5, out-of-band buffers, raw socket, {label}"),
    ):
        c = Contestant(
            key,
            ("recv", _pickle_receiver, (grad, oob)),
            ("send", _pickle_sender, (grad, oob)),
            per_turn=2,
        )
        plans.append(Planned(key, "e2e", name, c))

    name = f"torch.distributed gloo send/recv, {label}"
    if importlib.util.find_spec("torch") is None:
        plans.append(Planned("e2e_gloo", "e2e", name, None, "torch is not installed"))
    else:
        port = _free_port()
        # Its rank 0 waits for its turn inside gloo, so the gloo timeout covers whole rounds.
        wait = cfg.deadline * 20
        c = Contestant(
            "e2e_gloo",
            ("gloo-recv", _gloo_worker, (1, port, grad, wait)),
            ("gloo-send", _gloo_worker, (0, port, grad, wait)),
            per_turn=2,
            connect=False,
        )
        plans.append(Planned("e2e_gloo", "e2e", name, c, "wire bytes taken as the gradient's"))
    return plans


def bench_transfers(cfg: Config, res: Results, plans: list[Planned], grad: F32) -> None:
    run_rounds([p.contestant for p in plans if p.contestant], cfg.repeats, cfg.deadline)
    for p in plans:
        c = p.contestant
        if c is None:
            res.add(Row(p.key, p.section, p.name, "skipped", p.note))
            continue
        try:
            if c.error is not None:
                raise ChildError(c.error)
            seconds, wire = _pair_times(c.messages, cfg.repeats)
        except ChildError as exc:
            res.add(Row(p.key, p.section, p.name, "failed", str(exc)))
            continue
        res.add(
            _timed_row(
                p.key,
                p.section,
                p.name,
                seconds,
                elements=grad.size,
                gradient_bytes=grad.nbytes,
                wire_bytes=wire,
                note=p.note,
            )
        )


# --------------------------------------------------------------------------- section 4


def _window(step: Callable[[], Any], seconds: float) -> float:
    """Round trips per second over a window of about `seconds`."""
    count = 0
    start = time.perf_counter()
    while True:
        step()
        count += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return count / elapsed


async def _window_async(step: Callable[[], Any], seconds: float) -> float:
    count = 0
    start = time.perf_counter()
    while True:
        await step()
        count += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return count / elapsed


def _pp_initiator(
    out: Any, ctl: Any, sock: socket.socket, impl: str, g: F32, wire_len: int, seconds: float
) -> None:
    """Side A: per turn, a window of round trips (a warm-up before the first); at the end
    it closes its side, which stops side B."""
    if impl == "raw":
        msg = (g.tobytes() * (wire_len // g.nbytes + 1))[:wire_len]
        view = memoryview(bytearray(wire_len))

        def step() -> None:
            sock.sendall(msg)
            if _recv_exactly(sock, view) != wire_len:
                raise ChildError("the echo side closed the connection")

        for rep in _turns(ctl):
            if rep == 0:
                _window(step, seconds / 4)
            rate = _window(step, seconds)
            out.put(("rate", rep, rate, bytes(view) == msg))
    else:
        session = SessionSpec(impl).make()
        last: list[Any] = [g]

        async def step_async() -> None:
            await session.stream_to(g, sock)
            last[0] = await session.receive_from(sock)

        async def run() -> None:
            for rep in _turns(ctl):
                if rep == 0:
                    await _window_async(step_async, seconds / 4)
                rate = await _window_async(step_async, seconds)
                out.put(("rate", rep, rate, _same(last[0], g)))

        asyncio.run(run())
    sock.shutdown(socket.SHUT_WR)


def _pp_echo(out: Any, _: Any, sock: socket.socket, impl: str, g: F32, wire_len: int) -> None:
    """Side B: sends back what arrives until side A closes."""
    if impl == "raw":
        view = memoryview(bytearray(wire_len))
        while _recv_exactly(sock, view) == wire_len:
            sock.sendall(view)
        return
    session = SessionSpec(impl).make()  # no timeout: it idles while the others take turns

    async def run() -> None:
        while True:
            got = await session.receive_from(sock)
            if got.size == 0:  # the peer closed between gradients
                return
            await session.stream_to(got, sock)

    asyncio.run(run())


def bench_small(cfg: Config, res: Results) -> None:
    from . import _native

    g = _gradient(cfg.pingpong_elements)
    wire_len = len(_native.GradientStreamSession("bench", 65536).encode_frames(g))
    plans = [
        Planned(
            f"pingpong_{impl}",
            "small",
            name,
            Contestant(
                f"pingpong_{impl}",
                ("ping", _pp_initiator, (impl, g, wire_len, cfg.pingpong_seconds)),
                ("echo", _pp_echo, (impl, g, wire_len)),
                per_turn=1,
            ),
        )
        for impl, name in (
            ("native", f"native socket path, {g.size:,} values ({wire_len:,} wire bytes)"),
            ("reference", f"reference socket path, {g.size:,} values"),
            ("raw", f"raw socket ping-pong of {wire_len:,} bytes (sendall / recv_into)"),
        )
    ]
    run_rounds([p.contestant for p in plans if p.contestant], cfg.repeats, cfg.deadline)
    for p in plans:
        c = p.contestant
        assert c is not None
        rates = [m[2] for m in c.messages if m[0] == "rate"]
        if c.error is not None or len(rates) != cfg.repeats:
            res.add(Row(p.key, "small", p.name, "failed", c.error or "missing repeats"))
            continue
        rate = statistics.median(rates)
        row = Row(p.key, "small", p.name, seconds=1 / rate, samples=[1 / r for r in rates])
        row.round_trips_per_s = rate
        row.elements = g.size
        row.wire_bytes = wire_len
        row.note = f"{1e6 / rate:,.1f} us per round trip"
        if not all(m[3] for m in c.messages):
            row.status, row.note = "failed", "the echoed gradient differs from the sent one"
        res.add(row)


# --------------------------------------------------------------------------- section 5


def _rss_now() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise ChildError("no VmRSS in /proc/self/status")


def _rss_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _rss_sender(out: Any, _: Any, sock: socket.socket, n: int, timeout: float) -> None:
    session = SessionSpec("native", timeout=timeout).make()
    grad = _gradient(n)
    crc = zlib.crc32(grad.data)
    base = _rss_now()  # the gradient itself is in the baseline

    async def run() -> None:
        if _go(sock):
            await session.stream_to(grad, sock)

    asyncio.run(run())
    out.put(("send", _rss_peak() - base, crc))


def _rss_receiver(out: Any, ctl: Any, sock: socket.socket, n: int, timeout: float) -> None:
    session = SessionSpec("native", timeout=timeout).make()
    base = _rss_now()

    async def run() -> Any:
        sock.sendall(GO)
        return await session.receive_from(sock)

    for _ in _turns(ctl):  # one turn: ru_maxrss only grows, so each repeat is a new process
        got = asyncio.run(run())
        peak = _rss_peak() - base  # before anything else allocates
        out.put(("recv", peak, zlib.crc32(got) if got.size == n else None))
        del got


def bench_rss(cfg: Config, res: Results) -> None:
    n = cfg.rss_elements
    label = _size(n * 4)
    send_name = f"send {label}: peak RSS over baseline (gradient in baseline)"
    recv_name = f"receive {label}: peak RSS over baseline"
    sends: list[int] = []
    recvs: list[int] = []
    try:
        for _ in range(cfg.repeats):
            c = Contestant(
                "rss",
                ("recv", _rss_receiver, (n, cfg.stall_timeout)),
                ("send", _rss_sender, (n, cfg.stall_timeout)),
                per_turn=2,
            )
            run_rounds([c], 1, cfg.deadline)
            if c.error is not None:
                raise ChildError(c.error)
            by_side = {m[0]: m for m in c.messages}
            if by_side["recv"][2] != by_side["send"][2]:
                raise ChildError("the received gradient differs from the sent one")
            sends.append(by_side["send"][1])
            recvs.append(by_side["recv"][1])
    except ChildError as exc:
        res.add(Row("rss_send", "rss", send_name, "failed", str(exc)))
        res.add(Row("rss_recv", "rss", recv_name, "failed", str(exc)))
        return
    for key, name, values in (("rss_send", send_name, sends), ("rss_recv", recv_name, recvs)):
        row = Row(key, "rss", name, elements=n, gradient_bytes=n * 4)
        row.peak_over_baseline_mib = statistics.median(values) / MIB
        row.note = f"{row.peak_over_baseline_mib * MIB / (n * 4):.2f} x the gradient"
        res.add(row)


# --------------------------------------------------------------------------- ratios


def _ratio_of(
    res: Results,
    name: str,
    num: str,
    den: str | None,
    attr: str,
    op: str,
    target: float,
    target_text: str,
    den_attr: str | None = None,
) -> Ratio:
    a = res.ok(num)
    b = res.ok(den) if den is not None else None
    missing = [k for k, row in ((num, a), (den, b)) if k is not None and row is None]
    if missing:
        why = "; ".join(
            f"{k}: {res.rows[k].note}" if k in res.rows else f"{k}: not measured" for k in missing
        )
        return Ratio(name, num, den, None, op, target, target_text, None, f"not measured ({why})")
    x = getattr(a, attr)
    y = 1.0 if b is None else getattr(b, den_attr or attr)
    if x is None or not y:
        return Ratio(name, num, den, None, op, target, target_text, None, "no figure")
    value = float(x) / float(y)
    met = value >= target if op == ">=" else value <= target
    return Ratio(name, num, den, value, op, target, target_text, met)


def compute_ratios(res: Results, cfg: Config) -> list[Ratio]:
    ratios: list[Ratio] = []
    new_copy = res.ok("memcpy_new")
    # memcpy copies into a reused, pre-faulted buffer: like for like is encode and decode
    # into reused buffers (out=). Into new objects, the page faults of fresh memory are
    # the cost; the note compares those with numpy's own copy into a new array.
    for layout in LAYOUTS:
        for op, target in (("encode", 0.5), ("decode", 0.4)):
            key = f"native_{op}_out_{layout}_65536"
            ratio = _ratio_of(
                res,
                f"native {op}_frames(out=), chunk 65536, {layout} / memcpy",
                key,
                "memcpy",
                "gbps",
                ">=",
                target,
                f">= {target:g} x memcpy",
            )
            fresh = res.ok(f"native_{op}_{layout}_65536")
            if ratio.measured is not None and fresh and fresh.gbps and new_copy and new_copy.gbps:
                ratio.note = (
                    f"(new objects: {fresh.gbps / new_copy.gbps:.2f} x a copy into a new array)"
                )
            ratios.append(ratio)
    for layout in LAYOUTS:
        for chunk_size, target in ((4096, 10.0), (65536, 4.0)):
            for op in ("encode", "decode"):
                ratio = _ratio_of(
                    res,
                    f"native / reference {op}_frames(out=), chunk {chunk_size}, {layout}",
                    f"native_{op}_out_{layout}_{chunk_size}",
                    f"reference_{op}_out_{layout}_{chunk_size}",
                    "gbps",
                    ">=",
                    target,
                    f">= {target:g} x",
                )
                a = res.ok(f"native_{op}_{layout}_{chunk_size}")
                b = res.ok(f"reference_{op}_{layout}_{chunk_size}")
                if ratio.measured is not None and a and b and a.gbps and b.gbps:
                    ratio.note = f"(new objects: {a.gbps / b.gbps:.2f} x)"
                ratios.append(ratio)
    hot = res.ok("raw_tcp_hot")
    for name, key, attr, target in (
        ("seed: wire GB/s", "e2e_native_socket_seed", "wire_gbps", 0.9),
        ("compact: gradient GB/s", "e2e_native_socket_compact", "gbps", 0.86),
    ):
        ratio = _ratio_of(
            res,
            f"end to end, socket path, {name} / raw loopback TCP",
            key,
            "raw_tcp",
            attr,
            ">=",
            target,
            f">= {target:g} x raw TCP",
            den_attr="wire_gbps",
        )
        row = res.ok(key)
        if ratio.measured is not None and row and hot and hot.wire_gbps:
            ratio.note = (
                f"({getattr(row, attr) / hot.wire_gbps:.2f} x raw TCP through 1 MiB buffers)"
            )
        ratios.append(ratio)
    ratios.append(
        _ratio_of(
            res,
            "end to end, socket path, compact / gloo (gradient GB/s)",
            "e2e_native_socket_compact",
            "e2e_gloo",
            "gbps",
            ">=",
            1.0,
            ">= gloo",
        )
    )
    for layout in LAYOUTS:
        ratios.append(
            _ratio_of(
                res,
                f"end to end, asyncio streams / reference, {layout}",
                f"e2e_native_streams_{layout}",
                f"e2e_reference_socket_{layout}",
                "gbps",
                ">=",
                3.0,
                ">= 3 x reference",
            )
        )
    ratios.append(
        _ratio_of(
            res,
            "small-gradient round trips, native / raw socket ping-pong",
            "pingpong_native",
            "pingpong_raw",
            "round_trips_per_s",
            ">=",
            0.5,
            ">= 0.5 x raw",
        )
    )
    ratios.append(
        _ratio_of(
            res,
            "small-gradient round trips, native / reference",
            "pingpong_native",
            "pingpong_reference",
            "round_trips_per_s",
            ">=",
            3.0,
            ">= 3 x reference",
        )
    )
    rss_gib = cfg.rss_elements * 4 / GIB
    ratios.append(
        _rss_ratio(
            res,
            "rss_recv",
            f"peak RSS over baseline, {_size(cfg.rss_elements * 4)} receive / gradient",
            1.25,
            rss_gib,
        )
    )
    ratios.append(
        _rss_ratio(
            res,
            "rss_send",
            f"peak RSS beyond the gradient, {_size(cfg.rss_elements * 4)} send / gradient",
            0.25,
            rss_gib,
        )
    )
    return ratios


def _rss_ratio(res: Results, key: str, name: str, target: float, gib: float) -> Ratio:
    """Peak over baseline as a fraction of the gradient's size: 1.25 GiB for a 1 GiB receive
    is 1.25; the quick run's smaller gradient gets the same fraction."""
    text = f"<= {target:g} x gradient ({target * gib:.3g} GiB)"
    row = res.ok(key)
    if row is None or row.peak_over_baseline_mib is None or not row.gradient_bytes:
        note = res.rows[key].note if key in res.rows else "not measured"
        return Ratio(name, key, None, None, "<=", target, text, None, f"not measured ({note})")
    value = row.peak_over_baseline_mib * MIB / row.gradient_bytes
    return Ratio(name, key, None, value, "<=", target, text, value <= target)


def print_ratios(ratios: list[Ratio]) -> None:
    print("\nratios (measured in this run) against the targets of issue 4", flush=True)
    width = max(len(r.name) for r in ratios)
    for r in ratios:
        measured = "-" if r.measured is None else f"{r.measured:.3f}"
        verdict = "not measured" if r.met is None else ("met" if r.met else "NOT MET")
        line = f"  {r.name:{width}} {measured:>8}  {r.target_text:34} {verdict}"
        if r.note:
            line += f"  {r.note}"
        print(line, flush=True)


# --------------------------------------------------------------------------- machine


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
    from . import __version__

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


# --------------------------------------------------------------------------- main


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smaller gradients and 3 repeats (under a minute) instead of 5 (under ten)",
    )
    parser.add_argument(
        "--json", metavar="FILE", default=None, help="also write every row and ratio to FILE"
    )
    # For the test suite: sizes small enough for seconds.
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--elements", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=None, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    """The benchmark; 0 when every row ran or was skipped, 1 when one failed."""
    if args.elements is not None and args.elements < 1:
        print("gradstream bench: error: --elements must be >= 1", file=sys.stderr)
        return 2
    if args.repeats is not None and args.repeats < 1:
        print("gradstream bench: error: --repeats must be >= 1", file=sys.stderr)
        return 2
    started = time.perf_counter()
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
    memcpy = Memcpy(cfg.limit_bytes)
    bench_limits(cfg, res, memcpy)
    grad = _gradient(max(cfg.e2e_elements, cfg.codec_elements))
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
            "benchmark": "gradstream bench (issue 4)",
            "mode": cfg.mode,
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="gradstream bench",
        description=(__doc__ or "").split("\n\n")[0],
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
