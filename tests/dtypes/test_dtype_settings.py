"""Dtypes with the other features and settings, against both implementations: out=,
shapes and codecs, the keep_dtype / wire_dtype settings, tensor-set manifests, and torch
tensors as input.
"""

from __future__ import annotations

import inspect
import math
import pickle
import socket
from types import ModuleType
from typing import Any

import ml_dtypes
import numpy as np
import pyarrow as pa
import pytest

import gradstream._dtypes as _dtypes
import gradstream.reference as ref
from gradstream.errors import (
    FrameError,
    GradientDtypeError,
    GradientSizeError,
    GradientStreamError,
    SettingError,
)
from support.aio import run
from support.dtypes import (
    DTYPES,
    assert_values,
    bits,
    expected,
    from_bits,
    numpy_dtype,
    sample,
    schema_of,
)
from support.frames import join_frames, split_frames
from support.impls import CODECS, IMPL_NAMES, LAYOUTS, PAIR_IDS, PAIRS, session
from support.impls import load_impl as module

# --------------------------------------------------------------------------- out=


@pytest.mark.parametrize("name", DTYPES)
def test_out_of_each_dtype(impl: ModuleType, name: str):
    s = session(impl, 4, keep_dtype=True)
    words = sample(name, 12, seed=2)
    parts = split_frames(s.encode_frames(from_bits(words, name)))
    out = np.zeros((3, 4), dtype=numpy_dtype(name))
    got = s.decode_frames(join_frames(parts[::-1]), out=out)
    assert got is out and out.shape == (3, 4)
    assert np.array_equal(bits(out), words)


@pytest.mark.parametrize(
    ("sent", "out_dtype", "settings_"),
    [
        ("float32", "float16", {}),
        ("float16", "float32", {"keep_dtype": True}),
        ("float64", "float32", {"keep_dtype": True}),
        ("bfloat16", "float16", {"keep_dtype": True}),
        ("float32", "float64", {"wire_dtype": "float64"}),  # handed back float32
        ("float64", "float16", {"wire_dtype": "float16", "keep_dtype": True}),  # float64
    ],
)
def test_out_of_another_dtype_is_a_gradient_dtype_error(impl, sent, out_dtype, settings_):
    """At the first chunk to arrive, before any of its values is written; its fields and
    text; a TypeError too, and it pickles."""
    received = sent if settings_.get("keep_dtype") else "float32"
    s = session(impl, 4, **settings_)
    parts = split_frames(s.encode_frames(from_bits(sample(sent, 10), sent)))
    for order in ([0, 1, 2], [2, 0, 1], [1, 2, 0]):
        sentinel = np.arange(10).astype(numpy_dtype(out_dtype))
        out = sentinel.copy()
        with pytest.raises(GradientDtypeError) as info:
            session(impl).decode_frames(join_frames([parts[i] for i in order]), out=out)
        err = info.value
        assert (err.expected, err.received, err.chunk_index) == (out_dtype, received, order[0])
        assert str(err) == f"the gradient is {received}; out= is {out_dtype}"
        assert isinstance(err, TypeError) and isinstance(err, GradientStreamError)
        assert np.array_equal(bits(out), bits(sentinel))  # nothing of the chunk written
        again = pickle.loads(pickle.dumps(err))
        assert type(again) is GradientDtypeError
        assert (again.expected, again.received, again.chunk_index) == (
            out_dtype,
            received,
            order[0],
        )


def test_receive_from_out_of_another_dtype(impl: ModuleType):
    s = session(impl, 4, keep_dtype=True)
    grad = from_bits(sample("float16", 10), "float16")
    wire = s.encode_frames(grad)

    async def main() -> tuple[Any, np.ndarray]:
        a, b = socket.socketpair()
        with a, b:
            a.sendall(wire)
            out = np.zeros(10, np.float32)
            with pytest.raises(GradientDtypeError) as info:
                await s.receive_from(b, out=out)
            return info.value, out

    err, out = run(main)
    assert (err.expected, err.received, err.chunk_index) == ("float32", "float16", 0)
    assert not out.any()


def test_receive_from_out_of_the_right_dtype(impl: ModuleType):
    s = session(impl, 4, keep_dtype=True, wire_dtype="bfloat16")
    words = sample("float64", 10)
    wire = s.encode_frames(from_bits(words, "float64"))

    async def main() -> np.ndarray:
        a, b = socket.socketpair()
        with a, b:
            a.sendall(wire)
            out = np.zeros((2, 5), np.float64)
            return await s.receive_from(b, out=out)

    got = run(main)
    assert got.shape == (2, 5)
    assert np.array_equal(bits(got), expected(words, "float64", "bfloat16", "float64"))


def test_empty_input_with_out_of_any_dtype(impl: ModuleType):
    """No chunk, no dtype to check: the empty input fills an empty out= of any dtype."""
    s = session(impl)
    for name in DTYPES:
        out = np.empty((0, 3), dtype=numpy_dtype(name))
        assert s.decode_frames(b"", out=out) is out
    with pytest.raises(GradientSizeError):
        s.decode_frames(b"", out=np.empty(2, np.float16))


# --------------------------------------------------------------------------- with shapes, codecs


@pytest.mark.parametrize(("enc", "dec"), PAIRS, ids=PAIR_IDS)
def test_keep_shape_with_dtypes(enc: str, dec: str):
    """The shape and the dtype travel together; a cast keeps the shape, 0-d included."""
    rx = session(module(dec), 3)
    cases = [
        ("float16", (3, 4), None, True),
        ("bfloat16", (2, 1, 5), None, True),
        ("float64", (), "float32", True),
        ("float64", (), "float16", False),
        ("float16", (0, 5), "float64", True),
        ("float32", (4, 2), "bfloat16", False),
    ]
    for source, shape, wire_dtype, keep in cases:
        tx = session(module(enc), 4, keep_shape=True, keep_dtype=keep, wire_dtype=wire_dtype)
        words = sample(source, math.prod(shape))
        grad = from_bits(words, source, shape)
        result = source if keep else "float32"
        want = expected(words, source, wire_dtype or source, result)
        wire = tx.encode_frames(grad)
        for _, _, p in split_frames(wire):
            meta = schema_of(p).metadata or {}
            # Key order is the writer's (arrow-rs keeps schema metadata in a hash map).
            assert meta[b"gradient_shape"] == ref._shape_text(shape).encode()
        assert_values(rx.decode_frames(wire), result, want, shape)
        assert_values(rx.decode_chunks(tx.encode_gradient(grad)[::-1]), result, want, shape)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("enc", "dec"), PAIRS, ids=PAIR_IDS)
def test_compression_with_dtypes(enc: str, dec: str, layout: str, codec: str):
    rx = session(module(dec), 3)
    for name in DTYPES:
        words = sample(name, 300, seed=9)
        words[100:250] = 0  # something to compress
        tx = session(module(enc), 64, layout=layout, compression=codec, keep_dtype=True)
        wire = tx.encode_frames(from_bits(words, name))
        assert_values(rx.decode_frames(wire), name, words)
        assert_values(rx.decode_chunks(tx.encode_gradient(from_bits(words, name))), name, words)
        cast = session(module(enc), 64, layout=layout, compression=codec, wire_dtype="bfloat16")
        got = rx.decode_frames(cast.encode_frames(from_bits(words, name)))
        assert_values(got, "float32", expected(words, name, "bfloat16", "float32"))


def test_payloads_are_smaller_for_narrower_dtypes(impl: ModuleType):
    """chunk_size counts values; the payload holds width bytes a value (plus the index in
    the seed layout)."""
    n = 1000
    sizes = {}
    for name in DTYPES:
        s = session(impl, 400, layout="compact", keep_dtype=True)
        parts = split_frames(s.encode_frames(from_bits(sample(name, n), name)))
        assert len(parts) == 3
        sizes[name] = sum(len(p) for _, _, p in parts)
    # bfloat16's field metadata (the extension name) costs some bytes a payload.
    assert sizes["float16"] < sizes["bfloat16"] < sizes["float32"]
    assert sizes["float16"] + 1500 < sizes["float32"] < sizes["float64"] - 3500


def test_max_payload_len_refuses_by_the_wire_width(impl: ModuleType):
    """A chunk that fits as float16 is refused as float32 (the encoder's FrameError)."""
    grad = np.ones(1000, np.float32)
    f16 = session(impl, 1000, layout="compact", wire_dtype="float16", max_payload_len=3000)
    assert session(impl).decode_frames(f16.encode_frames(grad)).size == 1000
    f32 = session(impl, 1000, layout="compact", max_payload_len=3000)
    with pytest.raises(FrameError) as info:
        f32.encode_frames(grad)
    assert info.value.chunk_index == 0
    f64 = session(impl, 1000, layout="compact", wire_dtype="float64", max_payload_len=3000)
    with pytest.raises(FrameError):
        f64.encode_frames(grad)


def test_max_gradient_len_counts_values_of_any_dtype(impl: ModuleType):
    s = session(impl, 4, keep_dtype=True)
    wire = s.encode_frames(np.ones(10, np.float16))
    with pytest.raises(FrameError) as info:
        session(impl, max_gradient_len=9).decode_frames(wire)
    assert info.value.detail == "gradient exceeds max_gradient_len 9: 10 values by chunk 2"
    assert session(impl, max_gradient_len=10).decode_frames(wire).dtype == np.float16


# --------------------------------------------------------------------------- settings


def test_settings_defaults_and_properties(impl: ModuleType):
    s = impl.GradientStreamSession("s")
    assert s.keep_dtype is False and s.wire_dtype is None
    # The last keyword is seal (tests/seal/).
    params = list(inspect.signature(impl.GradientStreamSession).parameters.values())[:-1]
    assert [p.name for p in params[-3:]] == ["keep_shape", "keep_dtype", "wire_dtype"]
    for p in params[-2:]:
        assert p.kind is inspect.Parameter.KEYWORD_ONLY
    # keep_dtype left unset (None) takes the transport's default: False on bare frames
    # (tests/api/test_connection_defaults.py: True on gradstream connections).
    assert params[-2].default is None and params[-1].default is None
    assert session(impl, keep_dtype=None).keep_dtype is False
    for name in DTYPES:
        t = session(impl, wire_dtype=name, keep_dtype=True)
        assert t.wire_dtype == name and t.keep_dtype is True
    # A str subclass is taken as its text.
    assert session(impl, wire_dtype=type("S", (str,), {})("float16")).wire_dtype == "float16"


def test_repr_ends_with_the_dtype_settings(impl: ModuleType):
    s = session(impl)
    assert repr(s).endswith(", keep_shape=False, keep_dtype=False, wire_dtype=None, seal=False)"), (
        repr(s)
    )
    t = session(impl, keep_shape=True, keep_dtype=True, wire_dtype="bfloat16")
    assert repr(t).endswith(
        ", keep_shape=True, keep_dtype=True, wire_dtype='bfloat16', seal=False)"
    ), repr(t)


def test_with_compression_keeps_the_settings(impl: ModuleType):
    t = session(impl, keep_shape=True, keep_dtype=True, wire_dtype="float16")
    for enabled in (True, False):
        u = t.with_compression(enabled)
        assert (u.keep_shape, u.keep_dtype, u.wire_dtype) == (True, True, "float16")
        assert u.compression == ("lz4" if enabled else None)


@pytest.mark.parametrize(
    ("value", "name"), [(1, "int"), (0, "int"), ("yes", "str"), (1.0, "float")]
)
def test_keep_dtype_must_be_a_bool(impl: ModuleType, value: Any, name: str):
    with pytest.raises(TypeError) as info:
        session(impl, keep_dtype=value)
    assert str(info.value) == f"keep_dtype must be a bool, got {name}"


@pytest.mark.parametrize("value", ["int4", "uint8", "Float16", "float", "", "bf16", " float32"])
def test_wire_dtype_other_names_are_a_setting_error(impl: ModuleType, value: str):
    with pytest.raises(SettingError) as info:
        session(impl, wire_dtype=value)
    assert isinstance(info.value, ValueError)
    assert info.value.setting == "wire_dtype"
    assert str(info.value) == (
        "wire_dtype must be None, 'float16', 'bfloat16', 'float32', 'float64' or 'int8', "
        f"got {value!r}"
    )


@pytest.mark.parametrize("compression", [True, "lz4", "zstd"])
def test_the_int8_wire_refuses_compression(impl: ModuleType, compression: Any):
    with pytest.raises(SettingError) as info:
        session(impl, wire_dtype="int8", compression=compression)
    assert info.value.setting == "wire_dtype"
    codec = "lz4" if compression is True else compression
    assert str(info.value) == (
        f"wire_dtype='int8' does not combine with compression='{codec}': int8 payloads travel "
        "uncompressed (receivers refuse compressed list columns); drop one of the two"
    )
    # Turning compression on later is refused alike.
    with pytest.raises(SettingError):
        session(impl, wire_dtype="int8").with_compression(True)


@pytest.mark.parametrize(
    ("value", "name"),
    [(16, "int"), (b"float16", "bytes"), (np.dtype(np.float16), "Float16DType"), (True, "bool")],
)
def test_wire_dtype_other_types_are_a_type_error(impl: ModuleType, value: Any, name: str):
    with pytest.raises(TypeError) as info:
        session(impl, wire_dtype=value)
    assert str(info.value) == f"wire_dtype must be None or a dtype name (str), not {name}"


def test_frames_len_refusals(impl: ModuleType):
    """After the compression and keep_shape refusals: keep_dtype, then a wire_dtype other
    than float32."""
    keep = (
        "frames_len is not known in advance when keep_dtype is set: payload sizes depend on "
        "the gradient's dtype"
    )
    for kwargs, message in [
        ({"keep_dtype": True}, keep),
        ({"keep_dtype": True, "wire_dtype": "float32"}, keep),
        ({"keep_dtype": True, "wire_dtype": "float16"}, keep),
        (
            {"wire_dtype": "bfloat16"},
            "frames_len is not known in advance when wire_dtype is 'bfloat16': only float32 "
            "payload sizes are computed",
        ),
        (
            {"wire_dtype": "float64"},
            "frames_len is not known in advance when wire_dtype is 'float64': only float32 "
            "payload sizes are computed",
        ),
    ]:
        with pytest.raises(ValueError) as info:
            session(impl, **kwargs).frames_len(10)
        assert str(info.value) == message
    with pytest.raises(ValueError, match="compressed"):
        session(impl, compression="lz4", keep_dtype=True).frames_len(10)
    with pytest.raises(ValueError, match="keep_shape"):
        session(impl, keep_shape=True, wire_dtype="float16").frames_len(10)
    with pytest.raises(ValueError, match=r">= 0|negative"):
        session(impl, keep_dtype=True).frames_len(-1)
    s = session(impl, wire_dtype="float32")
    assert s.frames_len(10) == len(s.encode_frames(np.ones(10, np.float64)))


@pytest.mark.parametrize("settings_", [{"keep_dtype": True}, {"wire_dtype": "bfloat16"}])
def test_encode_frames_into_out_without_frames_len(impl: ModuleType, settings_):
    s = session(impl, 4, **settings_)
    grad = np.linspace(-1, 1, 10).astype(np.float16 if "keep_dtype" in settings_ else np.float32)
    want = s.encode_frames(grad)
    out = bytearray(b"\xa5" * (len(want) + 7))
    assert s.encode_frames(grad, out=out) == len(want)
    assert bytes(out[: len(want)]) == want and out[len(want) :] == b"\xa5" * 7
    small = bytearray(len(want) - 1)
    with pytest.raises(ValueError):
        s.encode_frames(grad, out=small)
    assert small == bytearray(len(want) - 1)


# --------------------------------------------------------------------------- manifests


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("enc", "dec"), PAIRS, ids=PAIR_IDS)
def test_manifest_round_trip(enc: str, dec: str, layout: str, compression: str | None):
    tx = session(module(enc), layout=layout, compression=compression, keep_shape=True)
    rx = session(module(dec))
    text = '{"format":"gradstream.tensors","tensors":[{"name":"ü✓ 梯度 😀","dtype":"bfloat16"}]}'
    data = tx._encode_manifest(text)
    assert isinstance(data, bytes)
    ((index, total, p),) = split_frames(data)
    assert (index, total) == (0, 1)
    schema = schema_of(p)
    assert schema.metadata == {b"gradstream_tensors": text.encode()}
    assert schema.field("value").type == pa.float32()
    assert schema.names == (["value"] if layout == "compact" else ["index", "value"])
    assert pa.ipc.open_file(pa.py_buffer(p)).read_all().num_rows == 0
    assert rx._decode_manifest(data) == (text, 0)
    assert rx._decode_manifest(bytearray(data)) == (text, 0)
    assert rx._decode_manifest(tx._encode_manifest("")) == ("", 0)


def test_decode_manifest_of_plain_gradients(impl: ModuleType):
    s = session(impl, 4)
    assert s._decode_manifest(b"") == (None, 0)
    assert s._decode_manifest(s.encode_frames(np.ones(10, np.float32))) == (None, 10)
    k = session(impl, 4, keep_dtype=True, keep_shape=True)
    assert s._decode_manifest(k.encode_frames(np.ones((2, 3), np.float16))) == (None, 6)


def test_decode_manifest_applies_the_decoding_rules(impl: ModuleType):
    s = session(impl)
    data = s._encode_manifest("x")
    with pytest.raises(FrameError):
        s._decode_manifest(data[:-1])
    with pytest.raises(FrameError):
        s._decode_manifest(data + b"\0")
    with pytest.raises(FrameError):
        session(impl, max_payload_len=len(data) - 17)._decode_manifest(data)
    corrupt = bytearray(data)
    corrupt[-20] ^= 1
    with pytest.raises(GradientStreamError):
        s._decode_manifest(bytes(corrupt))


def test_manifest_text_must_be_a_str(impl: ModuleType):
    with pytest.raises(TypeError):
        session(impl)._encode_manifest(b"x")


# --------------------------------------------------------------------------- torch tensors
# torch is not installed on the CI machines (PyPI's wheel needs the CUDA libraries), so
# these tests stand a minimal stand-in module in for it: it has the attributes and methods
# gradstream uses (dtype, device, detach, contiguous, view(torch.int16), numpy, and
# __dlpack__ for the float dtypes, as a CPU torch.Tensor has). They test gradstream's side
# of the contract, not torch's.


class _FakeTorchDtype:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"torch.{self.name}"


def _fake_torch() -> Any:
    import types

    torch = types.ModuleType("torch")
    torch.bfloat16 = _FakeTorchDtype("bfloat16")  # type: ignore[attr-defined]
    torch.int16 = _FakeTorchDtype("int16")  # type: ignore[attr-defined]
    torch.float16 = _FakeTorchDtype("float16")  # type: ignore[attr-defined]

    class Tensor:
        def __init__(self, values: np.ndarray, dtype: Any, device: str = "cpu") -> None:
            self._values = values
            self.dtype = dtype
            self.device = types.SimpleNamespace(type=device)
            self.shape = values.shape

        def detach(self) -> Tensor:
            return self

        def contiguous(self) -> Tensor:
            return Tensor(np.ascontiguousarray(self._values), self.dtype, self.device.type)

        def view(self, dtype: Any) -> Tensor:
            assert dtype is torch.int16  # type: ignore[attr-defined]
            return Tensor(self._values.view(np.int16), dtype, self.device.type)

        def numpy(self) -> np.ndarray:
            return self._values

        def __dlpack__(self, **kwargs: Any) -> Any:
            return self._values.__dlpack__(**kwargs)

        def __dlpack_device__(self) -> Any:
            return self._values.__dlpack_device__()

    Tensor.__module__ = "torch"
    torch.Tensor = Tensor  # type: ignore[attr-defined]
    return torch


@pytest.fixture
def torch(monkeypatch: pytest.MonkeyPatch) -> Any:
    fake = _fake_torch()
    monkeypatch.setitem(__import__("sys").modules, "torch", fake)
    return fake


@pytest.mark.parametrize(("enc", "dec"), PAIRS, ids=PAIR_IDS)
def test_torch_tensors_of_each_dtype_travel_as_they_are(torch: Any, enc: str, dec: str):
    bits16 = np.array(sample("bfloat16", 12), np.uint16).reshape(3, 4)
    half = from_bits(sample("float16", 12), "float16", (3, 4))
    cases = [
        (torch.Tensor(bits16, torch.bfloat16), "bfloat16", bits16.view(ml_dtypes.bfloat16)),
        (torch.Tensor(half, torch.float16), "float16", half),
        # Non-contiguous: the view of every other column.
        (
            torch.Tensor(bits16[:, ::2], torch.bfloat16),
            "bfloat16",
            bits16[:, ::2].view(ml_dtypes.bfloat16),
        ),
    ]
    tx = session(module(enc), 5, keep_dtype=True, keep_shape=True)
    rx = session(module(dec), 5)
    for tensor, name, want in cases:
        got = rx.decode_frames(tx.encode_frames(tensor))
        assert _dtypes.dtype_name(got.dtype) == name and got.shape == want.shape
        assert got.tobytes() == np.ascontiguousarray(want).tobytes()


def test_torch_bfloat16_on_another_device_is_refused(torch: Any):
    t = torch.Tensor(np.zeros(3, np.uint16), torch.bfloat16, device="cuda")
    for name in IMPL_NAMES:
        with pytest.raises(TypeError, match=r"gradient tensor is on .*; move it to the CPU"):
            session(module(name), keep_dtype=True).encode_frames(t)
    # Without keep_dtype or wire_dtype a torch bfloat16 tensor is the usual TypeError.
    for name in IMPL_NAMES:
        with pytest.raises(TypeError):
            session(module(name)).encode_frames(
                torch.Tensor(np.zeros(3, np.uint16), torch.bfloat16)
            )


def test_a_tensor_set_of_torch_tensors(torch: Any):
    grads = {
        "w": torch.Tensor(np.arange(6, dtype=np.uint16).reshape(2, 3) + 0x3F80, torch.bfloat16),
        "b": np.arange(3, dtype=np.float64),
    }
    for enc in IMPL_NAMES:
        for dec in IMPL_NAMES:
            got = session(module(dec)).decode_tensors(session(module(enc)).encode_tensors(grads))
            assert list(got) == ["w", "b"]
            assert got["w"].dtype == ml_dtypes.bfloat16 and got["w"].shape == (2, 3)
            assert (
                got["w"].view(np.uint16).tolist() == (np.arange(6).reshape(2, 3) + 0x3F80).tolist()
            )
            assert got["b"].tolist() == [0.0, 1.0, 2.0]
