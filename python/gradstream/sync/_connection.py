"""The blocking ``Connection`` and ``connect`` (docs/guides/blocking.md): the asyncio
face's twin over the same core (``gradstream._connection.ConnectionCore``), each
transfer's job waited for on the caller's thread."""

from __future__ import annotations

import errno
import logging
from collections.abc import Iterator
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import numpy.typing as npt

from .._address import peer_text
from .._checks import HANDSHAKE_TIMEOUT, OWN_USER, RESUME_WINDOW, check_seconds
from .._connection import ConnectionCore, Timed, set_like
from .._connection_args import connect_args
from .._session import _Out, hand_back_as, lend_either
from .._torch import check_like
from .._turns import Phase
from ..errors import StreamIOError
from ._wait import interrupted, stopping, wait, waiter

if TYPE_CHECKING:
    from .. import TransferProgress

log = logging.getLogger("gradstream")

__all__ = ["Connection", "connect"]


class Connection(ConnectionCore):
    """A blocking connection to one peer, as ``gradstream.Connection`` (the same
    transfers, errors and guarantees) without ``await``. Made by ``connect``,
    ``Listener.accept`` or ``serve``. One transfer at a time: a second thread's call
    while one runs is a ``SettingError``. Ctrl-C during a call stops its transfer (what
    was received and not handed over is refused, as a cancelled asyncio call's), then
    raises ``KeyboardInterrupt``."""

    _close_advice = "conn.close(), or with"
    # Set by Server.shutdown: the transfer a handler is in was stopped (why it ended).
    _shut_down = False

    def _wait(self, own: Any, job: Any, *, now: bool = False) -> Any:
        """``job``'s result (``job`` itself when ``now``: the call ran the transfer to
        its end, None when it was stopped); a StreamIOError when the server's shutdown
        stopped it."""
        value = job if now else wait(own, job)
        if self._shut_down and (value is None or not now):
            self._abandoned()
            self._turns.close()
            raise StreamIOError(
                errno.ECONNABORTED,
                "the transfer was stopped: the server shut down (Server.shutdown)",
            )
        return value

    def _stop(self, own: Any) -> None:
        """For ``Server.shutdown``, from another thread: mark the connection closed and
        stop the transfer its handler (waiting on ``own``) is in."""
        self._shut_down = True
        self._turns.close()
        if own is not None:
            own.abort_all()

    def send(
        self,
        gradient: Any,
        *,
        progress: TransferProgress | None = None,
        deadline: float | None = None,
        wire_dtype: str | None = None,
    ) -> int:
        """Send one gradient; the number of chunks, once the peer has verified it (its
        ack). ``DeliveryError`` when it did not; ``deadline`` replaces the connection's;
        ``wire_dtype`` the session's for this gradient alone."""
        # try/finally rather than context managers: a small round trip feels them.
        self._begin(Phase.SENDING, "send")
        try:
            wire = self._session._transfer_wire(wire_dtype)
            args = self._session._take(gradient, wire)
            bound = check_seconds(deadline, "deadline")
            own = waiter()
            timed = Timed(progress)
            try:
                now, value = self._link.send(own, args, timed.progress, bound, True)
                sent: int = self._wait(own, value, now=now)
            except Exception:
                raise
            except BaseException:  # as stopping() does
                interrupted(own, self._abandoned)
                raise
        finally:
            self._end(Phase.SENDING)
        timed.log("sent", "gradient", self.peer)
        return sent

    def recv(
        self,
        out: npt.NDArray[Any] | None = None,
        *,
        progress: TransferProgress | None = None,
        deadline: float | None = None,
        reduce_into: npt.NDArray[np.float32] | None = None,
        op: str = "sum",
        like: Literal["numpy", "torch"] | None = None,
    ) -> Any:
        """Receive one gradient (into ``out`` when given: then ``out`` itself; added into
        ``reduce_into`` when given: then that array); an empty array when the peer
        closed the connection before another began (``closed`` is then True). ``out``
        and ``reduce_into`` may be CPU torch tensors; ``like="torch"`` hands back a torch
        tensor (docs/guides/torch.md)."""
        lent = lend_either(out, reduce_into, op)
        kind = check_like(like)
        self._begin(Phase.RECEIVING, "recv")
        try:
            got = self._recv(lent, progress, deadline, none_at_end=False, like=kind)
        finally:
            self._end(Phase.RECEIVING)
        assert got is not None  # none_at_end=False gives the empty gradient instead
        return got

    def _recv(
        self,
        lent: _Out | None,
        progress: TransferProgress | None,
        deadline: float | None,
        *,
        none_at_end: bool,
        like: str = "numpy",
    ) -> Any:
        bound = check_seconds(deadline, "deadline")
        own = waiter()
        timed = Timed(progress)
        args = None if lent is None else lent.args
        try:
            now, value = self._link.recv(own, timed.progress, args, bound, none_at_end, True)
            values = self._wait(own, value, now=now)
            if values is None:
                return None
            got = lent.array if lent is not None else hand_back_as(values, like)
            # The gradient is the caller's from here: only now is its ack written
            # (docs/guides/connections.md "Delivery"); the fast path wrote it already.
            if not now:
                self._link.settle()
        except Exception:
            raise
        except BaseException:  # as stopping() does
            interrupted(own, self._abandoned)
            raise
        timed.log("received", "gradient", self.peer)
        return got

    def send_tensors(
        self,
        tensors: Any,
        *,
        progress: TransferProgress | None = None,
        deadline: float | None = None,
    ) -> int:
        """Send a named set of tensors; the number of frames, once acknowledged."""
        with self._turn(Phase.SENDING, "send_tensors"):
            taken = self._session._tensors(tensors, "sending")
            bound = check_seconds(deadline, "deadline")
            own = waiter()
            timed = Timed(progress)
            with stopping(own, self._abandoned):
                sent: int = self._wait(
                    own, self._link.send_tensors(own, taken, timed.progress, bound)
                )
        timed.log("sent", "tensor set", self.peer)
        return sent

    def recv_tensors(
        self,
        *,
        progress: TransferProgress | None = None,
        deadline: float | None = None,
        max_values: int | None = None,
        out: Any = None,
        like: Literal["numpy", "torch"] | None = None,
    ) -> Any:
        """Receive a named set of tensors, in the sender's order; ``{}`` when the peer
        closed the connection before another began (``closed`` is then True). A set of
        more than ``max_values`` values in all is refused from its manifest.
        ``like="torch"`` gives torch tensors; ``out=`` (a torch module or a mapping of
        name to tensor) is filled in place and returned, refused before any write when
        the set's names, shapes or dtypes differ (docs/guides/torch.md)."""
        kind = set_like(out, like)
        with self._turn(Phase.RECEIVING, "recv_tensors"):
            bound = check_seconds(deadline, "deadline")
            most = self._most(max_values)
            own = waiter()
            timed = Timed(progress)
            with stopping(own, self._abandoned):
                got = self._wait(own, self._link.recv_tensors(own, timed.progress, bound, most))
                if got is None:
                    return {}
                tensors = self._taken_set(got, kind, out)
        timed.log("received", "tensor set", self.peer)
        return tensors

    def __iter__(self) -> Iterator[npt.NDArray[Any]]:
        """The gradients received, until the peer closes the connection."""
        while not self.closed:
            self._begin(Phase.RECEIVING, "for")
            try:
                gradient = self._recv(None, None, None, none_at_end=True)
            finally:
                self._end(Phase.RECEIVING)
            if gradient is None:
                return
            yield gradient

    def close(self) -> None:
        """Close the connection, its socket at once (after a transfer another thread
        runs on it, which ends first); idempotent."""
        self._start_close()
        own = waiter()
        with stopping(own):
            now, job = self._link.close(own)
            if not now:
                wait(own, job)

    def __enter__(self) -> Connection:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def connect(
    address: Any,
    *,
    session: Any = None,
    tls: Any = None,
    authkey: Any = None,
    timeout: Any = None,
    deadline: Any = None,
    protocol: Any = "gradstream",
    handshake_timeout: Any = HANDSHAKE_TIMEOUT,
    allowed_uid: Any = OWN_USER,
    streams: Any = 1,
    resume: Any = None,
    resume_window: Any = RESUME_WINDOW,
) -> Connection:
    """Connect to a listener at ``address`` and shake hands (as ``gradstream.connect``,
    blocking); ``handshake_timeout`` bounds the TCP connect, TLS and the hello
    together; ``streams``, ``resume`` and ``resume_window`` as ``gradstream.connect``'s."""
    opened = connect_args(
        address,
        session=session,
        tls=tls,
        authkey=authkey,
        timeout=timeout,
        deadline=deadline,
        protocol=protocol,
        handshake_timeout=handshake_timeout,
        allowed_uid=allowed_uid,
        streams=streams,
        resume=resume,
        resume_window=resume_window,
    )
    own = waiter()
    with stopping(own):
        link = wait(own, opened.session._open_link(own, opened.host, opened.port, opened.args))
    connection = Connection(link, opened.session)
    log.info("connected to %s (%s)", peer_text(connection.peer.address), opened.speaks)
    return connection
