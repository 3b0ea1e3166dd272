"""How ``recv`` and ``send`` connect: ``--protocol``, ``--tls-cert``, ``--tls-key``,
``--tls-ca`` and ``--authkey-file``, checked into a ``LinkSettings``.

Combinations that cannot work are command-line mistakes (exit 2), found before any
file is read: ``--protocol seed`` with TLS or an authkey (the bare frames of
ipfrs-transport carry neither), a certificate without its key, a receiver asking
workers for certificates without one of its own, a worker with a certificate but no CA
to check the receiver's. A file that cannot be read, or an authkey file too short to be
a key, is a failure (exit 1) naming the flag and the file.

Over ``_cli_base``, ``_checks`` and ``_tls_settings``; ``cli`` builds the settings,
``keywords`` turns them into those of ``serve`` / ``connect``, and ``cli_session`` makes
the session a run connects with.
"""

from __future__ import annotations

import argparse
import os
import typing
from dataclasses import dataclass
from typing import Any

from ._checks import MIN_AUTHKEY_LEN, Protocol
from ._cli_base import CliError
from ._session import GradientStreamSession
from ._tls_settings import TLS

__all__ = [
    "PROTOCOLS",
    "SESSION_ID",
    "LinkSettings",
    "TlsFiles",
    "cli_session",
    "link_settings",
    "read_authkey",
]

PROTOCOLS: tuple[Protocol, ...] = typing.get_args(Protocol)
SESSION_ID = "gradstream-cli"
# A key file is a few dozen bytes; past this it is some other file given by mistake.
MAX_AUTHKEY_FILE = 64 * 1024
KEY_HINT = "make one with: gradstream keygen --out FILE"


@dataclass(frozen=True)
class TlsFiles:
    """PEM files, each checked readable: this side's certificate and key, the CA."""

    cert: str | None
    key: str | None
    ca: str | None


@dataclass(frozen=True)
class LinkSettings:
    """One side's connection settings: the protocol, TLS files, the authkey's bytes."""

    protocol: Protocol
    tls: TlsFiles | None
    authkey: bytes | None

    def describe(self) -> str:
        """`gradstream, mutual TLS, authkey`: what the connections carry."""
        parts: list[str] = [self.protocol]
        if self.tls is not None:
            mutual = self.tls.ca is not None and self.tls.cert is not None
            parts.append("mutual TLS" if mutual else "TLS")
        if self.authkey is not None:
            parts.append("authkey")
        return ", ".join(parts)

    def keywords(self) -> dict[str, Any]:
        """The keywords of ``serve`` / ``connect`` these settings stand for."""
        tls = None
        if self.tls is not None:
            tls = TLS(cert=self.tls.cert, key=self.tls.key, ca=self.tls.ca)
        return {"protocol": self.protocol, "tls": tls, "authkey": self.authkey}


def cli_session(
    chunk_size: int | None = None,
    timeout: float | None = None,
    layout: str | None = None,
    compression: str | None = None,
    max_gradient_len: int | None = None,
    wire_dtype: str | None = None,
) -> GradientStreamSession:
    """The session of a ``recv`` or ``send`` run; settings it refuses are a command-line
    mistake (exit 2). ``layout`` None: the connection's default (compact on gradstream
    connections, seed with ``--protocol seed``)."""
    args: list[Any] = [SESSION_ID]
    if chunk_size is not None:
        args.append(chunk_size)
    kwargs: dict[str, Any] = {"layout": layout, "compression": compression}
    if wire_dtype is not None:
        kwargs["wire_dtype"] = wire_dtype
    if max_gradient_len is not None:
        kwargs["max_gradient_len"] = max_gradient_len
    if timeout is not None:
        kwargs["timeout"] = timeout
    try:
        return GradientStreamSession(*args, **kwargs)
    except (ValueError, OverflowError, TypeError) as exc:
        raise CliError(f"bad session settings: {exc}", 2) from exc


def _check_combination(args: argparse.Namespace, listening: bool) -> None:
    """Refuse, as command-line mistakes, the flag sets that cannot make a connection."""
    secured = [
        flag
        for flag, value in (
            ("--tls-cert", args.tls_cert),
            ("--tls-key", args.tls_key),
            ("--tls-ca", args.tls_ca),
            ("--authkey-file", args.authkey_file),
        )
        if value is not None
    ]
    if args.protocol == "seed" and secured:
        raise CliError(
            f"--protocol seed speaks the bare frames of ipfrs-transport 0.2.0, which carry "
            f"no TLS and no authkey: drop {' and '.join(secured)} or use --protocol "
            "gradstream",
            2,
        )
    if (args.tls_cert is None) != (args.tls_key is None):
        given, missing = (
            ("--tls-cert", "--tls-key") if args.tls_key is None else ("--tls-key", "--tls-cert")
        )
        raise CliError(f"{given} needs {missing} too: a certificate goes with its key", 2)
    if listening and args.tls_ca is not None and args.tls_cert is None:
        raise CliError(
            "recv --tls-ca (asking workers for certificates) needs --tls-cert and --tls-key: "
            "the receiver's own certificate",
            2,
        )
    if not listening and args.tls_cert is not None and args.tls_ca is None:
        raise CliError(
            "send --tls-cert needs --tls-ca: the authority that signed the receiver's "
            "certificate (without it, the receiver cannot be checked)",
            2,
        )


def _readable(flag: str, path: str) -> str:
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise CliError(f"cannot read {flag} {path}: {exc.strerror or exc}") from exc
    return path


def read_authkey(path: str) -> bytes:
    """The bytes of the file at ``path``, all of them (a final newline too: both sides
    read the same file), refused when too short to be a key or too long to be one."""
    try:
        size = os.stat(path).st_size
        if size > MAX_AUTHKEY_FILE:
            raise CliError(
                f"--authkey-file {path} holds {size:,} bytes: not a key file? ({KEY_HINT})"
            )
        with open(path, "rb") as f:
            key = f.read(MAX_AUTHKEY_FILE + 1)
    except OSError as exc:
        raise CliError(f"cannot read --authkey-file {path}: {exc.strerror or exc}") from exc
    if not key:
        raise CliError(
            f"--authkey-file {path} is empty: an authkey is {MIN_AUTHKEY_LEN} bytes or more "
            f"({KEY_HINT})"
        )
    if len(key) < MIN_AUTHKEY_LEN:
        raise CliError(
            f"--authkey-file {path} holds {len(key)} bytes: an authkey is {MIN_AUTHKEY_LEN} "
            f"bytes or more ({KEY_HINT})"
        )
    return key


def link_settings(args: argparse.Namespace, *, listening: bool) -> LinkSettings:
    """The connection flags of ``recv`` (``listening``) or ``send``, checked."""
    _check_combination(args, listening)
    tls = None
    if args.tls_cert is not None or args.tls_ca is not None:
        tls = TlsFiles(
            cert=None if args.tls_cert is None else _readable("--tls-cert", args.tls_cert),
            key=None if args.tls_key is None else _readable("--tls-key", args.tls_key),
            ca=None if args.tls_ca is None else _readable("--tls-ca", args.tls_ca),
        )
    key = None if args.authkey_file is None else read_authkey(args.authkey_file)
    return LinkSettings(args.protocol, tls, key)
