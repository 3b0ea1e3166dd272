"""``gradstream recv``: serve any number of connections at once (``serve``), save every
gradient that arrives as a .npy file (or, when ``--out`` is a .npz or .safetensors file,
every tensor set as one such file: ``_cli_files``), and stop after ``--count`` gradients
in all, or never (``--forever``, until SIGINT or SIGTERM).

The suffix of ``--out`` decides the kind a run waits for: the library tells a tensor
set's manifest from a lone gradient by the seal of the first chunk and refuses the other
kind there (the connection closes; its sender's transfer fails), so a receiver cannot
take whichever comes. A refused one is logged in the command's words, and nothing of it
is written.

Three rules make a run honest about what it kept:

* **Slots.** With ``--count N`` a connection takes one of the N slots before it reads a
  gradient, and gives it back if that gradient fails. So at most the gradients still
  missing are read at once, and no gradient past the N-th is ever read, let alone
  acknowledged: its sender's ``send`` fails (``DeliveryError``) when the run ends.
* **Shares.** ``--max-bytes B`` is split evenly: each gradient is received with room for
  ``B / N`` bytes (``B`` with ``--forever``) counted at the widest value a peer can send,
  and the session refuses, before it is acknowledged and before anything is written, a
  gradient that would take more. The N gradients together stay within ``B``, however
  they arrive; the hello tells each sender its limit, so it fails at once, not at the end.
* **Bad peers do not end a run.** A peer the listener refuses (TLS, hello, authkey) is
  logged by the library; a gradient that fails (its CRC, its seal, the room) is logged
  here, with the peer, and its connection closed. The run goes on serving the others.

Over ``_cli_base``, ``_cli_link`` and ``serve``; ``cli`` calls ``run_recv``.
"""

from __future__ import annotations

import argparse
import asyncio
import enum
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy.typing as npt

from . import TransferProgress
from ._cli_base import (
    MIB,
    WIDEST_VALUE,
    CliError,
    count_of,
    describe_peer,
    describe_transfer_error,
    describe_values,
    format_address,
    format_bytes,
    format_size,
    library_address,
    parse_address,
    rate,
    resolve,
    say,
    shown,
)
from ._cli_files import (
    SET_SUFFIXES,
    WANTS_A_GRADIENT,
    WANTS_A_SET,
    describe_set,
    needs_safetensors,
    remove_quietly,
    write_gradient,
    write_set,
)
from ._cli_link import LinkSettings, cli_session, link_settings
from ._connection import Connection, serve
from ._session import GradientStreamSession
from .errors import GradientStreamError

__all__ = ["LISTENING_PREFIX", "output_path", "output_paths", "run_recv"]

DEFAULT_HOST = "127.0.0.1"
# The first line `recv` prints; `gradstream demo` and the tests parse it.
LISTENING_PREFIX = "listening on "
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

log = logging.getLogger("gradstream.cli")


# --------------------------------------------------------------------------- files


def output_path(out: Path, index: int, count: int | None) -> Path:
    """Where the ``index``-th gradient saved (from 0) goes: ``out`` itself
    when the run takes one, else ``STEM-index.SUFFIX`` (``--forever`` numbers them all)."""
    if count == 1:
        return out
    return out.with_name(f"{out.stem}-{index}{out.suffix}")


def output_paths(out: Path, count: int) -> list[Path]:
    """``out`` itself for one gradient; ``STEM-0.SUFFIX``, ``STEM-1.SUFFIX``... for more."""
    return [output_path(out, i, count) for i in range(count)]


def _rename(part: Path, path: Path) -> None:
    """The written `part` becomes `path` at once (a reader never sees half a file)."""
    try:
        os.replace(part, path)
    except OSError as exc:
        remove_quietly(part)
        raise CliError(f"cannot write {path}: {exc.strerror or exc}") from exc


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class RecvPlan:
    """What the command line asks of one ``recv`` run (its settings; no run state)."""

    address: tuple[str, int]
    out: Path
    count: int | None  # None: --forever
    max_bytes: int
    idle_timeout: float | None  # --timeout, for the wait without a connection
    max_connections: int | None

    @property
    def takes_sets(self) -> bool:
        """Whether the run receives tensor sets (--out FILE.npz or FILE.safetensors) or
        lone gradients (any other --out): the peer's kind must be this one."""
        return self.out.suffix.lower() in SET_SUFFIXES

    @property
    def share(self) -> int:
        """The bytes of values one gradient may take."""
        return self.max_bytes // (self.count or 1)

    @property
    def room(self) -> int:
        """The values one gradient may hold, each counted at the widest dtype."""
        return self.share // WIDEST_VALUE

    @property
    def kind(self) -> str:
        """What the run takes, in its lines: `tensor set` or `gradient`."""
        return "tensor set" if self.takes_sets else "gradient"

    def label(self, index: int) -> str:
        kind = self.kind
        if self.count == 1:
            return kind
        return f"{kind} {index + 1}" + ("" if self.count is None else f"/{self.count}")

    def bound(self) -> str:
        """`--max-bytes 8K over --count 2 (4,096 bytes a gradient: room for 512 values of
        up to 8 bytes)`, as the refusals name it."""
        over = "" if (self.count or 1) == 1 else f" over --count {self.count}"
        return (
            f"--max-bytes {format_size(self.max_bytes)}{over} ({self.share:,} bytes a "
            f"gradient: room for {count_of(self.room, 'value')} of up to {WIDEST_VALUE} bytes)"
        )


def recv_plan(args: argparse.Namespace) -> RecvPlan:
    host, port = parse_address(args.address, default_host=DEFAULT_HOST, allow_port_zero=True)
    count = None if args.forever else (1 if args.count is None else args.count)
    if count is not None and count < 1:
        raise CliError(f"--count must be >= 1, got {count}", 2)
    if args.max_connections is not None and args.max_connections < 1:
        raise CliError(f"--max-connections must be >= 1, got {args.max_connections}", 2)
    plan = RecvPlan(
        address=(host, port),
        out=Path(args.out),
        count=count,
        max_bytes=args.max_bytes,
        idle_timeout=None if count is None else args.timeout,
        max_connections=args.max_connections,
    )
    if plan.room < 1:
        each = "" if (count or 1) == 1 else f" for each of {count} gradients"
        raise CliError(
            f"--max-bytes {format_size(plan.max_bytes)} leaves less than {WIDEST_VALUE} bytes"
            f"{each}: no room for one value (recv counts {WIDEST_VALUE} bytes a value)",
            2,
        )
    first = output_path(plan.out, 0, count)
    if not first.parent.is_dir():
        raise CliError(f"cannot write {first}: directory {first.parent} does not exist")
    if plan.takes_sets and args.protocol == "seed":
        raise CliError(
            f"--out {plan.out.name} saves tensor sets, which --protocol seed does not carry "
            "(the seed wire has flat float32 gradients alone): give --out FILE.npy, or use "
            "--protocol gradstream",
            2,
        )
    needs_safetensors(plan.out)
    return plan


# --------------------------------------------------------------------------- the run


class RunState(enum.Enum):
    RECEIVING = "receiving"
    COMPLETE = "complete"  # --count gradients saved
    STOPPED = "stopped"  # by a signal
    FAILED = "failed"  # a file not written, or no connection within --timeout


class Run:
    """One ``recv`` run as it goes: its state, the slots of ``--count``, the gradients
    arrived and saved, the connections open (for ``--timeout``) and the saves running."""

    def __init__(self, plan: RecvPlan) -> None:
        self.plan = plan
        self.state = RunState.RECEIVING
        self.finished = asyncio.Event()
        self.failure: CliError | None = None
        self.stopped_by: signal.Signals | None = None
        self.saved = 0
        self.chunks = 0  # counted over the saved gradients
        self._arrived = 0  # gradients arrived, for their files' temporary names
        self._slots = None if plan.count is None else asyncio.Semaphore(plan.count)
        self._open = 0
        self._idle: asyncio.TimerHandle | None = None
        self._saves: set[asyncio.Task[None]] = set()
        self._numbering = asyncio.Lock()
        # The gradients under way when the run stopped, dropped: (peer, bytes received).
        self.dropped: list[tuple[str, int]] = []

    # ---- state

    def _finish(self, state: RunState) -> None:
        if self.state is RunState.RECEIVING:
            self.state = state
            self.finished.set()
            if self._idle is not None:
                self._idle.cancel()

    def stop(self, signum: signal.Signals) -> None:
        if self.state is RunState.RECEIVING:
            self.stopped_by = signum
            self._finish(RunState.STOPPED)

    def fail(self, error: CliError) -> None:
        if self.state is RunState.RECEIVING:
            self.failure = error
            self._finish(RunState.FAILED)

    # ---- slots

    async def claim(self) -> bool:
        """A slot for the next gradient of a connection; False once the run is over."""
        if self._slots is not None:
            await self._slots.acquire()
        if self.state is not RunState.RECEIVING:
            self.release()
            return False
        return True

    def release(self) -> None:
        """Give back a slot whose gradient did not arrive."""
        if self._slots is not None:
            self._slots.release()

    # ---- connections, for --timeout

    def watch_idle(self) -> None:
        """With --timeout, fail when no connection is open for that long."""
        seconds = self.plan.idle_timeout
        if seconds is not None and self._open == 0 and self.state is RunState.RECEIVING:
            loop = asyncio.get_running_loop()
            self._idle = loop.call_later(seconds, self._idle_too_long, seconds)

    def _idle_too_long(self, seconds: float) -> None:
        done = (
            f" ({self.saved} of {self.plan.count} {self.plan.kind}s received)" if self.saved else ""
        )
        self.fail(CliError(f"no connection within {seconds:g} s{done}"))

    def opened(self) -> None:
        self._open += 1
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None

    def closed(self) -> None:
        self._open -= 1
        self.watch_idle()

    # ---- saving

    def keep(self, received: Received, who: str, seconds: float) -> asyncio.Task[None]:
        """Save a gradient that arrived, in a task of its own (a cancelled connection does
        not cancel it: ``saves_done`` waits for it)."""
        self._arrived += 1
        part = self.plan.out.with_name(f"{self.plan.out.name}.{self._arrived}.part")
        task = asyncio.get_running_loop().create_task(self._save(part, received, who, seconds))
        self._saves.add(task)
        task.add_done_callback(self._saves.discard)
        return task

    async def _save(self, part: Path, received: Received, who: str, seconds: float) -> None:
        """Write the gradient, then give it the next number: files and lines are numbered
        in the order the gradients are saved (a large one still being written does not
        hold a number up)."""
        try:
            if isinstance(received.values, dict):
                kind = self.plan.out.suffix.lower()
                await asyncio.to_thread(write_set, part, received.values, kind)
            else:
                await asyncio.to_thread(write_gradient, part, received.values)
            async with self._numbering:
                index = self.saved
                path = output_path(self.plan.out, index, self.plan.count)
                await asyncio.to_thread(_rename, part, path)
                self.saved += 1
                self._report(index, path, received, who, seconds)
        except CliError as exc:
            self.fail(exc)
            return
        if self.saved == self.plan.count:
            self._finish(RunState.COMPLETE)

    def _report(self, index: int, path: Path, received: Received, who: str, seconds: float) -> None:
        values = received.values
        self.chunks += received.chunks
        if isinstance(values, dict):
            nbytes = sum(t.nbytes for t in values.values())
            what = (
                f"{describe_set(values)} ({format_bytes(nbytes)} of values, "
                f"{format_bytes(received.wire)} on the wire)"
            )
        else:
            nbytes = values.nbytes
            what = f"{describe_values(values.dtype, values.shape)} ({nbytes / MIB:,.1f} MiB)"
        say(
            f"received {self.plan.label(index)}: {what}, {received.chunks:,} chunks in "
            f"{seconds:.3f} s, {rate(nbytes, seconds)} from {who} -> {path}"
        )

    async def saves_done(self) -> None:
        while self._saves:
            await asyncio.gather(*self._saves)

    def checks_passed(self) -> str:
        """`all 12 chunk CRC-32 checks passed` (a getting here means every one held)."""
        return f"all {self.chunks:,} chunk CRC-32 checks passed"


# --------------------------------------------------------------------------- a connection


def _refusal(plan: RecvPlan, who: str, exc: Exception) -> str:
    # The library refuses the other kind at chunk 0, from its seal, before anything of it
    # is acknowledged or written; --out decides which kind the run takes.
    if WANTS_A_GRADIENT in str(exc):
        return (
            f"tensor set from {who} refused: --out {plan.out.name} saves lone gradients; "
            "give --out FILE.npz or FILE.safetensors to save tensor sets"
        )
    if WANTS_A_SET in str(exc):
        return (
            f"lone gradient from {who} refused: --out {plan.out.name} saves tensor sets; "
            "give --out FILE.npy to save lone gradients"
        )
    # The session stops a gradient at its max_gradient_len, the room of --max-bytes: a
    # header's total_chunks, a compressed batch's rows, or the values counted so far.
    if "max_gradient_len" in str(exc):
        return f"{plan.kind} from {who} refused: it would pass {plan.bound()}: " + (
            describe_transfer_error(exc)
        )
    return f"{plan.kind} from {who} failed: {describe_transfer_error(exc)}"


@dataclass(frozen=True)
class Received:
    """One gradient or tensor set from a connection, and the chunks and wire bytes it
    came in."""

    values: npt.NDArray[Any] | dict[str, npt.NDArray[Any]]
    chunks: int
    wire: int


async def _next_gradient(
    conn: Connection, progress: TransferProgress, plan: RecvPlan
) -> Received | None:
    """The connection's next gradient (a tensor set when the run takes sets), or None
    when the peer closed it before one began (``recv`` then gives an empty array,
    ``recv_tensors`` an empty set, and the connection says it is closed; an empty
    gradient leaves it open). A set is bounded as a gradient is, by its values in all."""
    if plan.takes_sets:
        tensors = await conn.recv_tensors(progress=progress, max_values=plan.room)
        if not tensors and conn.closed:
            return None
        return Received(tensors, progress.chunks, progress.bytes)
    values = await conn.recv(progress=progress)
    if values.size == 0 and conn.closed:
        return None
    return Received(values, progress.chunks, progress.bytes)


async def _take_gradients(run: Run, conn: Connection) -> None:
    """Every gradient of one connection, each under a slot, until the peer closes, a
    gradient fails, or the run is over."""
    who = describe_peer(conn.peer)
    run.opened()
    try:
        while await run.claim():
            start = time.perf_counter()
            progress = TransferProgress()
            try:
                received = await _next_gradient(conn, progress, run.plan)
            except (GradientStreamError, OSError) as exc:
                run.release()
                log.warning("%s", _refusal(run.plan, who, exc))
                return
            except BaseException:
                # Cancelled as the run stops: a gradient begun is dropped (unacknowledged).
                if progress.bytes:
                    run.dropped.append((who, progress.bytes))
                run.release()
                raise
            if received is None:
                run.release()
                return
            seconds = time.perf_counter() - start
            # Its slot is spent: the gradient arrived (and was acknowledged).
            await asyncio.shield(run.keep(received, who, seconds))
    finally:
        run.closed()


# --------------------------------------------------------------------------- the command


async def _serve(plan: RecvPlan, session: GradientStreamSession, link: LinkSettings) -> Run:
    run = Run(plan)
    loop = asyncio.get_running_loop()
    for signum in STOP_SIGNALS:
        loop.add_signal_handler(signum, run.stop, signum)
    where = format_address(*plan.address)
    try:
        try:
            caps = {} if plan.max_connections is None else {"max_connections": plan.max_connections}
            server = await serve(
                library_address(plan.address),
                lambda conn: _take_gradients(run, conn),
                session=session,
                **link.keywords(),
                **caps,
            )
        except OSError as exc:
            raise CliError(f"cannot listen on {where}: {exc.strerror or exc}") from exc
        except GradientStreamError as exc:
            raise CliError(f"cannot listen on {where}: {describe_transfer_error(exc)}") from exc
        try:
            say(f"{LISTENING_PREFIX}{shown(server.address)}")
            run.watch_idle()
            await run.finished.wait()
        finally:
            await server.close()
            await run.saves_done()
    finally:
        for signum in STOP_SIGNALS:
            loop.remove_signal_handler(signum)
    return run


def _outcome(run: Run) -> int:
    """The last line and the exit status of a finished run."""
    if run.state is RunState.FAILED:
        assert run.failure is not None
        raise run.failure
    if run.state is RunState.COMPLETE:
        say(run.checks_passed())
        return 0
    assert run.stopped_by is not None
    received = count_of(run.saved, run.plan.kind)
    passed = f"; {run.checks_passed()}" if run.saved else ""
    dropped = "".join(
        f"; dropped the {run.plan.kind} under way from {who} ({n:,} bytes of it received, not "
        "acknowledged)"
        for who, n in run.dropped
    )
    say(f"stopped by {run.stopped_by.name} after {received}{passed}{dropped}")
    if run.plan.count is None:
        return 0  # a signal is how --forever ends
    return 128 + run.stopped_by.value


def run_recv(args: argparse.Namespace) -> int:
    """``gradstream recv``; its exit status."""
    plan = recv_plan(args)
    link = link_settings(args, listening=True)
    resolve(*plan.address, passive=True)
    session = cli_session(timeout=args.timeout, max_gradient_len=plan.room)
    return _outcome(asyncio.run(_serve(plan, session, link)))
