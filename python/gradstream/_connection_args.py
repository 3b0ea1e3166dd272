"""The keywords of ``listen`` and ``connect``, checked once for both faces (asyncio's
``gradstream._connection`` and the blocking ``gradstream.sync``): where, the session, the
link's settings as the engine takes them, the listener's own, and what the side speaks.

Uses ``_address``, ``_checks``, ``_tls_settings``, ``_logs`` and ``_session``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ._address import parse_address
from ._checks import (
    AUTH_FAILURE_WINDOW,
    HANDSHAKE_TIMEOUT,
    HELLO_TIMEOUT,
    LISTENER_MOST,
    MAX_AUTH_FAILURES,
    MAX_CONNECTIONS,
    MAX_PENDING_HANDSHAKES,
    MAX_PENDING_PER_SOURCE,
    MAX_STREAMS,
    OWN_USER,
    RESUME_WINDOW,
    check_authkey,
    check_count,
    check_handshake_timeout,
    check_plain_seed,
    check_protocol,
    check_resume,
    check_resume_window,
    check_same_host,
    check_seconds,
    check_streams,
    check_streams_secret,
    connection_waits,
)
from ._logs import describe_side
from ._session import GradientStreamSession
from ._tls_settings import client_tls, listener_tls


def _session(session: Any, protocol: Any) -> GradientStreamSession:
    return GradientStreamSession._for_connection(session, protocol)


def _link_settings(
    session: GradientStreamSession,
    *,
    listening: bool,
    tls: Any,
    authkey: Any,
    protocol: Any,
    timeout: Any,
    deadline: Any,
    handshake_timeout: Any,
) -> tuple[dict[str, Any], str]:
    """The checked keywords of ``connect`` or ``listen`` (``listening``), in order, as
    the engine takes them; and what the side speaks, for the logs."""
    kind = check_protocol(protocol)
    checked_tls = listener_tls(tls) if listening else client_tls(tls)
    key = check_authkey(authkey)
    wait = check_seconds(timeout)
    bound = check_seconds(deadline, "deadline")
    check_plain_seed(kind, checked_tls, key)
    wait, bound = connection_waits(session.timeout, session.deadline, wait, bound)
    args = {
        "protocol": kind,
        "tls": None if checked_tls is None else (checked_tls.cert, checked_tls.key, checked_tls.ca),
        "authkey": key,
        "handshake_timeout": check_handshake_timeout(handshake_timeout),
        "timeout": wait,
        "deadline": bound,
    }
    return args, describe_side(kind, checked_tls is not None, key is not None)


@dataclasses.dataclass(frozen=True)
class Opened:
    """The checked arguments of ``connect`` or ``listen``, as both faces give them to
    the engine: where, the session, the link's settings, the listener's own, and what
    the side speaks (for the logs)."""

    host: str
    port: int
    session: GradientStreamSession
    args: dict[str, Any]
    speaks: str
    listener: dict[str, float]


def listen_args(
    address: Any,
    *,
    session: Any = None,
    tls: Any = None,
    authkey: Any = None,
    handshake_timeout: Any = HANDSHAKE_TIMEOUT,
    max_pending_handshakes: Any = MAX_PENDING_HANDSHAKES,
    max_connections: Any = MAX_CONNECTIONS,
    timeout: Any = None,
    deadline: Any = None,
    protocol: Any = "gradstream",
    max_pending_per_source: Any = MAX_PENDING_PER_SOURCE,
    hello_timeout: Any = HELLO_TIMEOUT,
    max_auth_failures: Any = MAX_AUTH_FAILURES,
    auth_failure_window: Any = AUTH_FAILURE_WINDOW,
    allowed_uid: Any = OWN_USER,
    max_streams: Any = MAX_STREAMS,
    resume_window: Any = RESUME_WINDOW,
) -> Opened:
    """``listen``'s arguments, checked (both faces)."""
    host, port = parse_address(address)
    uid = check_same_host(host, tls, protocol, allowed_uid)
    own = _session(session, protocol)
    args, speaks = _link_settings(
        own,
        listening=True,
        tls=tls,
        authkey=authkey,
        protocol=protocol,
        timeout=timeout,
        deadline=deadline,
        handshake_timeout=handshake_timeout,
    )
    counts = {
        "max_pending_handshakes": max_pending_handshakes,
        "max_connections": max_connections,
        "max_pending_per_source": max_pending_per_source,
        "max_auth_failures": max_auth_failures,
    }
    own_settings: dict[str, float] = {
        name: check_count(value, name, most=LISTENER_MOST[name]) for name, value in counts.items()
    }
    own_settings["max_streams"] = check_streams(max_streams, "max_streams")
    own_settings["hello_timeout"] = check_handshake_timeout(hello_timeout, "hello_timeout")
    own_settings["resume_window"] = check_resume_window(resume_window, zero=True)
    own_settings["auth_failure_window"] = check_handshake_timeout(
        auth_failure_window, "auth_failure_window"
    )
    return Opened(host, port, own, {**args, "allowed_uid": uid}, speaks, own_settings)


def connect_args(
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
) -> Opened:
    """``connect``'s arguments, checked (both faces)."""
    host, port = parse_address(address)
    uid = check_same_host(host, tls, protocol, allowed_uid)
    count = check_streams(streams)
    own = _session(session, protocol)
    args, speaks = _link_settings(
        own,
        listening=False,
        tls=tls,
        authkey=authkey,
        protocol=protocol,
        timeout=timeout,
        deadline=deadline,
        handshake_timeout=handshake_timeout,
    )
    check_streams_secret(count, args["protocol"], args["tls"], args["authkey"], host)
    window = check_resume_window(resume_window)
    resumes = check_resume(resume, count, args["protocol"], args["tls"], args["authkey"], host)
    link = {**args, "allowed_uid": uid, "streams": count, "resume": window if resumes else None}
    return Opened(host, port, own, link, speaks, {})
