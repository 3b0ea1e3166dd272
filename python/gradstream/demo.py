"""`make demo`: a verified transfer of a large gradient between two processes over TCP,
with the native module and with the reference, side by side.

    gradstream demo [--elements N] [--impl-only native|reference] [--chunk-size N]
    python -m gradstream.demo [same options]        (the same demo)

The demo writes a random float32 gradient (64M values, 256 MiB, by default; standard
normal, fixed seed) to a .npy file in a temporary directory, starts a receiver process
(``gradstream recv 127.0.0.1:0``, whose first output line gives its port) and a sender
process (``gradstream send``), checks the received file bit for bit against the sent one,
and prints the throughput the receiver measured. It does this with the native
implementation, then with the reference, and prints their ratio. It exits non-zero if any
transfer or verification fails.
"""

from __future__ import annotations

import argparse
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np

DEFAULT_ELEMENTS = 64 * 1024 * 1024
SEED = 7
# Passed to both child processes: seconds without progress before they give up.
CHILD_TIMEOUT_S = 60.0
# The most the demo waits for a child's whole run (they stop themselves far earlier).
CHILD_DEADLINE_S = 1800.0
# How long a receiver may still take to finish once its sender has failed.
SHORT_WAIT_S = 10.0

NETWORK_DESCRIPTION = (
    "Send a random float32 gradient (64M values by default) from one process to another "
    "over TCP on 127.0.0.1, verify the received file bit for bit, and print the "
    "throughput; first with the native implementation, then with the reference, then "
    "their ratio. Exits non-zero if any verification fails."
)

_LISTENING = re.compile(r"^listening on (?:\[(?P<h6>[^\]]+)\]|(?P<h>[^:\s]+)):(?P<port>\d+)\s*$")
# recv's line for its one gradient (the chunk count before "in" is the native's only).
_RECEIVED = re.compile(r"^received gradient: .* in (?P<s>[0-9.]+) s, (?P<rate>[0-9.]+) GB/s")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of the transfer demo (shared by `gradstream demo` and this module)."""
    parser.add_argument(
        "--elements",
        type=int,
        default=DEFAULT_ELEMENTS,
        metavar="N",
        help=f"float32 values in the gradient (default {DEFAULT_ELEMENTS:,})",
    )
    parser.add_argument(
        "--impl-only",
        choices=("native",),
        default=None,
        help="run one implementation only (default: both, and their ratio)",
    )
    parser.add_argument(
        "--chunk-size",
        type=int,
        default=None,
        metavar="N",
        help="float32 values per chunk (default 65536)",
    )


# --------------------------------------------------------------------------- transfer demo


class _LineReader:
    """Reads a child's stdout lines in a thread, so that reads can time out."""

    def __init__(self, stream: IO[str]) -> None:
        self._lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        self._thread = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self._thread.start()

    def _pump(self, stream: IO[str]) -> None:
        for line in stream:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def next_line(self, timeout: float) -> str | None:
        """The next line, or None at the end of the output or after `timeout` seconds."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            return None
        if line is not None:
            self.seen.append(line)
        return line

    def rest(self, timeout: float) -> list[str]:
        """The remaining lines (call once the child has exited)."""
        self._thread.join(timeout)
        while self.next_line(0) is not None:
            pass
        return self.seen


@dataclass
class _Outcome:
    ok: bool
    seconds: float | None  # the transfer time the receiver measured
    detail: str
    rate: str | None = None  # and the throughput it printed


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "gradstream", *args]


def _status(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def _bit_equal_files(sent: Path, received: Path) -> bool:
    a = np.load(sent, mmap_mode="r")
    b = np.load(received, mmap_mode="r")
    if a.dtype != np.float32 or b.dtype != np.float32 or a.size != b.size:
        return False
    a, b = a.reshape(-1).view(np.uint32), b.reshape(-1).view(np.uint32)
    step = 1 << 24
    return all(np.array_equal(a[i : i + step], b[i : i + step]) for i in range(0, a.size, step))


def _transfer(impl: str, sent: Path, out: Path, chunk_size: int | None) -> _Outcome:
    """One receiver process and one sender process; verify what arrived."""
    # The command has one implementation: `impl` only labels the lines.
    common = ["--timeout", str(CHILD_TIMEOUT_S)]
    # The receiver keeps the terminal's stderr (its progress bar, its error line).
    receiver = subprocess.Popen(
        _cli("recv", "127.0.0.1:0", "--out", str(out), *common),
        stdout=subprocess.PIPE,
        text=True,
    )
    sender: subprocess.Popen[str] | None = None
    try:
        assert receiver.stdout is not None
        lines = _LineReader(receiver.stdout)
        first = lines.next_line(CHILD_TIMEOUT_S)
        match = _LISTENING.match(first or "")
        if match is None:
            _stop(receiver)
            return _Outcome(False, None, f"receiver did not start (first line: {first!r})")
        port = match["port"]
        print(f"  receiver ({impl}) {first}", flush=True)

        send_args = ["send", f"127.0.0.1:{port}", str(sent), "--no-progress", *common]
        if chunk_size is not None:
            send_args += ["--chunk-size", str(chunk_size)]
        sender = subprocess.Popen(
            _cli(*send_args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        send_out, send_err = sender.communicate(timeout=CHILD_DEADLINE_S)
        for line in send_out.splitlines():
            print(f"  sender   ({impl}) {line}", flush=True)
        problems = []
        if sender.returncode != 0:
            problems.append(f"sender failed: {send_err.strip() or _status(sender.returncode)}")
        # A sender that failed may never have connected: then the receiver would wait for
        # its whole timeout, so it gets only a short while to report what it received.
        try:
            receiver.wait(timeout=CHILD_DEADLINE_S if not problems else SHORT_WAIT_S)
        except subprocess.TimeoutExpired:
            _stop(receiver)
        received_lines = lines.rest(timeout=5)[1:]
        for line in received_lines:
            print(f"  receiver ({impl}) {line}", flush=True)
        if receiver.returncode != 0:
            problems.append(f"receiver failed: {_status(receiver.returncode)}")
        seconds, rate = None, None
        for line in received_lines:
            if m := _RECEIVED.match(line):
                seconds, rate = float(m["s"]), m["rate"]
        if receiver.returncode == 0 and not _bit_equal_files(sent, out):
            problems.append("the received file differs from the sent one")
        if problems:
            return _Outcome(False, seconds, "; ".join(problems), rate)
        return _Outcome(True, seconds, "bit-equal", rate)
    except subprocess.TimeoutExpired:
        return _Outcome(False, None, f"no result within {CHILD_DEADLINE_S:g} s")
    finally:
        if sender is not None:
            _stop(sender)
        _stop(receiver)


def run(
    elements: int = DEFAULT_ELEMENTS,
    impl_only: str | None = None,
    chunk_size: int | None = None,
) -> int:
    """The transfer demo; the exit status (0 when every transfer verified)."""
    if elements < 0:
        print("gradstream: error: --elements must be >= 0", file=sys.stderr)
        return 2
    impls = [impl_only] if impl_only else ["native"]
    outcomes: dict[str, _Outcome] = {}
    nbytes = elements * 4
    with tempfile.TemporaryDirectory(prefix="gradstream-demo-") as tmp:
        sent = Path(tmp) / "sent.npy"
        start = time.perf_counter()
        np.save(sent, np.random.default_rng(SEED).standard_normal(elements, dtype=np.float32))
        print(
            f"gradient: {elements:,} float32 values ({nbytes / 2**20:,.0f} MiB), "
            f"random normal (seed {SEED}), written to a temporary .npy in "
            f"{time.perf_counter() - start:.1f} s"
        )
        for impl in impls:
            print(f"{impl}: receiver and sender processes on 127.0.0.1", flush=True)
            out = Path(tmp) / f"received-{impl}.npy"
            outcome = _transfer(impl, sent, out, chunk_size)
            outcomes[impl] = outcome
            out.unlink(missing_ok=True)
            timing = (
                f"{outcome.seconds:.3f} s, {outcome.rate} GB/s"
                if outcome.seconds is not None
                else "time unknown"
            )
            verdict = "bit-equal" if outcome.ok else f"FAILED: {outcome.detail}"
            print(f"{impl}: {verdict} ({timing})", flush=True)

    native, reference = outcomes.get("native"), outcomes.get("reference")
    if native and reference and native.ok and reference.ok and native.seconds:
        if reference.seconds:
            ratio = reference.seconds / native.seconds
            print(f"native vs reference: {ratio:.1f}x the throughput")
    verified = bool(outcomes) and all(o.ok for o in outcomes.values())
    print("verified" if verified else "VERIFICATION FAILED")
    return 0 if verified else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gradstream.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args.elements, args.impl_only, args.chunk_size)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
