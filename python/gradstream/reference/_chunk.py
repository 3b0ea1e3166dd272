"""``GradientChunk``: one Arrow-IPC-encoded slice of a gradient with its CRC-32, the value
object encode_gradient returns and decode_chunks takes (the original's API).

Apart from the session because it holds no settings and runs no rules: decode_chunks
reads any chunk-like object by duck typing (``_rules._chunk_fields``), this one included.
"""

from __future__ import annotations

import zlib
from typing import Any

import pyarrow as pa

from .._convert import byte_view as _byte_view
from ._settings import _check_str, _check_u32


def _to_bytes(data: Any) -> bytes:
    if type(data) is bytes:
        return data
    # Going through memoryview (not bytes(data)) so that an int is refused instead of being
    # taken as a length.
    return _byte_view(data).tobytes()


class GradientChunk:
    """One Arrow-IPC-encoded slice of a gradient with its CRC-32, as in the original."""

    __slots__ = ("_arrow_ipc_bytes", "_checksum", "_chunk_index", "_session_id", "_total_chunks")

    def __init__(
        self,
        session_id: str,
        chunk_index: int,
        total_chunks: int,
        arrow_ipc_bytes: Any,
        checksum: int,
    ) -> None:
        self._session_id = _check_str(session_id, "session_id")
        self._chunk_index = _check_u32(chunk_index, "chunk_index")
        self._total_chunks = _check_u32(total_chunks, "total_chunks")
        self._arrow_ipc_bytes = _to_bytes(arrow_ipc_bytes)
        self._checksum = _check_u32(checksum, "checksum")

    @property
    def session_id(self) -> str:
        return self._session_id

    @property
    def chunk_index(self) -> int:
        return self._chunk_index

    @property
    def total_chunks(self) -> int:
        return self._total_chunks

    @property
    def checksum(self) -> int:
        return self._checksum

    @property
    def arrow_ipc_bytes(self) -> bytes:
        return self._arrow_ipc_bytes

    @property
    def payload(self) -> pa.Buffer:
        """The payload as a pyarrow.Buffer over the same memory (no copy)."""
        return pa.py_buffer(self._arrow_ipc_bytes)

    @staticmethod
    def compute_checksum(data: Any) -> int:
        """CRC-32 (IEEE 802.3, as zlib.crc32 and crc32fast) of any bytes-like object."""
        return zlib.crc32(_byte_view(data))

    def verify_checksum(self) -> bool:
        return zlib.crc32(self._arrow_ipc_bytes) == self._checksum

    def __repr__(self) -> str:
        # The payload can be hundreds of KiB: show its length, not its bytes.
        return (
            f"GradientChunk(session_id={self._session_id!r}, chunk_index={self._chunk_index}, "
            f"total_chunks={self._total_chunks}, checksum={self._checksum:#010x}, "
            f"payload_len={len(self._arrow_ipc_bytes)})"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, GradientChunk):
            return NotImplemented
        return (
            self._session_id == other._session_id
            and self._chunk_index == other._chunk_index
            and self._total_chunks == other._total_chunks
            and self._checksum == other._checksum
            and self._arrow_ipc_bytes == other._arrow_ipc_bytes
        )

    # Mutable-looking value objects with __eq__ are unhashable, as a PyO3 class with eq is.
    __hash__ = None  # type: ignore[assignment]
