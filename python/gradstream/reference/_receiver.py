"""The frame receiver: decode_frames' rules 1-9 (docs/spec/decoding-rules.md) as one sans-I/O
state machine, ``_FrameReceiver``, that is fed one header or one payload at a time, and
``_run_frames``, which drives it over bytes in memory (decode_frames). The session's
``receive_from`` / ``receive_iter`` drive the same machine over a socket or an asyncio
stream (docs/guides/limits.md), so every way in raises the same errors for the same bytes.

Caller-provided buffers (``out=``): the receiver can write the gradient into an array the
caller owns, chunk by chunk as the chunks come into index order (a chunk that arrives
early is held until its turn), and refuses a gradient of another size with
``GradientSizeError`` (of another dtype: ``GradientDtypeError``).

Apart from the rules because it owns the state of one gradient in flight (what arrived,
what is held, where the next header starts), and from the channels because it never
touches I/O: the driver reads exactly ``want`` bytes and hands them over.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..errors import FrameError, GradientSizeError, IncompleteStreamError
from ._reader import _concat, _open_payload, _read_values
from ._rules import (
    _disagree,
    _DtypeTracker,
    _duplicate,
    _empty_vector,
    _out_of_range,
    _room,
    _ShapeTracker,
    _verify_checksum,
)
from ._seal import _SealTracker
from ._wire import HEADER, HEADER_LEN

# Unsigned integers of each width, to move values of any dtype as raw bits.
_WORDS: dict[int, np.dtype] = {
    2: np.dtype(np.uint16),
    4: np.dtype(np.uint32),
    8: np.dtype(np.uint64),
}


def _flat(out: np.ndarray) -> np.ndarray:
    """The 1-D view of a checked decode ``out=`` (C-contiguous, so never a copy)."""
    flat: np.ndarray = out.reshape(-1)
    return flat


class _PendingFrame(NamedTuple):
    """A frame whose header has been read and whose payload is awaited."""

    chunk_index: int
    total_chunks: int
    payload_len: int
    checksum: int
    offset: int  # of the header, from the gradient's first byte


class _FrameReceiver:
    """decode_frames rules 1-9 as a sans-I/O state machine, for one gradient.

    The driver asks ``want`` for the number of bytes it needs next (a 16-byte header, then
    that header's payload), reads exactly that many and hands them to ``feed``, until
    ``done``. If the input ends first it calls ``end_of_stream`` with the number of the
    wanted bytes that did arrive. Every rule lives here, so decode_frames and the stream
    receivers raise the same errors for the same bytes. Any exception ends the gradient:
    a receiver is not fed again after one.

    The values are placed in index order as soon as they can be: chunk k goes in once
    chunks 0..k-1 have, and a chunk that arrives before its turn is held until then, in
    the value column's dtype. With ``out`` (a checked array of the caller's) they are cast
    to the dtype handed back and copied straight into it, so the receiver holds nothing but
    early chunks; the gradient must then have exactly ``out.size`` values
    (``GradientSizeError``) and come back in ``out``'s dtype (``GradientDtypeError``).
    Without ``out`` the values are kept in the column's dtype and cast once complete.
    """

    __slots__ = (
        "_copy_values",
        "_dtype",
        "_first",
        "_flat_out",
        "_held",
        "_manifest",
        "_max_gradient_len",
        "_max_payload_len",
        "_next",
        "_offset",
        "_out",
        "_pending",
        "_placed",
        "_pos",
        "_seal",
        "_shape",
        "_values",
    )

    def __init__(
        self,
        max_payload_len: int,
        max_gradient_len: int,
        *,
        copy_values: bool,
        out: np.ndarray | None = None,
        seal: _SealTracker | None = None,
    ) -> None:
        self._max_payload_len = max_payload_len
        self._max_gradient_len = max_gradient_len
        # True when the fed payloads are transient buffers: values held for later are then
        # copied out, so that only one payload is held at a time, never all of them.
        self._copy_values = copy_values
        self._out = out
        # out= as raw words of its width: values go in as bits, never through a float.
        self._flat_out = None if out is None else _flat(out).view(_WORDS[out.dtype.itemsize])
        self._offset = 0  # of the next header, from the gradient's first byte
        self._pending: _PendingFrame | None = None
        self._first: tuple[int, int] | None = None  # (chunk_index, total_chunks)
        self._next = 0  # chunks 0.._next-1 are placed
        self._held: dict[int, list[np.ndarray]] = {}  # accepted before their turn
        self._placed: list[np.ndarray] = []  # without out: the values, in index order
        self._pos = 0  # values placed
        self._values = 0  # accepted so far, in arrival order
        self._shape = _ShapeTracker()  # gradient_shape: the first arrival's, checked
        self._dtype = _DtypeTracker()  # value dtype, gradient_dtype: likewise
        # The seal every chunk is held to (docs/spec/decoding-rules.md); by default, a
        # lone gradient's seal, verified when it has one.
        self._seal = _SealTracker() if seal is None else seal
        self._manifest: str | None = None  # the first arrival's gradstream_tensors

    @property
    def want(self) -> int:
        """Bytes needed next: a header, or the pending header's payload (may be 0)."""
        return HEADER_LEN if self._pending is None else self._pending.payload_len

    @property
    def done(self) -> bool:
        """As many frames as total_chunks have arrived: reading stops (rule 8)."""
        return self._first is not None and self.received == self._first[1]

    @property
    def received(self) -> int:
        return self._next + len(self._held)

    @property
    def total(self) -> int | None:
        """total_chunks, once a first frame has been accepted."""
        return None if self._first is None else self._first[1]

    @property
    def offset(self) -> int:
        """Bytes consumed: the offset of the next header."""
        return self._offset

    def feed(self, unit: memoryview) -> None:
        """Take exactly ``want`` bytes: a header or a payload."""
        assert len(unit) == self.want and not self.done
        if self._pending is None:
            self._feed_header(unit)
        else:
            self._feed_payload(self._pending, unit)

    def _feed_header(self, header: memoryview) -> None:
        index, total, payload_len, checksum = HEADER.unpack(header)
        # Rule 3 comes before any use of payload_len, so a hostile header costs nothing.
        if payload_len > self._max_payload_len:
            raise FrameError(
                f"chunk {index} declares a {payload_len}-byte payload, "
                f"above max_payload_len {self._max_payload_len}",
                index,
                self._offset,
            )
        self._pending = _PendingFrame(index, total, payload_len, checksum, self._offset)

    def _feed_payload(self, frame: _PendingFrame, payload: memoryview) -> None:
        index, total, offset = frame.chunk_index, frame.total_chunks, frame.offset
        # Rule 4 (truncation) is end_of_stream's: the whole payload is here.
        first = self._first if self._first is not None else (index, total)
        if total != first[1]:  # rule 5
            raise FrameError(_disagree(first[0], first[1], index, total), index, offset)
        # Every chunk carries at least one value, but the empty gradient's single chunk.
        limit = self._max_gradient_len
        if total > max(limit, 1):
            raise FrameError(f"total_chunks {total} above max_gradient_len {limit}", index, offset)
        if index >= total:  # rule 6
            raise FrameError(_out_of_range(index, total), index, offset)
        if index < self._next or index in self._held:  # rule 7
            raise FrameError(_duplicate(index), index, offset)
        # Rule 8: each frame is verified and decoded as it arrives.
        _verify_checksum(index, frame.checksum, payload)
        reader, head = _open_payload(payload, index, _room(limit, self._values))
        # The seal, then the dtypes: after the schema, before the record batches are read.
        transfer = self._seal.check(head.seal, index, total, offset)
        self._dtype.check(head, index, offset, self._out)
        parts = _read_values(reader, head, index)
        # The shape metadata: after the decode, before the values are counted.
        self._shape.check(head.shape, index, offset)
        count = self._values + sum(len(part) for part in parts)
        if count > limit:
            raise FrameError(
                f"gradient exceeds max_gradient_len {limit}: {count} values by chunk {index}",
                index,
                offset,
            )
        # out= runs over: checked on the same arrival-order count, after the limit.
        out = self._flat_out
        if out is not None and count > out.size:
            raise GradientSizeError(out.size, count, index)
        self._values = count
        if self._first is None:
            self._manifest = head.manifest
        self._first = first
        self._seal.accept(index, transfer)
        self._dtype.accept(head, index)
        self._shape.accept(head.shape, index)
        self._pending = None
        self._offset = offset + HEADER_LEN + frame.payload_len
        if index != self._next:
            # Early: held until its turn. The parts are views over the payload; a
            # transient payload is not kept, only a copy of its values (in the column's
            # dtype, as they came).
            held = [_concat(parts, self._dtype.storage)] if self._copy_values else parts
            self._held[index] = held
            return
        self._place(parts)
        while self._next in self._held:
            self._place(self._held.pop(self._next))

    def _place(self, parts: list[np.ndarray]) -> None:
        """Put chunk ``_next``'s values after those of the chunks before it."""
        out = self._flat_out
        for part in parts:
            n = len(part)
            if out is None:
                # np.concatenate copies: the result never aliases a payload buffer.
                self._placed.append(_concat([part], part.dtype))
            else:
                # Cast to the dtype handed back (out='s, checked), then copied as raw
                # words, so NaN payloads and -0.0 survive.
                values = self._dtype.hand_back(part)
                out[self._pos : self._pos + n] = values.view(out.dtype)
            self._pos += n
        self._next += 1

    @property
    def transfer(self) -> bytes | None:
        """The transfer id of the chunks accepted so far (the expected one, for an exact
        id); None before the first, or when they are unsealed."""
        return self._seal.transfer

    @property
    def manifest(self) -> str | None:
        """The first accepted chunk's ``gradstream_tensors`` metadata (None if absent)."""
        return self._manifest

    def end_of_stream(self, got: int) -> None:
        """The input ended with ``got`` of the ``want`` bytes in. Returns only for the end
        before any byte (rule 1: an empty gradient, see ``_zero_values``); raises otherwise."""
        frame = self._pending
        if frame is not None:  # rule 4
            raise FrameError(
                f"truncated frame: chunk {frame.chunk_index} declares a "
                f"{frame.payload_len}-byte payload but only {got} bytes follow",
                frame.chunk_index,
                frame.offset,
            )
        if self._first is None:
            if got == 0:  # rule 1
                return
            # Rule 2: the original would silently return nothing here.
            raise FrameError(
                f"truncated frame header: {got} of {HEADER_LEN} bytes", None, self._offset
            )
        # Rule 9 (a header cut short after a frame counts as a missing frame).
        raise IncompleteStreamError(len(self._held) + self._next, self._first[1])

    def result(self) -> np.ndarray:
        """The gradient, once ``done`` and every other rule has passed: the values in index
        order, reshaped to the chunks' gradient_shape when they carry one (FrameError if it
        does not hold as many values), or ``out`` filled with them, in its own shape
        (GradientSizeError if it has room for more)."""
        assert self._first is not None and self.done and not self._held
        self._shape.finish(self._pos)
        if self._out is None:
            # One chunk's values are a copy of their own already (``_place``): handed back
            # as they are, so that a one-chunk gradient is not held twice.
            placed = self._placed
            values = placed[0] if len(placed) == 1 else _concat(placed, self._dtype.storage)
            return self._shape.shape(self._dtype.hand_back(values))
        if self._pos != self._out.size:
            raise GradientSizeError(self._out.size, self._pos, None)
        return self._out


def _zero_values(out: np.ndarray | None) -> np.ndarray:
    """The gradient of an input that ended before its first byte (rule 1): zero values, as
    a new empty array or as ``out``, which must then have room for exactly none."""
    if out is None:
        return _empty_vector()
    if out.size != 0:
        raise GradientSizeError(out.size, 0, None)
    return out


def _decode_frame_stream(
    data: memoryview,
    max_payload_len: int,
    max_gradient_len: int,
    out: np.ndarray | None = None,
    seal: _SealTracker | None = None,
) -> np.ndarray:
    """decode_frames: drive the receiver over bytes in memory, then rule 9's left-over, then
    the size of ``out``."""
    return _run_frames(data, max_payload_len, max_gradient_len, out, seal)[0]


def _run_frames(
    data: memoryview,
    max_payload_len: int,
    max_gradient_len: int,
    out: np.ndarray | None,
    seal: _SealTracker | None = None,
) -> tuple[np.ndarray, _FrameReceiver | None]:
    """_decode_frame_stream's gradient, and the receiver that read it (None for the empty
    input)."""
    receiver = _FrameReceiver(
        max_payload_len, max_gradient_len, copy_values=False, out=out, seal=seal
    )
    pos = _walk_frames(receiver, data)
    if pos is None:
        return _zero_values(out), None
    end = len(data)
    if pos < end:  # rule 9
        raise FrameError(f"{end - pos} bytes left over after the last chunk", None, pos)
    return receiver.result(), receiver


def _walk_frames(receiver: _FrameReceiver, data: memoryview) -> int | None:
    """Feed ``receiver`` from the start of ``data`` until it is done; the bytes it took
    (where its gradient ends, and so where whatever follows starts), or None for empty
    ``data``. Running out of data first raises the receiver's truncation errors."""
    end = len(data)
    pos = 0
    while not receiver.done:
        want = receiver.want
        if end - pos < want:
            receiver.end_of_stream(end - pos)  # raises, but for the empty input
            return None
        receiver.feed(data[pos : pos + want])
        pos += want
    return pos
