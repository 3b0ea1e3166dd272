"""The ``gradstream`` command: send and receive gradients over connections, and the demo.

    gradstream recv [HOST:]PORT --out FILE.npy|FILE.npz|FILE.safetensors
                    [--count N | --forever] [--max-bytes B] [--max-connections N]
                    [CONNECTION FLAGS] [--timeout S] [-v]
    gradstream send HOST:PORT FILE [FILE ...] [--chunk-size N] [--layout L]
                    [--compression C] [--wire-dtype D] [--streams N]
                    [--resume | --no-resume]
                    [CONNECTION FLAGS]
                    [--timeout S] [-v]
    gradstream demo [--mib N] [--repeats R]
    gradstream keygen [--out FILE]

    CONNECTION FLAGS: [--protocol gradstream|seed] [--tls-cert FILE --tls-key FILE]
                      [--tls-ca FILE] [--authkey-file FILE]

(``python -m gradstream ...`` is the same command. The benchmarks are not part of it: they
live in the repository's ``benches/``, run by ``make bench``.)

``recv`` listens, prints ``listening on HOST:PORT`` as its first line of output (PORT 0
picks a free port; the line gives the one bound), serves any number of connections at
once and saves each gradient as it arrives, until ``--count`` gradients in all or, with
``--forever``, until SIGINT or SIGTERM (``_cli_recv``). ``send`` connects once and sends
each file over that connection (``_cli_send``): a .npy file as a gradient, a .npz or
.safetensors file as a tensor set, which ``recv`` takes when its ``--out`` is one
(``_cli_files``); with the default ``--protocol
gradstream`` each file is done only once the receiver acknowledged it, and one it did
not fails the command. ``--protocol seed`` speaks the bare frames of ipfrs-transport
0.2.0 (no hello, no acknowledgement; no TLS, no authkey). ``--tls-*`` and
``--authkey-file`` are checked in ``_cli_link``.

Exit status: 0 on success; 1 when a transfer, a connection, a file or a verification
fails; 2 for a command-line mistake (unknown option, bad HOST:PORT, flags that do not go
together); 130 on Ctrl-C (143 on SIGTERM) except for ``recv --forever``, which a signal
ends normally (0). Failures print one line on stderr (``gradstream: error: ...``), never
a traceback; the library's log shows on stderr one line a record, WARNING and above
(``-v`` for INFO), e.g. the bad peers a receiver refused (``_cli_log``).

A progress bar (tqdm) appears on stderr for a ``send`` that runs longer than a second,
when stderr is a terminal; ``--no-progress`` turns it off.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Sequence
from typing import Any, NoReturn

from ._cli_base import WIDEST_VALUE, CliError, format_size, one_line, parse_address, parse_size
from ._cli_keygen import add_keygen
from ._cli_link import PROTOCOLS
from ._cli_log import command_logging, level_for
from ._cli_recv import output_paths, run_recv
from ._cli_send import SEND_TIMEOUT, run_send

__all__ = ["CliError", "format_size", "main", "output_paths", "parse_address", "parse_size"]

DEFAULT_MAX_BYTES = "4G"


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


def _add_common(p: argparse.ArgumentParser, *, listening: bool) -> None:
    p.add_argument(
        "--timeout",
        type=_positive_float,
        metavar="S",
        default=None if listening else SEND_TIMEOUT,
        help="fail after S seconds without progress (default: wait for ever)"
        if listening
        else f"fail after S seconds without progress (default: {SEND_TIMEOUT:g})",
    )
    p.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="show the library's INFO log (connections, handshakes) on stderr; -vv for "
        "DEBUG (each transfer's size and rate). Default: warnings and errors only",
    )
    link = p.add_argument_group("connection")
    link.add_argument(
        "--protocol",
        choices=PROTOCOLS,
        default="gradstream",
        help="gradstream (the default: a hello, sealed chunks, an acknowledgement per "
        "gradient; TLS and authkey possible) or seed (the bare frames of ipfrs-transport "
        "0.2.0, for the original crate: none of that, and a lost gradient goes unnoticed)",
    )
    whose = "this receiver's" if listening else "this worker's (mutual TLS, with --tls-ca)"
    link.add_argument(
        "--tls-cert", metavar="FILE", help=f"TLS: {whose} certificate, PEM (with --tls-key)"
    )
    link.add_argument("--tls-key", metavar="FILE", help="TLS: the private key of --tls-cert, PEM")
    link.add_argument(
        "--tls-ca",
        metavar="FILE",
        help="TLS: the CA certificate, PEM, that signed "
        + (
            "the workers' certificates: asks each for one (mutual TLS)"
            if listening
            else "the receiver's certificate (needed for TLS; its name or IP must be HOST)"
        ),
    )
    link.add_argument(
        "--authkey-file",
        metavar="FILE",
        help="a shared key: the file's bytes, at least 16 (make one with gradstream keygen "
        "--out FILE); "
        "only peers with the same key are admitted, both ways",
    )


def build_parser() -> argparse.ArgumentParser:
    fmt = _Formatter
    parser = _Parser(
        prog="gradstream",
        description="Stream float32 gradients between processes over TCP (optionally TLS), "
        "with a CRC-32 check on every chunk and an acknowledgement of every gradient.",
        epilog="Run 'gradstream COMMAND --help' for a command's options.\n"
        "Exit status: 0 success, 1 failure, 2 command-line mistake, 130 interrupted.",
        formatter_class=fmt,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_recv(sub)
    _add_send(sub)
    _add_demo(sub)
    add_keygen(sub, _Formatter)
    return parser


# The subparsers' action type is private to argparse.
def _add_recv(sub: Any) -> None:
    recv = sub.add_parser(
        "recv",
        help="listen, receive gradients or tensor sets from any number of workers, save "
        "them as .npy (or .npz / .safetensors)",
        description="Listen on [HOST:]PORT (HOST defaults to 127.0.0.1; PORT 0 picks a free "
        "port) and serve any number of connections at once, until --count gradients in all "
        "have arrived or, with --forever, until SIGINT or SIGTERM. The first line printed is "
        "'listening on HOST:PORT' with the port bound; then one line per gradient, naming "
        "the peer (its address, its TLS subject under mutual TLS, 'authenticated' when it "
        "proved the authkey or a certificate) and what arrived.",
        epilog="With --count 1 the gradient is saved to FILE as given; otherwise the i-th "
        "saved (from 0, across connections, as they arrive) goes to STEM-i.SUFFIX (out.npy "
        "-> out-0.npy, out-1.npy, ...), --forever included.\n"
        "The suffix of FILE says what the run takes: .npz or .safetensors, tensor sets "
        "('gradstream send' of a .npz or .safetensors file, or send_tensors), each saved "
        "with its names, dtypes and shapes as sent; any other, lone gradients, each saved "
        "as a .npy file. A peer that sends the other kind is refused (its send fails), "
        "nothing of it is written, and the run goes on. .safetensors needs the "
        "safetensors package; bfloat16 is saved as bfloat16 with ml_dtypes installed "
        "(in a .npy or .npz file as numpy saves it, raw 2-byte values '<V2'; in a "
        ".safetensors file as BF16), as float32 without.\n"
        "A gradient is saved in the dtype and shape it arrives in: 'gradstream send' sends "
        "a file's dtype and shape (with --protocol seed, float32 values without a shape, "
        "1-D); a Python peer may also send bfloat16. The line printed for each says which. "
        "Every chunk's CRC-32 is checked.\n"
        "--max-bytes B bounds the bytes of values the run accepts: with --count N each "
        "gradient gets B/N, so that the N together stay within B (with --forever, each "
        f"gets B). A gradient's room is counted at {WIDEST_VALUE} bytes a value (float64, "
        "the widest a peer can send), so that the values recv holds stay within the bound "
        "whatever a peer sends; a float32 gradient can therefore take at most half of it. "
        "A gradient that would pass its share is refused before it is acknowledged or "
        "written (a gradstream sender learns the limit from the hello and fails at once).\n"
        "A peer that fails TLS, the hello or the authkey, or whose gradient fails, is "
        "logged on stderr and dropped; the run goes on. With --count, --timeout also ends "
        "the run when no connection is open for that long.\n\n"
        "example:\n  gradstream recv 0 --out grad.npy\n  gradstream recv 0.0.0.0:9000 "
        "--out g.npy --count 2 --tls-cert receiver.pem --tls-key receiver.key "
        "--authkey-file round.key",
        formatter_class=_Formatter,
    )
    recv.add_argument(
        "address",
        metavar="[HOST:]PORT",
        help="where to listen; unix:PATH for processes of this host (docs/guides/same-host.md)",
    )
    recv.add_argument(
        "--out",
        required=True,
        metavar="FILE",
        help="where to save: FILE.npy for lone gradients, FILE.npz or FILE.safetensors "
        "for tensor sets",
    )
    until = recv.add_mutually_exclusive_group()
    until.add_argument(
        "--count", type=int, metavar="N", help="gradients to receive, in all (default 1)"
    )
    until.add_argument(
        "--forever", action="store_true", help="receive until SIGINT or SIGTERM (exit 0)"
    )
    recv.add_argument(
        "--max-bytes",
        type=_size,
        default=DEFAULT_MAX_BYTES,
        metavar="B",
        help="the most bytes of values the whole run accepts: bytes, or with a K, M or G "
        f"suffix (binary: 1K = 1024); default {DEFAULT_MAX_BYTES}",
    )
    recv.add_argument(
        "--max-connections",
        type=int,
        metavar="N",
        help="connections open at once, at most (default 256); with --forever the values "
        "held are at most N times --max-bytes",
    )
    _add_common(recv, listening=True)
    recv.set_defaults(func=run_recv)


def _add_send(sub: Any) -> None:
    send = sub.add_parser(
        "send",
        help="send .npy gradients, or .npz / .safetensors tensor sets, to a receiver",
        description="Connect to HOST:PORT and send each FILE over that one connection, "
        "in order. With --protocol gradstream (the default) a .npy file goes as one "
        "gradient, as it is, float16, bfloat16, float32 or float64 in its shape; a .npz "
        "archive or a "
        ".safetensors file goes as one tensor set, its arrays by name in the file's order, "
        "each float16, bfloat16, float32 or float64 in its shape (recv saves it alike into "
        "a .npz or .safetensors --out). A file is sent once the receiver acknowledged it; "
        "one it did not acknowledge (refused, or closed before) fails the command. With "
        "--protocol seed, .npy files of float32 alone, flattened in C order, as "
        "ipfrs-transport sends them. The line printed for each file gives its value bytes "
        "and the bytes it took on the wire.",
        epilog="example:\n  gradstream send 127.0.0.1:9000 grad.npy\n"
        "  gradstream send 127.0.0.1:9000 a.npy b.npy   # to a recv --count 2\n"
        "  gradstream send 127.0.0.1:9000 grads.npz     # to a recv --out FILE.npz\n"
        "  gradstream send 10.0.0.5:9000 g.npy --tls-ca ca.pem --authkey-file round.key",
        formatter_class=_Formatter,
    )
    send.add_argument("address", metavar="HOST:PORT", help="the receiver; unix:PATH on this host")
    send.add_argument(
        "files",
        nargs="+",
        metavar="FILE",
        help=".npy file(s) of float16, bfloat16, float32 or float64 values (float32 alone "
        "with --protocol seed), or .npz / .safetensors file(s) of such tensors, each sent as "
        "one tensor set (not with --protocol seed). bfloat16 needs ml_dtypes; a .npy or .npz "
        "file holds it as numpy saves ml_dtypes.bfloat16 (raw 2-byte values, '<V2'), a "
        ".safetensors file as BF16; .safetensors needs the safetensors package",
    )
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
        default=None,
        help="payload columns: compact (values only; the default with --protocol "
        "gradstream) or seed (index + value, twice the wire bytes, as ipfrs-transport "
        "sends; the default with --protocol seed). Any gradstream or ipfrs-transport "
        "receiver reads both",
    )
    send.add_argument(
        "--compression",
        choices=["none", "lz4", "zstd"],
        default="none",
        help="Arrow IPC buffer compression of the payloads (default none; any gradstream "
        "receiver reads lz4 and zstd, ipfrs-transport may not)",
    )
    send.add_argument(
        "--wire-dtype",
        choices=["float16", "bfloat16", "float32", "float64", "int8"],
        default=None,
        help="what the values travel as (default: their own dtype): a float dtype they are "
        "cast to, or int8, blockwise-quantized float32 at about a quarter of float32's "
        "bytes, lossy (the receiver gets the file's dtype back; not with --compression)",
    )
    send.add_argument(
        "--streams",
        type=int,
        default=1,
        metavar="N",
        help="TCP (or TLS) connections to spread each gradient's chunks over, 1 to 255 "
        "(default 1): for long paths, where one connection's window caps its rate; needs "
        "--authkey-file or TLS, and the receiver may grant fewer",
    )
    send.add_argument(
        "--resume",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="after a connection failure mid-transfer, dial again and send only what the "
        "receiver lacks (default: on with --streams above 1, off with one; needs "
        "--authkey-file or TLS)",
    )
    send.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (there is none anyway when stderr is not a terminal)",
    )
    _add_common(send, listening=False)
    send.set_defaults(func=run_send)


def _cmd_demo(args: argparse.Namespace) -> int:
    from . import demo

    return demo.run(mib=args.mib, repeats=args.repeats)


def _add_demo(sub: Any) -> None:
    from . import demo

    demo_parser = sub.add_parser(
        "demo",
        help=demo.HELP,
        description=demo.DESCRIPTION,
        formatter_class=_Formatter,
    )
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(func=_cmd_demo)


def main(argv: Sequence[str] | None = None) -> int:
    """The console script ``gradstream``; returns the exit status."""
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        with command_logging(level_for(getattr(args, "verbose", 0))):
            return int(args.func(args))
    except KeyboardInterrupt:
        return 130
    except CliError as exc:
        print(f"gradstream: error: {one_line(str(exc))}", file=sys.stderr, flush=True)
        return exc.status


if __name__ == "__main__":
    sys.exit(main())
