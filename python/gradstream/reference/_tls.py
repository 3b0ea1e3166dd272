"""TLS for the reference's connections (README "TLS and authentication") with Python's
``ssl``: the contexts a listener and a client make from their ``TLS`` settings (TLS 1.3
only, ALPN ``gradstream/1``, the server's name or IP checked, mutual TLS when a listener
has ``ca``), what ``ssl`` errors mean as ``TlsError``, and who the peer is after the
handshake.

Apart because it is the one place that knows ``ssl``: the handshake module hands it an
``ssl.SSLObject`` and gets back a checked identity or a TlsError.
"""

from __future__ import annotations

import ssl
from typing import Any

from .._peers import TLS, quoted, subject_text
from ..errors import Address, SettingError, TlsError

ALPN = "gradstream/1"


def _context(purpose: int, tls: TLS) -> ssl.SSLContext:
    context = ssl.SSLContext(purpose)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.maximum_version = ssl.TLSVersion.TLSv1_3
    context.set_alpn_protocols([ALPN])
    try:
        if tls.cert is not None:
            context.load_cert_chain(tls.cert, tls.key)
    except (ssl.SSLError, OSError) as exc:
        raise SettingError(
            "tls",
            f"TLS cert= {_path(tls.cert)} and key= {_path(tls.key)} do not load: {_what(exc)}",
        ) from None
    try:
        if tls.ca is not None:
            context.load_verify_locations(cafile=tls.ca)
    except (ssl.SSLError, OSError) as exc:
        raise SettingError("tls", f"TLS ca= {_path(tls.ca)} does not load: {_what(exc)}") from None
    return context


def _path(path: str | None) -> str:
    return "None" if path is None else quoted(path)


def listener_context(tls: TLS) -> ssl.SSLContext:
    """A listener's context: its certificate; with ``ca``, mutual TLS (a client
    certificate signed by ``ca`` is required)."""
    context = _context(ssl.PROTOCOL_TLS_SERVER, tls)
    if tls.ca is not None:
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_context(tls: TLS) -> ssl.SSLContext:
    """A client's context: the server's certificate must be signed by ``ca`` and name
    the host connected to (PROTOCOL_TLS_CLIENT checks the name, with no way around it
    here); ``cert`` and ``key``, when given, are presented for mutual TLS."""
    context = _context(ssl.PROTOCOL_TLS_CLIENT, tls)
    assert context.check_hostname and context.verify_mode == ssl.CERT_REQUIRED
    return context


def _what(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"certificate verify failed: {exc.verify_message}"
    if isinstance(exc, ssl.SSLError) and exc.reason:
        return str(exc.reason).lower().replace("_", " ")
    return str(exc) or type(exc).__name__


# Reasons OpenSSL gives that have a plainer cause.
_HINTS = {
    "wrong version number": "the peer does not speak TLS (give both sides tls=, or neither)",
    "http request": "the peer sent an HTTP request, not a TLS handshake",
    "unsupported protocol": "the peer does not offer TLS 1.3",
    "tlsv1 alert protocol version": "the peer refused TLS 1.3",
    "peer did not return a certificate": (
        "the client presented no certificate (this listener requires one: mutual TLS)"
    ),
    "tlsv13 alert certificate required": (
        "the listener requires a client certificate (mutual TLS): give tls=TLS(cert=, key=, ca=)"
    ),
}


def tls_error(exc: BaseException, peer: Address | None) -> TlsError:
    """The TlsError for an ``ssl`` failure of a handshake or of a read during it."""
    what = _what(exc)
    hint = _HINTS.get(what)
    return TlsError(what if hint is None else f"{hint} ({what})", peer)


def broke_off(what: str, peer: Address | None) -> TlsError:
    """A listener's TlsError for a client that hung up, or sent an alert of its own,
    during the handshake (``what``: what the failure said)."""
    return TlsError(
        f"the client broke off the TLS handshake ({what}): it refused this listener's "
        "certificate, or is no TLS client",
        peer,
    )


def listener_tls_error(exc: ssl.SSLError, peer: Address | None) -> TlsError:
    """The TlsError of a listener's handshake: a client's own alert is the client
    breaking off (unless its reason has a plainer hint)."""
    what = _what(exc)
    if " alert " in f" {what} " and what not in _HINTS:
        return broke_off(what, peer)
    return tls_error(exc, peer)


def checked_peer(ssl_object: Any, peer: Address | None, verified_client: bool) -> str | None:
    """After a handshake: TlsError unless ALPN chose ``gradstream/1``; the subject text of
    the client's certificate on a mutual-TLS listener (``verified_client``), else None."""
    chosen = ssl_object.selected_alpn_protocol()
    if chosen != ALPN:
        offered = "no ALPN" if chosen is None else f"ALPN {chosen!r}"
        raise TlsError(f"the peer negotiated {offered}; {ALPN!r} is required", peer)
    if not verified_client:
        return None
    cert = ssl_object.getpeercert()
    if not cert:  # CERT_REQUIRED makes this unreachable; never trust a silent None
        raise TlsError("the client presented no certificate", peer)
    return subject_text(cert.get("subject", ()))
