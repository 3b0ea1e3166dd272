"""Named tensor sets (docs/guides/tensor-sets.md) for the reference session: encode_tensors,
decode_tensors, stream_tensors and receive_tensors, following the docs/spec/decoding-rules.md
framing and
its receiver rules 1-4 in order.

A set is a manifest (one frame of an empty gradient whose schema metadata
``gradstream_tensors`` lists the tensors, see ``_manifest``), then each tensor as the
frames of a keep_shape, keep_dtype gradient. Everything here stands on the reference's
own machinery: the payload writer for the manifest frame, the session's frame encoder and
sender for the tensors, ``_FrameReceiver`` (fed from memory by ``_walk_frames``, or from
a channel by the session's receive loop) for every frame read, so that where a gradient
ends is the receiver's knowledge and not a second header walk, and the channels for all
I/O. A sealed set (docs/spec/wire-format.md) carries one transfer id in every frame: the
manifest at position ``fffffffe``, tensor k at position k; its receiver holds the
manifest to what it expects and each tensor to the manifest's id exactly.

Apart from ``gradstream._tensors``, which the native session uses, on purpose: a set
layer shared by both implementations could not be caught out by the differential tests.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple, Protocol

import numpy as np
import pyarrow as pa

from .. import _dtypes
from .._convert import byte_view, check_bool
from .._io import Clock, Stalled
from ..errors import TensorSetError
from ._channels import (
    TransferProgress,
    _Channel,
    _check_progress,
    _receive_frames,
    _receiving_channel,
    _recv_all,
    _send_all,
    _sending_channel,
)
from ._manifest import (
    MANIFEST_CAP,
    MAX_DIMS,
    Entry,
    _dims,
    check_name,
    manifest_json,
    quoted,
    read_manifest,
)
from ._receiver import _decode_frame_stream, _FrameReceiver, _walk_frames
from ._seal import ABSENT, MANIFEST, WHEN_PRESENT, Expect, Seal, _SealTracker
from ._settings import Compression
from ._wire import HEADER, HEADER_LEN, shape_text
from ._writer import _Gradient, encode_payload


class _Session(Protocol):
    """What the tensor sets take of a session: ``_session``'s GradientStreamSession, which
    calls this module with itself (so this module knows it only by what it uses)."""

    @property
    def layout(self) -> str: ...
    @property
    def compression(self) -> Compression | None: ...
    @property
    def max_payload_len(self) -> int: ...
    @property
    def max_gradient_len(self) -> int: ...
    @property
    def wire_dtype(self) -> str | None: ...
    def _clock(self, deadline: Any) -> Clock: ...
    def _expect(self, transfer: bytes | None = None) -> Expect: ...
    def _transfer(self, transfer: bytes | None = None) -> bytes | None: ...
    def _joined_frames(self, gradient: _Gradient) -> bytes: ...
    async def _send(
        self, channel: _Channel, grad: _Gradient, progress: TransferProgress | None
    ) -> int: ...


_PAIRS = "a mapping of name to tensor or an iterable of (name, tensor) pairs"


# ---------------------------------------------------------------------------- notes


@contextlib.contextmanager
def _about(doing: str, name: str, k: int, n: int) -> Iterator[None]:
    """Any error inside gets the note ``while <doing> tensor "name" (k of n) of a tensor
    set`` (receiver rule 3; the sender's errors likewise)."""
    try:
        yield
    except Exception as exc:
        text = f"while {doing} tensor {quoted(name)} ({k} of {n}) of a tensor set"
        exc.add_note(text)
        raise


# ---------------------------------------------------------------------------- sending


class _Tensor(NamedTuple):
    """A tensor taken for sending: its manifest entry and its values, C-contiguous in its
    own dtype and shape (bfloat16 as uint16 bits), not yet cast to any wire dtype."""

    entry: Entry
    values: np.ndarray


def _named_pairs(tensors: Any) -> list[tuple[Any, Any]]:
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


def _take(tensors: Any, doing: str) -> list[_Tensor]:
    """Every name checked first (before any tensor is converted), then each tensor taken
    in its own dtype and shape, as keep_dtype=True takes it."""
    pairs = _named_pairs(tensors)
    taken: set[str] = set()
    for name, _ in pairs:
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, not {type(name).__name__}")
        check_name(name, taken)
    out = []
    for k, (name, tensor) in enumerate(pairs, 1):
        with _about(doing, name, k, len(pairs)):
            own = _dtypes.prepare(tensor, keep_dtype=True, wire_dtype=None)
            values = own.values
            if values.ndim > MAX_DIMS:
                raise TensorSetError(
                    f"tensor {quoted(name)} has {values.ndim} dimensions; a tensor set carries "
                    f"at most {MAX_DIMS}",
                    name=name,
                )
            # A shape any receiver would refuse (a dimension of 19 digits, more than
            # 2**60 values beside a zero) is refused here, in the receiver's words.
            _dims(list(values.shape), name)
            out.append(_Tensor(Entry(name, own.wire, values.shape), values))
    return out


def _as_gradient(session: _Session, tensor: _Tensor, k: int, transfer: bytes | None) -> _Gradient:
    """A tensor, the ``k``-th of its set (from 0), as the encoder of a keep_shape,
    keep_dtype session with the caller's wire_dtype takes it: cast to the wire dtype, flat,
    with its shape and (when cast) its own dtype as metadata, sealed at position ``k`` of
    the set ``transfer`` when the set is sealed."""
    own = tensor.entry.dtype
    wire = session.wire_dtype or own
    carrier = _dtypes.carrier(wire)
    values = _dtypes.cast(tensor.values, own, carrier)
    shape = shape_text(tensor.values.shape)
    seal = None if transfer is None else Seal(transfer, k)
    return _Gradient(values.reshape(-1), wire, shape, None if carrier == own else own, seal)


def manifest_frame(
    layout: str, compression: str | None, text: str, transfer: bytes | None = None
) -> bytes:
    """The manifest's frame: chunk 0 of 1, an empty float32 gradient whose schema
    metadata is ``gradstream_tensors`` = ``text`` (and, for a sealed set, its seal at the
    manifest's position)."""
    empty = np.empty(0, dtype=np.float32)
    seal = None if transfer is None else Seal(transfer, MANIFEST).text(0, 1)
    payload = encode_payload(empty, layout, compression, manifest=text, seal=seal)
    return HEADER.pack(0, 1, len(payload), zlib.crc32(payload)) + payload


def _manifest_for(session: _Session, tensors: list[_Tensor], transfer: bytes | None) -> bytes:
    """The set's manifest frame, or TensorSetError when a receiver with this session's
    max_payload_len would refuse it for its size."""
    cap = _cap(session)
    text = manifest_json([t.entry for t in tensors])
    json_bytes = len(text.encode("utf-8"))
    # The JSON goes into the payload (twice, schema and footer): past the cap on its own,
    # it is refused without building the payload.
    size = f"{json_bytes} bytes of JSON"
    frame = b""
    if json_bytes <= cap:
        frame = manifest_frame(session.layout, session.compression, text, transfer)
        size = f"{len(frame) - HEADER_LEN} bytes"
    if not frame or len(frame) - HEADER_LEN > cap:
        raise TensorSetError(
            f"the tensor set's manifest takes {size}, above the {cap}-byte limit of a "
            f"manifest frame (max_payload_len, at most {MANIFEST_CAP}): send fewer "
            "tensors per set or shorter names"
        )
    return frame


def encode_tensors(
    session: _Session,
    tensors: Any,
    as_buffer: bool = False,
    transfer: bytes | None = None,
) -> bytes | pa.Buffer:
    """The set's frames: the manifest's, then each tensor's, joined; sealed with
    ``transfer`` when given, else as the session seals."""
    as_buffer = check_bool(as_buffer, "as_buffer")
    sealed = session._transfer(transfer)
    taken = _take(tensors, "encoding")
    parts = [_manifest_for(session, taken, sealed)]
    for k, tensor in enumerate(taken, 1):
        with _about("encoding", tensor.entry.name, k, len(taken)):
            grad = _as_gradient(session, tensor, k - 1, sealed)
            parts.append(session._joined_frames(grad))
    data = b"".join(parts)
    del parts
    return pa.py_buffer(data) if as_buffer else data


async def stream_tensors(
    session: _Session,
    tensors: Any,
    stream: Any,
    progress: TransferProgress | None = None,
    deadline: float | None = None,
    transfer: bytes | None = None,
) -> int:
    """Send the set: the stream, the names and every tensor checked before a byte goes;
    the number of frames written, the manifest's included. ``progress`` counts the
    tensors' frames only. Sealed with ``transfer`` when given, else as the session seals."""
    channel = _sending_channel(stream, session._clock(deadline), "stream_tensors")
    progress = _check_progress(progress)
    sealed = session._transfer(transfer)
    taken = _take(tensors, "sending")
    frame = _manifest_for(session, taken, sealed)
    channel.clock.start()  # the set's deadline runs from now, over all its tensors
    with channel:  # the socket stays non-blocking from the manifest to the last tensor
        try:
            await _send_all(channel, memoryview(frame), None)
        except Stalled as stalled:
            raise stalled.error(0, 1) from None
        sent = 1
        for k, tensor in enumerate(taken, 1):
            with _about("sending", tensor.entry.name, k, len(taken)):
                grad = _as_gradient(session, tensor, k - 1, sealed)
                sent += await session._send(channel, grad, progress)
    return sent


# ---------------------------------------------------------------------------- receiving


def _first_header(header: memoryview) -> None:
    """Receiver rule 1, before the usual rules see the header: one chunk."""
    total = HEADER.unpack(header)[1]
    if total != 1:
        raise TensorSetError(
            f"not a tensor set: the first gradient has {total} chunks; a set starts with "
            "a one-chunk manifest"
        )


def _cap(session: _Session) -> int:
    """The max_payload_len a manifest frame is written and read under."""
    return min(session.max_payload_len, MANIFEST_CAP)


def _manifest_receiver(session: _Session, copy: bool, expect: Expect) -> _FrameReceiver:
    """A receiver for the manifest frame: the usual rules, max_payload_len capped at
    16 MiB, and no values allowed (max_gradient_len 0); its seal held to ``expect`` at
    the manifest's position."""
    seal = _SealTracker(expect, MANIFEST)
    return _FrameReceiver(_cap(session), 0, copy_values=copy, seal=seal)


def _tensor_seal(expect: Expect, manifest: _FrameReceiver, k: int) -> _SealTracker:
    """What tensor ``k`` (from 0) is held to, at position ``k``: the manifest's transfer id
    exactly when it was sealed, else no seal when the receiver took it unsealed."""
    transfer = manifest.transfer
    if transfer is not None:
        return _SealTracker(transfer, k)
    return _SealTracker(ABSENT if expect == WHEN_PRESENT else expect, k)


def _tensor_limit(entry: Entry) -> int:
    """Rule 3: a tensor is received with max_gradient_len its entry's element count
    (at least 1, as the native side does)."""
    return max(entry.size, 1)


def _tensor_receiver(
    session: _Session, entry: Entry, copy: bool, seal: _SealTracker
) -> _FrameReceiver:
    """A receiver for one tensor: the session's max_payload_len, the entry's limit, the
    tensor's seal rule."""
    limit = _tensor_limit(entry)
    return _FrameReceiver(session.max_payload_len, limit, copy_values=copy, seal=seal)


def _entries(
    session: _Session, receiver: _FrameReceiver, max_values: int | None = None
) -> list[Entry]:
    """Rules 1 (the end of the frame's decode) and 2: the manifest's entries, checked,
    their element counts summed within max_gradient_len (and ``max_values``, a
    receive's own bound, when given)."""
    receiver.result()  # decode_frames' rule 9 on the manifest's one frame
    text = receiver.manifest
    if text is None:
        raise TensorSetError(
            "not a tensor set: the first gradient has no gradstream_tensors manifest"
        )
    entries = read_manifest(text)
    held = sum(entry.size for entry in entries)
    limit = session.max_gradient_len
    if held > limit:
        raise TensorSetError(f"tensor set holds {held} values, above max_gradient_len {limit}")
    if max_values is not None and held > max_values:
        raise TensorSetError(
            f"tensor set holds {held} values, above this receive's max_values {max_values}"
        )
    return entries


def _as_declared(entry: Entry, values: np.ndarray) -> np.ndarray:
    """Rule 3's end: the tensor came back in its entry's dtype (as this process hands it
    back) and shape."""
    dtype = _dtypes.dtype_name(values.dtype)
    if dtype == _dtypes.hand_back(entry.dtype) and values.shape == entry.shape:
        return values
    raise TensorSetError(
        f"tensor {quoted(entry.name)} arrived as {dtype} {shape_text(values.shape)}; the "
        f"manifest says {entry.dtype} {shape_text(entry.shape)}",
        name=entry.name,
    )


def _cut_short(received: int, n: int) -> TensorSetError:
    return TensorSetError(f"the tensor set ends after {received} of its {n} tensors")


def _memory_manifest(
    session: _Session, view: memoryview, expect: Expect
) -> tuple[list[Entry], int, _FrameReceiver]:
    """The manifest at the start of non-empty ``view``: its entries, where it ends, and
    the receiver that read it."""
    if len(view) >= HEADER_LEN:
        _first_header(view[:HEADER_LEN])
    receiver = _manifest_receiver(session, False, expect)
    end = _walk_frames(receiver, view)
    assert end is not None  # view is not empty
    return _entries(session, receiver), end, receiver


def decode_tensors(
    session: _Session, data: Any, transfer: bytes | None = None
) -> dict[str, np.ndarray]:
    """The set held by ``data``; ``{}`` for no bytes. Each tensor is decoded by
    decode_frames' rules from where the one before ended, the last one up to the end of
    the data (so bytes after it are its "left over" FrameError). Seals are held to
    ``transfer`` exactly when given, else to what the session expects."""
    view = byte_view(data)
    if not len(view):
        return {}
    expect = session._expect(transfer)
    entries, pos, manifest = _memory_manifest(session, view, expect)
    if not entries and pos < len(view):
        # An empty set's manifest is its last frame: decoded again as a whole, it meets
        # decode_frames' rule 9 (bytes left over), the manifest having passed the rest.
        _decode_frame_stream(view, _cap(session), 0, None, _SealTracker(expect, MANIFEST))
    result: dict[str, np.ndarray] = {}
    n = len(entries)
    for k, entry in enumerate(entries, 1):
        with _about("receiving", entry.name, k, n):
            rest = view[pos:]
            if not len(rest):
                raise _cut_short(k - 1, n)
            seal = _tensor_seal(expect, manifest, k - 1)
            if k == n:
                limit = _tensor_limit(entry)
                values = _decode_frame_stream(rest, session.max_payload_len, limit, None, seal)
            else:
                receiver = _tensor_receiver(session, entry, False, seal)
                used = _walk_frames(receiver, rest)
                assert used is not None  # rest is not empty
                pos += used
                values = receiver.result()
            result[entry.name] = _as_declared(entry, values)
    return result


async def _fill(channel: _Channel, size: int, total: int | None) -> bytes:
    """``size`` bytes from ``channel``, or fewer when the stream ended first."""
    unit = memoryview(bytearray(size))
    try:
        got = await _recv_all(channel, unit, None)
    except Stalled as stalled:
        raise stalled.error(0, total) from None
    return bytes(unit[:got])


async def _stream_manifest(
    session: _Session,
    channel: _Channel,
    receiver: _FrameReceiver,
    max_values: int | None,
) -> list[Entry] | None:
    """Rules 1, 2 and 4 over a stream, read by ``receiver`` (``_manifest_receiver``): the
    manifest's entries, or None when the stream ended before its first byte. Reads exactly
    the manifest frame."""
    header = await _fill(channel, HEADER_LEN, None)
    if len(header) < HEADER_LEN:
        receiver.end_of_stream(len(header))  # raises, but before any byte
        return None
    _first_header(memoryview(header))
    receiver.feed(memoryview(header))  # the capped max_payload_len, before any allocation
    payload = await _fill(channel, receiver.want, 1)
    if len(payload) < receiver.want:
        receiver.end_of_stream(len(payload))  # raises
    receiver.feed(memoryview(payload))
    return _entries(session, receiver, max_values)


async def receive_tensors(
    session: _Session,
    stream: Any,
    progress: TransferProgress | None = None,
    deadline: float | None = None,
    transfer: bytes | None = None,
    max_values: int | None = None,
) -> dict[str, np.ndarray]:
    """Receive one set; ``{}`` when the peer closed before its first byte. Nothing past
    the set's last frame is read. ``progress`` counts the tensors' frames only. Seals are
    held to ``transfer`` exactly when given, else to what the session expects; a set of
    more than ``max_values`` values is refused from its manifest."""
    expect = session._expect(transfer)
    channel = _receiving_channel(stream, session._clock(deadline), "receive_tensors")
    progress = _check_progress(progress)
    result: dict[str, np.ndarray] = {}
    with channel:
        manifest = _manifest_receiver(session, True, expect)
        entries = await _stream_manifest(session, channel, manifest, max_values)
        n = len(entries or ())
        for k, entry in enumerate(entries or (), 1):
            with _about("receiving", entry.name, k, n):
                seal = _tensor_seal(expect, manifest, k - 1)
                receiver = _tensor_receiver(session, entry, True, seal)
                values = await _receive_frames(channel, progress, receiver)
                if values is None:
                    raise _cut_short(k - 1, n)
                result[entry.name] = _as_declared(entry, values)
    return result
