"""``gradstream send``: each file over one connection, in order: a .npy file as one
gradient, a .npz archive or a .safetensors file as one tensor set (``_cli_files``).

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

import numpy.typing as npt

from . import TransferProgress
from ._checks import (
    CONNECTION_DEADLINE,
    HANDSHAKE_TIMEOUT,
    check_resume,
    check_streams,
    check_streams_secret,
)
from ._cli_base import (
    CliError,
    count_of,
    describe_transfer_error,
    describe_values,
    format_address,
    format_bytes,
    library_address,
    parse_address,
    rate,
    resolve,
    say,
)
from ._cli_files import WANTS_A_GRADIENT, WANTS_A_SET, TensorSet, load_gradient, load_item
from ._cli_link import LinkSettings, cli_session, link_settings
from ._cli_progress import want_progress, with_progress
from ._connection import connect
from ._session import GradientStreamSession
from .errors import GradientStreamError, SettingError, StreamTimeoutError

__all__ = ["load_gradient", "load_item", "run_send"]


# `send --timeout`'s default: every wait of a send is inside a transfer, so none is
# unbounded by default, as on every connection (docs/guides/connections.md "Timeouts").
SEND_TIMEOUT = CONNECTION_DEADLINE


@dataclass(frozen=True)
class SendPlan:
    """What the command line asks of one ``send`` run."""

    address: tuple[str, int]
    gradients: list[tuple[Path, npt.NDArray[Any] | TensorSet]]
    session: GradientStreamSession
    link: LinkSettings
    timeout: float | None
    bar: bool
    streams: int = 1
    resume: bool | None = None


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


def _sending_failure(exc: BaseException) -> str:
    """The transfer error, told in the command's words when the receiver refused the kind
    (its --out decides: .npy takes lone gradients, .npz and .safetensors tensor sets)."""
    text = str(exc)
    if WANTS_A_SET in text:
        return (
            "the receiver saves tensor sets (its --out is a .npz or .safetensors file) and "
            "refused this lone gradient: send a .npz or .safetensors file, or have recv save "
            f"to a .npy file ({type(exc).__name__})"
        )
    if WANTS_A_GRADIENT in text:
        return (
            "the receiver saves lone gradients (its --out is a .npy file) and refused this "
            "tensor set: have recv save to a .npz or .safetensors file, or send .npy files "
            f"({type(exc).__name__})"
        )
    return describe_transfer_error(exc)


async def _send_all(plan: SendPlan, doing: _Doing) -> None:
    where = format_address(*plan.address)
    try:
        conn = await connect(
            library_address(plan.address),
            session=plan.session,
            streams=plan.streams,
            resume=plan.resume,
            **plan.link.keywords(),
        )
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
                if isinstance(grad, TensorSet):
                    sending = conn.send_tensors(grad.tensors, progress=progress)
                else:
                    sending = conn.send(grad, progress=progress)
                await with_progress(sending, progress, label, plan.bar)
            except (GradientStreamError, OSError) as exc:
                raise CliError(f"sending {which} failed: {_sending_failure(exc)}") from exc
            seconds = time.perf_counter() - start
            what = (
                f"a tensor set of {grad.describe()}"
                if isinstance(grad, TensorSet)
                else _sent_values(keep_shape, grad)
            )
            say(
                f"sent {path}: {what} "
                f"({format_bytes(grad.nbytes)} of values, "
                f"{format_bytes(progress.bytes)} on the wire), "
                f"{count_of(progress.chunks, 'chunk')} in {seconds:.3f} s, "
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
    try:
        streams = check_streams(args.streams, "--streams")
        check_streams_secret(streams, link.protocol, link.tls, link.authkey, host)
    except SettingError as exc:
        raise CliError(str(exc).replace("streams=", "--streams ", 1), 2) from exc
    try:
        check_resume(args.resume, streams, link.protocol, link.tls, link.authkey, host)
    except SettingError as exc:
        raise CliError(str(exc).replace("resume=True", "--resume", 1), 2) from exc
    gradients = [(Path(f), load_item(Path(f), link.protocol)) for f in args.files]
    resolve(host, port, passive=False)
    compression = None if args.compression == "none" else args.compression
    plan = SendPlan(
        address=(host, port),
        gradients=gradients,
        session=cli_session(
            args.chunk_size, args.timeout, args.layout, compression, wire_dtype=args.wire_dtype
        ),
        link=link,
        timeout=args.timeout,
        bar=want_progress(args),
        streams=streams,
        resume=args.resume,
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
