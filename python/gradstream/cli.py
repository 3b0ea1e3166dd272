"""The ``gradstream`` command: send and receive gradients over TCP, and the demo.

    gradstream recv [HOST:]PORT --out FILE.npy [--count N] [--max-bytes B]
                    [--impl native|reference] [--timeout S]
    gradstream send HOST:PORT FILE.npy [FILE.npy ...] [--chunk-size N] [--layout L]
                    [--compression C] [--impl ...] [--timeout S]
    gradstream demo [--elements N] [--impl-only native|reference] [--chunk-size N]

(``python -m gradstream ...`` is the same command. The benchmarks are not part of it: they
live in the repository's ``benches/``, run by ``make bench``.)

``recv`` listens, prints ``listening on HOST:PORT`` as its first line of output (PORT 0
picks a free port; the line gives the one bound), accepts one connection and receives
``--count`` gradients from it, one after the other. ``send`` connects and sends each file
in turn over that one connection, so ``send`` with two files pairs with ``recv --count 2``.
``send`` sends float32 values without their shape (a file of any shape arrives 1-D).
``recv`` saves each gradient as it arrives: a Python peer may send float16, bfloat16 or
float64 values (``keep_dtype=True``) or a shape (``keep_shape=True``), and those are kept.
The line each prints for a gradient says the dtype and shape sent or received.

``recv --max-bytes B`` (default 4G; a number of bytes, or with a K, M or G suffix, binary)
bounds the bytes of values the whole run accepts: each gradient's bytes count against it,
so with ``--count N`` the N gradients together. Each gradient is received with room for
the bytes left counted at the widest value a peer can send (8 bytes, float64), so that
whatever a peer sends the values ``recv`` holds stay within the bound (decoding a
compressed chunk also takes, for a moment, a buffer of its uncompressed size); a float32
gradient can therefore take at most half of what is left. A gradient that would pass the
bound fails the command (exit 1, one line naming the bound) and nothing of it is written;
the gradients before it stay saved.

Exit status: 0 on success; 1 when a transfer, a connection, a file or a verification
fails; 2 for a command-line mistake (unknown option, bad HOST:PORT); 130 on Ctrl-C.
Failures print one line on stderr (``gradstream: error: ...``), never a traceback; a
failed transfer names the ``gradstream.errors`` class that stopped it.

A progress bar (tqdm) appears on stderr for a transfer that runs longer than a second,
when stderr is a terminal; ``--no-progress`` turns it off.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import math
import os
import re
import socket
import sys
import textwrap
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, Protocol, TypeVar, cast

import numpy as np
import numpy.typing as npt

from ._dtypes import DTYPES, numpy_dtype
from .errors import GradientStreamError

__all__ = ["CliError", "format_size", "main", "output_paths", "parse_address", "parse_size"]

T = TypeVar("T")

DEFAULT_HOST = "127.0.0.1"
SESSION_ID = "gradstream-cli"
MIB = 2**20
# The first line `recv` prints; `gradstream demo` and the tests parse it.
LISTENING_PREFIX = "listening on "
IMPLS = ("native", "reference")
PROGRESS_POLL_S = 0.1
PROGRESS_DELAY_S = 1.0
SIZE_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}
MAX_SIZE = 2**63 - 2**30  # a whole number of G, and far beyond any machine's memory
DEFAULT_MAX_BYTES = "4G"
# The widest value a receiving session can hand back (float64, from a peer that keeps its
# dtype): recv's room for values is the bytes left over this.
WIDEST_VALUE = max(numpy_dtype(name).itemsize for name in DTYPES)


class CliError(Exception):
    """A failure reported as one line on stderr, with an exit status."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


# --------------------------------------------------------------------------- impls


class _Progress(Protocol):
    @property
    def bytes(self) -> int: ...
    @property
    def chunks(self) -> int: ...
    @property
    def total_chunks(self) -> int: ...


class _Session(Protocol):
    @property
    def keep_shape(self) -> bool: ...
    def stream_to(
        self, gradient: Any, stream: Any, /, *, progress: Any = None
    ) -> Awaitable[int]: ...
    def receive_from(
        self, stream: Any, /, *, progress: Any = None
    ) -> Awaitable[npt.NDArray[Any]]: ...


@dataclass(frozen=True)
class _Impl:
    name: str
    session_class: Callable[..., Any]
    progress_class: Callable[[], Any]

    def session(
        self,
        chunk_size: int | None = None,
        timeout: float | None = None,
        layout: str = "seed",
        compression: str | None = None,
        max_gradient_len: int | None = None,
    ) -> _Session:
        args: list[Any] = [SESSION_ID]
        if chunk_size is not None:
            args.append(chunk_size)
        kwargs: dict[str, Any] = {"layout": layout}
        if compression is not None:
            kwargs["compression"] = compression
        if max_gradient_len is not None:
            kwargs["max_gradient_len"] = max_gradient_len
        if timeout is not None:
            kwargs["timeout"] = timeout
        try:
            return cast(_Session, self.session_class(*args, **kwargs))
        except (ValueError, OverflowError, TypeError) as exc:
            raise CliError(f"bad session settings: {exc}", 2) from exc

    def progress(self) -> _Progress:
        return cast(_Progress, self.progress_class())


def load_impl(name: str) -> _Impl:
    """The native (Rust) or the reference (pure Python) implementation, checked for streaming."""
    module = importlib.import_module("gradstream" if name == "native" else "gradstream.reference")
    session_class = getattr(module, "GradientStreamSession", None)
    progress_class = getattr(module, "TransferProgress", None)
    missing = [
        what
        for what, ok in (
            ("GradientStreamSession.stream_to", hasattr(session_class, "stream_to")),
            ("GradientStreamSession.receive_from", hasattr(session_class, "receive_from")),
            ("TransferProgress", progress_class is not None),
        )
        if not ok
    ]
    if missing or session_class is None or progress_class is None:
        other = "reference" if name == "native" else "native"
        raise CliError(
            f"the {name} implementation in this build has no streaming support "
            f"(missing {', '.join(missing)}); try --impl {other}"
        )
    return _Impl(name, session_class, progress_class)


# --------------------------------------------------------------------------- addresses


def parse_address(
    text: str, *, default_host: str | None = None, allow_port_zero: bool = False
) -> tuple[str, int]:
    """Split ``HOST:PORT`` (``[v6addr]:PORT`` for IPv6) into (host, port).

    With ``default_host``, a bare ``PORT`` is accepted too. Raises ``CliError`` (status 2).
    """

    def bad(why: str) -> NoReturn:
        form = "[HOST:]PORT" if default_host is not None else "HOST:PORT"
        raise CliError(f"bad address {text!r}: {why} (expected {form})", 2)

    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            bad("no closing ']'")
        host, rest = text[1:end], text[end + 1 :]
        if not rest.startswith(":"):
            bad("no ':PORT' after ']'")
        port_text = rest[1:]
    elif ":" in text:
        host, _, port_text = text.rpartition(":")
        if ":" in host:
            bad("put an IPv6 address in brackets, as in [::1]:PORT")
    elif default_host is not None:
        host, port_text = default_host, text
    else:
        bad("no port")
    if not host:
        bad("empty host")
    if not (port_text.isascii() and port_text.isdigit()):
        bad(f"port {port_text!r} is not a number")
    port = int(port_text)
    lowest = 0 if allow_port_zero else 1
    if not lowest <= port <= 65535:
        bad(f"port {port} is not in {lowest}..65535")
    return host, port


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_size(text: str) -> int:
    """``4096``, ``64K``, ``512M``, ``4G`` (binary units, either case) as a number of bytes.

    Raises ``ValueError`` for anything else, and for 0 or more than ``MAX_SIZE``.
    """
    match = re.fullmatch(r"([0-9]+)([KMG]?)", text, re.ASCII | re.IGNORECASE)
    if match is None:
        raise ValueError(f"not a number of bytes: {text!r} (expected e.g. 1048576, 64K, 512M, 4G)")
    size = int(match[1]) * SIZE_UNITS[match[2].upper()]
    if not 0 < size <= MAX_SIZE:
        raise ValueError(f"must be from 1 byte to {format_size(MAX_SIZE)}, got {text}")
    return size


def format_size(size: int) -> str:
    """The shortest ``parse_size`` text for ``size``: ``4G``, ``1536M``, ``1000``."""
    for unit in ("G", "M", "K"):
        if size % SIZE_UNITS[unit] == 0:
            return f"{size // SIZE_UNITS[unit]}{unit}"
    return str(size)


def _resolve(host: str, port: int, *, passive: bool) -> list[tuple[Any, ...]]:
    try:
        return socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE if passive else 0
        )
    except socket.gaierror as exc:
        raise CliError(f"cannot resolve host {host!r}: {exc.strerror}") from exc


# --------------------------------------------------------------------------- output


def _say(message: str) -> None:
    print(message, flush=True)


def _rate(n_bytes: int, seconds: float) -> str:
    """Decimal GB/s."""
    return f"{n_bytes / 1e9 / seconds:.2f} GB/s" if seconds > 0 else "- GB/s"


def _one_line(text: str) -> str:
    return " ".join(text.split())


def describe_transfer_error(exc: BaseException) -> str:
    """`Checksum mismatch on chunk 3: ... (ChecksumMismatchError)`."""
    return f"{_one_line(str(exc)) or 'no detail'} ({type(exc).__name__})"


def describe_values(dtype: np.dtype[Any], shape: tuple[int, ...]) -> str:
    """`3,000 float32 values, 1-D` or `24 float64 values, shape (2, 3, 4)`."""
    form = "1-D" if len(shape) == 1 else f"shape {shape}"
    return f"{_count(math.prod(shape), dtype.name + ' value')}, {form}"


def _count(n: int, what: str) -> str:
    return f"{n:,} {what}{'' if n == 1 else 's'}"


# --------------------------------------------------------------------------- progress


def _tqdm_class() -> Callable[..., Any] | None:
    try:
        module = importlib.import_module("tqdm")
    except ImportError:
        return None
    return cast(Callable[..., Any], module.tqdm)


def _want_progress(args: argparse.Namespace) -> bool:
    if args.no_progress:
        return False
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


async def _watch(progress: _Progress, desc: str) -> None:
    """Mirror `progress` in a tqdm bar until cancelled; shown only after ~1 s."""
    tqdm = _tqdm_class()
    if tqdm is None:
        return
    bar = tqdm(
        desc=desc,
        total=None,
        unit=" chunks",
        delay=PROGRESS_DELAY_S,
        leave=False,
        file=sys.stderr,
        dynamic_ncols=True,
    )
    start = time.perf_counter()
    try:
        while True:
            await asyncio.sleep(PROGRESS_POLL_S)
            total = progress.total_chunks
            if total and bar.total != total:
                bar.total = total
            moved = progress.bytes
            elapsed = time.perf_counter() - start
            # TransferProgress.bytes counts wire bytes (headers and Arrow framing included).
            wire = f"{moved / MIB:,.0f} MiB on the wire, {_rate(moved, elapsed)}"
            bar.set_postfix_str(wire, refresh=False)
            bar.update(progress.chunks - bar.n)
    finally:
        bar.close()


async def _with_progress(
    transfer: Awaitable[T], progress: _Progress, desc: str, enabled: bool
) -> T:
    """Await `transfer` while a concurrent task polls `progress` for the bar."""
    if not enabled:
        return await transfer
    watcher = asyncio.create_task(_watch(progress, desc))
    try:
        return await transfer
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


def _run_transfer(coro: Awaitable[T]) -> T:
    """asyncio.run with transfer failures turned into one-line CliErrors."""

    async def wrapper() -> T:
        return await coro

    try:
        return asyncio.run(wrapper())
    except GradientStreamError as exc:
        raise CliError(f"transfer failed: {describe_transfer_error(exc)}") from exc
    except OSError as exc:
        raise CliError(f"connection failed: {describe_transfer_error(exc)}") from exc


# --------------------------------------------------------------------------- recv


def output_paths(out: Path, count: int) -> list[Path]:
    """``out`` itself for one gradient; ``STEM-0.SUFFIX``, ``STEM-1.SUFFIX``... for more."""
    if count == 1:
        return [out]
    return [out.with_name(f"{out.stem}-{i}{out.suffix}") for i in range(count)]


def _save(path: Path, array: npt.NDArray[Any]) -> None:
    """numpy.save to exactly `path` (no `.npy` appended), via a temporary file and rename."""
    part = path.with_name(path.name + ".part")
    try:
        with open(part, "wb") as f:
            np.save(f, array)
        os.replace(part, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            part.unlink()
        raise CliError(f"cannot write {path}: {exc.strerror or exc}") from exc


@dataclass
class _Budget:
    """What ``--max-bytes`` (``limit`` bytes) still allows in this run."""

    limit: int
    used: int = 0

    @property
    def left(self) -> int:
        return self.limit - self.used

    def room(self) -> int:
        """The values the next gradient may hold: every one might be of the widest dtype.
        At least 1, the least a session takes (`admit` then refuses a value too wide)."""
        return max(self.left // WIDEST_VALUE, 1)

    def refusal(self, which: str, why: str) -> CliError:
        return CliError(
            f"{which} refused: it would pass --max-bytes {format_size(self.limit)} "
            f"({self.limit:,} bytes in all, {self.left:,} left, room for "
            f"{_count(self.room(), 'value')} of up to {WIDEST_VALUE} bytes): {why}"
        )

    def admit(self, which: str, grad: npt.NDArray[Any]) -> None:
        """Count `grad` against the bound, or refuse it (before it is written)."""
        if grad.nbytes > self.left:
            raise self.refusal(which, f"it arrived as {grad.nbytes:,} bytes ({_values_of(grad)})")
        self.used += grad.nbytes


def _values_of(array: npt.NDArray[Any]) -> str:
    return describe_values(array.dtype, array.shape)


def _over_room(exc: GradientStreamError) -> bool:
    """Whether a receive stopped at the session's max_gradient_len (the budget's room):
    a header's total_chunks, a compressed batch's rows, or the values counted so far."""
    return "max_gradient_len" in str(exc)


async def _receive_all(
    impl: _Impl,
    conn: socket.socket,
    paths: list[Path],
    timeout: float | None,
    bar: bool,
    budget: _Budget,
) -> None:
    count = len(paths)
    total_chunks = 0
    for i, path in enumerate(paths):
        # A session per gradient, so that the values it may hold are what the run has left.
        session = impl.session(timeout=timeout, max_gradient_len=budget.room())
        progress = impl.progress()
        label = "recv" if count == 1 else f"recv {i + 1}/{count}"
        which = "gradient" if count == 1 else f"gradient {i + 1}/{count}"
        start = time.perf_counter()
        try:
            grad = await _with_progress(
                session.receive_from(conn, progress=progress), progress, label, bar
            )
        except GradientStreamError as exc:
            if _over_room(exc):
                raise budget.refusal(which, describe_transfer_error(exc)) from exc
            raise
        seconds = time.perf_counter() - start
        if grad.size == 0 and progress.chunks == 0:
            # receive_from's empty array for a peer that closed before a gradient's first byte.
            got = f"after {i} of {count} gradients" if count > 1 else "before sending a gradient"
            raise CliError(f"the peer closed the connection {got}")
        budget.admit(which, grad)
        _save(path, grad)
        total_chunks += progress.chunks
        _say(
            f"received {which}: {_values_of(grad)} ({grad.nbytes / MIB:,.1f} MiB), "
            f"{progress.chunks:,} chunks in {seconds:.3f} s, {_rate(grad.nbytes, seconds)} "
            f"-> {path}"
        )
    # A CRC mismatch raises ChecksumMismatchError, so getting here means every one held.
    _say(f"all {total_chunks:,} chunk CRC-32 checks passed")


def _cmd_recv(args: argparse.Namespace) -> int:
    host, port = parse_address(args.address, default_host=DEFAULT_HOST, allow_port_zero=True)
    if args.count < 1:
        raise CliError(f"--count must be >= 1, got {args.count}", 2)
    paths = output_paths(Path(args.out), args.count)
    parent = paths[0].parent
    if not parent.is_dir():
        raise CliError(f"cannot write {paths[0]}: directory {parent} does not exist")
    impl = load_impl(args.impl)

    family = _resolve(host, port, passive=True)[0][0]
    try:
        server = socket.create_server((host, port), family=family)
    except OSError as exc:
        raise CliError(
            f"cannot listen on {format_address(host, port)}: {exc.strerror or exc}"
        ) from exc
    with server:
        bound_host, bound_port = server.getsockname()[:2]
        _say(f"{LISTENING_PREFIX}{format_address(bound_host, bound_port)}")
        server.settimeout(args.timeout)
        try:
            conn, peer = server.accept()
        except TimeoutError as exc:
            raise CliError(f"no connection within {args.timeout:g} s") from exc
    _say(f"connection from {format_address(peer[0], peer[1])}")
    with conn:
        conn.setblocking(True)
        budget = _Budget(args.max_bytes)
        _run_transfer(_receive_all(impl, conn, paths, args.timeout, _want_progress(args), budget))
    return 0


# --------------------------------------------------------------------------- send


def load_gradient(path: Path) -> npt.NDArray[np.float32]:
    """A float32 array from a .npy file, memory-mapped when possible (no copy)."""
    if not path.is_file():
        raise CliError(f"cannot read {path}: no such file")
    try:
        try:
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError:
            # Arrays numpy cannot map (e.g. object arrays) get a plain load and its message.
            array = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise CliError(f"cannot read {path} as a .npy file: {_one_line(str(exc))}") from exc
    if not isinstance(array, np.ndarray):
        raise CliError(f"{path} is not a .npy file holding one array (a .npz archive?)")
    if array.dtype.kind != "f" or array.dtype.itemsize != 4:
        stem = path.with_name(path.stem + "-f32.npy")
        raise CliError(
            f"{path} holds {array.dtype} values; gradstream sends float32 only. Convert it: "
            f"python -c \"import numpy as n; n.save('{stem}', "
            f"n.load('{path}').astype(n.float32))\""
        )
    return cast(npt.NDArray[np.float32], array)


async def _send_all(
    impl: _Impl,
    sock: socket.socket,
    grads: list[tuple[Path, npt.NDArray[np.float32]]],
    chunk_size: int | None,
    timeout: float | None,
    bar: bool,
    layout: str = "seed",
    compression: str | None = None,
) -> None:
    session = impl.session(chunk_size, timeout, layout, compression)
    count = len(grads)
    for i, (path, grad) in enumerate(grads):
        progress = impl.progress()
        label = "send" if count == 1 else f"send {i + 1}/{count}"
        start = time.perf_counter()
        chunks = await _with_progress(
            session.stream_to(grad, sock, progress=progress), progress, label, bar
        )
        seconds = time.perf_counter() - start
        _say(
            f"sent {path}: {_sent_values(session, grad)} ({grad.nbytes / MIB:,.1f} MiB), "
            f"{chunks:,} chunks in {seconds:.3f} s, {_rate(grad.nbytes, seconds)}"
        )


def _sent_values(session: _Session, grad: npt.NDArray[np.float32]) -> str:
    """What the peer receives of `grad`: its values, flat unless the session keeps shapes
    (dtype.name is float32 for a big-endian file too: the values are sent swapped)."""
    shape = grad.shape if session.keep_shape else (grad.size,)
    what = describe_values(grad.dtype, shape)
    return what if shape == grad.shape else f"{what} (flattened from shape {grad.shape})"


def _cmd_send(args: argparse.Namespace) -> int:
    host, port = parse_address(args.address)
    if args.chunk_size is not None and args.chunk_size < 0:
        raise CliError(f"--chunk-size must be >= 0, got {args.chunk_size}", 2)
    grads = [(Path(f), load_gradient(Path(f))) for f in args.files]
    impl = load_impl(args.impl)
    _resolve(host, port, passive=False)
    where = format_address(host, port)
    try:
        sock = socket.create_connection((host, port), timeout=args.timeout)
    except TimeoutError as exc:
        raise CliError(f"cannot connect to {where}: no answer within {args.timeout:g} s") from exc
    except OSError as exc:
        raise CliError(f"cannot connect to {where}: {exc.strerror or exc}") from exc
    with sock:
        sock.setblocking(True)
        _run_transfer(
            _send_all(
                impl,
                sock,
                grads,
                args.chunk_size,
                args.timeout,
                _want_progress(args),
                args.layout,
                None if args.compression == "none" else args.compression,
            )
        )
    return 0


# --------------------------------------------------------------------------- demo


def _cmd_demo(args: argparse.Namespace) -> int:
    from . import demo

    return demo.run(elements=args.elements, impl_only=args.impl_only, chunk_size=args.chunk_size)


# --------------------------------------------------------------------------- parser


class _Formatter(argparse.HelpFormatter):
    """Wraps each line of a description or epilog as a paragraph; keeps indented lines."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n".join(
            indent + line
            if not line or line.startswith("  ")
            else textwrap.fill(line, width, initial_indent=indent, subsequent_indent=indent)
            for line in text.splitlines()
        )


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--impl",
        choices=IMPLS,
        default="native",
        help="native (Rust, the default) or reference (pure Python)",
    )
    p.add_argument(
        "--timeout",
        type=_positive_float,
        metavar="S",
        help="fail after S seconds without progress (default: wait for ever)",
    )
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (there is none anyway when stderr is not a terminal)",
    )


def build_parser() -> argparse.ArgumentParser:
    fmt = _Formatter
    parser = _Parser(
        prog="gradstream",
        description="Stream float32 gradients between processes over TCP, with a CRC-32 "
        "check on every chunk.",
        epilog="Run 'gradstream COMMAND --help' for a command's options.\n"
        "Exit status: 0 success, 1 failure, 2 command-line mistake, 130 interrupted.",
        formatter_class=fmt,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_recv(sub)
    _add_send(sub)
    _add_demo(sub)
    return parser


# The subparsers' action type is private to argparse.
def _add_recv(sub: Any) -> None:
    recv = sub.add_parser(
        "recv",
        help="listen, receive gradients, save them as .npy",
        description="Listen on [HOST:]PORT (HOST defaults to 127.0.0.1; PORT 0 picks a free "
        "port), accept one connection and receive --count gradients from it. The first line "
        "printed is 'listening on HOST:PORT' with the port bound.",
        epilog="With --count 1 the gradient is saved to FILE as given; with --count N > 1 the "
        "i-th (from 0) goes to STEM-i.SUFFIX (out.npy -> out-0.npy, out-1.npy, ...).\n"
        "A gradient is saved in the dtype and shape it arrives in: 'gradstream send' sends "
        "float32 values without a shape (1-D); a Python peer may send float16, bfloat16 or "
        "float64, or a shape (keep_dtype=True, keep_shape=True). The line printed for each "
        "says which. Every chunk's CRC-32 is checked; a mismatch fails the command.\n"
        "--max-bytes bounds the bytes of values the run accepts in all (with --count N, the "
        "N gradients together). While a gradient arrives, its room is what is left counted "
        f"at {WIDEST_VALUE} bytes a value (float64, the widest a peer can send), so that the "
        "values recv holds stay within the bound whatever a peer sends; a float32 gradient "
        "can therefore take at most half of what is left. A gradient that would pass the "
        "bound fails the command and nothing of it is written (the ones before it stay "
        "saved).\n"
        "--timeout also bounds the wait for the connection.\n\n"
        "example:\n  gradstream recv 0 --out grad.npy\n  gradstream recv 0.0.0.0:9000 "
        "--out g.npy --count 2",
        formatter_class=_Formatter,
    )
    recv.add_argument("address", metavar="[HOST:]PORT", help="where to listen")
    recv.add_argument("--out", required=True, metavar="FILE.npy", help="where to save")
    recv.add_argument(
        "--count", type=int, default=1, metavar="N", help="gradients to receive (default 1)"
    )
    recv.add_argument(
        "--max-bytes",
        type=_size,
        default=DEFAULT_MAX_BYTES,
        metavar="B",
        help="the most bytes of values the whole run accepts: bytes, or with a K, M or G "
        f"suffix (binary: 1K = 1024); default {DEFAULT_MAX_BYTES}",
    )
    _add_common(recv)
    recv.set_defaults(func=_cmd_recv)


def _add_send(sub: Any) -> None:
    send = sub.add_parser(
        "send",
        help="send .npy gradients to a receiver",
        description="Connect to HOST:PORT and send each FILE.npy (float32, any shape, sent "
        "flattened in C order) over that one connection, in order.",
        epilog="example:\n  gradstream send 127.0.0.1:9000 grad.npy\n"
        "  gradstream send 127.0.0.1:9000 a.npy b.npy   # pairs with recv --count 2",
        formatter_class=_Formatter,
    )
    send.add_argument("address", metavar="HOST:PORT", help="the receiver")
    send.add_argument("files", nargs="+", metavar="FILE.npy", help="float32 .npy file(s)")
    send.add_argument(
        "--chunk-size",
        type=int,
        default=None,
        metavar="N",
        help="float32 values per chunk (default 65536)",
    )
    send.add_argument(
        "--layout",
        choices=["seed", "compact"],
        default="seed",
        help="payload columns: seed (index + value, as ipfrs-transport sends; default) or "
        "compact (values only, half the wire bytes; any gradstream or ipfrs-transport "
        "receiver reads it)",
    )
    send.add_argument(
        "--compression",
        choices=["none", "lz4", "zstd"],
        default="none",
        help="Arrow IPC buffer compression of the payloads (default none; any gradstream "
        "receiver reads lz4 and zstd, ipfrs-transport may not)",
    )
    _add_common(send)
    send.set_defaults(func=_cmd_send)


def _add_demo(sub: Any) -> None:
    from . import demo

    demo_parser = sub.add_parser(
        "demo",
        help="a verified transfer between two processes, native vs reference",
        description=demo.NETWORK_DESCRIPTION,
        formatter_class=_Formatter,
    )
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(func=_cmd_demo)


def main(argv: Sequence[str] | None = None) -> int:
    """The console script ``gradstream``; returns the exit status."""
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130
    except CliError as exc:
        print(f"gradstream: error: {_one_line(str(exc))}", file=sys.stderr, flush=True)
        return exc.status


if __name__ == "__main__":
    sys.exit(main())
