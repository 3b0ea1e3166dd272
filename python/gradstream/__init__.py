"""gradstream: stream gradient tensors between processes, chunked as Arrow IPC with a
CRC-32 per chunk, in the wire format of ipfrs-transport 0.2.0.

``GradientStreamSession`` (``_session``, over the Rust engine) and ``GradientChunk`` (Rust)
are the native implementation; ``gradstream.reference`` holds a pure-Python one of the
same API.
"""

from __future__ import annotations

from ._connection import Connection, Listener, Server, connect, listen, serve
from ._dtypes import BFloat16Type
from ._memory import KeptMemory, keep_memory, kept_memory, release_memory
from ._native import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_MAX_GRADIENT_LEN,
    DEFAULT_MAX_PAYLOAD_LEN,
    HEADER_LEN,
    GradientChunk,
    TransferProgress,
)
from ._peers import TLS, Peer
from ._session import GradientStreamSession
from .errors import (
    ArrowIpcError,
    AuthenticationError,
    ChecksumMismatchError,
    DeliveryError,
    FrameError,
    GradientDtypeError,
    GradientSizeError,
    GradientStreamError,
    IncompleteStreamError,
    ObjectUnavailableError,
    ProtocolError,
    SettingError,
    StreamDeadlineError,
    StreamIOError,
    StreamTimeoutError,
    TensorSetError,
    TlsError,
    WorkerLostError,
)

__version__ = "0.2.0"

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_MAX_GRADIENT_LEN",
    "DEFAULT_MAX_PAYLOAD_LEN",
    "HEADER_LEN",
    "TLS",
    "ArrowIpcError",
    "AuthenticationError",
    "BFloat16Type",
    "ChecksumMismatchError",
    "Connection",
    "DeliveryError",
    "FrameError",
    "GradientChunk",
    "GradientDtypeError",
    "GradientSizeError",
    "GradientStreamError",
    "GradientStreamSession",
    "IncompleteStreamError",
    "KeptMemory",
    "Listener",
    "ObjectUnavailableError",
    "Peer",
    "ProtocolError",
    "Server",
    "SettingError",
    "StreamDeadlineError",
    "StreamIOError",
    "StreamTimeoutError",
    "TensorSetError",
    "TlsError",
    "TransferProgress",
    "WorkerLostError",
    "__version__",
    "connect",
    "keep_memory",
    "kept_memory",
    "listen",
    "release_memory",
    "serve",
]
