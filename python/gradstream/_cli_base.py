"""What every part of the ``gradstream`` command shares: ``CliError`` (a failure as one
line and an exit status), addresses and sizes as typed on the command line, and the
words of the lines it prints (values, rates, peers, errors).

Plain Python over ``_dtypes`` and ``errors``; ``cli`` and the ``_cli_*`` modules use it.
"""

from __future__ import annotations

import json
import math
import re
import socket
from typing import Any, NoReturn

import numpy as np

from ._address import UNIX, Address, Peer
from ._dtypes import DTYPES, width

__all__ = [
    "MIB",
    "WIDEST_VALUE",
    "CliError",
    "count_of",
    "describe_peer",
    "describe_transfer_error",
    "describe_values",
    "format_address",
    "format_bytes",
    "format_size",
    "library_address",
    "one_line",
    "parse_address",
    "parse_size",
    "rate",
    "resolve",
    "say",
    "shown",
]

MIB = 2**20
SIZE_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}
MAX_SIZE = 2**63 - 2**30  # a whole number of G, and far beyond any machine's memory
# The widest value a receiving session can hand back (float64, from a peer that keeps its
# dtype): recv counts its room at this many bytes a value.
WIDEST_VALUE = max(width(name) for name in DTYPES)


class CliError(Exception):
    """A failure reported as one line on stderr, with an exit status."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


# --------------------------------------------------------------------------- addresses


def parse_address(
    text: str, *, default_host: str | None = None, allow_port_zero: bool = False
) -> tuple[str, int]:
    """Split ``HOST:PORT`` (``[v6addr]:PORT`` for IPv6) into (host, port); a same-host
    ``unix:PATH`` comes back as its text and port 0 (``library_address``).

    With ``default_host``, a bare ``PORT`` is accepted too. Raises ``CliError`` (status 2).
    """

    def bad(why: str) -> NoReturn:
        form = "[HOST:]PORT" if default_host is not None else "HOST:PORT"
        raise CliError(f"bad address {text!r}: {why} (expected {form} or unix:PATH)", 2)

    if text.startswith(UNIX):
        if text == UNIX:
            bad("no path after 'unix:'")
        return text, 0

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
    elif text.isascii() and text.isdigit():
        # `send 7000`: a port without its host.
        bad(f"no host; the receiver's host goes before the port, as in 127.0.0.1:{text}")
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
    if host.startswith(UNIX):
        return host
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def shown(address: Address) -> str:
    """An address as the library gives it (``(host, port)`` or ``"unix:PATH"``), as the
    CLI prints it."""
    return address if isinstance(address, str) else format_address(*address)


def library_address(address: tuple[str, int]) -> Address:
    """``parse_address``'s result as ``connect`` and ``listen`` take it."""
    host, _ = address
    return host if host.startswith(UNIX) else address


def resolve(host: str, port: int, *, passive: bool) -> list[tuple[Any, ...]]:
    """getaddrinfo, its failure as a CliError naming the host (nothing to resolve for a
    unix: address)."""
    if host.startswith(UNIX):
        return []
    try:
        return socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE if passive else 0
        )
    except socket.gaierror as exc:
        raise CliError(f"cannot resolve host {host!r}: {exc.strerror}") from exc


# --------------------------------------------------------------------------- sizes


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


# --------------------------------------------------------------------------- lines


def say(message: str) -> None:
    """One line of the command's output (stdout), at once: other processes read it."""
    print(message, flush=True)


def rate(n_bytes: int, seconds: float) -> str:
    """Decimal GB/s."""
    return f"{n_bytes / 1e9 / seconds:.2f} GB/s" if seconds > 0 else "- GB/s"


def format_bytes(n: int) -> str:
    """`12,000 bytes`, or from 1 MiB up `200.0 MiB`."""
    return f"{n:,} bytes" if n < MIB else f"{n / MIB:,.1f} MiB"


def one_line(text: str) -> str:
    return " ".join(text.split())


def describe_transfer_error(exc: BaseException) -> str:
    """`Checksum mismatch on chunk 3: ... (ChecksumMismatchError)`."""
    return f"{one_line(str(exc)) or 'no detail'} ({type(exc).__name__})"


def describe_values(dtype: np.dtype[Any], shape: tuple[int, ...]) -> str:
    """`3,000 float32 values, 1-D` or `24 float64 values, shape (2, 3, 4)`."""
    form = "1-D" if len(shape) == 1 else f"shape {shape}"
    return f"{count_of(math.prod(shape), dtype.name + ' value')}, {form}"


def count_of(n: int, what: str) -> str:
    return f"{n:,} {what}{'' if n == 1 else 's'}"


def describe_peer(peer: Peer) -> str:
    """`10.0.0.7:51234`, with what vouches for it: `(subject "O=lab,CN=worker-1",
    authenticated)` under mutual TLS, `(authenticated)` with an authkey. The subject is
    quoted as JSON, so that no text in a certificate reads as more of the line. A
    same-host peer: `unix:PATH (pid 123, uid 1000)`."""
    vouched = []
    if peer.pid is not None:
        vouched.append(f"pid {peer.pid}")
    if peer.uid is not None:
        vouched.append(f"uid {peer.uid}")
    if peer.tls_subject is not None:
        vouched.append(f"subject {json.dumps(peer.tls_subject, ensure_ascii=False)}")
    if peer.authenticated:
        vouched.append("authenticated")
    if isinstance(peer.address, str):
        where = peer.address
    else:
        where = format_address(*peer.address)
    return f"{where} ({', '.join(vouched)})" if vouched else where
