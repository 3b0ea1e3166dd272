"""The defaults of connections and the checks of their keywords (docs/guides/
connections.md, docs/guides/limits.md): ``protocol=``, ``authkey=``, ``timeout=`` and
``deadline=`` (a call's or a session's), ``handshake_timeout=``, the listener's caps and
bounds,
``recv_tensors``' ``max_values=``; the waits a connection's transfers get; and why
``stream_to`` / ``receive_from`` refuse an ``ssl.SSLSocket``. Each raises the
``SettingError`` or ``TypeError`` a user sees, in words given here once.

Plain Python over ``errors`` and ``_tls_settings``: the native connections, the session
layers (the native one's and the reference's ``timeout=``) and ``gradstream.ray`` check
with it.
"""

from __future__ import annotations

import math
import operator
import os
from typing import Any, Literal, NamedTuple

from ._address import UNIX
from ._dtypes import WIRE_DTYPES
from ._tls_settings import TLS
from .errors import SettingError

__all__ = [
    "AUTH_FAILURE_WINDOW",
    "CONNECTION_DEADLINE",
    "HANDSHAKE_TIMEOUT",
    "HELLO_TIMEOUT",
    "LISTENER_MOST",
    "MAX_AUTH_FAILURES",
    "MAX_CONNECTIONS",
    "MAX_PENDING_HANDSHAKES",
    "MAX_PENDING_PER_SOURCE",
    "MAX_STREAMS",
    "MIN_AUTHKEY_LEN",
    "SSL_SOCKET_REFUSED",
    "Protocol",
    "check_authkey",
    "check_count",
    "check_handler",
    "check_handshake_timeout",
    "check_max_values",
    "check_plain_seed",
    "check_protocol",
    "check_seconds",
    "connection_waits",
]

Protocol = Literal["gradstream", "seed"]

# docs/guides/connections.md: the listener's defaults, the transfers' bound, and the
# shortest authkey.
HANDSHAKE_TIMEOUT = 10.0  # seconds for TLS, hello and authentication together
MAX_PENDING_HANDSHAKES = 256  # handshakes under way, from all sources
MAX_PENDING_PER_SOURCE = 64  # ... from one IPv4 address or IPv6 /64
HELLO_TIMEOUT = 3.0  # seconds for a peer's first byte
MAX_CONNECTIONS = 256
MAX_AUTH_FAILURES = 10  # failed authentications from one source within ...
AUTH_FAILURE_WINDOW = 60.0  # ... these seconds: the source is refused until they end
# The most each of the listener's counts may be: far past any use, and small enough for
# its tables and the kernel's backlog (a larger one made the listener fail, or hang).
LISTENER_MOST = {
    "max_pending_handshakes": 65_536,
    "max_pending_per_source": 65_536,
    "max_connections": 1 << 20,
    "max_auth_failures": 1 << 20,
}
# Seconds a transfer may take once begun, on every connection (either side): every wait
# inside it, the sender's wait for its ack included ("Timeouts").
CONNECTION_DEADLINE = 300.0
MIN_AUTHKEY_LEN = 16

# Why stream_to / receive_from refuse an ssl.SSLSocket: its descriptor carries TLS
# records, and frames written beneath the TLS session would go out in plaintext.
SSL_SOCKET_REFUSED = (
    "an ssl.SSLSocket cannot carry frames (they would bypass its TLS); use tls= with "
    "gradstream.connect / gradstream.listen, or asyncio streams over TLS"
)


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


MAX_STREAMS = 64  # a listener's grant to one connection (PCCL uses 64-128 per peer)
STREAMS_MOST = 255  # what a hello's byte can say


def check_streams(value: Any, name: str = "streams") -> int:
    """``streams=`` (connect) or ``max_streams=`` (listen): an int from 1 to 255."""
    return check_count(value, name, most=STREAMS_MOST)


class _Needs(NamedTuple):
    """What an option that adds TCP connections to a connection says when it cannot."""

    unix: str
    seed: str
    secret: str


_STREAMS_NEEDS = _Needs(
    "a unix: connection has one stream (shared memory needs no more)",
    "protocol='seed' has no hello to open several streams with",
    "several streams need an authkey or TLS: each joining connection proves it belongs to "
    "the first with their secret (without one, anyone on the path could join); give "
    "authkey= or tls=",
)
_RESUME_NEEDS = _Needs(
    "a unix: connection has no network path to lose (its peer is on this host)",
    "protocol='seed' has no hello to resume a connection with",
    "resume needs an authkey or TLS: each stream dialled again proves it belongs to the "
    "connection with their secret (without one, anyone on the path could take the "
    "connection over); give authkey= or tls=",
)


def _lacking(
    needs: _Needs, protocol: str, tls: object, authkey: bytes | None, host: str
) -> str | None:
    """Why a connection cannot have more TCP connections proven to belong to it: it is
    not over TCP, speaks no hello, or has no secret (an authkey or TLS); None if it can."""
    if host.startswith("unix:"):
        return needs.unix
    if protocol == "seed":
        return needs.seed
    if tls is None and authkey is None:
        return needs.secret
    return None


def check_streams_secret(
    streams: int, protocol: str, tls: object, authkey: bytes | None, host: str
) -> None:
    """Several streams need a secret to prove each join with (an authkey or TLS), the
    gradstream protocol, and TCP."""
    problem = None if streams == 1 else _lacking(_STREAMS_NEEDS, protocol, tls, authkey, host)
    if problem is not None:
        raise SettingError("streams", f"streams={streams}: {problem}")


RESUME_WINDOW = 30.0  # seconds a connection's streams may take to come back (both ends)


def check_resume_window(value: Any, name: str = "resume_window", *, zero: bool = False) -> float:
    """A resume window: a positive, finite number of seconds (a listener's may be 0: it
    grants no resumes)."""
    if zero and not isinstance(value, bool) and isinstance(value, int | float) and value == 0:
        return 0.0
    return check_handshake_timeout(value, name)


def check_resume(
    resume: Any, streams: int, protocol: str, tls: object, authkey: bytes | None, host: str
) -> bool:
    """``resume=``: None (on for several streams, which have a secret and a version 3
    hello already; off for one, whose hello stays version 2 so that a listener of
    gradstream 0.3.0 still takes it), True or False. A resume needs a secret to prove
    each new stream with (an authkey or TLS), the gradstream protocol, and TCP."""
    if resume is None:
        return streams > 1
    if not isinstance(resume, bool):
        raise TypeError(f"resume must be True, False or None, not {type(resume).__name__}")
    problem = _lacking(_RESUME_NEEDS, protocol, tls, authkey, host) if resume else None
    if problem is not None:
        raise SettingError("resume", f"resume=True: {problem}")
    return resume


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
) -> tuple[float | None, float | None]:
    """The timeout and deadline of a connection's transfers: a call's (``connect``,
    ``listen``) replace the session's; when neither sets a deadline, a transfer on
    either side gets CONNECTION_DEADLINE seconds once begun (waiting for a gradient to
    begin stays unbounded unless a timeout is set)."""
    wait = session_timeout if timeout is None else timeout
    bound = session_deadline if deadline is None else deadline
    if bound is None:
        bound = CONNECTION_DEADLINE
    return wait, bound


def check_handshake_timeout(value: Any, name: str = "handshake_timeout") -> float:
    """A positive, finite number of seconds (None is refused: a listener must not wait for
    ever on a silent peer); also hello_timeout and auth_failure_window (``name``)."""
    kind = type(value)
    if (
        value is None
        or isinstance(value, bool)
        or not (hasattr(kind, "__float__") or hasattr(kind, "__index__"))
    ):
        raise TypeError(f"{name} must be a number of seconds, not {kind.__name__}")
    seconds = float(value)
    if not (0.0 < seconds and math.isfinite(seconds)):
        raise SettingError(name, f"{name} must be a positive number of seconds, got {value!r}")
    return seconds


def check_wire_dtype(value: Any) -> str | None:
    """``wire_dtype=`` (a session's, or one send's): None, one of the four dtype names,
    or int8."""
    if value is None:
        return None
    if isinstance(value, str):
        if value in WIRE_DTYPES:
            return value
        raise SettingError(
            "wire_dtype",
            "wire_dtype must be None, 'float16', 'bfloat16', 'float32', 'float64' or "
            f"'int8', got {value!r}",
        )
    raise TypeError(f"wire_dtype must be None or a dtype name (str), not {type(value).__name__}")


def check_int8_uncompressed(wire_dtype: str | None, compression: str | None) -> None:
    """int8 payloads travel uncompressed: receivers refuse compressed list columns."""
    if wire_dtype == "int8" and compression is not None:
        raise SettingError(
            "wire_dtype",
            f"wire_dtype='int8' does not combine with compression='{compression}': int8 "
            "payloads travel uncompressed (receivers refuse compressed list columns); drop "
            "one of the two",
        )


def check_handler(handler: Any) -> None:
    """``serve``'s handler: anything callable (a coroutine function or a plain one)."""
    if not callable(handler):
        raise TypeError(f"handler must be callable, not {type(handler).__name__}")


def check_count(value: Any, name: str, least: int = 1, most: int | None = None) -> int:
    """max_pending_handshakes, max_pending_per_source, max_connections, max_auth_failures:
    an int of at least 1 (``least``) and, where given, at most ``most`` (LISTENER_MOST)."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, not bool")
    number = operator.index(value)
    if number < least:
        raise SettingError(name, f"{name} must be at least {least}, got {number}")
    if most is not None and number > most:
        raise SettingError(name, f"{name} must be at most {most}, got {number}")
    return number


def check_max_values(value: Any) -> int | None:
    """``recv_tensors``' ``max_values``: None, or an int of at least 0."""
    return None if value is None else check_count(value, "max_values", least=0)


# `allowed_uid=`'s default: this process's own user.
OWN_USER = "own user"


def check_uid(allowed_uid: Any, host: str) -> int | None:
    """``allowed_uid``: a user id, None (any user), or the default; only for a unix:
    address (a TCP peer has no uid)."""
    if not host.startswith(UNIX):
        if allowed_uid is not OWN_USER:
            raise SettingError(
                "allowed_uid",
                "allowed_uid is for unix: addresses: a peer over TCP has no user id "
                "(use authkey= or TLS to know who it is)",
            )
        return None
    if allowed_uid is OWN_USER:
        return os.getuid()
    if allowed_uid is None:
        return None
    if isinstance(allowed_uid, bool) or not isinstance(allowed_uid, int):
        raise TypeError(f"allowed_uid must be an int or None, not {type(allowed_uid).__name__}")
    if not 0 <= allowed_uid < 2**32:
        raise SettingError("allowed_uid", f"allowed_uid must be a user id, got {allowed_uid}")
    return allowed_uid


def check_same_host(host: str, tls: Any, protocol: Any, allowed_uid: Any) -> int | None:
    """What a ``unix:`` address allows, checked: neither TLS nor the seed protocol (said
    so, naming the fix); the peer's user it admits (``check_uid``)."""
    uid = check_uid(allowed_uid, host)
    if not host.startswith(UNIX):
        return uid
    if tls is not None:
        raise SettingError(
            "tls",
            "a unix: connection takes no TLS: the kernel is the only party between two "
            "processes of one host; a listener admits its own user only (allowed_uid=), "
            "and authkey= still applies",
        )
    if protocol == "seed":
        raise SettingError(
            "protocol",
            "a unix: connection speaks gradstream (its rings are set up after the hello); "
            "protocol='seed' is for the bare frames of TCP peers",
        )
    return uid
