"""What a connection writes to the ``gradstream`` logger (docs/guides/limits.md, logging):
a listener's accepted peers (INFO) and its refusals (WARNING, at most
REFUSAL_LOGS_PER_SECOND a second, the rest counted), and one DEBUG line per transfer.

Plain Python over ``_address`` and ``_checks``, so that the line's words are fixed here once.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from ._address import Address, Peer, peer_text
from ._checks import Protocol

__all__ = [
    "REFUSAL_LOGS_PER_SECOND",
    "RefusalLog",
    "describe_side",
    "log_accepted",
    "log_transfer",
    "silent_text",
]

REFUSAL_LOGS_PER_SECOND = 10  # per listener; the rest are counted in the next line

# The logger of the whole library.
logger = logging.getLogger("gradstream")


def silent_text(limit: float) -> str:
    """Why a listener dropped a peer that did not finish its handshake in time."""
    return f"silent past handshake_timeout ({limit:g} s)"


def describe_side(protocol: Protocol, tls: bool, authkey: bool) -> str:
    """What a side speaks, for the logs: ``gradstream, TLS, authkey``."""
    parts = [protocol, "TLS" if tls else "", "authkey" if authkey else ""]
    return ", ".join(part for part in parts if part)


def log_accepted(listener: Address, peer: Peer, protocol: Protocol) -> None:
    """The INFO line of a peer through a listener's handshake."""
    logger.info(
        "listener %s accepted %s (%s%s%s)",
        peer_text(listener),
        peer_text(peer.address),
        protocol,
        f", TLS subject {peer.tls_subject}" if peer.tls_subject else "",
        ", authenticated" if peer.authenticated else "",
    )


def log_transfer(done: str, what: str, wire_bytes: int, seconds: float, peer: Address) -> None:
    """The DEBUG line of one transfer: ``sent a gradient (N bytes on the wire) to
    HOST:PORT in T s (R MB/s)``; ``done`` is "sent" or "received", ``what`` "gradient" or
    "tensor set". N is what ``progress=`` counts: the frames' bytes (a set's tensors, not
    its manifest); T runs from the call (a receive's includes its wait for the first
    byte)."""
    rate = f"{wire_bytes / seconds / 1e6:.1f} MB/s" if seconds > 0 else "at once"
    logger.debug(
        "%s a %s (%d bytes on the wire) %s %s in %.3f s (%s)",
        done,
        what,
        wire_bytes,
        "to" if done == "sent" else "from",
        peer_text(peer),
        seconds,
        rate,
    )


class RefusalLog:
    """A listener's refusal lines (logger ``gradstream``, WARNING): at most ``per_second``
    in any one-second window; the ones past that are counted, and the count is reported
    in the next line that is written. ``clock`` is for the tests."""

    def __init__(
        self,
        listener: str,
        per_second: int = REFUSAL_LOGS_PER_SECOND,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._listener = listener
        self._per_second = per_second
        self._clock = clock
        self._window_start = -math.inf
        self._written = 0  # lines written in the current window
        self._unlogged = 0  # refusals not written since the last line

    def refused(self, address: Address | None, reason: str) -> bool:
        """Log that the peer at ``address`` was dropped for ``reason``; False when the
        line was only counted."""
        now = self._clock()
        if now - self._window_start >= 1.0:
            self._window_start = now
            self._written = 0
        if self._written >= self._per_second:
            self._unlogged += 1
            return False
        self._written += 1
        unlogged = f" ({self._unlogged} more refusals were not logged)" if self._unlogged else ""
        self._unlogged = 0
        logger.warning(
            "listener %s refused %s: %s%s", self._listener, peer_text(address), reason, unlogged
        )
        return True
