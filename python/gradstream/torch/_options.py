"""The backend's options: what ``configure`` sets before ``init_process_group``, read
when a group is made, and the session every connection of a group uses."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import numpy as np

from .._checks import check_streams
from .._session import GradientStreamSession
from ..errors import SettingError


@dataclasses.dataclass(frozen=True)
class Options:
    """What ``configure`` set: the host every rank listens on (and publishes), the TLS
    of its listener (``listen_tls``) and of its connection to the next rank
    (``connect_tls``), the authkey (None: a random one from rank 0, through the
    store), how ranks of one host meet (``same_host``: ``"unix"``, through the
    same-host transport, without TLS and under the authkey; ``"tcp"``, as ranks of
    different hosts do), the wire of the float32 values a sum or an average moves
    (``reduce_wire_dtype``: None, as they are; ``"int8"``, the int8 wire, lossy), and
    the streams of each TCP connection between ranks (``streams``: 1, or up to 255 for
    long paths; docs/guides/across-the-internet.md, "Parallel streams")."""

    host: str = "127.0.0.1"
    listen_tls: Any = None
    connect_tls: Any = None
    authkey: bytes | None = None
    same_host: Literal["unix", "tcp"] = "unix"
    reduce_wire_dtype: Literal["int8"] | None = None
    streams: int = 1


_options = [Options()]

# What configure(reduce_wire_dtype=) takes, and what the options then hold.
_WIRES: dict[str, Literal["int8"] | None] = {"int8": "int8", "none": None}


def configure(
    *,
    host: str | None = None,
    listen_tls: Any = None,
    connect_tls: Any = None,
    authkey: bytes | None = None,
    same_host: Literal["unix", "tcp"] | None = None,
    reduce_wire_dtype: Literal["int8", "none"] | None = None,
    streams: int | None = None,
) -> Options:
    """Set the options of the groups made from now on (before ``init_process_group``);
    what is not given keeps its default (``reduce_wire_dtype="none"`` puts back the
    exact wire). Returns them."""
    if same_host not in (None, "unix", "tcp"):
        raise SettingError("same_host", f'same_host must be "unix" or "tcp", got {same_host!r}')
    if reduce_wire_dtype is not None and reduce_wire_dtype not in _WIRES:
        raise SettingError(
            "reduce_wire_dtype",
            f'reduce_wire_dtype must be "int8" or "none", got {reduce_wire_dtype!r}',
        )
    count = None if streams is None else check_streams(streams)
    now = _options[0]
    _options[0] = Options(
        host=now.host if host is None else host,
        listen_tls=now.listen_tls if listen_tls is None else listen_tls,
        connect_tls=now.connect_tls if connect_tls is None else connect_tls,
        authkey=now.authkey if authkey is None else bytes(authkey),
        same_host=now.same_host if same_host is None else same_host,
        reduce_wire_dtype=(
            now.reduce_wire_dtype if reduce_wire_dtype is None else _WIRES[reduce_wire_dtype]
        ),
        streams=now.streams if count is None else count,
    )
    return _options[0]


def options() -> Options:
    """The options groups are made with."""
    return _options[0]


def _session() -> GradientStreamSession:
    # The compact layout, dtypes and shapes kept: the bits a rank sends are the bits
    # the next one gets.
    return GradientStreamSession(layout="compact", keep_shape=True, keep_dtype=True)


def as_delivered(values: np.ndarray, wire_dtype: Literal["int8"]) -> None:
    """Put in ``values`` (float32) what ``wire_dtype`` delivers of them on a link (the
    links' chunk size, so the same blocks): a rank about to send its part of a sum to
    the others keeps the bits they get."""
    frames = GradientStreamSession(layout="compact", wire_dtype=wire_dtype).encode_frames(values)
    GradientStreamSession().decode_frames(frames, out=values)
