"""gradstream: stream gradient tensors between processes, chunked as Arrow IPC with a
CRC-32 per chunk, in the wire format of ipfrs-transport 0.2.0.

``GradientStreamSession`` (``_session``, over the Rust engine) and ``GradientChunk`` (Rust)
are the native implementation; ``gradstream.reference`` holds a pure-Python one of the
same API.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from ._address import Peer
from ._connection import Connection, Listener, Server, connect, listen, serve
from ._native import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_MAX_GRADIENT_LEN,
    DEFAULT_MAX_PAYLOAD_LEN,
    HEADER_LEN,
    GradientChunk,
    TransferProgress,
)
from ._session import GradientStreamSession
from ._tls_settings import TLS
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

if TYPE_CHECKING:
    from ._arrow import BFloat16Type

__version__ = "0.3.0"

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
    "listen",
    "serve",
]


# pyarrow (and with it BFloat16Type, the Arrow type gradstream.bfloat16) is imported when
# first needed, not by `import gradstream` (docs/guides/dtypes-and-shapes.md). When the
# caller imported pyarrow already, the type is registered with it now, as it always was.
if "pyarrow" in sys.modules:
    from . import _arrow  # noqa: F401


def __getattr__(name: str) -> Any:
    if name == "BFloat16Type":
        from ._arrow import BFloat16Type

        return BFloat16Type
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
