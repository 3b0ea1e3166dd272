"""``gradstream send``: each .npy file over one connection, in order.

With ``--protocol gradstream`` (the default) ``send`` returns for a file only once the
receiver acknowledged it, so a gradient the receiver refused, or never read because it
closed first (``recv --count 1`` given two files), fails the command: exit 1 and one
line naming the file and the ``DeliveryError``. With ``--protocol seed`` a file is done
once its bytes are written, as ipfrs-transport does, and nothing tells a lost one.

Over ``_cli_base``, ``_checks``, ``_cli_link``, ``_cli_progress`` and ``connect``; ``cli`` calls
``run_send`` with the parsed arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from . import TransferProgress
from ._checks import CONNECTION_DEADLINE, HANDSHAKE_TIMEOUT
from ._cli_base import (
    MIB,
    CliError,
    count_of,
    describe_transfer_error,
    describe_values,
    format_address,
    one_line,
    parse_address,
    rate,
    resolve,
    say,
)
from ._cli_link import LinkSettings, cli_session, link_settings
from ._cli_progress import want_progress, with_progress
from ._connection import connect
from ._session import GradientStreamSession
from .errors import GradientStreamError, StreamTimeoutError

__all__ = ["load_gradient", "run_send"]


# What a .npy file may hold: float32 alone for --protocol seed (the original's wire),
# and the dtypes a gradstream connection keeps (docs/guides/connections.md "Defaults").
_GRADSTREAM_DTYPES = ("float16", "float32", "float64")


def load_gradient(path: Path, protocol: str = "gradstream") -> npt.NDArray[Any]:
    """The array of a .npy file, memory-mapped when possible (no copy): float16, float32
    or float64 over a gradstream connection (sent in its dtype and shape), float32 alone
    for ``--protocol seed``."""
    if path.is_dir():
        raise CliError(f"cannot read {path}: it is a directory; give a .npy file")
    if not path.is_file():
        raise CliError(f"cannot read {path}: no such file")
    try:
        with open(path, "rb") as f:
            magic = f.read(6)
    except OSError as exc:
        raise CliError(f"cannot read {path}: {exc.strerror or exc}") from exc
    if magic[:4] == b"PK\x03\x04":
        raise CliError(
            f"cannot read {path}: a .npz archive, not a .npy file; save each array as a "
            ".npy file (numpy.save) and send those"
        )
    if magic != b"\x93NUMPY":
        raise CliError(
            f"cannot read {path}: not a .npy file (it does not start with numpy's "
            "\\x93NUMPY header; make one with numpy.save)"
        )
    try:
        try:
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError:
            # Arrays numpy cannot map (e.g. object arrays) get a plain load and its message.
            array = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise CliError(f"cannot read {path} as a .npy file: {one_line(str(exc))}") from exc
    if not isinstance(array, np.ndarray):
        raise CliError(f"{path} is not a .npy file holding one array")
    kept = (
        protocol == "gradstream"
        and array.dtype.kind == "f"
        and (array.dtype.newbyteorder("=").name in _GRADSTREAM_DTYPES)
    )
    if kept or (array.dtype.kind == "f" and array.dtype.itemsize == 4):
        return array
    stem = path.with_name(path.stem + "-f32.npy")
    sends = (
        "--protocol seed sends float32 only (the original's wire)"
        if protocol == "seed"
        else "gradstream sends float16, float32 or float64"
    )
    raise CliError(
        f"{path} holds {array.dtype} values; {sends}. Convert it: "
        f"python -c \"import numpy as n; n.save('{stem}', "
        f"n.load('{path}').astype(n.float32))\""
    )


# `send --timeout`'s default: every wait of a send is inside a transfer, so none is
# unbounded by default, as on every connection (docs/guides/connections.md "Timeouts").
SEND_TIMEOUT = CONNECTION_DEADLINE


@dataclass(frozen=True)
class SendPlan:
    """What the command line asks of one ``send`` run."""

    address: tuple[str, int]
    gradients: list[tuple[Path, npt.NDArray[Any]]]
    session: GradientStreamSession
    link: LinkSettings
    timeout: float | None
    bar: bool


class _Doing:
    """What a ``send`` run is doing, for the line Ctrl-C prints: connecting, or sending a
    file with its progress."""

    def __init__(self, where: str) -> None:
        self.what = f"connecting to {where}"
        self.progress: TransferProgress | None = None

    def interrupted(self) -> str:
        if self.progress is None:
            return f"interrupted while {self.what}"
        return (
            f"interrupted while {self.what} ({self.progress.bytes:,} bytes of it written): "
            "the receiver drops what it got of it"
        )


def _connect_failure(where: str, exc: BaseException, link: LinkSettings) -> CliError:
    if isinstance(exc, StreamTimeoutError):
        if link.protocol == "seed":
            return CliError(f"cannot connect to {where}: no answer within {HANDSHAKE_TIMEOUT:g} s")
        # No hello came: a gradstream receiver answers at once; an HTTP server, say,
        # takes the connection and waits silently for a request line.
        return CliError(
            f"cannot connect to {where}: no gradstream hello within {HANDSHAKE_TIMEOUT:g} s: "
            "not a gradstream receiver (an HTTP server, for one, takes the connection and "
            "waits silently), or not reachable"
        )
    if isinstance(exc, OSError) and isinstance(exc.errno, int) and exc.errno > 0:
        # The OS's words for a refused or unreachable peer.
        hint = ""
        if link.tls is not None and exc.errno in (errno.ECONNRESET, errno.EPIPE):
            # A TLS listener that refuses this side's certificate closes at once, and the
            # reset can overtake its alert.
            hint = " (under TLS, often the receiver refusing this side's certificate: its log says)"
        return CliError(
            f"cannot connect to {where}: {os.strerror(exc.errno)} ({type(exc).__name__}){hint}"
        )
    return CliError(f"cannot connect to {where}: {describe_transfer_error(exc)}")


def _sent_values(keep_shape: bool, grad: npt.NDArray[Any]) -> str:
    """What the peer receives of `grad`: its values, flat unless the connection keeps
    shapes (dtype.name is float32 for a big-endian file too: the values are sent
    swapped)."""
    shape = grad.shape if keep_shape else (grad.size,)
    what = describe_values(grad.dtype, shape)
    return what if shape == grad.shape else f"{what} (flattened from shape {grad.shape})"


def _bytes(n: int) -> str:
    """`12,000 bytes`, or from 1 MiB up `200.0 MiB`."""
    return f"{n:,} bytes" if n < MIB else f"{n / MIB:,.1f} MiB"


async def _send_all(plan: SendPlan, doing: _Doing) -> None:
    where = format_address(*plan.address)
    try:
        conn = await connect(plan.address, session=plan.session, **plan.link.keywords())
    except (GradientStreamError, OSError) as exc:
        raise _connect_failure(where, exc, plan.link) from exc
    acknowledged = ", acknowledged" if plan.link.protocol == "gradstream" else ""
    # As the connection uses the session: its unset settings take the connection's
    # defaults (shapes kept on a gradstream connection).
    keep_shape = GradientStreamSession._for_connection(plan.session, plan.link.protocol).keep_shape
    count = len(plan.gradients)
    try:
        for i, (path, grad) in enumerate(plan.gradients):
            progress = TransferProgress()
            label = "send" if count == 1 else f"send {i + 1}/{count}"
            which = str(path) if count == 1 else f"{path} ({i + 1} of {count})"
            doing.what, doing.progress = f"sending {which}", progress
            start = time.perf_counter()
            try:
                chunks = await with_progress(
                    conn.send(grad, progress=progress), progress, label, plan.bar
                )
            except (GradientStreamError, OSError) as exc:
                raise CliError(f"sending {which} failed: {describe_transfer_error(exc)}") from exc
            seconds = time.perf_counter() - start
            say(
                f"sent {path}: {_sent_values(keep_shape, grad)} "
                f"({_bytes(grad.nbytes)} of values, {_bytes(progress.bytes)} on the wire), "
                f"{count_of(chunks, 'chunk')} in {seconds:.3f} s, "
                f"{rate(grad.nbytes, seconds)}{acknowledged}"
            )
            doing.what, doing.progress = f"closing the connection to {where}", None
    finally:
        # A connection a failed transfer broke has nothing more to say; its error is the
        # one to report.
        with contextlib.suppress(GradientStreamError, OSError):
            await conn.close()


def run_send(args: argparse.Namespace) -> int:
    """``gradstream send``; its exit status."""
    host, port = parse_address(args.address)
    if args.chunk_size is not None and args.chunk_size < 0:
        raise CliError(f"--chunk-size must be >= 0, got {args.chunk_size}", 2)
    link = link_settings(args, listening=False)
    gradients = [(Path(f), load_gradient(Path(f), link.protocol)) for f in args.files]
    resolve(host, port, passive=False)
    compression = None if args.compression == "none" else args.compression
    plan = SendPlan(
        address=(host, port),
        gradients=gradients,
        session=cli_session(args.chunk_size, args.timeout, args.layout, compression),
        link=link,
        timeout=args.timeout,
        bar=want_progress(args),
    )
    doing = _Doing(format_address(host, port))
    try:
        asyncio.run(_send_all(plan, doing))
    except KeyboardInterrupt:
        # Exit 130 (cli.main), saying what was dropped: the files before were
        # acknowledged (their lines are printed), this one was not.
        print(f"gradstream: {doing.interrupted()}", file=sys.stderr, flush=True)
        raise
    return 0
