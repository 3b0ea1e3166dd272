"""Addresses and the peer at one (docs/guides/connections.md): ``"host:port"``, a
``(host, port)`` pair or ``"unix:PATH"`` (this host, docs/guides/same-host.md) parsed for
``listen`` and ``connect``, how messages and logs write an address, and ``Peer``, the other
side of a connection.

Plain Python over ``errors`` only.
"""

from __future__ import annotations

import ipaddress
import operator
import os
from dataclasses import dataclass
from typing import Any

from .errors import Address, SettingError, _peer_text

__all__ = ["UNIX", "Address", "Peer", "address_of", "parse_address", "peer_text"]

# The prefix of a same-host address.
UNIX = "unix:"
# The longest path a Unix-domain socket address holds (sun_path, its NUL excluded).
UNIX_PATH_MOST = 107


def peer_text(address: Address | None) -> str:
    """How messages and logs name a peer: ``host:port``, ``[v6]:port``, or ``the peer``
    (the errors' own words, ``errors._peer_text``)."""
    return _peer_text(address)


def address_of(native: Any) -> Address:
    """An address as the engine gives it (a ``(host, port)`` sequence, or a
    ``"unix:PATH"`` string) as Python holds it."""
    if isinstance(native, str):
        return native
    host, port = native
    return host, port


@dataclass(frozen=True)
class Peer:
    """The other side of a connection.

    ``address`` is its ``(host, port)``, or ``"unix:PATH"`` for a same-host connection;
    ``tls_subject`` the subject of the client certificate a listener verified under
    mutual TLS, as RFC 4514 text (the most specific attribute first:
    ``"CN=worker-1,O=lab"``), else None; ``authenticated`` is True when the peer proved
    the authkey or presented a certificate this side verified (a client's TLS always
    verifies the server's). ``pid`` and ``uid`` are a same-host peer's process and user,
    from the kernel (``SO_PEERCRED``; ``pid`` None when the kernel does not say, as for a
    peer in another pid namespace), None over TCP.
    """

    address: Address
    tls_subject: str | None = None
    authenticated: bool = False
    pid: int | None = None
    uid: int | None = None


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


def _ipv6(host: str, address: str) -> None:
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        raise SettingError(
            "address", f"address {address!r}: {host!r} in brackets is not an IPv6 address"
        ) from None


def _unix(address: str) -> tuple[str, int]:
    """A ``"unix:PATH"`` address checked, as the engine takes it: its text and port 0."""
    path = address[len(UNIX) :]
    if not path:
        raise SettingError("address", f"address {address!r} has no path after 'unix:'")
    size = len(os.fsencode(path))
    if size > UNIX_PATH_MOST or "\0" in path:
        raise SettingError(
            "address",
            f"address {address!r}: a Unix-domain socket's path holds at most "
            f"{UNIX_PATH_MOST} bytes and no NUL (this one: {size} bytes); use a shorter path",
        )
    return UNIX + path, 0


def parse_address(address: Any) -> tuple[str, int]:
    """``"host:port"`` (an IPv6 host in brackets: ``"[::1]:7000"``) or a ``(host, port)``
    pair, as ``(host, port)`` (the brackets dropped). Port 0 asks a listener for any free
    port. ``"unix:PATH"`` (a Unix-domain socket of this host) comes back as its text and
    port 0, which the engine takes for it."""
    if isinstance(address, str) and address.startswith(UNIX):
        return _unix(address)
    if isinstance(address, tuple):
        if len(address) == 2 and isinstance(address[0], str) and address[0].startswith(UNIX):
            raise SettingError(
                "address",
                f"address {address!r}: a unix: address is the string 'unix:PATH', not a "
                "(host, port) pair",
            )
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
