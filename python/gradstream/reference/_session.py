"""``GradientStreamSession``: the settings of one stream and the API on them, encoding
(encode_gradient, encode_frames, frames_len), decoding (decode_chunks, decode_frames),
streaming (stream_to, receive_from, receive_iter) and tensor sets; and the seams a
connection uses to send and receive sealed with a transfer id of its own (the
``_*_sealed`` methods, docs/spec/wire-format.md, sealed chunks).

Apart because it only holds settings and wires the other modules together: the payloads
come from the writer, every rule of decoding from the rules and the receiver, every byte of
I/O from the channels. What stays here is what depends on the settings: how a gradient
is cut into chunks, when a chunk's payload is refused as too big (max_payload_len), and
how many bytes its frames take (``frames_len``, which ``encode_frames(out=)`` uses to
refuse a buffer too small before writing to it).
"""

from __future__ import annotations

import asyncio
import operator
import os
import zlib
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any, Literal, overload

import numpy as np
import pyarrow as pa

from .. import _dtypes
from .._checks import check_int8_uncompressed, check_wire_dtype
from .._convert import byte_view as _byte_view
from .._convert import check_bool as _check_bool
from .._convert import frame_buffer, reduction, value_buffer
from .._io import Clock, Stalled
from ..errors import FrameError, GradientSizeError
from . import _tensors
from ._channels import (
    TransferProgress,
    _Channel,
    _check_progress,
    _count,
    _receive_frames,
    _receiving_channel,
    _send_all,
    _sending_channel,
)
from ._chunk import GradientChunk
from ._receiver import _decode_frame_stream, _FrameReceiver, _run_frames, _zero_values
from ._rules import _chunk_fields, _decode_chunk_list
from ._seal import (
    CONSISTENT,
    LONE,
    WHEN_PRESENT,
    Expect,
    Seal,
    _SealTracker,
    check_transfer_id,
    new_transfer_id,
)
from ._settings import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_MAX_GRADIENT_LEN,
    DEFAULT_MAX_PAYLOAD_LEN,
    Compression,
    _check_chunk_size,
    _check_compression_setting,
    _check_flag,
    _check_layout,
    _check_max_gradient_len,
    _check_max_payload_len,
    _check_str,
    _check_timeout,
)
from ._wire import HEADER, HEADER_LEN, U32_MAX
from ._wire import shape_text as _shape_text
from ._writer import _Gradient, _min_payload_len, encode_payload, payload_len


class GradientStreamSession:
    """Splits gradients into Arrow IPC chunks / frames and reassembles them."""

    __slots__ = (
        "_chunk_size",
        "_compression",
        "_deadline",
        "_keep_dtype",
        "_keep_shape",
        "_layout",
        "_max_gradient_len",
        "_max_payload_len",
        "_seal",
        "_session_id",
        "_timeout",
        "_wire_dtype",
    )

    def __init__(
        self,
        session_id: str | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        *,
        max_payload_len: int = DEFAULT_MAX_PAYLOAD_LEN,
        max_gradient_len: int = DEFAULT_MAX_GRADIENT_LEN,
        timeout: float | None = None,
        deadline: float | None = None,
        layout: str | None = None,
        compression: bool | str | None = None,
        keep_shape: bool | None = None,
        keep_dtype: bool | None = None,
        wire_dtype: str | None = None,
        seal: bool = False,
    ) -> None:
        # The id only labels chunks locally (it never goes on the wire): without one, a
        # fresh "gradstream-<16 hex digits>".
        if session_id is None:
            session_id = f"gradstream-{os.urandom(8).hex()}"
        # In this order: with several bad arguments, the first one raises.
        self._session_id = _check_str(session_id, "session_id")
        # layout, keep_shape and keep_dtype left unset (None) take the bare frames'
        # defaults, the original's: the reference has no connections, whose defaults
        # differ (docs/guides/connections.md, "Defaults").
        self._layout = _check_layout("seed" if layout is None else layout)
        self._chunk_size = _check_chunk_size(chunk_size)
        self._max_payload_len = _check_max_payload_len(max_payload_len)
        self._max_gradient_len = _check_max_gradient_len(max_gradient_len)
        self._timeout = _check_timeout(timeout)
        self._deadline = _check_timeout(deadline, "deadline")
        self._compression = _check_compression_setting(compression)
        self._keep_shape = _check_flag(False if keep_shape is None else keep_shape, "keep_shape")
        self._keep_dtype = _check_flag(False if keep_dtype is None else keep_dtype, "keep_dtype")
        self._wire_dtype = check_wire_dtype(wire_dtype)
        check_int8_uncompressed(self._wire_dtype, self._compression)
        self._seal = _check_flag(seal, "seal")

    @classmethod
    def with_defaults(cls, session_id: str | None = None) -> GradientStreamSession:
        return cls(session_id, DEFAULT_CHUNK_SIZE)

    def with_compression(self, enabled: bool) -> GradientStreamSession:
        """A new session with the same settings and compression "lz4" if ``enabled``, else
        none."""
        enabled = _check_bool(enabled, "enabled")
        return GradientStreamSession(
            self._session_id,
            self._chunk_size,
            max_payload_len=self._max_payload_len,
            max_gradient_len=self._max_gradient_len,
            timeout=self._timeout,
            deadline=self._deadline,
            layout=self._layout,
            compression="lz4" if enabled else None,
            keep_shape=self._keep_shape,
            keep_dtype=self._keep_dtype,
            wire_dtype=self._wire_dtype,
            seal=self._seal,
        )

    def is_compression_enabled(self) -> bool:
        return self._compression is not None

    @property
    def compression(self) -> Compression | None:
        """The codec of the payloads this session writes: None, "lz4" or "zstd"."""
        return self._compression

    @property
    def session_id(self) -> str:
        return self._session_id

    @property
    def chunk_size(self) -> int:
        return self._chunk_size

    @property
    def max_payload_len(self) -> int:
        return self._max_payload_len

    @property
    def max_gradient_len(self) -> int:
        return self._max_gradient_len

    @property
    def timeout(self) -> float | None:
        return self._timeout

    @property
    def deadline(self) -> float | None:
        return self._deadline

    def _clock(self, deadline: Any) -> Clock:
        """The waits of one transfer: the timeout, and the call's deadline (checked as the
        setting is) or else the session's."""
        checked = _check_timeout(deadline, "deadline")
        return Clock(self._timeout, self._deadline if checked is None else checked)

    @property
    def layout(self) -> str:
        return self._layout

    @property
    def keep_shape(self) -> bool:
        """Whether this session writes the gradient's shape into every payload's schema
        metadata (``gradient_shape``). Receivers reshape whatever their own setting."""
        return self._keep_shape

    @property
    def keep_dtype(self) -> bool:
        """Whether this session sends float16, bfloat16 and float64 gradients in their own
        dtype (and has them handed back in it); without it (or wire_dtype) only float32 is
        taken."""
        return self._keep_dtype

    @property
    def wire_dtype(self) -> str | None:
        """The dtype every gradient is cast to for transfer, or None (its own dtype)."""
        return self._wire_dtype

    @property
    def seal(self) -> bool:
        """Whether each gradient (or tensor set) is sealed with a fresh random transfer id,
        and this session's receivers require every chunk sealed, all alike (without it,
        they verify the seals they find: docs/spec/decoding-rules.md)."""
        return self._seal

    def _expect(self, transfer: bytes | None = None) -> Expect:
        """What this session's receivers expect of seals: ``transfer`` exactly when given
        (a connection's), else every chunk alike when the session seals, else a seal
        found verified all the same (docs/spec/decoding-rules.md)."""
        if transfer is not None:
            return check_transfer_id(transfer)
        return CONSISTENT if self._seal else WHEN_PRESENT

    def _transfer(self, transfer: bytes | None = None) -> bytes | None:
        """The id a transfer is sealed with: ``transfer`` when given (a connection's), a
        fresh random one when the session seals, else None (unsealed)."""
        if transfer is not None:
            return check_transfer_id(transfer)
        return new_transfer_id() if self._seal else None

    def __repr__(self) -> str:
        return (
            f"GradientStreamSession(session_id={self._session_id!r}, "
            f"chunk_size={self._chunk_size}, max_payload_len={self._max_payload_len}, "
            f"max_gradient_len={self._max_gradient_len}, timeout={self._timeout!r}, "
            f"deadline={self._deadline!r}, "
            f"layout={self._layout!r}, compression={self._compression!r}, "
            f"keep_shape={self._keep_shape!r}, keep_dtype={self._keep_dtype!r}, "
            f"wire_dtype={self._wire_dtype!r}, seal={self._seal!r})"
        )

    # ---- encoding

    def _refusal(self, chunk_index: int, n_values: int) -> FrameError:
        # One message for both checks, so the text does not depend on the Arrow writer's
        # exact byte count (which differs between pyarrow and arrow-rs).
        return FrameError(
            f"chunk {chunk_index} ({n_values} values) would encode to a payload above "
            f"max_payload_len {self._max_payload_len} bytes; use a smaller chunk_size",
            chunk_index,
        )

    def _chunk_payload(
        self, chunk_index: int, total: int, window: np.ndarray, gradient: _Gradient
    ) -> bytes:
        """Encode chunk ``chunk_index`` of ``total`` (``window``, values of ``gradient``,
        sealed as it says), refusing it if its payload would exceed max_payload_len."""
        limit = self._max_payload_len
        # Cheap lower bound first: never build a payload we already know is too big (a
        # compressed payload has no such bound: its size depends on the values).
        floor = _min_payload_len(len(window), self._layout, gradient.dtype)
        if self._compression is None and floor > limit:
            raise self._refusal(chunk_index, len(window))
        payload = encode_payload(
            window,
            self._layout,
            self._compression,
            gradient.shape,
            dtype=gradient.dtype,
            result=gradient.result,
            seal=None if gradient.seal is None else gradient.seal.text(chunk_index, total),
        )
        if len(payload) > limit:
            raise self._refusal(chunk_index, len(window))
        return payload

    def _frame_len(self, chunk_index: int, n_values: int) -> int:
        """Bytes of the frame of a chunk of n_values values, refused as _chunk_payload
        would refuse it."""
        length = payload_len(n_values, self._layout, self._seal)
        if length > self._max_payload_len:
            raise self._refusal(chunk_index, n_values)
        return HEADER_LEN + length

    def _total_chunks(self, length: int) -> int:
        # Ceiling division; an empty gradient still makes one (empty) chunk.
        size = self._chunk_size
        total = max(1, -(-length // size))
        if total > U32_MAX:
            raise FrameError(
                f"a gradient of {length} values needs {total} chunks of {size}, more "
                f"than total_chunks can count ({U32_MAX}); use a larger chunk_size"
            )
        return total

    def _input(self, gradient: Any, transfer: bytes | None = None) -> _Gradient:
        """The gradient as the codec takes it (``_dtypes.prepare``: float32 unless
        keep_dtype or wire_dtype say otherwise), with the metadata to write: the compact
        JSON of its shape (keep_shape; after conversion to a numpy array and before
        flattening), the dtype to hand back when it is not the wire's, and its seal (a lone
        gradient's, with ``transfer`` or, when the session seals, a fresh random id)."""
        prepared = _dtypes.prepare(
            gradient, keep_dtype=self._keep_dtype, wire_dtype=self._wire_dtype
        )
        values = prepared.values  # C-contiguous: the flattening is a view
        shape = _shape_text(values.shape) if self._keep_shape else None
        result = None if prepared.result == _dtypes.carrier(prepared.wire) else prepared.result
        sealed = self._transfer(transfer)
        seal = None if sealed is None else Seal(sealed, LONE)
        return _Gradient(values.reshape(-1), prepared.wire, shape, result, seal)

    def _frames(self, gradient: _Gradient) -> Iterator[tuple[int, int, bytes, int]]:
        """(chunk_index, total_chunks, payload, checksum) of each chunk, encoded one at a
        time as the caller asks for it."""
        values = gradient.values
        size = self._chunk_size
        total = self._total_chunks(len(values))
        for k in range(total):
            payload = self._chunk_payload(k, total, values[k * size : (k + 1) * size], gradient)
            yield k, total, payload, zlib.crc32(payload)

    def encode_gradient(self, gradient: Any) -> list[GradientChunk]:
        return [
            GradientChunk(self._session_id, k, total, payload, checksum)
            for k, total, payload, checksum in self._frames(self._input(gradient))
        ]

    def frames_len(self, n_values: int) -> int:
        """The exact number of bytes encode_frames (and stream_to) produce for a gradient
        of ``n_values`` values in this session's layout and chunk size, computed without
        any values.

        TypeError for a non-integer, ValueError for a negative count, then ValueError for
        a compressed session (its payload sizes depend on the values), a keep_shape one (the
        metadata's size depends on the shape), a keep_dtype one (on the gradient's dtype)
        and a wire_dtype other than float32; for a length that encode_frames would refuse
        (a chunk whose payload exceeds max_payload_len, more chunks than a u32 counts) the
        FrameError encode_frames would raise.
        """
        n = operator.index(n_values)
        if n < 0:
            raise ValueError(f"n_values must be >= 0, got {n}")
        unknown = self._sizes_unknown()
        if unknown is not None:
            raise ValueError(unknown)
        size = self._chunk_size
        total = self._total_chunks(n)
        last = n - (total - 1) * size  # the empty gradient's one chunk holds 0 values
        # Chunks are refused in index order, as encode_frames meets them: chunk 0 first.
        if total == 1:
            return self._frame_len(0, last)
        full = self._frame_len(0, size)
        return (total - 1) * full + self._frame_len(total - 1, last)

    @overload
    def encode_frames(
        self, gradient: Any, as_buffer: Literal[False] = False, *, out: None = None
    ) -> bytes: ...
    @overload
    def encode_frames(
        self, gradient: Any, as_buffer: Literal[True], *, out: None = None
    ) -> pa.Buffer: ...
    @overload
    def encode_frames(self, gradient: Any, as_buffer: bool = False, *, out: Any) -> int: ...
    def encode_frames(
        self, gradient: Any, as_buffer: bool = False, *, out: Any = None
    ) -> bytes | pa.Buffer | int:
        """The frames of ``gradient``: ``bytes``, or a ``pyarrow.Buffer`` (as_buffer=True).

        With ``out`` (any object exporting a writeable C-contiguous buffer: bytearray,
        memoryview, a numpy array of any dtype but object, viewed as raw bytes) the frames
        are written at its start instead and their byte count is returned; the bytes after
        them are left as they were. TypeError for a read-only or non-contiguous buffer;
        ValueError for one smaller than the frames (``frames_len`` of the gradient; a
        compressed session encodes every frame first to know their length), in which case
        nothing is written, and for as_buffer=True with out. A gradient that cannot be
        encoded raises what it raises without ``out``, before anything is written.
        """
        as_buffer = _check_bool(as_buffer, "as_buffer")
        if out is None:
            frames = self._joined_frames(self._input(gradient))
            # py_buffer wraps the bytes object without copying it.
            return pa.py_buffer(frames) if as_buffer else frames
        if as_buffer:
            raise ValueError("as_buffer=True and out= exclude each other: out= is the buffer")
        with frame_buffer(out) as view:
            grad = self._input(gradient)
            values = grad.values
            if view.nbytes and np.may_share_memory(values, np.frombuffer(view, np.uint8)):
                raise ValueError(
                    "out= overlaps the gradient's memory: the frames would overwrite values "
                    "before they are read"
                )
            return self._encode_frames_into(grad, view)

    def _joined_frames(self, gradient: _Gradient) -> bytes:
        """The frames of a prepared gradient, headers and payloads, as one bytes object."""
        parts: list[bytes] = []
        for k, total, payload, checksum in self._frames(gradient):
            parts.append(HEADER.pack(k, total, len(payload), checksum))
            parts.append(payload)
        return b"".join(parts)

    def _sizes_unknown(self) -> str | None:
        """Why frames_len cannot compute the frames' length in advance (the message of its
        ValueError), or None when it can."""
        if self._compression is not None:
            return (
                "frames_len is not known in advance for a compressed session: payload sizes "
                "depend on the values"
            )
        if self._keep_shape:
            return (
                "frames_len is not known in advance when keep_shape is set: the shape "
                "metadata's size depends on the shape"
            )
        if self._keep_dtype:
            return (
                "frames_len is not known in advance when keep_dtype is set: payload sizes "
                "depend on the gradient's dtype"
            )
        if self._wire_dtype not in (None, "float32"):
            return (
                f"frames_len is not known in advance when wire_dtype is {self._wire_dtype!r}: "
                "only float32 payload sizes are computed"
            )
        return None

    def _encode_frames_into(self, gradient: _Gradient, view: memoryview) -> int:
        if self._sizes_unknown() is not None:
            return self._encode_sized_frames_into(gradient, view)
        # The exact size first (raising the encoder's FrameError for a refused length), so
        # that a buffer too small is refused before a byte of it is written.
        values = gradient.values
        assert gradient.dtype == "float32" and gradient.result is None and gradient.shape is None
        needed = self.frames_len(len(values))
        if needed > len(view):
            raise ValueError(
                f"out= holds {len(view)} bytes; the frames of {len(values)} values take {needed}"
            )
        pos = 0
        for k, total, payload, checksum in self._frames(gradient):
            end = pos + HEADER_LEN + len(payload)
            if end > needed:  # frames_len and the encoder disagree: a bug, never an overrun
                raise AssertionError(f"frames_len {needed} is short of the frames' length")
            HEADER.pack_into(view, pos, k, total, len(payload), checksum)
            view[pos + HEADER_LEN : end] = payload
            pos = end
        assert pos == needed, (pos, needed)
        return pos

    def _encode_sized_frames_into(self, gradient: _Gradient, view: memoryview) -> int:
        # Payload sizes depend on the values (compression), on the shape (keep_shape) or on
        # the dtype (keep_dtype, wire_dtype): encode every frame first, so that a buffer too
        # small is refused before a byte of it is written.
        frames = [
            (HEADER.pack(k, total, len(payload), checksum), payload)
            for k, total, payload, checksum in self._frames(gradient)
        ]
        needed = sum(HEADER_LEN + len(payload) for _, payload in frames)
        if needed > len(view):
            n = len(gradient.values)
            raise ValueError(
                f"out= holds {len(view)} bytes; the frames of {n} values take {needed}"
            )
        pos = 0
        for header, payload in frames:
            view[pos : pos + HEADER_LEN] = header
            view[pos + HEADER_LEN : pos + HEADER_LEN + len(payload)] = payload
            pos += HEADER_LEN + len(payload)
        return pos

    # ---- decoding

    def decode_chunks(self, chunks: Iterable[Any]) -> np.ndarray:
        fields = [_chunk_fields(c) for c in chunks]
        return _decode_chunk_list(fields, self._max_gradient_len, self._expect())

    def decode_frames(
        self,
        data: Any,
        *,
        out: np.ndarray | None = None,
        reduce_into: np.ndarray | None = None,
        op: str = "sum",
    ) -> np.ndarray:
        """The gradient held by the frames in ``data`` (any bytes-like object): a new 1-D
        array (float32 unless the payloads say otherwise; in the sender's shape when it
        sent one), or, with ``out``, ``out`` itself filled with the values.

        ``out`` must be a writeable, C-contiguous, aligned numpy array of float16,
        bfloat16 (ml_dtypes), float32 or float64 in native byte order, of any shape
        (TypeError otherwise, before the data is read); it is filled in C order and keeps
        its shape. The gradient must come back in ``out``'s dtype, else GradientDtypeError
        at the first chunk, before any of its values is written. It must hold exactly
        ``out.size`` values, else GradientSizeError: as soon as the chunk that runs over is
        decoded
        (values counted in arrival order; a gradient over max_gradient_len is the
        FrameError first), or, for a gradient short of it, once every other rule has
        passed (truncation, IncompleteStreamError, bytes left over). The empty input is a
        gradient of 0 values. Nothing is written past ``out``'s end, but after any error
        its contents are unspecified (part of the gradient, perhaps).

        ``reduce_into`` (a float32 array, instead of ``out``) gets the values added into
        it, in float32 (docs/guides/buffers.md), and is returned.
        """
        acc = reduction(out, reduce_into, op)
        if acc is not None:
            return add_into(acc, self._decode_frames(data, None, None))
        return self._decode_frames(data, out, None)

    def _decode_frames(
        self, data: Any, out: np.ndarray | None, transfer: bytes | None
    ) -> np.ndarray:
        """decode_frames, its seals held to ``_expect(transfer)``."""
        seal = _SealTracker(self._expect(transfer), LONE)
        if out is not None:
            out = value_buffer(out)
        return _decode_frame_stream(
            _byte_view(data), self._max_payload_len, self._max_gradient_len, out, seal
        )

    # ---- streaming (docs/guides/limits.md)

    async def stream_to(
        self,
        gradient: Any,
        stream: Any,
        *,
        progress: TransferProgress | None = None,
        deadline: float | None = None,
    ) -> int:
        """Send one gradient over a socket or an asyncio stream; the number of chunks.

        The bytes are exactly encode_frames(gradient), encoded and written one chunk at a
        time. The gradient is read as the chunks are encoded: do not change it meanwhile.
        """
        return await self._stream_to(gradient, stream, progress, deadline, None)

    async def _stream_to(
        self,
        gradient: Any,
        stream: Any,
        progress: TransferProgress | None,
        deadline: float | None,
        transfer: bytes | None,
    ) -> int:
        """stream_to, sealed as ``_input(gradient, transfer)`` says."""
        channel = _sending_channel(stream, self._clock(deadline))
        progress = _check_progress(progress)
        return await self._send(channel, self._input(gradient, transfer), progress)

    async def _send(
        self, channel: _Channel, grad: _Gradient, progress: TransferProgress | None
    ) -> int:
        """stream_to once the stream and the gradient are checked: the frames of ``grad``
        written to ``channel`` one at a time; the number of chunks."""
        frames = self._frames(grad)
        total = self._total_chunks(len(grad.values))  # FrameError before any byte is sent
        _count(progress, total_chunks=total)
        channel.clock.start()  # a sender's deadline runs from now
        with channel:
            for k, _, payload, checksum in frames:
                # One buffer per frame: two writes (header, payload) would meet Nagle's
                # algorithm and delayed ACKs on TCP.
                frame = memoryview(HEADER.pack(k, total, len(payload), checksum) + payload)
                try:
                    await _send_all(channel, frame, progress)
                except Stalled as stalled:
                    raise stalled.error(k, total) from None
                _count(progress, chunks=1)
                await asyncio.sleep(0)  # a turn for the loop per frame, as on receipt
        return total

    async def receive_from(
        self,
        stream: Any,
        *,
        progress: TransferProgress | None = None,
        out: np.ndarray | None = None,
        deadline: float | None = None,
        reduce_into: np.ndarray | None = None,
        op: str = "sum",
    ) -> np.ndarray:
        """Receive one gradient from a socket or an asyncio stream.

        The end of the stream before any byte gives an empty array (the original's "no
        network"); see docs/spec/wire-format.md for the other ends. ``out`` is as for
        decode_frames: the
        gradient is written into it as its chunks arrive, and ``out`` is returned; it is
        checked before any byte is read, and holds unspecified values after an error.
        ``reduce_into`` is as for decode_frames (the end of the stream is then a
        GradientSizeError, as for ``out``).
        """
        acc = reduction(out, reduce_into, op)
        channel = _receiving_channel(stream, self._clock(deadline))
        progress = _check_progress(progress)
        if out is not None:
            out = value_buffer(out)
        values = await self._receive(channel, progress, out)
        if acc is not None:
            return add_into(acc, _zero_values(None) if values is None else values)
        return _zero_values(out) if values is None else values

    # ---- seams of a connection (docs/spec/wire-format.md, sealed chunks): its own transfer ids

    def _encode_frames_sealed(self, gradient: Any, transfer: bytes) -> bytes:
        """encode_frames, every chunk sealed with ``transfer`` (16 bytes), position lone."""
        return self._joined_frames(self._input(gradient, transfer))

    def _decode_frames_sealed(
        self, data: Any, transfer: bytes, *, out: np.ndarray | None = None
    ) -> np.ndarray:
        """decode_frames, every chunk expected sealed with ``transfer``, position lone."""
        return self._decode_frames(data, out, transfer)

    async def _stream_to_sealed(
        self,
        gradient: Any,
        stream: Any,
        transfer: bytes,
        *,
        progress: TransferProgress | None = None,
        deadline: float | None = None,
    ) -> int:
        """stream_to, every chunk sealed with ``transfer``; the number of chunks."""
        return await self._stream_to(gradient, stream, progress, deadline, transfer)

    async def _receive_from_sealed(
        self,
        stream: Any,
        transfer: bytes,
        *,
        progress: TransferProgress | None = None,
        out: np.ndarray | None = None,
        deadline: float | None = None,
    ) -> np.ndarray | None:
        """receive_from, every chunk expected sealed with ``transfer`` (a ``FrameError``
        otherwise); None when the stream ended before the gradient's first byte."""
        seal = _SealTracker(self._expect(transfer), LONE)
        channel = _receiving_channel(stream, self._clock(deadline))
        progress = _check_progress(progress)
        if out is not None:
            out = value_buffer(out)
        return await self._receive(channel, progress, out, seal)

    async def receive_iter(
        self,
        stream: Any,
        *,
        progress: TransferProgress | None = None,
        deadline: float | None = None,
    ) -> AsyncIterator[np.ndarray]:
        """Receive gradients until the peer closes the stream between two of them."""
        channel = _receiving_channel(stream, self._clock(deadline))
        progress = _check_progress(progress)
        while True:
            values = await self._receive(channel, progress, None)
            if values is None:
                return
            yield values

    async def _receive(
        self,
        channel: _Channel,
        progress: TransferProgress | None,
        out: np.ndarray | None,
        seal: _SealTracker | None = None,
    ) -> np.ndarray | None:
        """One gradient (written into ``out`` when given), or None when the stream ended
        before its first byte; its seals held to ``seal`` (by default, the session's
        expectation)."""
        channel.clock.reset()  # each gradient's deadline runs from its own first byte
        if seal is None:
            seal = _SealTracker(self._expect(), LONE)
        receiver = _FrameReceiver(
            self._max_payload_len, self._max_gradient_len, copy_values=True, out=out, seal=seal
        )
        return await _receive_frames(channel, progress, receiver)

    # ---- tensor sets (docs/guides/tensor-sets.md; the logic is this package's _tensors)

    def encode_tensors(self, tensors: Any, as_buffer: bool = False) -> bytes | pa.Buffer:
        return _tensors.encode_tensors(self, tensors, as_buffer)

    def decode_tensors(self, data: Any) -> dict[str, np.ndarray]:
        return _tensors.decode_tensors(self, data)

    async def stream_tensors(
        self,
        tensors: Any,
        stream: Any,
        *,
        progress: TransferProgress | None = None,
        deadline: float | None = None,
    ) -> int:
        return await _tensors.stream_tensors(self, tensors, stream, progress, deadline)

    async def receive_tensors(
        self,
        stream: Any,
        *,
        progress: TransferProgress | None = None,
        deadline: float | None = None,
    ) -> dict[str, np.ndarray]:
        return await _tensors.receive_tensors(self, stream, progress, deadline)

    def _encode_tensors_sealed(self, tensors: Any, transfer: bytes) -> bytes:
        """encode_tensors, every frame sealed with ``transfer`` (a connection's id)."""
        data = _tensors.encode_tensors(self, tensors, False, check_transfer_id(transfer))
        assert isinstance(data, bytes)
        return data

    def _decode_tensors_sealed(self, data: Any, transfer: bytes) -> dict[str, np.ndarray]:
        """decode_tensors, every frame expected sealed with ``transfer``."""
        return _tensors.decode_tensors(self, data, check_transfer_id(transfer))

    async def _stream_tensors_sealed(
        self,
        tensors: Any,
        stream: Any,
        transfer: bytes,
        *,
        progress: TransferProgress | None = None,
        deadline: float | None = None,
    ) -> int:
        """stream_tensors, every frame sealed with ``transfer``; the frames written."""
        transfer = check_transfer_id(transfer)
        return await _tensors.stream_tensors(self, tensors, stream, progress, deadline, transfer)

    async def _receive_tensors_sealed(
        self,
        stream: Any,
        transfer: bytes,
        *,
        progress: TransferProgress | None = None,
        deadline: float | None = None,
    ) -> dict[str, np.ndarray]:
        """receive_tensors, every frame expected sealed with ``transfer`` ({} when the
        stream ended before the set's first byte)."""
        transfer = check_transfer_id(transfer)
        return await _tensors.receive_tensors(self, stream, progress, deadline, transfer)

    def _encode_manifest(self, text: str) -> bytes:
        """The frames of an empty gradient (one frame, chunk 0 of 1: a float32 value column
        of no rows, in this session's layout and compression) whose schema metadata holds
        ``gradstream_tensors`` = ``text`` and nothing else (unsealed, whatever ``seal``:
        a test's seam)."""
        text = _check_str(text, "text")
        frame = _tensors.manifest_frame(self._layout, self._compression, text)
        if len(frame) - HEADER_LEN > self._max_payload_len:
            raise self._refusal(0, 0)
        return frame

    def _decode_manifest(self, data: Any) -> tuple[str | None, int]:
        """Decode ``data`` exactly as decode_frames does; the first chunk's (the first to
        arrive) ``gradstream_tensors`` metadata (None when absent, or for the empty input)
        and the gradient's number of values."""
        seal = _SealTracker(self._expect(), LONE)
        values, receiver = _run_frames(
            _byte_view(data), self._max_payload_len, self._max_gradient_len, None, seal
        )
        return (None if receiver is None else receiver.manifest), values.size


def add_into(acc: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``reduce_into=``: the gradient's values added into ``acc``, each once
    (docs/guides/buffers.md): float32 and float64 arrays add in their own dtype (the
    values cast to it first), float16 and bfloat16 ones in float32, the sum rounded back
    by the cast rule; GradientSizeError when the sizes differ."""
    if values.size != acc.size:
        raise GradientSizeError(acc.size, values.size)
    flat = acc.reshape(-1)
    name = _dtypes.dtype_name(acc.dtype)
    if name == "float32":
        np.add(flat, values.reshape(-1).astype(np.float32, copy=False), out=flat)
        return acc
    source = _dtypes.dtype_name(values.dtype)
    assert name is not None and source is not None
    given = np.require(values.reshape(-1), requirements=["C"])
    if source == "bfloat16":
        given = given.view(np.uint16)
    if name == "float64":
        np.add(flat, _dtypes.cast(given, source, "float64"), out=flat)
        return acc
    own = flat.view(np.uint16) if name == "bfloat16" else flat
    total = _dtypes.cast(own, name, "float32") + _dtypes.cast(given, source, "float32")
    rounded = _dtypes.cast(np.asarray(total, np.float32), "float32", name)
    own[...] = rounded
    return acc
