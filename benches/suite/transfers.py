"""End to end over loopback TCP (section 3, and the raw TCP rows of section 1): the
children of each contestant (gradstream, raw sockets, pickle, gloo) and their rows."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import importlib
import importlib.util
import os
import pickle
import shutil
import socket
import struct
import tempfile
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import numpy as np

from .children import (
    ChildError,
    Contestant,
    pair_times,
    recv_exactly,
    recv_go,
    run_rounds,
    socket_path,
    turns,
)
from .config import (
    F32,
    GO,
    HOT_BUFFER,
    LAYOUTS,
    Config,
    SessionSpec,
    importable,
    layout_arg,
    now_ns,
    progress_class,
    same_bits,
    size_text,
)
from .results import Results, Row, timed_row

# ------------------------------------------------------------- end-to-end children: gradstream


def prefaulted(like: F32) -> F32:
    """A new array of like's size with every page faulted in (np.zeros would map them
    lazily) and no value of a gradient. For the clock it is a buffer kept from turn to
    turn; made per turn, it keeps idle pairs from holding a gradient-sized buffer each
    (a full run has some twenty pairs of 1 GiB gradients)."""
    return np.ones_like(like)


@dataclass(frozen=True)
class Route:
    """How a gradstream row moves its gradient: over the socket itself or asyncio streams
    on it, under the default event loop or uvloop, received into a reused out= array or
    into the new array receive_from makes."""

    path: str = "socket"  # "socket" or "streams"
    loop: str = "asyncio"  # "asyncio" or "uvloop"
    into_out: bool = True


def _run(main: Coroutine[Any, Any, None], loop: str) -> None:
    factory = None
    if loop == "uvloop":
        factory = importlib.import_module("uvloop").new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main)


class _Link:
    """A connection as a gradstream stream (socket or asyncio streams) plus the go byte."""

    def __init__(self, sock: socket.socket, path: str) -> None:
        self.sock = sock
        self.path = path
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        if self.path == "streams":
            # The transport asyncio.start_server hands its callback, on a connected socket.
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
            return recv_go(self.sock)
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
    out: Any, _: Any, sock: socket.socket, spec: SessionSpec, route: Route, grad: F32
) -> None:
    session = spec.make()

    async def run() -> None:
        link = _Link(sock, route.path)
        await link.open()
        rep = 0
        while await link.go():
            t0 = now_ns()
            await session.stream_to(grad, link.stream)
            out.put(("t0", rep, t0))
            rep += 1
        await link.close()

    _run(run(), route.loop)


def _gs_receiver(
    out: Any, ctl: Any, sock: socket.socket, spec: SessionSpec, route: Route, grad: F32
) -> None:
    session = spec.make()
    progress_cls = progress_class(spec.impl)

    async def run() -> None:
        link = _Link(sock, route.path)
        await link.open()
        for rep in turns(ctl):
            # A pre-faulted out= array, as a training loop keeps its gradient buffer (the
            # raw TCP rows likewise): made before the go byte and dropped after the turn.
            dest = prefaulted(grad) if route.into_out else None
            progress = progress_cls()
            await link.send_go()
            got = await session.receive_from(link.stream, progress=progress, out=dest)
            t1 = now_ns()
            same = (dest is None or got is dest) and same_bits(got, grad)
            out.put(("t1", rep, t1, progress.bytes, same))
            del got, dest
        await link.close()

    _run(run(), route.loop)


def _conn_receiver(
    out: Any, ctl: Any, sock: socket.socket, grad: F32, unix: str | None = None
) -> None:
    """A blocking gs.sync connection (the defaults a gradstream connection has: compact
    layout, sealed, acknowledged), received into a pre-faulted out= each turn; over TCP,
    or at ``unix`` (a "unix:PATH" address: the same-host transport). The bench's socket
    carries the listener's port once (0 for unix), then the go bytes."""
    import gradstream
    from gradstream import sync as gsync

    with gsync.listen(unix or "127.0.0.1:0") as listener:
        port = 0 if unix else listener.address[1]
        sock.sendall(struct.pack("<H", port))
        with listener.accept(timeout=60) as conn:
            for rep in turns(ctl):
                dest = prefaulted(grad)
                progress = gradstream.TransferProgress()
                sock.sendall(GO)
                got = conn.recv(out=dest, progress=progress)
                t1 = now_ns()
                out.put(("t1", rep, t1, progress.bytes, got is dest and same_bits(got, grad)))
                del got, dest


def _conn_sender(out: Any, _: Any, sock: socket.socket, grad: F32, unix: str | None = None) -> None:
    from gradstream import sync as gsync

    head = bytearray(2)
    if recv_exactly(sock, memoryview(head)) != 2:
        raise ChildError("no listener port from the receiver")
    (port,) = struct.unpack("<H", head)
    with gsync.connect(unix or ("127.0.0.1", port)) as conn:
        rep = 0
        while recv_go(sock):
            t0 = now_ns()
            conn.send(grad)  # returns once the ack is back: t1 is taken before that
            out.put(("t0", rep, t0))
            rep += 1


# ------------------------------------------------------------- end-to-end children: raw, pickle


def _raw_sender(out: Any, _: Any, sock: socket.socket, grad: F32, mode: str) -> None:
    """mode "reuse" / "new" / "slices": one sendall of the whole gradient; "hot": the
    gradient's size as sendalls of one 1 MiB buffer, again and again (it stays in the CPU
    caches)."""
    view = grad.data.cast("B")
    hot = memoryview(bytes(min(len(view), HOT_BUFFER)))
    rep = 0
    while recv_go(sock):
        t0 = now_ns()
        if mode != "hot":
            sock.sendall(view)
        else:
            for start in range(0, len(view), len(hot)):
                sock.sendall(hot[: len(view) - start])
        out.put(("t0", rep, t0))
        rep += 1


def _recv_slices(sock: socket.socket, view: memoryview) -> int:
    """Fill view by recv_into calls of at most 1 MiB each, in order (as a receiver that
    reads a frame's values straight into their place does); the bytes read."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got : got + HOT_BUFFER])
        if n == 0:
            break
        got += n
    return got


def _raw_receiver(out: Any, ctl: Any, sock: socket.socket, grad: F32, mode: str) -> None:
    """mode "reuse": recv_into a pre-faulted gradient-sized buffer; "slices": the same in
    1 MiB recv_into calls; "new": into a new array (its page faults timed); "hot": into
    one 1 MiB buffer, again and again (the bytes are lost)."""
    hot = prefaulted(np.empty(HOT_BUFFER // 4, dtype=np.float32))
    for rep in turns(ctl):
        if mode == "hot":
            buf = hot
        elif mode == "new":
            buf = np.empty(grad.size, dtype=np.float32)  # faulted in by recv_into, timed
        else:
            buf = prefaulted(grad)  # untimed: made before the go byte
        sock.sendall(GO)
        view = buf.data.cast("B")
        if mode == "hot":
            got = 0
            while got < grad.nbytes:
                step = recv_exactly(sock, view[: min(len(view), grad.nbytes - got)])
                if step == 0:
                    break
                got += step
        else:
            got = _recv_slices(sock, view) if mode == "slices" else recv_exactly(sock, view)
        # The clock stops when the bytes are in, before the check (as for every peer).
        t1 = now_ns()
        ok = got == grad.nbytes and (mode == "hot" or same_bits(buf, grad))
        out.put(("t1", rep, t1, got, ok))
        del view, buf


def _pickle_sender(out: Any, _: Any, sock: socket.socket, grad: F32, oob: bool) -> None:
    rep = 0
    while recv_go(sock):
        t0 = now_ns()
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


class _Buffers:
    """Receive buffers kept from turn to turn by size (pickle lets a receiver reuse them:
    out-of-band buffers become the loaded array's memory, in-band bytes are copied out)."""

    def __init__(self) -> None:
        self.kept: dict[tuple[int, int], bytearray] = {}

    def recv(self, sock: socket.socket, size: int, slot: int = 0) -> bytearray:
        buf = self.kept.get((slot, size))
        if buf is None:
            buf = self.kept[(slot, size)] = bytearray(size)
        if recv_exactly(sock, memoryview(buf)) != size:
            raise ChildError("the sender closed the connection")
        return buf


def _pickle_receiver(out: Any, ctl: Any, sock: socket.socket, grad: F32, oob: bool) -> None:
    kept = _Buffers()
    for rep in turns(ctl):
        sock.sendall(GO)
        if oob:
            meta_len, count = struct.unpack("<QQ", kept.recv(sock, 16))
            sizes = struct.unpack(f"<{count}Q", kept.recv(sock, 8 * count))
            meta = kept.recv(sock, meta_len)
            bufs = [kept.recv(sock, size, slot) for slot, size in enumerate(sizes, 1)]
            got = pickle.loads(meta, buffers=bufs)
            wire = 16 + 8 * count + meta_len + sum(sizes)
        else:
            (size,) = struct.unpack("<Q", kept.recv(sock, 8))
            got = pickle.loads(kept.recv(sock, size, 1))
            wire = 8 + size
        t1 = now_ns()
        out.put(("t1", rep, t1, wire, same_bits(got, grad)))
        if oob:
            got.fill(0)  # its memory is a kept buffer: a stale copy must not pass next turn
        del got


# ------------------------------------------------------------- end-to-end children: gloo


def _gloo_worker(out: Any, ctl: Any, rank: int, folder: str, grad: F32, timeout: float) -> None:
    """torch.distributed gloo send/recv. Rank 1 (the receiver, the trigger) tells rank 0 to
    go on or stop with a one-value tensor, then both leave a barrier and the timing starts.
    The rendezvous is a file store in ``folder`` (rank 1 removes it): a TCP store's port,
    chosen before the children start, could be taken meanwhile by another row's listener."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only
    os.makedirs(folder, exist_ok=True)
    torch: Any = importlib.import_module("torch")
    dist: Any = importlib.import_module("torch.distributed")
    dist.init_process_group(
        "gloo",
        init_method=f"file://{folder}/store",
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
                t0 = now_ns()
                dist.send(tensor, dst=1)
                out.put(("t0", rep, t0))
                rep += 1
        else:
            # One receive tensor for every turn (gloo receives into the caller's tensor).
            buf = torch.empty(grad.size, dtype=torch.float32)
            for rep in turns(ctl):
                dist.send(torch.ones(1, dtype=torch.int32), dst=0)
                dist.barrier()
                dist.recv(buf, src=0)
                t1 = now_ns()
                out.put(("t1", rep, t1, grad.nbytes, same_bits(buf.numpy(), grad)))
                buf.numpy().fill(0)  # shares the tensor's memory: no stale pass next turn
            dist.send(flag, dst=0)  # zero: stop
    finally:
        dist.destroy_process_group()
        if rank == 1:
            shutil.rmtree(folder, ignore_errors=True)


RAW_TCP = (
    ("raw_tcp", "reuse", "raw loopback TCP {}, sendall / recv_into a reused buffer", ""),
    (
        "raw_tcp_slices",
        "slices",
        "raw loopback TCP {}, recv_into the reused buffer, 1 MiB slices",
        "the socket path's baseline: same destination, no framing, no CRC",
    ),
    ("raw_tcp_new", "new", "raw loopback TCP {}, recv_into a new array each time", ""),
    ("raw_tcp_hot", "hot", "raw loopback TCP {} through 1 MiB buffers (cache-hot)", ""),
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


@dataclass(frozen=True)
class GsRow:
    """One gradstream row of section 3: who, over what, into what."""

    impl: str  # "native" or "reference"
    layout: str
    route: Route
    suffix: str = ""  # of the key, after the layout
    off: tuple[str, ...] = ()  # native drivers turned off (config.drivers_off)
    chunk_size: int = 65536

    @property
    def key(self) -> str:
        path = "uvloop" if self.route.loop == "uvloop" else self.route.path
        return f"e2e_{self.impl}_{path}_{self.layout}{self.suffix}"

    def name(self, label: str) -> str:
        what = "socket" if self.route.path == "socket" else "asyncio streams"
        if self.route.loop == "uvloop":
            what += " under uvloop"
        into = "into out=" if self.route.into_out else "receive_from into a new array"
        without = "".join(f", without {driver}" for driver in self.off)
        chunks = "" if self.chunk_size == 65536 else f", chunk {self.chunk_size}"
        return f"{self.impl} {what}, {self.layout} layout{chunks}, {label}, {into}{without}"


STREAMS = Route("streams")
GS_ROWS = (
    *(GsRow("native", layout, Route()) for layout in LAYOUTS),
    # The default call, receive_from into a new array: against the out= rows beside them,
    # and (compact) against raw TCP recv_into a new array.
    *(GsRow("native", layout, Route(into_out=False), "_new") for layout in LAYOUTS),
    *(GsRow("native", layout, STREAMS) for layout in LAYOUTS),
    *(GsRow("native", layout, Route("streams", "uvloop")) for layout in LAYOUTS),
    *(GsRow("reference", layout, route) for route in (Route(), STREAMS) for layout in LAYOUTS),
    # Section 7's rows: a driver turned off, beside the row that has it.
    *(GsRow("native", layout, STREAMS, "_generic", ("handover",)) for layout in LAYOUTS),
    # Larger chunks on the socket path (issue 23: fewer frames, fewer system calls).
    *(
        GsRow("native", "compact", Route(), f"_chunk{size}", chunk_size=size)
        for size in (262_144, 1_048_576)
    ),
)
# What each kind of row has that the others do not (the "keep every peer honest" notes).
STREAMS_NOTE = "open_connection(sock=) at both ends (start_server's transport)"
CONNECTION_NOTE = "the torch backend's path; t1 before the ack goes back"
UNIX_NOTE = "two processes of this machine; its ratio is against memcpy, the TCP row beside it"
PICKLE_NOTES = {
    False: "handicap: dumps makes a new bytes and loads a new array (no out=); "
    "the receive buffer is reused",
    True: "receive buffers reused, the array loaded over them without a copy; no checksum",
}


def _gs_plan(row: GsRow, cfg: Config, grad: F32, available: dict[str, str | None]) -> Planned:
    name = row.name(size_text(grad.nbytes))
    why = available[row.impl]
    if row.layout == "compact" and why is not None:
        return Planned(row.key, "e2e", name, None, why)
    if row.route.loop == "uvloop" and not importable("uvloop"):
        return Planned(row.key, "e2e", name, None, "uvloop is not importable")
    layout = layout_arg(row.layout, available, row.impl)
    spec = SessionSpec(row.impl, row.chunk_size, layout, cfg.stall_timeout, row.off)
    c = Contestant(
        row.key,
        ("recv", _gs_receiver, (spec, row.route, grad)),
        ("send", _gs_sender, (spec, row.route, grad)),
        per_turn=2,
    )
    note = STREAMS_NOTE if row.route.path == "streams" else ""
    if not row.route.into_out:
        note = "the default call: a new array per receive, against the out= row beside it"
    if row.off:
        note = f"section 7: the path without {', '.join(row.off)}, against the row with it"
    return Planned(row.key, "e2e", name, c, note)


def plan_transfers(cfg: Config, grad: F32, available: dict[str, str | None]) -> list[Planned]:
    """The raw TCP rows of section 1 and the rows of section 3, as contestants."""
    label = size_text(grad.nbytes)
    plans: list[Planned] = []
    for key, mode, name, note in RAW_TCP:
        c = Contestant(
            key,
            ("recv", _raw_receiver, (grad, mode)),
            ("send", _raw_sender, (grad, mode)),
            per_turn=2,
        )
        note = note or ("" if mode == "reuse" else "information only")
        plans.append(Planned(key, "limits", name.format(label), c, note))

    plans += [_gs_plan(row, cfg, grad, available) for row in GS_ROWS]

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
        plans.append(Planned(key, "e2e", name, c, PICKLE_NOTES[oob]))

    c = Contestant(
        "e2e_native_connection",
        ("recv", _conn_receiver, (grad,)),
        ("send", _conn_sender, (grad,)),
        per_turn=2,
    )
    name = (
        f"native gs.sync connection (connection defaults: compact, sealed, ack), {label}, into out="
    )
    plans.append(Planned("e2e_native_connection", "e2e", name, c, CONNECTION_NOTE))

    # The same over the same-host transport (issue 24): a Unix socket, shared-memory rings.
    unix = "unix:" + socket_path("e2e")
    c = Contestant(
        "e2e_native_unix",
        ("recv", _conn_receiver, (grad, unix)),
        ("send", _conn_sender, (grad, unix)),
        per_turn=2,
    )
    name = f"native gs.sync unix: connection (shared-memory rings), {label}, into out="
    plans.append(Planned("e2e_native_unix", "e2e", name, c, UNIX_NOTE))

    name = f"torch.distributed gloo send/recv, {label}"
    if importlib.util.find_spec("torch") is None:
        plans.append(Planned("e2e_gloo", "e2e", name, None, "torch is not installed"))
    else:
        # Made by the workers (a plan that is not run leaves nothing behind).
        folder = os.path.join(tempfile.gettempdir(), f"gradstream-bench-gloo-{os.urandom(8).hex()}")
        # Its rank 0 waits for its turn inside gloo, so the gloo timeout covers whole rounds.
        wait = cfg.deadline * 20
        c = Contestant(
            "e2e_gloo",
            ("gloo-recv", _gloo_worker, (1, folder, grad, wait)),
            ("gloo-send", _gloo_worker, (0, folder, grad, wait)),
            per_turn=2,
            connect=False,
        )
        note = "receive tensor reused; wire bytes taken as the gradient's"
        plans.append(Planned("e2e_gloo", "e2e", name, c, note))
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
            seconds, wire = pair_times(c.messages, cfg.repeats)
        except ChildError as exc:
            res.add(Row(p.key, p.section, p.name, "failed", str(exc)))
            continue
        res.add(
            timed_row(
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
