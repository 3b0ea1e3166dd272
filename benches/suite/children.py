"""Child processes: every figure that crosses a socket is measured between two of them."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import multiprocessing as mp
import os
import queue
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from .config import GO

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


def turns(ctl: Any) -> Iterator[int]:
    """The repeat numbers the parent hands out, until it says stop."""
    while True:
        rep = ctl.recv()
        if rep is None:
            return
        yield int(rep)


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    """A connected TCP pair on 127.0.0.1 (client, server side), TCP_NODELAY on both."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname()[:2])
        conn, _ = server.accept()
    for s in (client, conn):
        s.setblocking(True)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return client, conn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_socket_folder: list[str] = []


def socket_path(name: str) -> str:
    """A fresh Unix socket path for a contestant, in one directory of this run's own,
    removed (with the listeners' PATH.lock files) when the run's process exits."""
    if not _socket_folder:
        folder = tempfile.mkdtemp(prefix="gradstream-bench-")
        atexit.register(shutil.rmtree, folder, True)
        _socket_folder.append(folder)
    return os.path.join(_socket_folder[0], f"{name}-{os.urandom(4).hex()}.sock")


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
            socks: tuple[socket.socket, ...] = tcp_pair() if c.connect else ()
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


def pair_times(messages: list[tuple[Any, ...]], repeats: int) -> tuple[list[float], int]:
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


def recv_exactly(sock: socket.socket, view: memoryview) -> int:
    """Fill view from sock; the bytes read (fewer only at the end of the stream)."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            break
        got += n
    return got


def recv_go(sock: socket.socket) -> bool:
    """Wait for the receiver's go byte; False when it closed the connection instead."""
    data = sock.recv(1)
    if data not in (GO, b""):
        raise ChildError(f"bad go byte {data!r}")
    return data == GO
