"""The blocking ``Listener``, ``Server``, ``listen`` and ``serve``
(docs/guides/blocking.md): a pump thread per listener takes the native listener's
events (connections queued for ``accept``, refusals logged as the asyncio listener logs
them); a server runs each connection's handler in a thread of its own."""

from __future__ import annotations

import errno
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

from .._address import Address, address_of, peer_text
from .._checks import check_handler, check_seconds
from .._connection_args import listen_args
from .._logs import RefusalLog, log_accepted, silent_text
from .._session import GradientStreamSession
from ..errors import StreamIOError
from ._connection import Connection
from ._wait import stopping, wait, waiter

log = logging.getLogger("gradstream")

__all__ = ["Listener", "Server", "listen", "serve"]

# Seconds a closing listener waits for the events its stopped accept loop still sends.
_LAST_EVENTS = 5.0


class Listener:
    """A bound listener, blocking: peers through TLS, the hello and authentication come
    out of ``accept`` (or ``for conn in listener``); every other peer is logged
    (rate-limited) and dropped, as by ``gradstream.Listener``."""

    def __init__(self, native: Any, session: GradientStreamSession, protocol: Any) -> None:
        self._native = native
        self._session = session
        self._protocol = protocol
        self.address: Address = native.address
        self._ready: queue.Queue[Connection | None] = queue.Queue()
        self._lock = threading.Lock()
        self._closed = False
        self._refusals = RefusalLog(peer_text(self.address))
        self._pump = threading.Thread(
            target=self._take_events,
            name=f"gradstream-listener {peer_text(self.address)}",
            daemon=True,
        )
        self._pump.start()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "listening"
        return f"<Listener {peer_text(self.address)} {self._protocol} {state}>"

    def _take_events(self) -> None:
        own = waiter()
        while True:
            try:
                event = wait(own, self._native.next(own))
            except Exception as exc:  # the accept loop itself failed: nothing more comes
                log.warning("listener %s stopped: %r", peer_text(self.address), exc)
                break
            if event is None:
                break
            if event[0] == "connection":
                self._arrived(event[1])
            elif event[0] == "silent":
                self._refusals.refused(address_of(event[1]), silent_text(event[2]))
            elif event[0] == "dropped":  # closed by the listener itself: its words
                self._refusals.refused(address_of(event[1]), event[2])
            else:
                self._refusals.refused(address_of(event[1]), str(event[2]))

    def _arrived(self, link: Any) -> None:
        connection = Connection(link, self._session)
        with self._lock:
            if not self._closed:
                log_accepted(self.address, connection.peer, self._protocol)
                self._ready.put(connection)
                return
        connection.close()  # passed as the listener closed: not to be accepted

    def accept(self, timeout: float | None = None) -> Connection:
        """The next peer through the handshake, waiting at most ``timeout`` seconds
        (None: for ever; then TimeoutError); ``StreamIOError`` once closed."""
        wait_for = check_seconds(timeout, "timeout")
        try:
            got = self._ready.get(timeout=wait_for)
        except queue.Empty:
            raise TimeoutError(
                f"no connection on {peer_text(self.address)} within {wait_for:g} s"
            ) from None
        if got is None:
            self._ready.put(None)  # for every other waiter
            raise StreamIOError(errno.EBADF, "accept() on a closed listener")
        return got

    def __iter__(self) -> Iterator[Connection]:
        """The connections accepted, until the listener closes."""
        while True:
            try:
                yield self.accept()
            except StreamIOError:
                if self._closed:
                    return
                raise

    def close(self) -> None:
        """Stop listening: handshakes under way are dropped, connections not yet
        accepted are closed; connections accept() gave out stay their owners'."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        while True:
            try:
                waiting = self._ready.get_nowait()
            except queue.Empty:
                break
            if waiting is not None:
                waiting.close()
        self._ready.put(None)
        own = waiter()
        with stopping(own):
            wait(own, self._native.close(own))
        # The events still on their way end with the accept loop's tasks: the pump closes
        # their connections, then ends.
        self._pump.join(_LAST_EVENTS)
        log.info("listener %s closed", peer_text(self.address))

    def __enter__(self) -> Listener:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def listen(address: Any, **keywords: Any) -> Listener:
    """Listen on ``address``, blocking until bound: the arguments of
    ``gradstream.listen`` (``session``, ``tls``, ``authkey``, the caps and waits)."""
    opened = listen_args(address, **keywords)
    own = waiter()
    with stopping(own):
        native = wait(
            own,
            opened.session._open_listener(
                own, opened.host, opened.port, opened.args, opened.listener
            ),
        )
    listener = Listener(native, opened.session, opened.args["protocol"])
    log.info("listening on %s (%s)", peer_text(listener.address), opened.speaks)
    return listener


class Server:
    """``serve``'s result: each connection goes to ``handler(conn)`` in a thread of its
    own, and is closed when it returns; a handler's exception is logged (WARNING, with
    the traceback) and ends its connection only. ``address`` is the listener's."""

    def __init__(self, listener: Listener, handler: Callable[[Connection], Any]) -> None:
        self._listener = listener
        self._handler = handler
        self._lock = threading.Lock()
        # Each running handler's thread: its connection and that thread's Completions
        # (None until the thread runs).
        self._handlers: dict[threading.Thread, tuple[Connection, Any]] = {}
        self._dispatcher = threading.Thread(
            target=self._dispatch, name="gradstream-server", daemon=True
        )
        self._dispatcher.start()

    @property
    def address(self) -> Address:
        return self._listener.address

    def __repr__(self) -> str:
        return f"<Server {self._listener!r}>"

    def _dispatch(self) -> None:
        for conn in self._listener:
            thread = threading.Thread(
                target=self._serve,
                args=(conn,),
                name=f"gradstream-handler-{peer_text(conn.peer.address)}",
                daemon=True,
            )
            with self._lock:
                self._handlers[thread] = (conn, None)  # its Completions once it runs
            thread.start()

    def _serve(self, conn: Connection) -> None:
        with self._lock:
            self._handlers[threading.current_thread()] = (conn, waiter())
        try:
            if not conn._shut_down:  # else shut down before it ran
                self._handler(conn)
        except Exception as exc:
            log.warning(
                "handler of the connection with %s failed: %r",
                peer_text(conn.peer.address),
                exc,
                exc_info=exc,
            )
        finally:
            conn.close()
            with self._lock:
                self._handlers.pop(threading.current_thread(), None)

    def serve_forever(self) -> None:
        """Block until the server is shut down (from another thread, or Ctrl-C here)."""
        while self._dispatcher.is_alive():
            self._dispatcher.join(0.1)  # short joins: Ctrl-C is seen between them

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop listening, stop the running handlers' transfers and wait up to
        ``timeout`` seconds in all for the handlers to return. A handler's connection is
        closed under it: the transfer it is in raises ``StreamIOError`` ("the server
        shut down"), as a cancelled asyncio handler's (a gradient received and not
        handed over is refused), and its next call says the connection is closed."""
        self._listener.close()
        self._dispatcher.join()
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                running = dict(self._handlers)
            if not running:
                return
            # Again each round: a handler may have been about to start a transfer.
            for conn, own in running.values():
                conn._stop(own)
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                return
            for thread in running:
                thread.join(0.05 if left is None else min(0.05, left))

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


def serve(address: Any, handler: Callable[[Connection], Any], **keywords: Any) -> Server:
    """``listen(address, **keywords)``, each connection handed to ``handler(conn)`` in a
    thread of its own; the connection is closed when the handler returns."""
    check_handler(handler)
    return Server(listen(address, **keywords), handler)
