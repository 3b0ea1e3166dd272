"""The backend's options: what ``configure`` sets before ``init_process_group``, read
when a group is made, and the session every connection of a group uses."""

from __future__ import annotations

import dataclasses
from typing import Any

from .._session import GradientStreamSession


@dataclasses.dataclass(frozen=True)
class Options:
    """What ``configure`` set: the host every rank listens on (and publishes), the TLS
    of its listener (``listen_tls``) and of its connection to the next rank
    (``connect_tls``), and the authkey (None: a random one from rank 0, through the
    store)."""

    host: str = "127.0.0.1"
    listen_tls: Any = None
    connect_tls: Any = None
    authkey: bytes | None = None


_options = [Options()]


def configure(
    *,
    host: str | None = None,
    listen_tls: Any = None,
    connect_tls: Any = None,
    authkey: bytes | None = None,
) -> Options:
    """Set the options of the groups made from now on (before ``init_process_group``);
    what is not given keeps its default. Returns them."""
    now = _options[0]
    _options[0] = Options(
        host=now.host if host is None else host,
        listen_tls=now.listen_tls if listen_tls is None else listen_tls,
        connect_tls=now.connect_tls if connect_tls is None else connect_tls,
        authkey=now.authkey if authkey is None else bytes(authkey),
    )
    return _options[0]


def options() -> Options:
    """The options groups are made with."""
    return _options[0]


def _session() -> GradientStreamSession:
    # The compact layout, dtypes and shapes kept: the bits a rank sends are the bits
    # the next one gets.
    return GradientStreamSession(layout="compact", keep_shape=True, keep_dtype=True)
