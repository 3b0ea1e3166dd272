"""``gradstream.GradientStreamSession``: the native session users see.

The arrows point one way. Each public method takes its arguments as a caller gives them,
normalises them once here (a gradient into its values' bytes, dtype names and shape; an
``out=`` buffer checked and viewed as bytes; a socket checked), and makes one call into
the Rust engine (``gradstream._native.Engine``), which holds the settings and does the
work with the GIL released. Rust never calls back into this package: what comes back is
plain (bytes, a flat array with its dtype name and shape, a job number for the event
loop's hub), and is finished here.

Uses ``_native`` (the engine), ``_convert`` and ``_dtypes`` (taking gradients and ``out=``),
``_aio`` (the asyncio-streams half and the loop's hub) and ``_handover`` (an asyncio
stream's plain socket lent to the socket path). Tensor sets are the engine's
too (gradstream-core's ``tensors``): only the (name, tensor) pairs are read here.
"""

from __future__ import annotations

import _socket
import errno
import os
import socket
import ssl
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, overload

import numpy as np
import numpy.typing as npt
from typing_extensions import Buffer

from . import _aio, _dtypes, _handover, _torch
from ._checks import (
    SSL_SOCKET_REFUSED,
    check_int8_uncompressed,
    check_protocol,
    check_wire_dtype,
)
from ._convert import check_bool, check_op, frame_buffer, reduction, value_buffer
from ._fill import fill_model
from ._native import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_MAX_GRADIENT_LEN,
    DEFAULT_MAX_PAYLOAD_LEN,
    Completions,
    Engine,
    GradientChunk,
    Handover,
    TransferProgress,
    open_link,
    open_listener,
    tensor_note,
)
from .errors import StreamIOError

if TYPE_CHECKING:
    # Only named in annotations: pyarrow is imported when a pyarrow.Buffer is asked for.
    import pyarrow as pa

__all__ = ["GradientStreamSession"]

_DtypeName = Literal["float16", "bfloat16", "float32", "float64"]
# What wire_dtype= takes: a dtype, or the int8 wire (docs/spec/wire-format.md).
_WireName = Literal["float16", "bfloat16", "float32", "float64", "int8"]

# What the engine's methods take and give (see crates/gradstream-py/src/convert.rs):
# a gradient as (its values' bytes, dtype, wire dtype, dtype handed back, shape to send),
# an out= or reduce_into= array as (its bytes, dtype, "fill" or "sum"), received values
# as (flat array, dtype, shape).
_GradientArgs = tuple[np.ndarray, str, str, str | None, tuple[int, ...] | None]
_OutArgs = tuple[np.ndarray, str, str]
_TensorArgs = tuple[str, np.ndarray, str, tuple[int, ...]]
_Values = tuple[np.ndarray, str, list[int] | None]
_FLOAT32 = np.dtype(np.float32)  # native byte order
_BYTES = np.dtype(np.uint8)


class _Out(NamedTuple):
    """An ``out=`` array, checked: the array itself (handed back: a numpy array or a torch
    tensor) and the engine's view."""

    array: Any
    args: _OutArgs


def _lend(out: Any) -> _Out:
    if _torch.is_tensor(out):
        view, name = _torch.lent_view(out, "out=")
        return _Out(out, (view.reshape(-1).view(np.uint8), name, "fill"))
    checked = value_buffer(out)
    known = _dtypes.dtype_name(checked.dtype)
    assert known is not None  # value_buffer took only the four dtypes
    return _Out(checked, (checked.reshape(-1).view(np.uint8), known, "fill"))


def lend_either(out: Any, reduce_into: Any, op: str) -> _Out | None:
    """The array a receive writes into: ``out`` (filled), ``reduce_into`` (summed into,
    in its dtype, docs/guides/buffers.md), or neither. Either may be a CPU torch tensor
    (docs/guides/torch.md): written in place through a view of its memory."""
    if _torch.is_tensor(reduce_into):
        check_op(out, reduce_into, op)
        view, name = _torch.lent_view(reduce_into, "reduce_into=")
        return _Out(reduce_into, (view.reshape(-1).view(np.uint8), name, "sum"))
    acc = reduction(out, reduce_into, op)
    if acc is not None:
        known = _dtypes.dtype_name(acc.dtype)
        assert known is not None  # reduction took only the four dtypes
        return _Out(acc, (acc.reshape(-1).view(np.uint8), known, "sum"))
    return None if out is None else _lend(out)


def _hand_back(values: _Values) -> np.ndarray:
    """Received values as the caller gets them: bfloat16 (and float16) bits viewed as their
    dtype, in the shape the sender kept."""
    flat, dtype, shape = values
    if flat.dtype == np.uint16:
        flat = flat.view(_dtypes.numpy_dtype(dtype))
    return flat if shape is None else flat.reshape(shape)


def hand_back_as(values: _Values, like: str) -> Any:
    """``_hand_back``, or with ``like="torch"`` a torch tensor over the same memory
    (docs/guides/torch.md)."""
    if like == "torch":
        flat, dtype, shape = values
        return _torch.from_values(flat, dtype, shape)
    return _hand_back(values)


_PAIRS = "a mapping of name to tensor or an iterable of (name, tensor) pairs"


def _tensor_pairs(tensors: Any) -> list[tuple[Any, Any]]:
    """The (name, tensor) pairs of a mapping or of an iterable of 2-item tuples/lists."""
    if isinstance(tensors, Mapping):
        return list(tensors.items())
    refused = TypeError(f"tensors must be {_PAIRS}, not {type(tensors).__name__}")
    if isinstance(tensors, (str, bytes, bytearray, memoryview)):
        raise refused
    try:
        items = iter(tensors)
    except TypeError:
        raise refused from None
    pairs = []
    for k, item in enumerate(items, 1):
        if not isinstance(item, (tuple, list)):
            raise TypeError(
                f"tensors item {k} is a {type(item).__name__}, not a (name, tensor) pair"
            )
        if len(item) != 2:
            raise TypeError(
                f"tensors item {k} is a {len(item)}-item {type(item).__name__}, not a "
                "(name, tensor) pair"
            )
        pairs.append((item[0], item[1]))
    return pairs


def _tensor_dict(received: list[tuple[str, _Values]]) -> dict[str, np.ndarray]:
    return {name: _hand_back(values) for name, values in received}


def tensor_set_as(received: list[tuple[str, _Values]], like: str, out: Any) -> Any:
    """A received set as the caller asked for it: a dict of arrays (or of torch tensors
    with ``like="torch"``), or ``out`` filled in place when given (a torch module or a
    mapping of name to tensor: every name, shape and dtype checked before any write)."""
    if out is not None:
        return fill_model(out, received)
    return {name: hand_back_as(values, like) for name, values in received}


# socket.type without its enum conversion, which costs a small transfer more than the
# check itself.
_raw_type = _socket.socket.type.__get__


def _stream_socket(stream: Any) -> socket.socket | None:
    """``stream`` when it is a socket the native I/O can drive, None when it is not a socket
    at all (asyncio streams); the error for a socket it cannot drive."""
    if not isinstance(stream, socket.socket):
        return None
    if isinstance(stream, ssl.SSLSocket):
        # Its descriptor carries TLS records: frames written beneath the TLS session would
        # be plaintext, and what we read would be ciphertext.
        raise TypeError(SSL_SOCKET_REFUSED)
    if stream.fileno() < 0:
        raise StreamIOError(errno.EBADF, "the socket is closed")  # as the reference says it
    if _raw_type(stream) != socket.SOCK_STREAM:
        raise ValueError(
            f"stream must be a connected stream socket (SOCK_STREAM), not {stream.type!r}"
        )
    return stream


# The settings whose default depends on where the frames go (docs/guides/connections.md,
# "Defaults"): left unset (None), a setting takes the transport's default, and a setting
# given explicitly always wins. Bare frames (encode_frames, stream_to, ...) and
# protocol="seed" connections keep the original's: the seed layout, flat float32 alone,
# byte-identical frames. A gradstream connection's hello makes its wire gradstream's own:
# compact, shapes and dtypes kept, so that conn.send(a); conn.recv() hands back a.
_FRAME_DEFAULTS: dict[str, Any] = {"layout": "seed", "keep_shape": False, "keep_dtype": False}
_CONNECTION_DEFAULTS: dict[str, Any] = {"layout": "compact", "keep_shape": True, "keep_dtype": True}


class GradientStreamSession:
    """Chunks gradients into CRC-checked Arrow IPC frames and reassembles them.

    The settings are fixed at construction (docs/reference/api.md); every method is one
    call into the native engine. ``GradientStreamSession()`` takes the defaults and a fresh
    session id (a local label, never sent). ``layout``, ``keep_shape`` and ``keep_dtype``
    left unset (None) take the transport's default: the original's for bare frames and
    ``protocol="seed"``, compact with shapes and dtypes kept on gradstream connections.
    """

    __slots__ = ("_connection_twin", "_engine", "_unset")
    _engine: Engine
    # The names of the transport-dependent settings left unset, and this session as a
    # gradstream connection uses it (made on first use).
    _unset: tuple[str, ...]
    _connection_twin: GradientStreamSession | None

    def __init__(
        self,
        session_id: str | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        *,
        max_payload_len: int = DEFAULT_MAX_PAYLOAD_LEN,
        max_gradient_len: int = DEFAULT_MAX_GRADIENT_LEN,
        timeout: float | None = None,
        deadline: float | None = None,
        layout: Literal["seed", "compact"] | None = None,
        compression: bool | Literal["lz4", "zstd"] | None = None,
        keep_shape: bool | None = None,
        keep_dtype: bool | None = None,
        wire_dtype: _WireName | None = None,
        seal: bool = False,
    ) -> None:
        # The id only labels chunks locally (it never goes on the wire): without one, a
        # fresh "gradstream-<16 hex digits>". The Rust API keeps the original's
        # GradientStreamSession::new(session_id, chunk_size).
        if session_id is None:
            session_id = f"gradstream-{os.urandom(8).hex()}"
        given = {"layout": layout, "keep_shape": keep_shape, "keep_dtype": keep_dtype}
        self._unset = tuple(name for name, value in given.items() if value is None)
        self._connection_twin = None
        self._engine = Engine(
            session_id,
            chunk_size,
            max_payload_len=max_payload_len,
            max_gradient_len=max_gradient_len,
            timeout=timeout,
            deadline=deadline,
            layout=_FRAME_DEFAULTS["layout"] if layout is None else layout,
            compression=compression,
            keep_shape=_FRAME_DEFAULTS["keep_shape"] if keep_shape is None else keep_shape,
            keep_dtype=_FRAME_DEFAULTS["keep_dtype"] if keep_dtype is None else keep_dtype,
            wire_dtype=wire_dtype,
            seal=seal,
            bf16_as_f32=not _dtypes.ML_DTYPES,
        )

    @classmethod
    def _of(cls, engine: Engine, unset: tuple[str, ...] = ()) -> GradientStreamSession:
        session = cls.__new__(cls)
        session._engine = engine
        session._unset = unset
        session._connection_twin = None
        return session

    @classmethod
    def _for_connection(cls, session: Any, protocol: Any) -> GradientStreamSession:
        """The session a connection of ``protocol`` uses, from ``connect``'s or
        ``listen``'s ``session=`` (None: the defaults): on a gradstream connection, its
        unset settings take the connection's defaults; otherwise the session itself."""
        if session is None:
            own = cls("gradstream")
        elif isinstance(session, GradientStreamSession):
            own = session
        else:
            raise TypeError(
                "session must be a gradstream.GradientStreamSession or None, not "
                f"{type(session).__name__}"
            )
        if check_protocol(protocol) != "gradstream" or not own._unset:
            return own
        if own._connection_twin is None:
            own._connection_twin = own._with(
                {name: _CONNECTION_DEFAULTS[name] for name in own._unset}
            )
        return own._connection_twin

    def _with(self, settings: dict[str, Any]) -> GradientStreamSession:
        """A session with these settings but for ``settings`` (given explicitly)."""
        e = self._engine
        mine: dict[str, Any] = {
            "layout": e.layout,
            "keep_shape": e.keep_shape,
            "keep_dtype": e.keep_dtype,
        }
        mine.update(settings)
        engine = Engine(
            e.session_id,
            e.chunk_size,
            max_payload_len=e.max_payload_len,
            max_gradient_len=e.max_gradient_len,
            timeout=e.timeout,
            deadline=e.deadline,
            compression=e.compression,
            wire_dtype=e.wire_dtype,
            seal=e.seal,
            bf16_as_f32=not _dtypes.ML_DTYPES,
            **mine,
        )
        return self._of(engine, tuple(name for name in self._unset if name not in settings))

    @classmethod
    def with_defaults(cls, session_id: str | None = None) -> GradientStreamSession:
        """A session with the default settings (chunks of 65,536 values)."""
        return cls(session_id)

    def with_compression(self, enabled: bool) -> GradientStreamSession:
        """A new session, the same but for compression: "lz4" when enabled, else none."""
        return self._of(self._engine.with_compression(enabled), self._unset)

    def is_compression_enabled(self) -> bool:
        return self._engine.compression is not None

    @property
    def session_id(self) -> str:
        return self._engine.session_id

    @property
    def chunk_size(self) -> int:
        return self._engine.chunk_size

    @property
    def max_payload_len(self) -> int:
        return self._engine.max_payload_len

    @property
    def max_gradient_len(self) -> int:
        return self._engine.max_gradient_len

    @property
    def timeout(self) -> float | None:
        """Longest wait, in seconds, for a byte to move on a stream; None waits for ever."""
        return self._engine.timeout

    @property
    def deadline(self) -> float | None:
        """Longest, in seconds, a transfer (a gradient or a tensor set) may take from its
        first byte; None: no bound. A call's ``deadline=`` overrides it."""
        return self._engine.deadline

    @property
    def layout(self) -> Literal["seed", "compact"]:
        """ "seed" (index + value columns, as the original) or "compact" (values only)."""
        return self._engine.layout

    @property
    def compression(self) -> Literal["lz4", "zstd"] | None:
        """None, "lz4" or "zstd": the payload compression this session writes."""
        return self._engine.compression

    @property
    def keep_shape(self) -> bool:
        """Whether each gradient's shape travels with it (and comes back reshaped)."""
        return self._engine.keep_shape

    @property
    def keep_dtype(self) -> bool:
        """Whether float16, bfloat16 and float64 gradients travel as they are."""
        return self._engine.keep_dtype

    @property
    def wire_dtype(self) -> _WireName | None:
        """The dtype every gradient is cast to for transfer (or ``"int8"``, the int8
        wire), or None."""
        return self._engine.wire_dtype

    @property
    def seal(self) -> bool:
        """Whether each gradient (or tensor set) is sealed with a fresh random transfer id
        and every receiver of this session requires all chunks sealed alike (without it,
        they verify the seals they find: docs/spec/decoding-rules.md)."""
        return self._engine.seal

    def __repr__(self) -> str:
        e = self._engine
        return (
            f"GradientStreamSession(session_id={e.session_id!r}, chunk_size={e.chunk_size}, "
            f"max_payload_len={e.max_payload_len}, max_gradient_len={e.max_gradient_len}, "
            f"timeout={e.timeout!r}, deadline={e.deadline!r}, layout={e.layout!r}, "
            f"compression={e.compression!r}, "
            f"keep_shape={e.keep_shape}, keep_dtype={e.keep_dtype}, "
            f"wire_dtype={e.wire_dtype!r}, seal={e.seal})"
        )

    # ---- taking a gradient (docs/guides/dtypes-and-shapes.md)

    def _take(self, gradient: Any, wire_dtype: str | None = None) -> _GradientArgs:
        """``gradient`` as this session's settings take it: float32 alone by default (read
        in place when it can be), else any of the four dtypes, cast to the wire dtype by the
        engine chunk by chunk. ``wire_dtype``: one transfer's, in place of the session's
        (checked by ``_transfer_wire``)."""
        e = self._engine
        wire = wire_dtype or e.wire_dtype
        if (
            type(gradient) is np.ndarray
            and gradient.dtype == _FLOAT32
            and gradient.flags.c_contiguous
            and gradient.flags.aligned
            and wire is None
        ):
            # What prepare gives for the commonest input, with keep_dtype or without (a
            # float32 gradient is float32 either way), without its checks (small
            # gradients at a high rate feel every microsecond here).
            values, wire, result, source = gradient, "float32", "float32", "float32"
        else:
            values, wire, result, source = _dtypes.prepare(
                gradient, keep_dtype=e.keep_dtype, wire_dtype=wire, cast_here=False
            )
        shape = values.shape if e.keep_shape else None
        # The values' memory as bytes: a view (prepare gives C-contiguous arrays, whose
        # ravel is a view; ravel and a dtype object cost less than reshape(-1) and the
        # np.uint8 type).
        return (values.ravel().view(_BYTES), source, wire, result, shape)

    def _transfer_wire(self, wire_dtype: Any) -> str | None:
        """A send's ``wire_dtype=``: None (the session's), or what the setting takes, in
        the setting's words (``SettingError``, ``TypeError``); int8 not on a compressed
        session."""
        wire = check_wire_dtype(wire_dtype)
        check_int8_uncompressed(wire, self._engine.compression)
        return wire

    # ---- in memory

    def encode_gradient(self, gradient: Any) -> list[GradientChunk]:
        """Split a gradient into Arrow IPC chunks, each with its CRC-32."""
        return self._engine.encode_gradient(self._take(gradient))

    def decode_chunks(self, chunks: Iterable[Any]) -> npt.NDArray[Any]:
        """Reassemble chunks given in any order."""
        return _hand_back(self._engine.decode_chunks(chunks))

    def frames_len(self, n_values: int) -> int:
        """Bytes of the frames of a gradient of ``n_values`` values."""
        return self._engine.frames_len(n_values)

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
    def encode_frames(
        self, gradient: Any, as_buffer: bool = False, *, out: Buffer | None = None
    ) -> bytes | pa.Buffer | int:
        """The frames ``stream_to`` writes, as ``bytes`` (or a ``pyarrow.Buffer`` with no
        copy), or written into ``out`` (then the number of bytes written)."""
        if as_buffer and out is not None:
            raise ValueError("as_buffer=True and out= exclude each other: out= is the buffer")
        view = None if out is None else frame_buffer(out)
        result: bytes | pa.Buffer | int = self._engine.encode_frames(
            self._take(gradient), as_buffer, view
        )
        return result

    def decode_frames(
        self,
        data: Buffer,
        *,
        out: npt.NDArray[Any] | None = None,
        reduce_into: npt.NDArray[np.float32] | None = None,
        op: str = "sum",
    ) -> npt.NDArray[Any]:
        """Parse a byte stream holding exactly one gradient's frames (into ``out``, when
        given: then ``out`` itself; added into ``reduce_into``: then that array)."""
        lent = lend_either(out, reduce_into, op)
        values = self._engine.decode_frames(data, None if lent is None else lent.args)
        if lent is not None:
            array: np.ndarray = lent.array
            return array
        return _hand_back(values)  # type: ignore[arg-type]

    # ---- streaming (docs/getting-started/python.md, docs/guides/limits.md)

    async def stream_to(
        self,
        gradient: Any,
        stream: Any,
        *,
        progress: TransferProgress | None = None,
        deadline: float | None = None,
    ) -> int:
        """Send one gradient over a socket or asyncio stream; the number of chunks."""
        sock = _stream_socket(stream)
        if sock is None:
            writer = _aio.writer_of(stream, "stream_to")
            sock = _handover.socket_to_write(writer)
            if sock is None:
                frames = self._engine.frame_encoder(self._take(gradient), progress, deadline)
                return await _aio.send(frames, writer)
        hub = _aio.hub()
        args = self._take(gradient)
        now, value = self._engine.stream_to_socket(hub.native, args, sock, progress, deadline)
        if now:  # a small gradient, all sent from this thread
            return value
        sent: int = await hub.run(value)
        return sent

    async def receive_from(
        self,
        stream: Any,
        *,
        progress: TransferProgress | None = None,
        out: npt.NDArray[Any] | None = None,
        deadline: float | None = None,
        reduce_into: npt.NDArray[np.float32] | None = None,
        op: str = "sum",
    ) -> npt.NDArray[Any]:
        """Receive one gradient from a socket or asyncio stream (``out`` itself, filled,
        when given; ``reduce_into`` itself, the gradient added into it, when given). The
        end of the stream before any byte gives an empty array."""
        got = await self._receive(
            stream, progress, False, lend_either(out, reduce_into, op), deadline
        )
        assert got is not None  # none_at_end=False gives the empty gradient instead
        return got

    async def receive_iter(
        self,
        stream: Any,
        *,
        progress: TransferProgress | None = None,
        deadline: float | None = None,
    ) -> AsyncIterator[npt.NDArray[Any]]:
        """Receive gradients until the peer closes the connection between two of them
        (each gradient's deadline runs from its own first byte)."""
        while True:
            gradient = await self._receive(stream, progress, True, None, deadline)
            if gradient is None:
                return
            yield gradient

    async def _receive(
        self,
        stream: Any,
        progress: TransferProgress | None,
        none_at_end: bool,
        lent: _Out | None,
        deadline: float | None,
    ) -> npt.NDArray[Any] | None:
        """One gradient, or None when the stream ended before its first byte and
        ``none_at_end`` (``receive_iter`` ends there)."""
        sock = _stream_socket(stream)
        args = None if lent is None else lent.args
        lease = None if sock is not None else _handover.lend_reader(_aio.reader_in(stream))
        if lease is not None:
            with lease as handover:
                values = await self._receive_socket(handover, progress, none_at_end, args, deadline)
        elif sock is None:
            receiver = self._engine.frame_receiver(progress, args, deadline)
            reader = _aio.reader_of(stream, "receive_from")
            values = await _aio.receive(receiver, reader, none_at_end)
        else:
            # _receive_socket's call, inlined: one coroutine less per small receive.
            receive = self._engine.receive_from_socket(sock, progress, none_at_end, args, deadline)
            values = await _aio.receive_socket(receive, sock)
        if values is None:
            return None
        if lent is not None:
            array: np.ndarray = lent.array
            return array
        return _hand_back(values)

    async def _receive_socket(
        self,
        sock: socket.socket | Handover,
        progress: TransferProgress | None,
        none_at_end: bool,
        args: _OutArgs | None,
        deadline: float | None,
    ) -> Any:
        """One gradient from a socket (or an asyncio stream's, handed over) natively: the
        values, ``out``'s array, or None at the end of the stream (as ``_receive``)."""
        receive = self._engine.receive_from_socket(sock, progress, none_at_end, args, deadline)
        return await _aio.receive_socket(receive, sock)

    # ---- tensor sets (docs/guides/tensor-sets.md)

    def _tensors(self, tensors: Any, doing: str) -> list[_TensorArgs]:
        """The tensors of a set as the engine takes them: every name checked first (by the
        engine, before any tensor is converted), then each tensor in its own dtype and
        shape, as keep_dtype=True takes it. A conversion error carries the tensor's note,
        unless an earlier tensor is refused (the first error of one pass is raised)."""
        pairs = _tensor_pairs(tensors)
        self._engine.check_tensor_names([name for name, _ in pairs])
        taken: list[_TensorArgs] = []
        for k, (name, tensor) in enumerate(pairs, 1):
            try:
                values, _, _, source = _dtypes.prepare(
                    tensor, keep_dtype=True, wire_dtype=None, cast_here=False
                )
            except Exception as exc:
                self._engine.check_tensors(taken, doing, len(pairs))
                exc.add_note(tensor_note(doing, name, k, len(pairs)))
                raise
            taken.append((name, values.reshape(-1).view(np.uint8), source, values.shape))
        return taken

    @overload
    def encode_tensors(self, tensors: Any, as_buffer: Literal[False] = False) -> bytes: ...
    @overload
    def encode_tensors(self, tensors: Any, as_buffer: Literal[True]) -> pa.Buffer: ...
    @overload
    def encode_tensors(self, tensors: Any, as_buffer: bool = False) -> bytes | pa.Buffer: ...
    def encode_tensors(self, tensors: Any, as_buffer: bool = False) -> bytes | pa.Buffer:
        """A named set of tensors as frames: the manifest's, then each tensor's."""
        as_buffer = check_bool(as_buffer, "as_buffer")
        return self._engine.encode_tensors(self._tensors(tensors, "encoding"), as_buffer)

    def decode_tensors(self, data: Buffer) -> dict[str, npt.NDArray[Any]]:
        """The named tensors of a set's frames, in the sender's order."""
        return _tensor_dict(self._engine.decode_tensors(data))

    async def stream_tensors(
        self,
        tensors: Any,
        stream: Any,
        *,
        progress: TransferProgress | None = None,
        deadline: float | None = None,
    ) -> int:
        """Send a named set of tensors; the number of frames written, manifest included.
        ``deadline`` bounds the whole set."""
        sock = _stream_socket(stream)
        if sock is None:
            writer = _aio.writer_of(stream, "stream_tensors")
            sock = _handover.socket_to_write(writer)
            if sock is None:
                taken = self._tensors(tensors, "sending")
                frames = self._engine.tensor_frame_encoder(taken, progress, deadline)
                return await _aio.send(frames, writer)
        hub = _aio.hub()
        taken = self._tensors(tensors, "sending")
        job = self._engine.stream_tensors_socket(hub.native, taken, sock, progress, deadline)
        sent: int = await hub.run(job)
        return sent

    async def receive_tensors(
        self,
        stream: Any,
        *,
        progress: TransferProgress | None = None,
        deadline: float | None = None,
    ) -> dict[str, npt.NDArray[Any]]:
        """Receive a named set of tensors, in the sender's order ({} when the stream ended
        before its first byte). ``deadline`` bounds the whole set from its first byte."""
        sock = _stream_socket(stream)
        lease = None if sock is not None else _handover.lend_reader(_aio.reader_in(stream))
        if lease is not None:
            with lease as handover:
                got = await self._receive_tensors_socket(handover, progress, deadline)
        elif sock is None:
            reader = _aio.reader_of(stream, "receive_tensors")
            receiver = self._engine.tensor_set_receiver(progress, deadline)
            got = await _aio.receive(receiver, reader, False)
        else:
            got = await self._receive_tensors_socket(sock, progress, deadline)
        return _tensor_dict(got)

    async def _receive_tensors_socket(
        self,
        sock: socket.socket | Handover,
        progress: TransferProgress | None,
        deadline: float | None,
    ) -> list[tuple[str, _Values]]:
        """One tensor set from a socket (or an asyncio stream's, handed over) natively."""
        hub = _aio.hub()
        job = self._engine.receive_tensors_socket(hub.native, sock, progress, deadline)
        got: list[tuple[str, _Values]] = await hub.run(job)
        return got

    # ---- connections (gradstream._connection's, with this session's settings)

    def _open_link(self, completions: Completions, host: str, port: int, args: Any) -> int:
        """A job of ``completions`` whose result is a native ``Link`` to host:port."""
        return open_link(self._engine, completions, host, port, args)

    def _open_listener(
        self, completions: Completions, host: str, port: int, args: Any, listener: Any
    ) -> int:
        """A job of ``completions`` whose result is a native ``Listener`` on host:port."""
        return open_listener(self._engine, completions, host, port, args, listener)

    def _encode_manifest(self, text: str) -> bytes:
        """The frames of a tensor set's manifest carrying ``text``."""
        return self._engine.encode_manifest(text)

    def _decode_manifest(self, data: Buffer) -> tuple[str | None, int]:
        """A manifest frame's text (None without one) and its number of values."""
        return self._engine.decode_manifest(data)
