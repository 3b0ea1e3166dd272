"""What both implementations of connections (README "Connections") share, in plain Python:
the ``TLS`` settings, the ``Peer`` a connection names, addresses, the defaults, the checks
of the connection keywords and the waits they give, the one-transfer-at-a-time state of a
connection (``Turns``), the text of a certificate's subject, the listener's log lines
(with the rate limit on refusals), and ``Server``, which runs a handler per connection
over either implementation's listener.

Plain Python like ``errors.py``, for the same reason: the native connection layer and
``gradstream.reference`` both import it, so it imports neither (only ``errors``), and
the two implementations refuse the same arguments with the same words.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import errno
import inspect
import ipaddress
import logging
import math
import operator
import os
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar
from typing import Protocol as _Protocol

from .errors import SettingError, StreamIOError, _peer_text

__all__ = [
    "HANDSHAKE_TIMEOUT",
    "LISTENER_DEADLINE",
    "MAX_CONNECTIONS",
    "MAX_PENDING_HANDSHAKES",
    "MIN_AUTHKEY_LEN",
    "REFUSAL_LOGS_PER_SECOND",
    "SSL_SOCKET_REFUSED",
    "TLS",
    "Address",
    "Peer",
    "Phase",
    "Protocol",
    "Ready",
    "RefusalLog",
    "Server",
    "Turns",
    "check_authkey",
    "check_count",
    "check_handler",
    "check_handshake_timeout",
    "check_max_values",
    "check_protocol",
    "check_seconds",
    "client_tls",
    "connection_waits",
    "describe_side",
    "listener_tls",
    "log_accepted",
    "log_transfer",
    "parse_address",
    "peer_text",
    "quoted",
    "silent_text",
    "subject_text",
]

Address = tuple[str, int]
Protocol = Literal["gradstream", "seed"]

# README "Connections": the listener's defaults and the shortest authkey.
HANDSHAKE_TIMEOUT = 10.0  # seconds for TLS, hello and authentication together
MAX_PENDING_HANDSHAKES = 64
MAX_CONNECTIONS = 256
LISTENER_DEADLINE = 300.0  # seconds for a gradient, once begun, on a listener's connections
MIN_AUTHKEY_LEN = 16
REFUSAL_LOGS_PER_SECOND = 10  # per listener; the rest are counted in the next line

# Why stream_to / receive_from refuse an ssl.SSLSocket, in both implementations: its
# descriptor carries TLS records, and frames written beneath the TLS session would go out
# in plaintext.
SSL_SOCKET_REFUSED = (
    "an ssl.SSLSocket cannot carry frames (they would bypass its TLS); use tls= with "
    "gradstream.connect / gradstream.listen, or asyncio streams over TLS"
)

# The logger of the whole library (README "Logging").
logger = logging.getLogger("gradstream")


def peer_text(address: Address | None) -> str:
    """How messages and logs name a peer: ``host:port``, ``[v6]:port``, or ``the peer``."""
    return _peer_text(address)


# --------------------------------------------------------------------------- TLS


def _readable_file(value: Any, name: str) -> str | None:
    """``value`` (None, a str or an os.PathLike) as a path to a file this process can read,
    or SettingError naming ``name`` and saying what is wrong with it."""
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(
            f"TLS {name}= must be None, a str or an os.PathLike, not {type(value).__name__}"
        )
    path = os.fspath(value)
    if not isinstance(path, str):
        raise TypeError(f"TLS {name}= must name a file by a str path, not {type(path).__name__}")
    if not os.path.exists(path):
        raise SettingError(name, f"TLS {name}= file {path!r} does not exist")
    if os.path.isdir(path):
        raise SettingError(name, f"TLS {name}= {path!r} is a directory, not a PEM file")
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise SettingError(
            name, f"TLS {name}= file {path!r} cannot be read: {exc.strerror}"
        ) from None
    return path


@dataclass(frozen=True)
class TLS:
    """TLS settings of one side of a connection: PEM files.

    ``TLS(cert=..., key=...)`` on a listener, ``TLS(ca=...)`` on a client (the server's
    certificate must be signed by ``ca`` and name the host ``connect`` was given), all
    three on both sides for mutual TLS (a listener with ``ca`` refuses a client without a
    certificate signed by it). The files are checked to exist and be readable here; they
    are loaded when a listener or connection is made.
    """

    cert: str | None = None
    key: str | None = None
    ca: str | None = None

    def __init__(
        self,
        cert: str | os.PathLike[str] | None = None,
        key: str | os.PathLike[str] | None = None,
        ca: str | os.PathLike[str] | None = None,
    ) -> None:
        # In this order: with several bad arguments, the first one raises.
        checked = {
            "cert": _readable_file(cert, "cert"),
            "key": _readable_file(key, "key"),
            "ca": _readable_file(ca, "ca"),
        }
        if (checked["cert"] is None) != (checked["key"] is None):
            given, missing = ("cert", "key") if checked["key"] is None else ("key", "cert")
            raise SettingError(
                missing, f"TLS {given}= needs {missing}= too: a certificate goes with its key"
            )
        if all(path is None for path in checked.values()):
            raise SettingError(
                "tls",
                "TLS() needs cert= and key= (a listener, or a client under mutual TLS) or ca=",
            )
        for name, path in checked.items():
            object.__setattr__(self, name, path)


def check_tls(tls: Any) -> TLS | None:
    if tls is None or isinstance(tls, TLS):
        return tls
    raise TypeError(f"tls must be None or a gradstream.TLS, not {type(tls).__name__}")


def _needing(tls: Any, part: str, detail: str) -> TLS | None:
    checked = check_tls(tls)
    if checked is not None and getattr(checked, part) is None:
        raise SettingError("tls", detail)
    return checked


def listener_tls(tls: Any) -> TLS | None:
    """A listener's ``tls=``: it needs its own certificate and key (``ca`` makes it mutual
    TLS)."""
    return _needing(
        tls,
        "cert",
        "a listener's TLS needs cert= and key= (its certificate); ca= alone is a client's",
    )


def client_tls(tls: Any) -> TLS | None:
    """A client's ``tls=``: it needs the ``ca`` that signed the server's certificate
    (``cert`` and ``key`` present it for mutual TLS)."""
    return _needing(
        tls, "ca", "a client's TLS needs ca= (the authority that signed the server's certificate)"
    )


# --------------------------------------------------------------------------- the peer


@dataclass(frozen=True)
class Peer:
    """The other side of a connection.

    ``address`` is its ``(host, port)``; ``tls_subject`` the subject of the client
    certificate a listener verified under mutual TLS, as RFC 4514 text (the most specific
    attribute first: ``"CN=worker-1,O=lab"``), else None;
    ``authenticated`` is True when the peer proved the authkey or presented a certificate
    this side verified (a client's TLS always verifies the server's).
    """

    address: Address
    tls_subject: str | None = None
    authenticated: bool = False


# --------------------------------------------------------------------------- addresses


def _port(value: Any, address: Any) -> int:
    """The port of a ``(host, port)`` pair (an int), or of ``"host:port"`` (its digits)."""
    if isinstance(value, str) and isinstance(address, str):
        if not value.isdigit() or not value.isascii():
            raise SettingError("address", f"address {address!r} has no port number after its ':'")
        number = int(value)
    elif isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(
            f"the port of address {address!r} must be an int, not {type(value).__name__}"
        )
    else:
        number = operator.index(value)
    if not 0 <= number <= 65535:
        raise SettingError(
            "address", f"the port of address {address!r} must be in 0..65535, got {number}"
        )
    return number


def parse_address(address: Any) -> Address:
    """``"host:port"`` (an IPv6 host in brackets: ``"[::1]:7000"``) or a ``(host, port)``
    pair, as ``(host, port)`` (the brackets dropped). Port 0 asks a listener for any free
    port."""
    if isinstance(address, tuple):
        if len(address) != 2 or not isinstance(address[0], str):
            raise TypeError(
                f"address must be 'host:port' or a (host: str, port: int) pair, got {address!r}"
            )
        host, port = address[0], _port(address[1], address)
    elif isinstance(address, str):
        host, sep, port_text = address.rpartition(":")
        if not sep:
            raise SettingError("address", f"address {address!r} must be 'host:port'")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
            _ipv6(host, address)
        elif ":" in host:
            raise SettingError(
                "address",
                f"address {address!r}: an IPv6 host goes in brackets, e.g. '[::1]:7000'",
            )
        port = _port(port_text, address)
    else:
        raise TypeError(
            f"address must be 'host:port' or a (host, port) pair, not {type(address).__name__}"
        )
    if not host:
        raise SettingError("address", f"address {address!r} has no host (use 0.0.0.0 or 127.0.0.1)")
    return host, port


def _ipv6(host: str, address: str) -> None:
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        raise SettingError(
            "address", f"address {address!r}: {host!r} in brackets is not an IPv6 address"
        ) from None


# --------------------------------------------------------------------------- keywords


def check_protocol(value: Any) -> Protocol:
    if not isinstance(value, str):
        raise TypeError(f"protocol must be 'gradstream' or 'seed', not {type(value).__name__}")
    if value == "gradstream":
        return "gradstream"
    if value == "seed":
        return "seed"
    raise SettingError("protocol", f"protocol must be 'gradstream' or 'seed', got {value!r}")


def check_authkey(value: Any) -> bytes | None:
    """``authkey=``: None, or bytes-like of at least MIN_AUTHKEY_LEN bytes (a str is
    refused: say which bytes it stands for)."""
    if value is None:
        return None
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise TypeError(f"authkey must be None or bytes, not {type(value).__name__}")
    key = bytes(value)
    if len(key) < MIN_AUTHKEY_LEN:
        raise SettingError(
            "authkey", f"authkey must hold at least {MIN_AUTHKEY_LEN} bytes, got {len(key)}"
        )
    return key


def check_plain_seed(protocol: Protocol, tls: TLS | None, authkey: bytes | None) -> None:
    """``protocol="seed"`` speaks bare frames: no TLS, no authkey."""
    if protocol == "seed" and (tls is not None or authkey is not None):
        given = "tls=" if tls is not None else "authkey="
        raise SettingError(
            "protocol",
            f"protocol='seed' speaks the bare frames of ipfrs-transport 0.2.0 and cannot "
            f"carry {given}; use protocol='gradstream'",
        )


def check_seconds(value: Any, name: str = "timeout") -> float | None:
    """``timeout=`` or ``deadline=`` (``name``), a session's or a call's: None, or a
    positive finite number of seconds."""
    if value is None:
        return None
    # What float() accepts from a number (int, float, numpy scalars, Decimal...), but not
    # a str, which float() would parse.
    kind = type(value)
    if not (hasattr(kind, "__float__") or hasattr(kind, "__index__")):
        raise TypeError(f"{name} must be None or a number, not {kind.__name__}")
    seconds = float(value)
    # NaN fails the comparison; infinity is None's job ("wait for ever").
    if not 0.0 < seconds < float("inf"):
        raise SettingError(
            name, f"{name} must be None or a positive number of seconds, got {value!r}"
        )
    return seconds


def connection_waits(
    session_timeout: float | None,
    session_deadline: float | None,
    timeout: float | None,
    deadline: float | None,
    *,
    listening: bool,
) -> tuple[float | None, float | None]:
    """The timeout and deadline of a connection's transfers: a call's (``connect``,
    ``listen``) replace the session's; a listener's connections give a gradient, once
    begun, LISTENER_DEADLINE seconds when neither sets a deadline."""
    wait = session_timeout if timeout is None else timeout
    bound = session_deadline if deadline is None else deadline
    if listening and bound is None:
        bound = LISTENER_DEADLINE
    return wait, bound


def check_handshake_timeout(value: Any) -> float:
    """A positive, finite number of seconds (None is refused: a listener must not wait for
    ever on a silent peer)."""
    kind = type(value)
    if (
        value is None
        or isinstance(value, bool)
        or not (hasattr(kind, "__float__") or hasattr(kind, "__index__"))
    ):
        raise TypeError(f"handshake_timeout must be a number of seconds, not {kind.__name__}")
    seconds = float(value)
    if not (0.0 < seconds and math.isfinite(seconds)):
        raise SettingError(
            "handshake_timeout",
            f"handshake_timeout must be a positive number of seconds, got {value!r}",
        )
    return seconds


def check_handler(handler: Any) -> None:
    """``serve``'s handler: anything callable (a coroutine function or a plain one)."""
    if not callable(handler):
        raise TypeError(f"handler must be callable, not {type(handler).__name__}")


def check_count(value: Any, name: str, least: int = 1) -> int:
    """max_pending_handshakes, max_connections: an int of at least 1 (``least``)."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, not bool")
    number = operator.index(value)
    if number < least:
        raise SettingError(name, f"{name} must be at least {least}, got {number}")
    return number


def check_max_values(value: Any) -> int | None:
    """``recv_tensors``' ``max_values``: None, or an int of at least 0."""
    return None if value is None else check_count(value, "max_values", least=0)


# --------------------------------------------------------------------------- subjects

# README "TLS and authentication": the keys of the subject text; any other attribute is
# named by its dotted OID (the native side reads the OIDs from the DER itself).
SUBJECT_KEYS = {
    "commonName": "CN",
    "organizationName": "O",
    "organizationalUnitName": "OU",
    "countryName": "C",
    "stateOrProvinceName": "ST",
    "localityName": "L",
    "emailAddress": "emailAddress",
}


def _key(name: str) -> str:
    """The key of an attribute ``ssl.getpeercert()`` names ``name``: its short name, else
    its OID (OpenSSL's long names mapped back; a name it does not know is kept)."""
    if name in SUBJECT_KEYS:
        return SUBJECT_KEYS[name]
    try:
        return str(ssl._ASN1Object.fromname(name).oid)
    except ValueError:
        return name


def _escaped(value: str) -> str:
    # A value holding a separator must not read as two attributes ("CN=a,O=lab" from a
    # commonName "a,O=lab"): backslash, comma and plus are escaped with a backslash.
    return value.replace("\\", "\\\\").replace(",", "\\,").replace("+", "\\+")


def subject_text(subject: Any) -> str:
    """A certificate subject in the form of ``ssl.getpeercert()["subject"]`` (a tuple of
    relative distinguished names, each a tuple of ``(name, value)`` pairs) as the text of
    ``Peer.tls_subject``: ``KEY=value`` in certificate order, joined by ``,``, the parts of
    a multi-valued RDN joined by ``+``."""
    return ",".join(
        "+".join(f"{_key(name)}={_escaped(value)}" for name, value in rdn) for rdn in subject
    )


# --------------------------------------------------------------------------- texts


def quoted(text: str) -> str:
    """A path or name in a message: in single quotes, ``\\`` and ``'`` escaped by a
    backslash (the native side writes the same)."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


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
    """The DEBUG line of one transfer, the same in both implementations: ``sent a
    gradient (N bytes on the wire) to HOST:PORT in T s (R MB/s)``; ``done`` is "sent" or
    "received", ``what`` "gradient" or "tensor set". N is what ``progress=`` counts: the
    frames' bytes (a set's tensors, not its manifest); T runs from the call (a receive's
    includes its wait for the first byte)."""
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


# --------------------------------------------------------------------------- one transfer at a time


class Phase(enum.Enum):
    """Where a connection stands: at most one transfer runs at a time."""

    IDLE = "idle"
    SENDING = "sending"
    RECEIVING = "receiving"
    CLOSED = "closed"


class Turns:
    """The state of a connection (README "Connections"): one transfer at a time, in
    either direction; a call while one runs is a SettingError, a call on a closed
    connection a StreamIOError (ENOTCONN)."""

    def __init__(self) -> None:
        self.phase = Phase.IDLE

    @property
    def closed(self) -> bool:
        return self.phase is Phase.CLOSED

    @contextlib.contextmanager
    def turn(self, phase: Phase, call: str) -> Iterator[None]:
        """For the time of one transfer (``call`` names it in the errors): ``phase``,
        then idle again unless the transfer closed the connection."""
        if self.phase is Phase.CLOSED:
            raise StreamIOError(errno.ENOTCONN, f"{call} on a closed connection")
        if self.phase is not Phase.IDLE:
            raise SettingError(
                "connection",
                f"{call} while this connection is {self.phase.value}: one transfer at a "
                "time per connection (open a second connection for the other direction)",
            )
        self.phase = phase
        try:
            yield
        finally:
            if self.phase is phase:
                self.phase = Phase.IDLE

    def close(self) -> bool:
        """Mark the connection closed; False when it already was."""
        was_open = self.phase is not Phase.CLOSED
        self.phase = Phase.CLOSED
        return was_open


# --------------------------------------------------------------------------- serve


class _Connection(_Protocol):
    @property
    def peer(self) -> Peer: ...
    async def close(self) -> None: ...


C = TypeVar("C", bound=_Connection)
C_co = TypeVar("C_co", bound=_Connection, covariant=True)


class _Listener(_Protocol[C_co]):
    @property
    def address(self) -> Address: ...
    def __aiter__(self) -> AsyncIterator[C_co]: ...
    async def close(self) -> None: ...


class Ready(Generic[C]):
    """A listener's connections through their handshake that ``accept()`` has not given
    out yet (README "Connections": they count against max_connections, and closing the
    listener closes them); once closed, ``accept()`` is a StreamIOError (EBADF) and
    ``next()`` None."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[C | None] = asyncio.Queue()
        self._closed = False

    def put(self, conn: C) -> None:
        self._queue.put_nowait(conn)

    async def next(self) -> C | None:
        """The next connection; None once closed (for ``async for``)."""
        if self._closed:
            return None
        conn = await self._queue.get()
        if conn is None:
            self._queue.put_nowait(None)  # for every other waiter
        return conn

    async def accept(self) -> C:
        conn = await self.next()
        if conn is None:
            raise StreamIOError(errno.EBADF, "accept() on a closed listener")
        return conn

    async def close(self) -> None:
        """Close the connections still waiting, and wake every waiter."""
        self._closed = True
        while not self._queue.empty():
            waiting = self._queue.get_nowait()
            if waiting is not None:
                await waiting.close()
        self._queue.put_nowait(None)


class Server(Generic[C]):
    """``serve``'s result, over either implementation's listener: each connection goes
    to ``handler`` in a task of its own, concurrently, and is closed when it returns; a
    handler's exception is logged (WARNING, with the traceback) and ends its connection
    only. ``address`` is the listener's."""

    def __init__(
        self, listener: _Listener[C], handler: Callable[[C], Awaitable[Any] | Any]
    ) -> None:
        self._listener = listener
        self._handler = handler
        self._handlers: set[asyncio.Task[None]] = set()
        self._dispatcher = asyncio.create_task(self._dispatch())

    @property
    def address(self) -> Address:
        return self._listener.address

    def __repr__(self) -> str:
        return f"<Server {self._listener!r}>"

    async def _dispatch(self) -> None:
        async for conn in self._listener:
            task = asyncio.create_task(self._serve(conn))
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)

    async def _serve(self, conn: C) -> None:
        try:
            result = self._handler(conn)
            if inspect.isawaitable(result):
                await result
        except Exception as exc:
            logger.warning(
                "handler of the connection with %s failed: %r",
                peer_text(conn.peer.address),
                exc,
                exc_info=exc,
            )
        finally:
            await conn.close()

    async def serve_forever(self) -> None:
        """Wait until the server is closed."""
        await asyncio.shield(self._dispatcher)

    async def close(self) -> None:
        """Stop listening and end the running handlers (their connections closed)."""
        await self._listener.close()
        self._dispatcher.cancel()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(self._dispatcher, *self._handlers, return_exceptions=True)

    async def __aenter__(self) -> Server[C]:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


# --------------------------------------------------------------------------- refusal logs


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
