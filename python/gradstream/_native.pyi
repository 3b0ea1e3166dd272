# Type stubs of the Rust extension module (crates/gradstream-py). mypy's stubtest checks
# them against the built module (the Makefile's lint), so they cannot drift from the code.
from collections.abc import AsyncIterator, Awaitable, Iterable
from typing import Any, Final, Literal, final, overload

import numpy.typing as npt
import pyarrow as pa
from typing_extensions import Buffer

from .errors import GradientStreamError

__all__ = [
    "BF16_EXTENSION",
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_MAX_GRADIENT_LEN",
    "DEFAULT_MAX_PAYLOAD_LEN",
    "DTYPE_KEY",
    "HEADER_LEN",
    "MANIFEST_KEY",
    "SHAPE_KEY",
    "GradientChunk",
    "GradientStreamSession",
    "TransferProgress",
    "_Completions",
    "_error_samples",
]

_DtypeName = Literal["float16", "bfloat16", "float32", "float64"]

DEFAULT_MAX_GRADIENT_LEN: Final[int]

DEFAULT_CHUNK_SIZE: Final[int]
DEFAULT_MAX_PAYLOAD_LEN: Final[int]
HEADER_LEN: Final[int]
SHAPE_KEY: Final[str]
DTYPE_KEY: Final[str]
MANIFEST_KEY: Final[str]
BF16_EXTENSION: Final[str]

@final
class GradientChunk:
    """One Arrow IPC chunk of a gradient with its CRC-32."""

    def __new__(
        cls,
        session_id: str,
        chunk_index: int,
        total_chunks: int,
        arrow_ipc_bytes: Buffer,
        checksum: int,
    ) -> GradientChunk: ...
    @property
    def session_id(self) -> str: ...
    @property
    def chunk_index(self) -> int: ...
    @property
    def total_chunks(self) -> int: ...
    @property
    def checksum(self) -> int: ...
    @property
    def arrow_ipc_bytes(self) -> bytes: ...
    @property
    def payload(self) -> pa.Buffer: ...
    def verify_checksum(self) -> bool: ...
    @staticmethod
    def compute_checksum(data: Buffer) -> int: ...
    def __eq__(self, value: object, /) -> bool: ...
    def __ne__(self, value: object, /) -> bool: ...
    __hash__: None  # type: ignore[assignment]

@final
class GradientStreamSession:
    """Chunks gradients into CRC-checked Arrow IPC frames and reassembles them."""

    def __new__(
        cls,
        session_id: str,
        chunk_size: int = 65536,
        *,
        max_payload_len: int = 268435456,
        max_gradient_len: int = 1073741824,
        timeout: float | None = None,
        layout: Literal["seed", "compact"] = "seed",
        compression: bool | Literal["lz4", "zstd"] | None = None,
        keep_shape: bool = False,
        keep_dtype: bool = False,
        wire_dtype: _DtypeName | None = None,
    ) -> GradientStreamSession: ...
    @staticmethod
    def with_defaults(session_id: str) -> GradientStreamSession: ...
    def with_compression(self, enabled: bool) -> GradientStreamSession: ...
    def is_compression_enabled(self) -> bool: ...
    @property
    def session_id(self) -> str: ...
    @property
    def chunk_size(self) -> int: ...
    @property
    def max_payload_len(self) -> int: ...
    @property
    def max_gradient_len(self) -> int: ...
    @property
    def timeout(self) -> float | None: ...
    @property
    def layout(self) -> Literal["seed", "compact"]: ...
    @property
    def compression(self) -> Literal["lz4", "zstd"] | None: ...
    @property
    def keep_shape(self) -> bool: ...
    @property
    def keep_dtype(self) -> bool: ...
    @property
    def wire_dtype(self) -> _DtypeName | None: ...
    def encode_gradient(self, gradient: Any) -> list[GradientChunk]: ...
    def decode_chunks(self, chunks: Iterable[Any]) -> npt.NDArray[Any]: ...
    def frames_len(self, n_values: int) -> int: ...
    @overload
    def encode_frames(
        self, gradient: Any, as_buffer: Literal[False] = False, *, out: None = None
    ) -> bytes: ...
    @overload
    def encode_frames(
        self, gradient: Any, as_buffer: Literal[True], *, out: None = None
    ) -> pa.Buffer: ...
    @overload
    def encode_frames(
        self, gradient: Any, as_buffer: Literal[False] = False, *, out: Buffer
    ) -> int: ...
    @overload
    def encode_frames(
        self, gradient: Any, as_buffer: bool = False, *, out: Buffer | None = None
    ) -> bytes | pa.Buffer | int: ...
    def decode_frames(
        self, data: Buffer, *, out: npt.NDArray[Any] | None = None
    ) -> npt.NDArray[Any]: ...
    def stream_to(
        self, gradient: Any, stream: Any, *, progress: TransferProgress | None = None
    ) -> Awaitable[int]: ...
    def receive_from(
        self,
        stream: Any,
        *,
        progress: TransferProgress | None = None,
        out: npt.NDArray[Any] | None = None,
    ) -> Awaitable[npt.NDArray[Any]]: ...
    def receive_iter(
        self, stream: Any, *, progress: TransferProgress | None = None
    ) -> AsyncIterator[npt.NDArray[Any]]: ...
    @overload
    def encode_tensors(self, tensors: Any, as_buffer: Literal[False] = False) -> bytes: ...
    @overload
    def encode_tensors(self, tensors: Any, as_buffer: Literal[True]) -> pa.Buffer: ...
    @overload
    def encode_tensors(self, tensors: Any, as_buffer: bool = False) -> bytes | pa.Buffer: ...
    def decode_tensors(self, data: Buffer) -> dict[str, npt.NDArray[Any]]: ...
    def stream_tensors(
        self, tensors: Any, stream: Any, *, progress: TransferProgress | None = None
    ) -> Awaitable[int]: ...
    def receive_tensors(
        self, stream: Any, *, progress: TransferProgress | None = None
    ) -> Awaitable[dict[str, npt.NDArray[Any]]]: ...
    def _encode_manifest(self, text: str) -> bytes: ...
    def _decode_manifest(self, data: Buffer) -> tuple[str | None, int]: ...

@final
class TransferProgress:
    """Counters a transfer updates as it runs (read them from any thread or task)."""

    def __new__(cls) -> TransferProgress: ...
    @property
    def bytes(self) -> int: ...
    @property
    def chunks(self) -> int: ...
    @property
    def total_chunks(self) -> int: ...

@final
class _Completions:
    """Native transfers of one event loop (used by gradstream._aio.Hub only)."""

    def __new__(cls) -> _Completions: ...
    def fileno(self) -> int: ...
    def drain(self) -> list[tuple[int, bool, Any]]: ...
    def abort(self, job: int) -> bool: ...
    def __len__(self) -> int: ...

def _error_samples() -> list[tuple[GradientStreamError, str]]:
    """One core error of every variant: (its Python exception, the Rust Display text)."""
