"""``gradstream keygen``: a random authkey, in the form ``--authkey-file`` reads.

The key is 32 bytes from the operating system's CSPRNG (``secrets``), written as 43
characters of URL-safe base64 and a newline: 256 bits of entropy, printable, and the
file's whole bytes are the authkey (``--authkey-file`` reads them all, the newline too;
in Python, ``authkey=open(FILE, "rb").read()`` gives the same bytes). With ``--out FILE``
the key goes to a new file that only its owner can read (mode 0600), never over an
existing one; without it, to stdout.

A random key is what the authkey's SPAKE2 exchange (docs/spec/threat-model.md) makes the
most of: nothing a connection carries lets a key be guessed offline, and online each
connection tests one guess, so a key of 256 random bits is out of reach however many
connections an attacker opens.
"""

from __future__ import annotations

import argparse
import base64
import os
import secrets
import sys
from typing import Any

from ._cli_base import CliError

__all__ = ["KEY_BYTES", "add_keygen", "new_key", "run_keygen"]

KEY_BYTES = 32


def new_key() -> bytes:
    """A fresh key file's bytes: 32 random bytes as URL-safe base64, then a newline."""
    return base64.urlsafe_b64encode(secrets.token_bytes(KEY_BYTES)).rstrip(b"=") + b"\n"


def run_keygen(args: argparse.Namespace) -> int:
    key = new_key()
    if args.out is None:
        sys.stdout.buffer.write(key)
        sys.stdout.flush()
        return 0
    try:
        fd = os.open(args.out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError as exc:
        raise CliError(
            f"--out {args.out} exists: a key file is never overwritten (remove it, or give "
            "another path)"
        ) from exc
    except OSError as exc:
        raise CliError(f"cannot create --out {args.out}: {exc.strerror or exc}") from exc
    with os.fdopen(fd, "wb") as f:
        f.write(key)
    return 0


# The subparsers' action type is private to argparse.
def add_keygen(sub: Any, formatter: type[argparse.HelpFormatter]) -> None:
    keygen = sub.add_parser(
        "keygen",
        help="print a random authkey for --authkey-file (or write it to a new file)",
        description="Make a random authkey: 32 bytes from the system's CSPRNG as 43 "
        "characters of URL-safe base64 and a newline, the form --authkey-file reads (the "
        "file's bytes, all of them, are the key; in Python, authkey=open(FILE, 'rb').read() "
        "gives the same). Printed on stdout, or with --out written to a new file of mode "
        "0600 (an existing file is never overwritten).",
        epilog="example:\n  gradstream keygen --out round.key\n"
        "  gradstream recv 0.0.0.0:9000 --out g.npy --authkey-file round.key\n"
        "  gradstream send 10.0.0.5:9000 g.npy --authkey-file round.key",
        formatter_class=formatter,
    )
    keygen.add_argument(
        "--out",
        metavar="FILE",
        help="write the key to FILE, a new file readable only by its owner (default: stdout)",
    )
    keygen.set_defaults(func=run_keygen)
