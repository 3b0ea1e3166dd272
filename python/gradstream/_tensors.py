"""Named tensor sets (README "Tensor sets"), shared by the native session and the reference.

A set travels as a sequence of ordinary gradients on one connection: first a *manifest*,
a gradient of zero values in one frame whose schema metadata ``gradstream_tensors`` is a
JSON text naming each tensor with its dtype and shape, then one gradient per manifest
entry, in order, each exactly what ``stream_to`` sends for that tensor in a session with
``keep_shape=True, keep_dtype=True``.

Everything here goes through a session's public API plus two private methods that both
implementations provide: ``_encode_manifest(text) -> bytes`` (the manifest's frame) and
``_decode_manifest(data) -> (text | None, n_values)`` (``decode_frames``' rules, returning
the metadata). Each tensor is encoded and decoded by a *sub-session* of the caller's class
whose ``max_gradient_len`` is that tensor's manifest element count, so a peer cannot make
a receiver hold more than its manifest declared, and a manifest declaring more than the
caller's ``max_gradient_len`` in all is refused before any tensor is read.

The only bytes this module moves itself are the manifest frame's: on a ``socket.socket``
with ``MSG_DONTWAIT`` reads and writes woken by the event loop's readiness callbacks, so
the socket's blocking mode is left alone (the implementations' own transfers, which may run
at the same time in the other direction, switch it and put it back); where MSG_DONTWAIT
does not exist, the socket is made non-blocking for the manifest and its mode put back.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import math
import re
import socket
import ssl
import struct
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple, NoReturn

import numpy as np
import pyarrow as pa

from . import _dtypes
from ._convert import byte_view as _byte_view
from ._convert import check_bool as _check_bool
from ._convert import shape_text as _shape_text
from ._io import Stalled, within
from .errors import FrameError, StreamIOError, StreamTimeoutError, TensorSetError

__all__ = [
    "FORMAT",
    "MANIFEST_MAX_PAYLOAD_LEN",
    "MAX_DIMS",
    "MAX_NAME_BYTES",
    "VERSION",
    "Entry",
    "decode_tensors",
    "encode_tensors",
    "manifest_text",
    "parse_manifest",
    "receive_tensors",
    "stream_tensors",
]

FORMAT = "gradstream.tensors"
VERSION = 1
MAX_NAME_BYTES = 1024
MAX_DIMS = 32
# A manifest nests arrays and objects at most this deep (its schema needs 3).
MAX_DEPTH = 32
MAX_INT_DIGITS = 4300
# Dimensions have at most 18 digits, as in the gradient_shape each tensor's payloads carry
# (a larger one could never arrive).
DIM_LIMIT = 10**18
# A receiver reads the manifest frame with max_payload_len capped at this.
MANIFEST_MAX_PAYLOAD_LEN = 16 << 20

_HEADER = struct.Struct("<IIII")  # chunk_index, total_chunks, payload_len, crc32
_HEADER_LEN = _HEADER.size
_KEYS = ("format", "version", "tensors")
_ENTRY_KEYS = ("name", "dtype", "shape")
_DTYPE_LIST = "float16, bfloat16, float32 or float64"
_PIECE = 64 * 1024


class Entry(NamedTuple):
    """One manifest entry: the tensor's name, dtype name and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)


# --------------------------------------------------------------------------- names, notes


def _quote(value: Any, limit: int = 80) -> str:
    """How a message quotes a name or a value: compact ASCII JSON, cut to ``limit``
    characters (manifest values can be megabytes)."""
    text = json.dumps(value, ensure_ascii=True, separators=(",", ":"), allow_nan=True)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_name(name: str, seen: set[str]) -> None:
    """A tensor name: a non-empty str of at most 1024 UTF-8 bytes, not seen before."""
    if not name:
        raise TensorSetError("a tensor name is empty; names are non-empty strings", name=name)
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        raise TensorSetError(
            f"tensor name {_quote(name)} is not valid Unicode text (a lone surrogate): it "
            "has no UTF-8 form",
            name=name,
        ) from None
    if size > MAX_NAME_BYTES:
        raise TensorSetError(
            f"tensor name {_quote(name)} takes {size} UTF-8 bytes, above the limit of "
            f"{MAX_NAME_BYTES}",
            name=name,
        )
    if name in seen:
        raise TensorSetError(
            f"tensor name {_quote(name)} appears twice in the tensor set", name=name
        )
    seen.add(name)


@contextlib.contextmanager
def _noting(doing: str, name: str, k: int, n: int) -> Iterator[None]:
    """Adds ``while <doing> tensor "name" (k of n) of a tensor set`` to any error."""
    try:
        yield
    except Exception as exc:
        exc.add_note(f"while {doing} tensor {_quote(name)} ({k} of {n}) of a tensor set")
        raise


# --------------------------------------------------------------------------- the manifest


def manifest_text(entries: list[Entry]) -> str:
    """The manifest's JSON text (compact, keys in this order, UTF-8 names as they are)."""
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "tensors": [{"name": e.name, "dtype": e.dtype, "shape": list(e.shape)} for e in entries],
    }
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False)


class _RepeatedKey(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise _RepeatedKey(key)
        obj[key] = value
    return obj


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a JSON value")


def _int_literal(text: str) -> int:
    # 4300 digits at most (Python 3.11's default limit), whatever this interpreter allows.
    if len(text) - text.startswith("-") > MAX_INT_DIGITS:
        raise ValueError("integer literal too long")
    return int(text)


# A JSON string with its escapes; one left open (a lone backslash last, even) runs to the
# end of the text.
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def _too_deep(text: str) -> bool:
    """The depth scan: with the strings taken out, whether the brackets left ever nest
    deeper than MAX_DEPTH."""
    depth = 0
    for bracket in _NOT_BRACKET.sub("", _STRING.sub("", text)):
        depth += 1 if bracket in "[{" else -1
        if depth > MAX_DEPTH:
            return True
    return False


def _load_json(text: str) -> Any:
    """The manifest's JSON document: nesting scanned first, RFC 8259 only, a repeated key
    refused as its object closes, no lone surrogate in any string."""
    if _too_deep(text):
        raise TensorSetError(
            f"tensor set manifest nests arrays or objects deeper than {MAX_DEPTH} levels"
        )
    not_json = TensorSetError("tensor set manifest is not valid JSON")
    try:
        doc = json.loads(
            text,
            object_pairs_hook=_unique_keys,
            parse_constant=_no_constant,
            parse_int=_int_literal,
        )
    except _RepeatedKey as exc:
        raise TensorSetError(
            f"tensor set manifest repeats the key {_quote(exc.key)} in one JSON object"
        ) from None
    except ValueError:
        raise not_json from None
    try:
        # Every string, keys included, written out raw: a lone surrogate has no UTF-8.
        json.dumps(doc, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise not_json from None
    return doc


def _kind(value: Any) -> str:
    """The JSON name of a parsed value's type."""
    if isinstance(value, bool):
        return "boolean"
    for cls, name in ((dict, "object"), (list, "array"), (str, "string"), (int, "integer")):
        if isinstance(value, cls):
            return name
    return "number" if isinstance(value, float) else "null"


def _check_keys(obj: dict[str, Any], keys: tuple[str, ...], where: str) -> None:
    for key in keys:
        if key not in obj:
            raise TensorSetError(f"{where} has no {_quote(key)} key")
    for key in obj:
        if key not in keys:
            raise TensorSetError(
                f"{where} has an unexpected key {_quote(key)} (its keys are "
                + ", ".join(keys)
                + ")"
            )


def _parse_shape(value: Any, name: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise TensorSetError(
            f"tensor {_quote(name)}: its shape is a JSON {_kind(value)}, not an array of integers",
            name=name,
        )
    if len(value) > MAX_DIMS:
        raise TensorSetError(
            f"tensor {_quote(name)}: its shape has {len(value)} dimensions, more than {MAX_DIMS}",
            name=name,
        )
    for dim in value:
        # type(...) is int: JSON true/false parse to bool, which is an int subclass.
        if type(dim) is not int or not 0 <= dim < DIM_LIMIT:
            raise TensorSetError(
                f"tensor {_quote(name)}: shape dimension {_quote(dim)} is not an integer of "
                "at most 18 digits",
                name=name,
            )
    if not _dtypes.numpy_can_make(tuple(value)):
        raise TensorSetError(
            f"tensor {_quote(name)}: its shape {_quote(value)} is beyond what numpy can make (its "
            "non-zero dimensions multiply past 2**60)",
            name=name,
        )
    return tuple(value)


def parse_manifest(text: str) -> list[Entry]:
    """The entries of a manifest's JSON text, checked strictly; TensorSetError naming the
    first problem (and, where one is concerned, the tensor: ``.name``)."""
    doc = _load_json(text)
    if not isinstance(doc, dict):
        raise TensorSetError(f"tensor set manifest is a JSON {_kind(doc)}, not an object")
    _check_keys(doc, _KEYS, "tensor set manifest")
    if not isinstance(doc["format"], str) or doc["format"] != FORMAT:
        raise TensorSetError(
            f"tensor set manifest format is {_quote(doc['format'])}, not {_quote(FORMAT)}"
        )
    version = doc["version"]
    if type(version) is not int or version != VERSION:
        raise TensorSetError(
            f"tensor set manifest version {_quote(version)} is not supported (this "
            f"gradstream reads version {VERSION})"
        )
    tensors = doc["tensors"]
    if not isinstance(tensors, list):
        raise TensorSetError(
            f"tensor set manifest {_quote('tensors')} is a JSON {_kind(tensors)}, not an array"
        )
    entries: list[Entry] = []
    seen: set[str] = set()
    for k, item in enumerate(tensors, 1):
        where = f"tensor set manifest entry {k} of {len(tensors)}"
        if not isinstance(item, dict):
            raise TensorSetError(f"{where} is a JSON {_kind(item)}, not an object")
        name = item.get("name")
        if not isinstance(name, str):
            _check_keys(item, _ENTRY_KEYS, where)
            raise TensorSetError(f"{where}: its name is a JSON {_kind(name)}, not a string")
        try:
            _check_keys(item, _ENTRY_KEYS, where)
        except TensorSetError as exc:
            exc.name = name
            raise
        _check_name(name, seen)
        dtype = item["dtype"]
        if not isinstance(dtype, str) or dtype not in _dtypes.DTYPES:
            raise TensorSetError(
                f"tensor {_quote(name)}: dtype {_quote(dtype)} is not {_DTYPE_LIST}", name=name
            )
        entries.append(Entry(name, dtype, _parse_shape(item["shape"], name)))
    return entries


def _manifest_session(session: Any, max_payload_len: int | None = None) -> Any:
    """The session the manifest frame is read with (max_payload_len capped at 16 MiB), or,
    with ``max_payload_len``, written with."""
    if max_payload_len is None:
        max_payload_len = min(session.max_payload_len, MANIFEST_MAX_PAYLOAD_LEN)
    return type(session)(
        session.session_id,
        session.chunk_size,
        max_payload_len=max_payload_len,
        max_gradient_len=1,
        timeout=session.timeout,
        layout=session.layout,
        compression=session.compression,
    )


def _tensor_session(session: Any, n_values: int) -> Any:
    """The session a tensor of ``n_values`` values travels with: the caller's settings,
    keep_shape and keep_dtype on, max_gradient_len the tensor's size."""
    return type(session)(
        session.session_id,
        session.chunk_size,
        max_payload_len=session.max_payload_len,
        max_gradient_len=max(n_values, 1),
        timeout=session.timeout,
        layout=session.layout,
        compression=session.compression,
        keep_shape=True,
        keep_dtype=True,
        wire_dtype=session.wire_dtype,
    )


def _not_a_set_chunks(total: int) -> TensorSetError:
    return TensorSetError(
        f"not a tensor set: the first gradient has {total} chunks; a set starts with a "
        "one-chunk manifest"
    )


def _read_manifest(session: Any, manifest: Any, frame: Any) -> list[Entry]:
    """Receiver rules 1 (after the header check) and 2: the entries of the manifest frame
    ``frame`` (header and payload, or less when truncated)."""
    text, n_values = manifest._decode_manifest(frame)
    if n_values:
        # The manifest session cannot say max_gradient_len 0 (1 is the least it takes):
        # the error decode_frames would give under a limit of 0.
        raise FrameError(f"gradient exceeds max_gradient_len 0: {n_values} values by chunk 0", 0, 0)
    if text is None:
        raise TensorSetError(
            "not a tensor set: the first gradient has no gradstream_tensors manifest"
        )
    entries = parse_manifest(text)
    total = sum(e.size for e in entries)
    if total > session.max_gradient_len:
        raise TensorSetError(
            f"tensor set holds {total} values, above max_gradient_len {session.max_gradient_len}"
        )
    return entries


def _check_arrival(entry: Entry, values: Any) -> np.ndarray:
    got = _dtypes.dtype_name(values.dtype)
    if got != _dtypes.hand_back(entry.dtype) or values.shape != entry.shape:
        raise TensorSetError(
            f"tensor {_quote(entry.name)} arrived as {got} {_shape_text(values.shape)}; the "
            f"manifest says {entry.dtype} {_shape_text(entry.shape)}",
            name=entry.name,
        )
    result: np.ndarray = values
    return result


def _ended(k: int, n: int) -> TensorSetError:
    return TensorSetError(f"the tensor set ends after {k - 1} of its {n} tensors")


# --------------------------------------------------------------------------- the sender side


def _pairs(tensors: Any) -> list[tuple[Any, Any]]:
    """(name, tensor) pairs of a mapping or of an iterable of pairs."""
    if isinstance(tensors, Mapping):
        return list(tensors.items())
    how = "a mapping of name to tensor or an iterable of (name, tensor) pairs"
    if isinstance(tensors, (str, bytes, bytearray, memoryview)):
        raise TypeError(f"tensors must be {how}, not {type(tensors).__name__}")
    try:
        items = iter(tensors)
    except TypeError:
        raise TypeError(f"tensors must be {how}, not {type(tensors).__name__}") from None
    pairs: list[tuple[Any, Any]] = []
    for k, item in enumerate(items, 1):
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            what = f"a {len(item)}-item {type(item).__name__}"
            if not isinstance(item, (tuple, list)):
                what = f"a {type(item).__name__}"
            raise TypeError(f"tensors item {k} is {what}, not a (name, tensor) pair")
        pairs.append((item[0], item[1]))
    return pairs


class _Outgoing(NamedTuple):
    entry: Entry
    # What the tensor's sub-session is handed: the prepared values (C-contiguous, in the
    # tensor's dtype and shape; bfloat16 viewed as ml_dtypes'), or the caller's object
    # when bfloat16 values cannot be given a bfloat16 dtype (no ml_dtypes).
    values: Any


def _outgoing(tensors: Any, doing: str) -> list[_Outgoing]:
    """Names checked (all of them, before any tensor is converted), then each tensor taken
    as the sub-sessions will take it, once: its dtype and shape for the manifest."""
    pairs = _pairs(tensors)
    seen: set[str] = set()
    for name, _ in pairs:
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, not {type(name).__name__}")
        _check_name(name, seen)
    out: list[_Outgoing] = []
    n = len(pairs)
    for k, (name, tensor) in enumerate(pairs, 1):
        with _noting(doing, name, k, n):
            prepared = _dtypes.prepare(tensor, keep_dtype=True, wire_dtype=None)
            values = prepared.values
            if values.ndim > MAX_DIMS:
                raise TensorSetError(
                    f"tensor {_quote(name)} has {values.ndim} dimensions; a tensor set carries at "
                    f"most {MAX_DIMS}",
                    name=name,
                )
            send: Any = values
            if prepared.wire == "bfloat16":
                bf16 = _dtypes.bfloat16_dtype()
                send = tensor if bf16 is None else values.view(bf16)
        out.append(_Outgoing(Entry(name, prepared.wire, tuple(values.shape)), send))
    return out


def _encoded_manifest(session: Any, outgoing: list[_Outgoing]) -> bytes:
    """The manifest frame of a set, refused (TensorSetError) when a receiver with the same
    settings would refuse it for its size."""
    limit = min(session.max_payload_len, MANIFEST_MAX_PAYLOAD_LEN)
    text = manifest_text([o.entry for o in outgoing])

    def too_big(what: str) -> TensorSetError:
        return TensorSetError(
            f"the tensor set's manifest takes {what}, above the {limit}-byte limit of a "
            f"manifest frame (max_payload_len, at most {MANIFEST_MAX_PAYLOAD_LEN}): send "
            "fewer tensors per set or shorter names"
        )

    size = len(text.encode("utf-8"))
    if size > limit:  # the payload holds the text (twice: schema and footer)
        raise too_big(f"{size} bytes of JSON")
    # Written without the cap (the text is bounded above), to tell its size.
    frame = bytes(_manifest_session(session, 0xFFFF_FFFF)._encode_manifest(text))
    if len(frame) - _HEADER_LEN > limit:
        raise too_big(f"{len(frame) - _HEADER_LEN} bytes")
    return frame


def encode_tensors(session: Any, tensors: Any, as_buffer: bool = False) -> bytes | pa.Buffer:
    """The frames of a tensor set (the manifest's, then each tensor's): ``bytes``, or a
    ``pyarrow.Buffer`` over them (``as_buffer=True``). Names are checked before anything
    is encoded."""
    as_buffer = _check_bool(as_buffer, "as_buffer")
    outgoing = _outgoing(tensors, "encoding")
    parts = [_encoded_manifest(session, outgoing)]
    n = len(outgoing)
    for k, item in enumerate(outgoing, 1):
        with _noting("encoding", item.entry.name, k, n):
            sub = _tensor_session(session, item.entry.size)
            parts.append(sub.encode_frames(item.values, True))
    data = b"".join(parts)
    del parts
    return pa.py_buffer(data) if as_buffer else data


async def stream_tensors(session: Any, tensors: Any, stream: Any, *, progress: Any = None) -> int:
    """Send a tensor set over a socket or an asyncio stream: the manifest frame, then each
    tensor as ``stream_to`` sends it. Returns the number of frames written, the manifest's
    included. Names, the stream's kind and every tensor's dtype are checked before a byte
    is sent; tensors that need converting (non-contiguous, another byte order, lists) are
    converted once, up front, and held until sent.

    ``progress`` is handed to each tensor's ``stream_to``: it counts the tensors' frames
    and bytes, not the manifest frame's.
    """
    conn = _Connection(stream, True, session.timeout, "stream_tensors")
    outgoing = _outgoing(tensors, "sending")
    frame = _encoded_manifest(session, outgoing)
    await conn.send(frame)
    sent = 1
    n = len(outgoing)
    for k, item in enumerate(outgoing, 1):
        with _noting("sending", item.entry.name, k, n):
            sub = _tensor_session(session, item.entry.size)
            sent += await sub.stream_to(item.values, stream, progress=progress)
    return sent


# --------------------------------------------------------------------------- the receiver side


def _run_end(view: memoryview, start: int, frames_allowed: int) -> int:
    """Where a gradient starting at ``start`` ends: after its first header's total_chunks
    frames (payload lengths walked from the headers), or at the end of the data, whichever
    comes first. A total_chunks above ``frames_allowed`` (what decode_frames will refuse
    at the first frame) or 0 ends the run after the first frame."""
    end = len(view)
    if end - start < _HEADER_LEN:
        return end
    total = _HEADER.unpack_from(view, start)[1]
    frames = total if 1 <= total <= frames_allowed else 1
    pos = start
    for _ in range(frames):  # each step moves 16 bytes at least: bounded by the data too
        if end - pos < _HEADER_LEN:
            return end
        pos += _HEADER_LEN + _HEADER.unpack_from(view, pos)[2]
        if pos >= end:
            return end
    return pos


def decode_tensors(session: Any, data: Any) -> dict[str, np.ndarray]:
    """The tensor set held by ``data`` (any bytes-like object), as a dict in manifest
    order; ``{}`` for empty data. The manifest is checked before any tensor is decoded;
    each tensor is decoded by ``decode_frames`` rules from its own run of frames, so bytes
    after the last tensor are that decode's "bytes left over" FrameError."""
    view = _byte_view(data)
    if not len(view):
        return {}
    manifest = _manifest_session(session)
    if len(view) >= _HEADER_LEN:
        _, total, payload_len, _ = _HEADER.unpack_from(view, 0)
        if total != 1:
            raise _not_a_set_chunks(total)
        pos = min(_HEADER_LEN + payload_len, len(view))
    else:
        pos = len(view)  # decode_frames' truncated-header error
    entries = _read_manifest(session, manifest, view[:pos])
    if not entries and pos < len(view):
        # Bytes after the empty set's manifest: decode_frames' left-over error.
        manifest._decode_manifest(view)
        raise FrameError(f"{len(view) - pos} bytes left over after the last chunk", None, pos)
    result: dict[str, np.ndarray] = {}
    n = len(entries)
    for k, entry in enumerate(entries, 1):
        with _noting("receiving", entry.name, k, n):
            if pos == len(view):
                raise _ended(k, n)
            sub = _tensor_session(session, entry.size)
            end = len(view) if k == n else _run_end(view, pos, sub.max_gradient_len)
            result[entry.name] = _check_arrival(entry, sub.decode_frames(view[pos:end]))
            pos = end
    return result


async def receive_tensors(
    session: Any, stream: Any, *, progress: Any = None
) -> dict[str, np.ndarray]:
    """Receive one tensor set from a socket or an asyncio stream, as a dict in manifest
    order; ``{}`` when the peer closed before the set's first byte. Reads nothing past the
    set's last frame, so sets can follow each other on one connection.

    ``progress`` is handed to each tensor's receive: it counts the tensors' frames and
    bytes (its ``total_chunks`` grows tensor by tensor), not the manifest frame's.
    """
    conn = _Connection(stream, False, session.timeout, "receive_tensors")
    manifest = _manifest_session(session)
    frame = await conn.read_manifest_frame(manifest.max_payload_len)
    if frame is None:
        return {}
    entries = _read_manifest(session, manifest, frame)
    result: dict[str, np.ndarray] = {}
    n = len(entries)
    for k, entry in enumerate(entries, 1):
        with _noting("receiving", entry.name, k, n):
            sub = _tensor_session(session, entry.size)
            # receive_iter, not receive_from: it tells a peer that closed before this
            # tensor (the set cut short) from an empty gradient.
            gradients = sub.receive_iter(stream, progress=progress)
            try:
                values = await anext(gradients)
            except StopAsyncIteration:
                raise _ended(k, n) from None
            finally:
                await gradients.aclose()
            result[entry.name] = _check_arrival(entry, values)
    return result


# --------------------------------------------------------------------------- manifest I/O


# 0 where the platform has no MSG_DONTWAIT: then the socket is switched to non-blocking.
_DONTWAIT: int = getattr(socket, "MSG_DONTWAIT", 0)


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class _Connection:
    """The manifest frame's bytes over a socket or asyncio streams; every wait bounded by
    the session's timeout (time without a byte moving)."""

    def __init__(self, stream: Any, sending: bool, timeout: float | None, method: str) -> None:
        self.timeout = timeout
        self.sock: socket.socket | None = None
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        if isinstance(stream, socket.socket):
            if isinstance(stream, ssl.SSLSocket):
                raise TypeError(
                    "an ssl.SSLSocket cannot carry frames; use asyncio streams over TLS"
                )
            if stream.fileno() < 0:
                raise StreamIOError(errno.EBADF, "the socket is closed")
            if stream.type != socket.SOCK_STREAM:
                raise ValueError(
                    f"stream must be a connected stream socket (SOCK_STREAM), not {stream.type!r}"
                )
            self.sock = stream
            return
        half = (
            stream[1 if sending else 0]
            if isinstance(stream, tuple) and len(stream) == 2
            else stream
        )
        if sending and isinstance(half, asyncio.StreamWriter):
            self.writer = half
        elif not sending and isinstance(half, asyncio.StreamReader):
            self.reader = half
        else:
            kind = "StreamWriter" if sending else "StreamReader"
            raise TypeError(
                f"{method} takes a connected socket.socket, an asyncio.{kind} or a "
                f"(reader, writer) pair, not {type(stream).__name__}"
            )

    @contextlib.contextmanager
    def _mode(self) -> Iterator[None]:
        """Without MSG_DONTWAIT: the socket non-blocking meanwhile, its mode put back."""
        sock = self.sock
        if sock is None or _DONTWAIT or sock.gettimeout() == 0.0:
            yield
            return
        previous = sock.gettimeout()
        try:
            sock.setblocking(False)
        except OSError as exc:
            raise StreamIOError.from_os_error(exc) from exc
        try:
            yield
        finally:
            if sock.fileno() != -1:
                sock.settimeout(previous)

    async def _ready(self, writing: bool) -> None:
        assert self.sock is not None
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        fd = self.sock.fileno()
        if writing:
            loop.add_writer(fd, _wake, waiter)
        else:
            loop.add_reader(fd, _wake, waiter)
        try:
            await waiter
        finally:
            if writing:
                loop.remove_writer(fd)
            else:
                loop.remove_reader(fd)

    async def _recv_into(self, view: memoryview) -> int:
        """1..len(view) bytes into view; 0 at the end of the stream."""
        if self.reader is not None:
            data = await within(self.reader.read(len(view)), self.timeout)
            view[: len(data)] = data
            return len(data)
        sock = self.sock
        assert sock is not None
        if not _DONTWAIT:
            loop = asyncio.get_running_loop()
            return await within(loop.sock_recv_into(sock, view), self.timeout)
        while True:
            # Readiness first: a socket with a timeout of its own would otherwise wait in
            # the call (CPython polls before recv), blocking the event loop.
            await within(self._ready(False), self.timeout)
            try:
                return sock.recv_into(view, len(view), _DONTWAIT)
            except (BlockingIOError, InterruptedError):
                continue

    async def _send(self, view: memoryview) -> int:
        if self.writer is not None:
            piece = view[:_PIECE]
            self.writer.write(piece)
            await within(self.writer.drain(), self.timeout)
            return len(piece)
        sock = self.sock
        assert sock is not None
        if not _DONTWAIT:
            piece = view[:_PIECE]
            await within(asyncio.get_running_loop().sock_sendall(sock, piece), self.timeout)
            return len(piece)
        while True:
            await within(self._ready(True), self.timeout)
            try:
                return sock.send(view, _DONTWAIT)
            except (BlockingIOError, InterruptedError):
                continue

    async def send(self, data: bytes) -> None:
        view = memoryview(data)
        with self._mode():
            try:
                while view:
                    view = view[await self._send(view) :]
            except Stalled:
                raise StreamTimeoutError(self.timeout or 0.0, 0, 1) from None
            except OSError as exc:
                raise StreamIOError.from_os_error(exc) from exc

    async def _fill(self, into: bytearray | memoryview, total: int | None) -> int:
        """Read into ``into`` until it is full or the stream ends; the bytes read."""
        view = memoryview(into)
        got = 0
        try:
            while got < len(view):
                n = await self._recv_into(view[got:])
                if n == 0:
                    break
                got += n
        except Stalled:
            raise StreamTimeoutError(self.timeout or 0.0, 0, total) from None
        except OSError as exc:
            raise StreamIOError.from_os_error(exc) from exc
        return got

    async def read_manifest_frame(self, max_payload_len: int) -> bytes | None:
        """Exactly one frame, header and payload, checked as decode_frames checks the
        first frame before reading its payload; None when the stream ended before it."""
        with self._mode():
            header = bytearray(_HEADER_LEN)
            got = await self._fill(header, None)
            if got == 0:
                return None
            if got < _HEADER_LEN:
                raise FrameError(f"truncated frame header: {got} of {_HEADER_LEN} bytes", None, 0)
            index, total, payload_len, _ = _HEADER.unpack(header)
            if total != 1:
                raise _not_a_set_chunks(total)
            if payload_len > max_payload_len:
                raise FrameError(
                    f"chunk {index} declares a {payload_len}-byte payload, above "
                    f"max_payload_len {max_payload_len}",
                    index,
                    0,
                )
            # Grown as bytes arrive, so a lying header costs no more memory than was sent.
            frame = header
            while len(frame) < _HEADER_LEN + payload_len:
                piece = bytearray(min(_HEADER_LEN + payload_len - len(frame), 1 << 20))
                got = await self._fill(piece, 1)
                frame += memoryview(piece)[:got]
                if got < len(piece):
                    raise FrameError(
                        f"truncated frame: chunk {index} declares a {payload_len}-byte "
                        f"payload but only {len(frame) - _HEADER_LEN} bytes follow",
                        index,
                        0,
                    )
            return bytes(frame)
