"""What ``gradstream.ray.register`` and ``ParameterServer`` are told: one frozen, picklable
record (the driver's travels to the job's processes through Ray's KV store, a server's
to its workers through Ray), checked once where the user gives it, so that a bad
keyword fails in the user's call and not in an actor. Unlike a session's ``timeout``,
none of these waits may be None (for ever): every wait of a Ray job has a bound."""

from __future__ import annotations

import dataclasses
import math
import secrets
from typing import Any, Literal

from .. import DEFAULT_MAX_GRADIENT_LEN
from .._checks import check_authkey
from .._session import GradientStreamSession
from .._tls_settings import TLS
from ..errors import SettingError

# The wire layout between gradstream peers on Ray: left unset (None), a gradstream
# connection's default, the compact layout with shapes and dtypes kept (nothing but
# gradstream reads these frames: docs/guides/ray.md, docs/guides/connections.md).
DEFAULT_LAYOUT: Literal["seed", "compact"] | None = None
# Seconds without progress before a transfer fails, and for connecting (TCP, TLS, hello).
DEFAULT_TIMEOUT = 60.0
DEFAULT_CONNECT_TIMEOUT = 10.0
# Seconds one transfer may take from its first byte, as a listener's connections have
# by default: a peer that trickles a byte per ``timeout`` is cut off here.
DEFAULT_DEADLINE = 300.0


def _seconds(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SettingError(name, f"{name} must be a number of seconds, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise SettingError(name, f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


@dataclasses.dataclass(frozen=True)
class RaySettings:
    """The gradstream side of a Ray integration: where endpoints listen, how peers prove
    themselves (``tls``, ``authkey``), and the session every transfer uses."""

    host: str | None = None
    tls: TLS | None = None
    authkey: bytes | None = None
    timeout: float = DEFAULT_TIMEOUT
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    deadline: float = DEFAULT_DEADLINE
    layout: Literal["seed", "compact"] | None = DEFAULT_LAYOUT
    compression: Literal["lz4", "zstd"] | None = None
    chunk_size: int = 65536
    # How a receiver fetches from a maker of its own Ray node: "unix", through the
    # same-host transport (shared memory; no TLS there, the authkey still); "tcp", as
    # from any other node.
    same_node: Literal["unix", "tcp"] = "unix"

    @classmethod
    def checked(
        cls,
        *,
        host: Any = None,
        tls: Any = None,
        authkey: Any = None,
        timeout: Any = DEFAULT_TIMEOUT,
        connect_timeout: Any = DEFAULT_CONNECT_TIMEOUT,
        deadline: Any = DEFAULT_DEADLINE,
        layout: Any = DEFAULT_LAYOUT,
        compression: Any = None,
        chunk_size: Any = 65536,
        same_node: Any = "unix",
    ) -> RaySettings:
        if host is not None and (not isinstance(host, str) or not host):
            raise SettingError("host", f"host must be a non-empty str or None, got {host!r}")
        if tls is not None and not isinstance(tls, TLS):
            raise TypeError(f"tls must be a gradstream.TLS or None, not {type(tls).__name__}")
        if tls is not None and (tls.cert is None or tls.ca is None):
            # Every process both serves (its objects) and connects (to others'): it
            # needs its certificate and the CA that signed its peers'.
            raise SettingError(
                "tls",
                "gradstream.ray needs TLS(cert=, key=, ca=): every process both listens "
                "and connects (mutual TLS)",
            )
        if same_node not in ("unix", "tcp"):
            raise SettingError("same_node", f'same_node must be "unix" or "tcp", got {same_node!r}')
        key = check_authkey(authkey)
        settings = cls(
            host=host,
            tls=tls,
            authkey=None if key is None else bytes(key),
            timeout=_seconds(timeout, "timeout"),
            connect_timeout=_seconds(connect_timeout, "connect_timeout"),
            deadline=_seconds(deadline, "deadline"),
            layout=layout,
            compression=compression,
            chunk_size=chunk_size,
            same_node=same_node,
        )
        session = settings.session()  # the session's checks: layout, compression, chunk_size
        # As the session reads them: compression True is "lz4" (a layout left unset stays
        # unset: the connections' default).
        return dataclasses.replace(
            settings,
            layout=None if layout is None else session.layout,
            compression=session.compression,
        )

    def with_key(self) -> RaySettings:
        """These settings, with a random authkey where none was given: a job's processes
        (or a server's workers) share it through Ray, and a peer without it gets no
        further than the handshake."""
        if self.authkey is not None:
            return self
        return dataclasses.replace(self, authkey=secrets.token_bytes(32))

    def session(self, max_values: int | None = None) -> GradientStreamSession:
        """The session of every transfer these settings make; ``max_values`` bounds what
        it receives (the peer learns it from the hello, and sends no more)."""
        return GradientStreamSession(
            "gradstream.ray",
            self.chunk_size,
            timeout=self.timeout,
            deadline=self.deadline,
            max_gradient_len=DEFAULT_MAX_GRADIENT_LEN if max_values is None else max(1, max_values),
            layout=self.layout,
            compression=self.compression,
            # keep_shape and keep_dtype unset: a connection's defaults, so a worker's
            # float16, bfloat16 or float64 gradient travels as it is (and is added in
            # float32), in its shape; tensor sets keep their dtypes in any session.
        )

    def link_keywords(self, max_values: int | None = None) -> dict[str, Any]:
        """The keywords ``gradstream.listen`` / ``connect`` take from these settings."""
        return {
            "session": self.session(max_values),
            "tls": self.tls,
            "authkey": self.authkey,
            "handshake_timeout": self.connect_timeout,
        }
