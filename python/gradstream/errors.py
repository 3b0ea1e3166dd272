"""Exception classes shared by the native module and the pure-Python reference.

They live in plain Python so that ``gradstream.reference`` can raise the very same
classes without importing the native extension; the Rust side imports this module
and raises instances of these classes (see ``crates/gradstream-py/src/errors.rs``).

Every class keeps the wording of ipfrs-transport 0.2.0 where the original has the
error, and carries the fields a caller needs as attributes.
"""

from __future__ import annotations

import errno as _errno
import os as _os

__all__ = [
    "ArrowIpcError",
    "AuthenticationError",
    "ChecksumMismatchError",
    "DeliveryError",
    "FrameError",
    "GradientDtypeError",
    "GradientSizeError",
    "GradientStreamError",
    "IncompleteStreamError",
    "ObjectUnavailableError",
    "ProtocolError",
    "SettingError",
    "StreamDeadlineError",
    "StreamIOError",
    "StreamTimeoutError",
    "TensorSetError",
    "TlsError",
    "WorkerLostError",
]


class GradientStreamError(Exception):
    """Base class of every error gradstream raises about gradient data."""


class ChecksumMismatchError(GradientStreamError):
    """A chunk's payload does not hash to the CRC-32 its header carries."""

    chunk_index: int
    expected: int
    actual: int

    def __init__(self, chunk_index: int, expected: int, actual: int) -> None:
        self.chunk_index = chunk_index
        self.expected = expected
        self.actual = actual
        super().__init__(
            f"Checksum mismatch on chunk {chunk_index}: "
            f"expected {expected:#010x}, got {actual:#010x}"
        )

    def __reduce__(self) -> tuple[type, tuple[int, int, int]]:
        return (type(self), (self.chunk_index, self.expected, self.actual))


class IncompleteStreamError(GradientStreamError):
    """Fewer (or more) chunks arrived than the stream's total_chunks."""

    received: int
    total: int

    def __init__(self, received: int, total: int) -> None:
        self.received = received
        self.total = total
        super().__init__(f"Incomplete chunk stream: received {received} of {total} chunks")

    def __reduce__(self) -> tuple[type, tuple[int, int]]:
        return (type(self), (self.received, self.total))


class ArrowIpcError(GradientStreamError):
    """A payload is not an Arrow IPC file holding a Float32 ``value`` column.

    ``chunk_index`` names the chunk whose payload failed, when there is one.
    """

    detail: str
    chunk_index: int | None

    def __init__(self, detail: str, chunk_index: int | None = None) -> None:
        self.detail = detail
        self.chunk_index = chunk_index
        where = "" if chunk_index is None else f" on chunk {chunk_index}"
        super().__init__(f"Arrow IPC error{where}: {detail}")

    def __reduce__(self) -> tuple[type, tuple[str, int | None]]:
        return (type(self), (self.detail, self.chunk_index))


class FrameError(GradientStreamError):
    """Malformed or hostile framing: truncation, limits, inconsistent headers.

    ``chunk_index`` is the chunk the problem is about (None when the header itself
    could not be read); ``offset`` is the byte offset in the frame stream of the
    header concerned (None for ``decode_chunks``, which has no byte stream).
    """

    detail: str
    chunk_index: int | None
    offset: int | None

    def __init__(
        self, detail: str, chunk_index: int | None = None, offset: int | None = None
    ) -> None:
        self.detail = detail
        self.chunk_index = chunk_index
        self.offset = offset
        super().__init__(detail)

    def __reduce__(self) -> tuple[type, tuple[str, int | None, int | None]]:
        return (type(self), (self.detail, self.chunk_index, self.offset))


class SettingError(GradientStreamError, ValueError):
    """A session setting out of range or unknown (a layout or codec name, a limit).

    Also a ``ValueError``. ``setting`` names the keyword; no session is made.
    """

    setting: str
    detail: str

    def __init__(self, setting: str, detail: str) -> None:
        self.setting = setting
        self.detail = detail
        super().__init__(detail)

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return (type(self), (self.setting, self.detail))


class GradientSizeError(GradientStreamError, ValueError):
    """The gradient that arrived does not have the size of the caller's ``out=`` array.

    ``expected`` is ``out.size``. ``received`` is the number of values the gradient
    holds, or, when it ran over, the count at the chunk that ran over (``chunk_index``;
    None when the gradient came up short). ``out`` may hold part of the gradient.
    """

    expected: int
    received: int
    chunk_index: int | None

    def __init__(self, expected: int, received: int, chunk_index: int | None = None) -> None:
        self.expected = expected
        self.received = received
        self.chunk_index = chunk_index
        if chunk_index is None:
            msg = f"the gradient holds {received} values; out= has room for exactly {expected}"
        else:
            msg = (
                f"the gradient runs over the {expected} values out= has room for: "
                f"{received} values by chunk {chunk_index}"
            )
        super().__init__(msg)

    def __reduce__(self) -> tuple[type, tuple[int, int, int | None]]:
        return (type(self), (self.expected, self.received, self.chunk_index))


class GradientDtypeError(GradientStreamError, TypeError):
    """The gradient that arrived is not of the dtype of the caller's ``out=`` array.

    Also a ``TypeError``. ``expected`` is ``out``'s dtype name, ``received`` the dtype
    the gradient is handed back in (``float16``, ``bfloat16``, ``float32``, ``float64``),
    ``chunk_index`` the chunk that told it. Nothing of that chunk is written to ``out``.
    """

    expected: str
    received: str
    chunk_index: int | None

    def __init__(self, expected: str, received: str, chunk_index: int | None = None) -> None:
        self.expected = expected
        self.received = received
        self.chunk_index = chunk_index
        super().__init__(f"the gradient is {received}; out= is {expected}")

    def __reduce__(self) -> tuple[type, tuple[str, str, int | None]]:
        return (type(self), (self.expected, self.received, self.chunk_index))


class TensorSetError(GradientStreamError, ValueError):
    """A tensor set that is not valid: a repeated or bad name, a manifest that cannot be
    read, a tensor that arrives other than its manifest entry says.

    Also a ``ValueError``. ``name`` is the tensor concerned, when there is one.
    """

    detail: str
    name: str | None

    def __init__(self, detail: str, name: str | None = None) -> None:
        self.detail = detail
        self.name = name
        super().__init__(detail)

    def __reduce__(self) -> tuple[type, tuple[str, str | None]]:
        return (type(self), (self.detail, self.name))


class StreamIOError(GradientStreamError, OSError):
    """The connection failed (reset, refused, closed under a write...).

    Also an ``OSError``: ``errno`` and ``strerror`` are those of the failed system call
    when there was one.
    """

    def __reduce__(self) -> tuple[type, tuple[object, ...]]:
        return (type(self), tuple(self.args))

    @classmethod
    def from_os_error(cls, exc: OSError) -> StreamIOError:
        """StreamIOError(errno, strerror) for a failed system call or stream operation
        (used by the Python-side I/O: the reference and the tensor-set layer)."""
        if isinstance(exc, StreamIOError):
            return exc
        code = exc.errno
        if code is None:
            # asyncio raises e.g. ConnectionResetError("Connection lost") without an
            # errno; the class says which one it stands for.
            code = next((c for kind, c in _ERRNO_OF if isinstance(exc, kind)), None)
        if code is None:
            return cls(str(exc) or type(exc).__name__)
        return cls(code, exc.strerror or _os.strerror(code))


_ERRNO_OF: tuple[tuple[type[OSError], int], ...] = (
    (BrokenPipeError, _errno.EPIPE),
    (ConnectionResetError, _errno.ECONNRESET),
    (ConnectionAbortedError, _errno.ECONNABORTED),
    (ConnectionRefusedError, _errno.ECONNREFUSED),
)


class StreamTimeoutError(StreamIOError, TimeoutError):
    """No byte moved for ``timeout`` seconds (the session's ``timeout``).

    ``received`` and ``total`` count the chunks of the gradient in flight (``total`` is
    None when no frame had arrived yet).
    """

    timeout: float
    received: int
    total: int | None

    def __init__(self, timeout: float, received: int = 0, total: int | None = None) -> None:
        self.timeout = timeout
        self.received = received
        self.total = total
        of = "" if total is None else f" of {total}"
        super().__init__(
            f"no progress for {timeout:g} s (after {received}{of} chunks); the peer stalled"
        )

    def __str__(self) -> str:
        return str(self.args[0])

    def __reduce__(self) -> tuple[type, tuple[float, int, int | None]]:
        return (type(self), (self.timeout, self.received, self.total))


class StreamDeadlineError(StreamTimeoutError):
    """A transfer (one gradient, or one tensor set) took longer than its ``deadline``
    seconds from its first byte, however steadily bytes moved (a slow drip).

    A ``StreamTimeoutError`` (and so a ``TimeoutError``) too; its ``timeout`` is the
    deadline. ``received`` and ``total`` count the chunks of the gradient in flight.
    """

    deadline: float

    def __init__(self, deadline: float, received: int = 0, total: int | None = None) -> None:
        super().__init__(deadline, received, total)
        self.deadline = deadline
        of = "" if total is None else f" of {total}"
        self.args = (
            f"the transfer took longer than its deadline of {deadline:g} s "
            f"(after {received}{of} chunks)",
        )

    def __reduce__(self) -> tuple[type, tuple[float, int, int | None]]:
        return (type(self), (self.deadline, self.received, self.total))


# Where a peer or a listener is: ``(host, port)`` over TCP, ``"unix:PATH"`` on this host.
Address = tuple[str, int] | str


def _peer_of(peer: Address | None) -> Address | None:
    """A peer as errors keep it: ``(host, port)`` of plain types (a numpy or pickled
    tuple's items made ``str``/``int``), or a ``"unix:PATH"`` as it is."""
    if peer is None or isinstance(peer, str):
        return peer
    return (str(peer[0]), int(peer[1]))


def _peer_text(peer: Address | None) -> str:
    """How messages name a connection's peer: ``host:port`` (``[v6]:port``),
    ``unix:PATH``, or ``the peer``."""
    if peer is None:
        return "the peer"
    if isinstance(peer, str):
        return peer
    host, port = peer
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class ProtocolError(GradientStreamError):
    """A connection's peer does not speak this side's protocol (docs/spec/protocol.md): an
    HTTP client, a TLS client at a plaintext listener, an ipfrs-transport peer (use
    ``protocol="seed"``), another version, a malformed message.

    ``expected`` and ``seen`` say what this side waited for and what came; ``peer`` is the
    peer's ``(host, port)`` when known.
    """

    expected: str
    seen: str
    peer: Address | None

    def __init__(self, expected: str, seen: str, peer: Address | None = None) -> None:
        self.expected = expected
        self.seen = seen
        self.peer = _peer_of(peer)
        super().__init__(
            f"protocol error with {_peer_text(self.peer)}: expected {expected}, got {seen}"
        )

    def __reduce__(self) -> tuple[type, tuple[str, str, Address | None]]:
        return (type(self), (self.expected, self.seen, self.peer))


class AuthenticationError(GradientStreamError):
    """The authkey check of a connection failed: a wrong or missing key, or a hello
    changed on the way. Raised on both sides, before any gradient byte is read."""

    detail: str
    peer: Address | None

    def __init__(self, detail: str, peer: Address | None = None) -> None:
        self.detail = detail
        self.peer = _peer_of(peer)
        super().__init__(f"authentication with {_peer_text(self.peer)} failed: {detail}")

    def __reduce__(self) -> tuple[type, tuple[str, Address | None]]:
        return (type(self), (self.detail, self.peer))


class TlsError(GradientStreamError):
    """The TLS handshake of a connection failed, or the peer's certificate was refused
    (an unknown issuer, a name that does not match, no client certificate under mutual
    TLS, no ``gradstream/1`` ALPN)."""

    detail: str
    peer: Address | None

    def __init__(self, detail: str, peer: Address | None = None) -> None:
        self.detail = detail
        self.peer = _peer_of(peer)
        super().__init__(f"TLS with {_peer_text(self.peer)} failed: {detail}")

    def __reduce__(self) -> tuple[type, tuple[str, Address | None]]:
        return (type(self), (self.detail, self.peer))


class DeliveryError(GradientStreamError):
    """A gradient (or tensor set) sent on a connection was not acknowledged: the peer
    refused it (``reason`` holds the peer's error message), closed before acknowledging,
    or acknowledged other bytes than were sent. The connection is closed."""

    detail: str
    peer: Address | None
    reason: str | None

    def __init__(self, detail: str, peer: Address | None = None, reason: str | None = None) -> None:
        self.detail = detail
        self.peer = _peer_of(peer)
        self.reason = reason
        super().__init__(f"gradient not delivered to {_peer_text(self.peer)}: {detail}")

    def __reduce__(self) -> tuple[type, tuple[str, Address | None, str | None]]:
        return (type(self), (self.detail, self.peer, self.reason))


class ObjectUnavailableError(GradientStreamError):
    """A Ray object sent through the ``GRADSTREAM`` tensor transport could not be fetched
    from the process that made it (``gradstream.ray``): that process no longer holds it
    (freed, or the actor restarted), or its endpoint cannot be reached."""

    object_id: str
    peer: Address | None
    detail: str

    def __init__(self, object_id: str, peer: Address | None, detail: str) -> None:
        self.object_id = object_id
        self.peer = _peer_of(peer)
        self.detail = detail
        super().__init__(
            f"object {object_id} cannot be fetched from {_peer_text(self.peer)}: {detail}"
        )

    def __reduce__(self) -> tuple[type, tuple[str, Address | None, str]]:
        return (type(self), (self.object_id, self.peer, self.detail))


class WorkerLostError(GradientStreamError):
    """A step of a ``gradstream.ray.ParameterServer`` under ``on_worker_failure="raise"``
    failed: ``missing`` holds the ranks whose gradient did not arrive, ``detail`` why."""

    step: int
    missing: tuple[int, ...]
    detail: str

    def __init__(self, step: int, missing: tuple[int, ...], detail: str) -> None:
        self.step = int(step)
        self.missing = tuple(int(rank) for rank in missing)
        self.detail = detail
        ranks = ", ".join(str(rank) for rank in self.missing)
        super().__init__(f"step {self.step} failed: no gradient from worker {ranks}: {detail}")

    def __reduce__(self) -> tuple[type, tuple[int, tuple[int, ...], str]]:
        return (type(self), (self.step, self.missing, self.detail))
