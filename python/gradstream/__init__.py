"""gradstream: stream gradient tensors between processes, chunked as Arrow IPC with a
CRC-32 per chunk, in the wire format of ipfrs-transport 0.2.0.

``GradientStreamSession`` (``_session``, over the Rust engine) and ``GradientChunk`` (Rust)
are the native implementation; ``gradstream.reference`` holds a pure-Python one of the
same API.
"""

from __future__ import annotations

from ._dtypes import BFloat16Type
from ._native import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_MAX_GRADIENT_LEN,
    DEFAULT_MAX_PAYLOAD_LEN,
    HEADER_LEN,
    GradientChunk,
    TransferProgress,
)
from ._session import GradientStreamSession
from .errors import (
    ArrowIpcError,
    AuthenticationError,
    DeliveryError,
    ProtocolError,
    TlsError,
    ChecksumMismatchError,
    FrameError,
    GradientDtypeError,
    GradientSizeError,
    GradientStreamError,
    IncompleteStreamError,
    SettingError,
    StreamDeadlineError,
    StreamIOError,
    StreamTimeoutError,
    TensorSetError,
)

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_MAX_GRADIENT_LEN",
    "DEFAULT_MAX_PAYLOAD_LEN",
    "HEADER_LEN",
    "ArrowIpcError",
    "AuthenticationError",
    "DeliveryError",
    "ProtocolError",
    "TlsError",
    "BFloat16Type",
    "ChecksumMismatchError",
    "FrameError",
    "GradientChunk",
    "GradientDtypeError",
    "GradientSizeError",
    "GradientStreamError",
    "GradientStreamSession",
    "IncompleteStreamError",
    "SettingError",
    "StreamDeadlineError",
    "StreamIOError",
    "StreamTimeoutError",
    "TensorSetError",
    "TransferProgress",
    "__version__",
]
