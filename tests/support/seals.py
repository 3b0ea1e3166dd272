"""What the sealed-chunk tests (seal/test_seal_*.py) share: the modes a sealed payload is
written in, the attacks the seal is for, made on frames by hand (each header keeping its
own payload's CRC, as an attacker who recomputes nothing would), and the seal read back
from a payload with pyarrow.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc

from gradstream.errors import GradientStreamError
from support.frames import HEADER, HEADER_LEN, join_frames, split_frames

SEAL_KEY = b"gradstream_seal"

# (layout, compression): both layouts, plain and compressed with either codec.
MODES = [("seed", None), ("compact", None), ("seed", "lz4"), ("compact", "zstd")]
MODE_IDS = [f"{layout}-{codec or 'plain'}" for layout, codec in MODES]


def sealed_session(impl: ModuleType, chunk_size: int = 4, **kwargs: Any) -> Any:
    return impl.GradientStreamSession("seal", chunk_size, **kwargs)


def mode(layout: str, compression: str | None) -> dict[str, Any]:
    return {"layout": layout, "compression": compression}


def gradient(n: int, seed: int = 0) -> np.ndarray:
    """n float32 values drawn as raw bit patterns."""
    bits = np.random.default_rng(seed).integers(0, 2**32, n, dtype=np.uint32)
    return bits.view(np.float32)


def bit_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool(np.array_equal(a.view(np.uint32), b.view(np.uint32)))


def seal_of(payload: bytes) -> str | None:
    """The gradstream_seal a payload's (footer) schema carries, as pyarrow reads it."""
    metadata = pa.ipc.open_file(pa.py_buffer(payload)).schema.metadata or {}
    raw = metadata.get(SEAL_KEY)
    return None if raw is None else raw.decode()


def transfer_of(wire: bytes, k: int = 0) -> str:
    """The transfer id (hex) frame ``k`` of a frame stream is sealed with."""
    seal = seal_of(split_frames(wire)[k][2])
    assert seal is not None
    return seal[:32]


def swap_indices(wire: bytes, a: int = 0, b: int = 1) -> bytes:
    """Frames ``a`` and ``b`` trade chunk indices; each header keeps its payload's CRC."""
    parts = split_frames(wire)
    (ia, ta, pa_), (ib, tb, pb) = parts[a], parts[b]
    parts[a], parts[b] = (ib, ta, pa_), (ia, tb, pb)
    return join_frames(parts)


def splice(ours: bytes, theirs: bytes, k: int) -> bytes:
    """``ours`` with frame ``k`` taken from ``theirs`` (a transfer of the same size)."""
    parts, other = split_frames(ours), split_frames(theirs)
    parts[k] = other[k]
    return join_frames(parts)


def frames(wire: bytes) -> list[bytes]:
    """The frames of a stream (a tensor set's too), each header and payload."""
    out, pos = [], 0
    while pos < len(wire):
        length = HEADER.unpack_from(wire, pos)[2]
        out.append(wire[pos : pos + HEADER_LEN + length])
        pos += HEADER_LEN + length
    return out


def swap_tensors(wire: bytes, per_tensor: int) -> bytes:
    """A set of a manifest and two tensors of ``per_tensor`` frames each, the two tensors'
    frames traded places."""
    parts = frames(wire)
    assert len(parts) == 1 + 2 * per_tensor
    first, second = parts[1 : 1 + per_tensor], parts[1 + per_tensor :]
    return b"".join([parts[0], *second, *first])


def outcome(call: Callable[[], Any]) -> Any:
    """What ``call`` returned, or the GradientStreamError it raised."""
    try:
        return call()
    except GradientStreamError as exc:
        return exc


def error_fields(got: Any) -> tuple[Any, ...]:
    """An error as the two implementations must agree on it: class, text, notes, fields."""
    assert isinstance(got, GradientStreamError), got
    fields = tuple(getattr(got, f, None) for f in ("chunk_index", "offset", "name"))
    return (type(got), str(got), tuple(getattr(got, "__notes__", ())), fields)


def lone_seal_text(transfer: bytes, index: int, total: int, position: int = 0xFFFFFFFF) -> str:
    """A seal's text, written here from the docs/spec/wire-format.md grammar."""
    return f"{transfer.hex()}:{index:08x}:{total:08x}:{position:08x}"


def note_of(name: str, k: int, n: int) -> str:
    return f"while receiving tensor {json.dumps(name)} ({k} of {n}) of a tensor set"
