"""One transfer at a time on a connection (docs/guides/connections.md): the state a
``Connection`` keeps, and the errors of a call made while another runs or after the
connection closed.

Plain Python over ``errors`` only.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import threading
from collections.abc import Iterator

from .errors import SettingError, StreamIOError

__all__ = ["Phase", "Turns"]


class Phase(enum.Enum):
    """Where a connection stands: at most one transfer runs at a time."""

    IDLE = "idle"
    SENDING = "sending"
    RECEIVING = "receiving"
    CLOSED = "closed"


class Turns:
    """The state of a connection: one transfer at a time, in either direction; a call
    while one runs is a SettingError, a call on a closed connection a StreamIOError
    (ENOTCONN). The check and the change are one step under a lock, so that two threads
    on one blocking connection (``gradstream.sync``) cannot both start a transfer."""

    def __init__(self) -> None:
        self.phase = Phase.IDLE
        self._lock = threading.Lock()

    @property
    def closed(self) -> bool:
        return self.phase is Phase.CLOSED

    @contextlib.contextmanager
    def turn(self, phase: Phase, call: str) -> Iterator[None]:
        """For the time of one transfer (``call`` names it in the errors): ``phase``,
        then idle again unless the transfer closed the connection."""
        self.begin(phase, call)
        try:
            yield
        finally:
            self.end(phase)

    def begin(self, phase: Phase, call: str) -> None:
        """``turn``'s start, for callers that cannot afford a context manager (a small
        transfer's round trip): ``end(phase)`` must follow, in a ``finally``."""
        with self._lock:
            if self.phase is Phase.CLOSED:
                raise StreamIOError(
                    errno.ENOTCONN,
                    f"{call} on a closed connection (closed by close(), by the peer, or "
                    "after a failed transfer): open a new one",
                )
            if self.phase is not Phase.IDLE:
                raise SettingError(
                    "connection",
                    f"{call} while this connection is {self.phase.value}: one transfer at "
                    "a time per connection (open a second connection for the other "
                    "direction, or one per thread)",
                )
            self.phase = phase

    def end(self, phase: Phase) -> None:
        """``turn``'s end: idle again unless the transfer closed the connection."""
        if self.phase is phase:
            self.phase = Phase.IDLE

    def close(self) -> bool:
        """Mark the connection closed; False when it already was."""
        was_open = self.phase is not Phase.CLOSED
        self.phase = Phase.CLOSED
        return was_open
