# Type stubs of the Rust extension module (crates/gradstream-py). mypy's stubtest checks
# them against the built module (the Makefile's lint), so they cannot drift from the code.
import socket
from asyncio.trsock import TransportSocket
from collections.abc import Iterable
from typing import Any, Final, Literal, final

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
    "Completions",
    "Driven",
    "Engine",
    "FrameEncoder",
    "FrameReceiver",
    "GradientChunk",
    "Handover",
    "Link",
    "Listener",
    "SocketReceive",
    "TensorFrameEncoder",
    "TensorSetReceiver",
    "TransferProgress",
    "_error_samples",
    "_protocol_ack",
    "_protocol_ack_rest",
    "_protocol_auth",
    "_protocol_describe",
    "_protocol_digest",
    "_protocol_digest_of_stream",
    "_protocol_hello",
    "_protocol_hello_rest",
    "_protocol_pake",
    "_protocol_read_ack",
    "_protocol_read_auth",
    "_protocol_read_hello",
    "_protocol_read_pake",
    "_protocol_transfer_id",
    "fast_path_counts",
    "manifest_json",
    "open_link",
    "open_listener",
    "read_manifest",
    "tensor_note",
]

_DtypeName = Literal["float16", "bfloat16", "float32", "float64"]
_WireName = Literal["float16", "bfloat16", "float32", "float64", "int8"]

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

_GradientArgs = tuple[npt.NDArray[Any], str, str, str | None, tuple[int, ...] | None]
_OutArgs = tuple[npt.NDArray[Any], str, str]
_TensorArgs = tuple[str, npt.NDArray[Any], str, tuple[int, ...]]
_Values = tuple[npt.NDArray[Any], str, list[int] | None]

@final
class Engine:
    """One session's settings and its native operations, called once per public call by
    gradstream._session.GradientStreamSession with arguments it has normalised: a
    gradient as (its values' bytes as uint8, dtype, wire dtype, dtype handed back, shape
    to send), out= as (its bytes as uint8, dtype); values come back as (flat array,
    dtype, shape)."""

    def __new__(
        cls,
        session_id: str,
        chunk_size: int,
        *,
        max_payload_len: int,
        max_gradient_len: int,
        timeout: float | None,
        deadline: float | None,
        layout: str,
        compression: bool | str | None,
        keep_shape: bool,
        keep_dtype: bool,
        wire_dtype: str | None,
        seal: bool,
        bf16_as_f32: bool,
    ) -> Engine: ...
    def with_compression(self, enabled: bool) -> Engine: ...
    def with_drivers(self, caller_thread: bool) -> Engine: ...
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
    def deadline(self) -> float | None: ...
    @property
    def layout(self) -> Literal["seed", "compact"]: ...
    @property
    def compression(self) -> Literal["lz4", "zstd"] | None: ...
    @property
    def keep_shape(self) -> bool: ...
    @property
    def seal(self) -> bool: ...
    @property
    def keep_dtype(self) -> bool: ...
    @property
    def wire_dtype(self) -> _WireName | None: ...
    def stream_to_socket(
        self,
        completions: Completions,
        gradient: _GradientArgs,
        socket: _Socket,
        progress: TransferProgress | None,
        deadline: float | None,
    ) -> tuple[bool, int]: ...
    def receive_from_socket(
        self,
        socket: _ReceiveSocket,
        progress: TransferProgress | None,
        none_at_end: bool,
        out: _OutArgs | None,
        deadline: float | None,
    ) -> SocketReceive: ...
    def frame_encoder(
        self, gradient: _GradientArgs, progress: TransferProgress | None, deadline: float | None
    ) -> FrameEncoder: ...
    def frame_receiver(
        self, progress: TransferProgress | None, out: _OutArgs | None, deadline: float | None
    ) -> FrameReceiver: ...
    def encode_gradient(self, gradient: _GradientArgs) -> list[GradientChunk]: ...
    def decode_chunks(self, chunks: Iterable[Any]) -> _Values: ...
    def frames_len(self, n_values: int) -> int: ...
    def encode_frames(
        self, gradient: _GradientArgs, as_buffer: bool, out: memoryview | None
    ) -> bytes | pa.Buffer | int: ...
    def decode_frames(self, data: Buffer, out: _OutArgs | None) -> _Values | None: ...
    def check_tensor_names(self, names: list[Any]) -> None: ...
    def check_tensors(self, tensors: list[_TensorArgs], doing: str, of: int) -> None: ...
    def encode_tensors(self, tensors: list[_TensorArgs], as_buffer: bool) -> bytes | pa.Buffer: ...
    def decode_tensors(self, data: Buffer) -> list[tuple[str, _Values]]: ...
    def stream_tensors_socket(
        self,
        completions: Completions,
        tensors: list[_TensorArgs],
        socket: _Socket,
        progress: TransferProgress | None,
        deadline: float | None,
    ) -> int: ...
    def receive_tensors_socket(
        self,
        completions: Completions,
        socket: _ReceiveSocket,
        progress: TransferProgress | None,
        deadline: float | None,
    ) -> int: ...
    def tensor_frame_encoder(
        self, tensors: list[_TensorArgs], progress: TransferProgress | None, deadline: float | None
    ) -> TensorFrameEncoder: ...
    def tensor_set_receiver(
        self, progress: TransferProgress | None, deadline: float | None
    ) -> TensorSetReceiver: ...
    def encode_manifest(self, text: str) -> bytes: ...
    def decode_manifest(self, data: Buffer) -> tuple[str | None, int]: ...

@final
class FrameEncoder:
    """The frames of one gradient, one bytes object per next() (asyncio streams)."""

    @property
    def total_chunks(self) -> int: ...
    def __iter__(self) -> FrameEncoder: ...
    def __next__(self) -> bytes: ...
    def sent(self, nbytes: int, frames: int) -> None: ...
    @property
    def waits(self) -> tuple[float | None, float | None]: ...
    def timed_out(self, seconds: float, late: bool = False) -> None: ...
    def note(self) -> str | None: ...

@final
class FrameReceiver:
    """Receives one gradient from bytes the caller reads: want() says how many next."""

    def want(self) -> int: ...
    @property
    def received(self) -> int: ...
    @property
    def total(self) -> int | None: ...
    def feed(self, data: Buffer) -> bool: ...
    def end(self, got: int) -> Any: ...
    def finish(self) -> Any: ...
    @property
    def waits(self) -> tuple[float | None, float | None]: ...
    def timed_out(self, seconds: float, late: bool = False) -> None: ...
    def note(self) -> str | None: ...

@final
class TensorFrameEncoder:
    """The frames of a tensor set, one bytes object per next() (asyncio streams)."""

    def __iter__(self) -> TensorFrameEncoder: ...
    def __next__(self) -> bytes: ...
    def sent(self, nbytes: int, frames: int) -> None: ...
    @property
    def waits(self) -> tuple[float | None, float | None]: ...
    def timed_out(self, seconds: float, late: bool = False) -> None: ...
    def note(self) -> str | None: ...

@final
class TensorSetReceiver:
    """Receives one tensor set from bytes the caller reads: want() says how many next."""

    def want(self) -> int: ...
    def feed(self, data: Buffer) -> bool: ...
    def end(self, got: int) -> list[tuple[str, _Values]]: ...
    def finish(self) -> list[tuple[str, _Values]]: ...
    @property
    def waits(self) -> tuple[float | None, float | None]: ...
    def timed_out(self, seconds: float, late: bool = False) -> None: ...
    def note(self) -> str | None: ...

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

# connect()'s and listen()'s settings, checked by gradstream._connection: keys protocol,
# tls ((cert, key, ca) paths or None), authkey, handshake_timeout, timeout, deadline,
# allowed_uid, streams (connect's, 1 to 255), resume (connect's: the resume window in
# seconds, or None); and _test_nonce (32 bytes: the hello's nonce), which only the tests'
# session replays set.
_LinkArgs = dict[str, Any]
# listen()'s own settings, checked by gradstream._connection: keys max_connections,
# max_pending_handshakes, max_pending_per_source, hello_timeout, max_auth_failures,
# auth_failure_window, max_streams (1 to 255), resume_window (seconds, 0: no resumes).
_ListenerArgs = dict[str, Any]

@final
class Link:
    """One connection (docs/guides/connections.md); send, recv, the tensor calls and close
    return a job of the loop's Completions (or, as a pair, the result when done at once);
    settle, abandoned and close_now act at once, never waiting."""

    def peer(self) -> tuple[tuple[str, int] | str, str | None, bool, int | None, int | None]: ...
    def streams(self) -> int: ...
    def resumes(self) -> bool: ...
    def resumed(self) -> tuple[int, int]: ...
    def closed(self) -> bool: ...
    def send(
        self,
        completions: Completions,
        gradient: _GradientArgs,
        progress: TransferProgress | None,
        deadline: float | None,
        here: bool = False,
        driven: bool = False,
    ) -> tuple[bool, Any]: ...
    def recv(
        self,
        completions: Completions,
        progress: TransferProgress | None,
        out: _OutArgs | None,
        deadline: float | None,
        none_at_end: bool,
        here: bool = False,
    ) -> tuple[bool, Any]: ...
    def send_tensors(
        self,
        completions: Completions,
        tensors: list[_TensorArgs],
        progress: TransferProgress | None,
        deadline: float | None,
    ) -> int: ...
    def recv_tensors(
        self,
        completions: Completions,
        progress: TransferProgress | None,
        deadline: float | None,
        max_values: int | None,
    ) -> int: ...
    def settle(self) -> None: ...
    def abandoned(self) -> bool: ...
    def close_now(self) -> bool: ...
    def close(self, completions: Completions) -> tuple[bool, Any]: ...

@final
class Listener:
    """A bound listener; next() returns a job whose result is ("connection", Link),
    ("refused", (host, port), exception), ("silent", (host, port), handshake_timeout),
    ("dropped", (host, port), why: str) for a peer the listener closed itself, or None
    once closed; close() a job done once the listening socket is closed."""

    @property
    def address(self) -> tuple[str, int] | str: ...
    def next(self, completions: Completions) -> int: ...
    def close(self, completions: Completions) -> int: ...

@final
class Completions:
    """Native transfers of one event loop (gradstream._aio.Hub) or of one thread
    (gradstream.sync, which blocks in ``wait``)."""

    def __new__(cls) -> Completions: ...
    def fileno(self) -> int: ...
    def drain(self) -> list[tuple[int, bool, Any]]: ...
    def abort(self, job: int) -> bool: ...
    def wait(self, job: int) -> tuple[bool, Any]: ...
    def stop_all(self) -> None: ...
    def abort_all(self) -> None: ...
    def __len__(self) -> int: ...

@final
class Driven:
    """A connection's transfer the event loop's thread drives itself (gradstream._aio.drive)."""

    @property
    def fd(self) -> int: ...
    @property
    def job(self) -> int: ...
    def poll(self) -> tuple[int, Any]: ...
    def stop(self) -> None: ...

@final
class SocketReceive:
    """One receive from a socket, tried on the caller's thread first (gradstream._aio)."""

    def poll(self) -> tuple[int, Any]: ...
    def hand_over(self, completions: Completions) -> int: ...

def fast_path_counts() -> tuple[int, int]:
    """(sends, receives) of small gradients finished on the caller's thread so far."""

def open_link(
    engine: Engine, completions: Completions, host: str, port: int, args: _LinkArgs
) -> int:
    """Connect to host:port with the engine's settings; a job whose result is a Link."""

def open_listener(
    engine: Engine,
    completions: Completions,
    host: str,
    port: int,
    args: _LinkArgs,
    listener: _ListenerArgs,
) -> int:
    """Listen on host:port with the engine's settings; a job whose result is a Listener."""

@final
class Handover:
    """A socket an asyncio transport stopped reading and the bytes its reader held, for
    one native receive (used by gradstream._handover only)."""

    def __new__(cls, socket: _Socket, buffered: Buffer) -> Handover: ...
    def unread(self) -> bytes: ...
    def ended(self) -> bool: ...
    def fileno(self) -> int: ...

# What the socket path drives: a socket, or an asyncio transport's (TransportSocket);
# a receive also takes one handed over with the bytes its reader held.
_Socket = socket.socket | TransportSocket
_ReceiveSocket = _Socket | Handover

def tensor_note(doing: str, name: str, k: int, n: int) -> str:
    """The note of an error met on tensor k of n: 'while <doing> tensor "name" (k of n) ...'."""

def read_manifest(text: str) -> list[tuple[str, str, list[int]]]:
    """A manifest's entries (name, dtype, shape) by the core's reader."""

def manifest_json(entries: list[tuple[str, str, tuple[int, ...]]]) -> str:
    """The manifest text a sender writes for these entries."""

def _error_samples() -> list[tuple[GradientStreamError, str]]:
    """One core error of every variant: (its Python exception, the Rust Display text)."""

# The protocol's messages (docs/spec/protocol.md), sans-I/O, for the golden tests
# (tests/support/protocol.py); every refusal is a gradstream.errors.ProtocolError.
def _protocol_hello(
    role_byte: int, auth: bool, nonce: bytes, max_gradient_len: int, max_payload_len: int
) -> bytes: ...
def _protocol_hello_rest(head: bytes) -> int: ...
def _protocol_read_hello(data: bytes, own_role: int) -> tuple[int, int, bytes, int, int]: ...
def _protocol_pake(key: bytes, role_byte: int, seed: bytes) -> bytes: ...
def _protocol_read_pake(data: bytes) -> bytes: ...
def _protocol_auth(
    key: bytes,
    role_byte: int,
    seed: bytes,
    peer_pake: bytes,
    client_hello: bytes,
    server_hello: bytes,
) -> bytes: ...
def _protocol_read_auth(data: bytes) -> bytes: ...
def _protocol_transfer_id(client: bytes, server: bytes, direction: int, counter: int) -> bytes: ...
def _protocol_digest(transfer: bytes, headers: list[bytes]) -> bytes: ...
def _protocol_digest_of_stream(transfer: bytes, pieces: list[bytes]) -> bytes: ...
def _protocol_ack(counter: int, digest: bytes, reason: str | None) -> bytes: ...
def _protocol_ack_rest(head: bytes) -> int: ...
def _protocol_read_ack(data: bytes) -> tuple[int, bytes, str | None]: ...
def _protocol_describe(head: bytes) -> str: ...
