"""What the tensor-set tests (tensors/test_tensor_*.py) share: mixed sets of tensors
and what they must come back as, manifests and tensor frames built by hand, transfers over
a connection, and the fake model of the done-when test (benches/tensor_set.py sends it
too).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import math
import socket
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

import gradstream._dtypes as dt
from gradstream.errors import GradientStreamError
from support.aio import T, close_all
from support.aio import run as run_under_deadline
from support.frames import HEADER, HEADER_LEN

try:
    import ml_dtypes

    BF16: Any = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is in requirements-dev.txt
    BF16 = None


WIRE_DTYPES = [None, "float16", "bfloat16", "float32", "float64"]


DEADLINE = 30.0


MiB = 1 << 20


# Not support.impls.session: the chunks of a tensor set here carry the session id "set".
def session(impl: ModuleType, chunk_size: int = 4, **kwargs: Any) -> Any:
    return impl.GradientStreamSession("set", chunk_size, **kwargs)


def numpy_dtype(name: str) -> np.dtype:
    return BF16 if name == "bfloat16" else np.dtype(name)


def raw(shape: tuple[int, ...], name: str, seed: int) -> np.ndarray:
    """An array of dtype ``name`` holding random bit patterns (NaN payloads, subnormals,
    infinities, -0.0 included)."""
    itemsize = numpy_dtype(name).itemsize
    words = np.random.default_rng(seed).integers(
        0, 1 << (8 * itemsize), math.prod(shape), dtype=f"u{itemsize}", endpoint=False
    )
    return words.view(numpy_dtype(name)).reshape(shape)


def bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(f"u{a.dtype.itemsize}").reshape(-1)


def mixed_set(seed: int = 0) -> dict[str, np.ndarray]:
    """Mixed dtypes and shapes (0-d, empty, multi-dimensional), names out of sorted order."""
    t = {
        "layer2.weight": raw((3, 4), "float16", seed),
        "scale": raw((), "float32", seed + 1),
        "empty": raw((0, 3), "float64", seed + 2),
        "block": raw((2, 3, 2), "float64", seed + 3),
        "β/ünïcode name": raw((7,), "float32", seed + 4),
        "a.bias": raw((9,), "float32", seed + 5),
    }
    if BF16 is not None:
        t["layer1.bias"] = raw((5,), "bfloat16", seed + 6)
    return t


def expected(tensors: Any, wire_dtype: str | None = None) -> dict[str, tuple[str, tuple, Any]]:
    """name -> (dtype handed back, shape, bits) after a trip with ``wire_dtype``: each
    tensor cast to the wire dtype and back by the cast rule."""
    items = tensors.items() if isinstance(tensors, dict) else tensors
    out = {}
    for name, t in items:
        own = dt.prepare(t, keep_dtype=True, wire_dtype=None)
        wire = dt.prepare(t, keep_dtype=True, wire_dtype=wire_dtype)
        back = dt.cast(wire.values, wire.wire, own.wire)
        if own.wire == "bfloat16" and dt.hand_back("bfloat16") == "float32":
            back = dt.cast(back, "bfloat16", "float32")
        out[name] = (dt.hand_back(own.wire), tuple(own.values.shape), bits(back))
    return out


def assert_set(got: Any, want: dict[str, tuple[str, tuple, Any]]) -> None:
    assert isinstance(got, dict)
    assert list(got) == list(want)
    for name, (dtype, shape, want_bits) in want.items():
        g = got[name]
        assert isinstance(g, np.ndarray), name
        assert dt.dtype_name(g.dtype) == dtype, (name, g.dtype, dtype)
        assert g.shape == shape, (name, g.shape, shape)
        assert np.array_equal(bits(g), want_bits), name


def frames_of(data: bytes) -> list[tuple[int, tuple[int, int, int, int]]]:
    """(offset, header) of each frame of well-formed frames."""
    out, pos = [], 0
    while pos < len(data):
        header = HEADER.unpack_from(data, pos)
        out.append((pos, header))
        pos += HEADER_LEN + header[2]
    return out


def outcome(call: Callable[[], T]) -> Any:
    try:
        return call()
    except GradientStreamError as exc:
        return exc


def described(result: Any) -> Any:
    """Something to compare outcomes by: an error's class, text, fields and notes; a set's
    names, dtypes, shapes and bits."""
    if isinstance(result, BaseException):
        fields = {k: v for k, v in vars(result).items() if k != "__notes__"}
        return (type(result).__name__, str(result), fields, getattr(result, "__notes__", []))
    return [(k, str(v.dtype), v.shape, bits(v).tobytes()) for k, v in result.items()]


# support.aio.run, under the tensor-set tests' own deadline (DEADLINE: 30 s, not 20).
run = functools.partial(run_under_deadline, deadline=DEADLINE)


async def receive_bytes(s: Any, data: bytes, path: str, close: bool = True) -> Any:
    """receive_tensors over a socketpair whose peer wrote ``data`` (and closed when
    ``close``); the result or the GradientStreamError raised."""
    a, b = socket.socketpair()
    writer = None
    try:
        a.setblocking(False)
        loop = asyncio.get_running_loop()
        sending = asyncio.ensure_future(loop.sock_sendall(a, data))
        rx: Any = b
        if path == "streams":
            rx, writer = await asyncio.open_connection(sock=b)
        try:
            if close:
                await sending
                a.shutdown(socket.SHUT_WR)
            return await s.receive_tensors(rx)
        except GradientStreamError as exc:
            return exc
        finally:
            sending.cancel()
            with contextlib.suppress(BaseException):
                await sending
    finally:
        await close_all([writer] if writer is not None else [], [a, b])


def assert_error(got: Any, cls: type, text: str, name: Any = "skip", notes: Any = "skip") -> None:
    assert type(got) is cls, f"expected {cls.__name__}({text!r}), got {got!r}"
    assert str(got) == text, str(got)
    if name != "skip":
        assert got.name == name
    if notes != "skip":
        assert getattr(got, "__notes__", []) == notes


def note_of(name: str, k: int, n: int) -> str:
    """The note of an error while receiving a tensor; the name quoted as JSON (short
    names only: no clipping)."""
    return f"while receiving tensor {json.dumps(name)} ({k} of {n}) of a tensor set"


# The model of the done-when test (test_tensor_set_streams.py); benches/tensor_set.py
# sends it too.
def fake_model(target_bytes: int, seed: int) -> dict[str, Any]:
    """About ``target_bytes`` of mixed-dtype tensors: a few big matrices, many small
    vectors, made cheaply from one block of normal float32 values."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(1 << 22, dtype=np.float32)
    scale = target_bytes / (1 << 30)

    def make(shape: tuple[int, ...], dtype: str, k: int) -> np.ndarray:
        n = math.prod(shape)
        start = (k * 7919) % len(base)
        f32 = np.resize(base[start:], n).reshape(shape)
        if dtype == "bfloat16":
            return (f32.view(np.uint32) >> 16).astype(np.uint16).view(BF16)
        return f32.astype(dtype, copy=False)

    big = [
        ("embed.weight", (16384, 4096), "float32"),
        ("block0.attn.weight", (8192, 8192), "bfloat16"),
        ("block0.mlp.weight", (8192, 8192), "float16"),
        ("head.weight", (4096, 8192), "float64"),
        ("block1.mlp.weight", (8192, 4096), "float32"),
        ("block1.attn.weight", (4096, 8192), "bfloat16"),
        ("block2.proj.weight", (4096, 4096), "float16"),
    ]
    model: dict[str, Any] = {}
    for k, (name, (rows, cols), dtype) in enumerate(big):
        model[name] = make((max(1, int(rows * scale)), cols), dtype, k)
    sizes = [1, 7, 768, 3072, 4096, 65537, 0]
    dtypes = ["float32", "float16", "bfloat16", "float64"]
    for k in range(100 - len(big) - 1):
        n = sizes[k % len(sizes)]
        model[f"layers.{k}.bias"] = make((n,), dtypes[k % 4], len(big) + k)
    model["step_scale"] = make((), "float64", 999)
    return model


# The two manifest codecs: (name, write, read). The native session's set layer and the
# reference's own are separate code; every manifest test runs against both.
def manifest_codecs() -> list[Any]:
    import pytest

    from gradstream.reference import _manifest

    return [
        pytest.param((native_manifest_json, native_read_manifest), id="native"),
        pytest.param((_manifest.manifest_json, _manifest.read_manifest), id="reference"),
    ]


def native_manifest_json(entries: list[Any]) -> str:
    """The native core's manifest writer, on reference ``Entry`` values."""
    from gradstream import _native

    return _native.manifest_json([(e.name, e.dtype, tuple(e.shape)) for e in entries])


def native_read_manifest(text: str) -> list[Any]:
    """The native core's manifest reader, its entries as reference ``Entry`` values."""
    from gradstream import _native
    from gradstream.reference._manifest import Entry

    return [Entry(name, dtype, tuple(shape)) for name, dtype, shape in _native.read_manifest(text)]
