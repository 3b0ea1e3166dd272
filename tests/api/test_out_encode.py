"""Caller-provided buffers on the way out: ``encode_frames(out=)`` and ``frames_len``,
the GradientSizeError itself, and a differential test of decoding into out=.

Every test but the differential one takes the ``impl`` fixture (tests/conftest.py). An
encode into ``out`` writes exactly ``encode_frames()``'s bytes at its start and nothing
else; ``frames_len(n)`` is their length without any values.
"""

from __future__ import annotations

import pickle
import re
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

import gradstream.reference as ref
from gradstream.errors import ArrowIpcError, FrameError, GradientSizeError, GradientStreamError
from support.impls import ERROR_FIELDS, FIXTURE_OK, LAYOUTS, session
from support.outputs import frames_of, ramp, sentinel_out
from support.values import float32_bits as bits
from support.values import special


def raw_bytes(buf: Any) -> bytes:
    view = memoryview(buf)
    return view.tobytes() if view.nbytes else b""


# --------------------------------------------------------------------------- encode_frames


BUFFER_KINDS = {
    "bytearray": lambda n: bytearray(b"\xa5" * n),
    "memoryview": lambda n: memoryview(bytearray(b"\xa5" * n)),
    "uint8": lambda n: np.full(n, 0xA5, dtype=np.uint8),
    # Any dtype is raw bytes: float64 rows, rounded up to whole elements.
    "float64-2d": lambda n: (
        np.frombuffer(b"\xa5" * (-(-n // 16) * 16), np.float64).copy().reshape(-1, 2)
    ),
    "float32": lambda n: np.frombuffer(b"\xa5" * (-(-n // 4) * 4), np.float32).copy(),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", list(BUFFER_KINDS))
@pytest.mark.parametrize("spare", [0, 1, 1000])
def test_encode_frames_out_writes_the_frames_and_leaves_the_rest(impl, layout, kind, spare):
    s = session(impl, 5, layout=layout)
    grad = special(23)
    expected = s.encode_frames(grad)
    out = BUFFER_KINDS[kind](len(expected) + spare)
    before = raw_bytes(out)
    n = s.encode_frames(grad, out=out)
    assert type(n) is int and n == len(expected)
    after = raw_bytes(out)
    assert len(after) == len(before)
    assert after[:n] == expected
    assert after[n:] == before[n:]
    # The written frames decode to the gradient.
    np.testing.assert_array_equal(bits(s.decode_frames(after[:n])), bits(grad))


def test_encode_frames_out_of_the_empty_gradient(impl):
    s = session(impl)
    expected = s.encode_frames([])
    out = bytearray(b"\xa5" * (len(expected) + 3))
    assert s.encode_frames(np.empty(0, np.float32), out=out) == len(expected)
    assert out == expected + b"\xa5" * 3


def test_encode_frames_out_in_a_window_of_a_larger_buffer(impl):
    s = session(impl, 3)
    expected = s.encode_frames(ramp(7))
    backing = bytearray(b"\xa5" * (len(expected) + 20))
    n = s.encode_frames(ramp(7), out=memoryview(backing)[10:])
    assert bytes(backing[:10]) == b"\xa5" * 10
    assert bytes(backing[10 : 10 + n]) == expected
    assert bytes(backing[10 + n :]) == b"\xa5" * 10


def test_encode_frames_out_too_small_is_value_error_naming_both_sizes(impl):
    s = session(impl, 4)
    grad = ramp(10)
    needed = len(s.encode_frames(grad))
    for room in (needed - 1, 17, 0):
        out = bytearray(b"\xa5" * room)
        with pytest.raises(ValueError) as info:
            s.encode_frames(grad, out=out)
        message = str(info.value)
        assert re.search(rf"\b{room}\b", message) and re.search(rf"\b{needed}\b", message)
        assert out == b"\xa5" * room


# (factory, pattern for the message).
BAD_ENCODE_OUTS = {
    "bytes": (lambda: b"\xa5" * 4096, r"(read-only|readonly|not writeable|immutable)"),
    "readonly-memoryview": (
        lambda: memoryview(b"\xa5" * 4096),
        r"(read-only|readonly|not writeable|immutable)",
    ),
    "readonly-numpy": (
        lambda: np.frombuffer(b"\xa5" * 4096, np.uint8),
        r"(read-only|readonly|not writeable|immutable)",
    ),
    "strided-numpy": (
        lambda: np.full(8192, 0xA5, np.uint8)[::2],
        r"(non-contiguous|not (C-)?contiguous)",
    ),
    "strided-memoryview": (
        lambda: memoryview(bytearray(b"\xa5" * 8192))[::2],
        r"(non-contiguous|not (C-)?contiguous)",
    ),
    "fortran-numpy": (
        lambda: np.full((64, 64), 0xA5, np.uint8, order="F"),
        r"(non-contiguous|not (C-)?contiguous)",
    ),
    "list": (lambda: [0] * 4096, r"\blist\b"),
    "str": (lambda: "x" * 4096, r"\bstr\b"),
}


@pytest.mark.parametrize("case", list(BAD_ENCODE_OUTS))
def test_encode_frames_bad_out_is_type_error_and_writes_nothing(impl, case):
    make, pattern = BAD_ENCODE_OUTS[case]
    s = session(impl, 4)
    out = make()
    before = out if isinstance(out, (list, str)) else raw_bytes(out)
    with pytest.raises(TypeError) as info:
        s.encode_frames(ramp(10), out=out)
    assert re.search(pattern, str(info.value)), str(info.value)
    assert "out=" in str(info.value)
    assert (out if isinstance(out, (list, str)) else raw_bytes(out)) == before


def test_encode_frames_out_bytearray_is_not_left_locked(impl):
    # A bytearray lent as out= can be resized after the call, whether it succeeded or not.
    s = session(impl, 4)
    out = bytearray(b"\xa5" * 4096)
    s.encode_frames(ramp(10), out=out)
    out.extend(b"x")
    with pytest.raises(ValueError):
        s.encode_frames(ramp(1000), out=out)
    out.extend(b"x")
    with pytest.raises(TypeError):
        s.encode_frames(np.zeros(3, np.float64), out=out)
    out.extend(b"x")
    assert len(out) == 4099


def test_encode_frames_as_buffer_with_out_is_value_error(impl):
    s = session(impl, 4)
    out = bytearray(b"\xa5" * 4096)
    with pytest.raises(ValueError):
        s.encode_frames(ramp(10), True, out=out)
    with pytest.raises(ValueError):
        s.encode_frames(ramp(10), as_buffer=True, out=out)
    assert out == b"\xa5" * 4096
    # as_buffer=False is the default's value: fine with out.
    assert s.encode_frames(ramp(10), False, out=out) == len(s.encode_frames(ramp(10)))


def test_encode_frames_out_bad_gradient_raises_as_without_out(impl):
    s = session(impl, 4)
    out = bytearray(b"\xa5" * 4096)
    with pytest.raises(TypeError, match="float64"):
        s.encode_frames(np.zeros(3, np.float64), out=out)
    small = session(impl, 100, max_payload_len=500)
    with pytest.raises(FrameError) as without:
        small.encode_frames(ramp(250))
    with pytest.raises(FrameError) as with_out:
        small.encode_frames(ramp(250), out=out)
    assert (with_out.value.detail, with_out.value.chunk_index, with_out.value.offset) == (
        without.value.detail,
        without.value.chunk_index,
        without.value.offset,
    )


def test_encode_frames_out_refuses_an_object_array(impl):
    # Raw bytes over Python object pointers would crash the interpreter; run in a child,
    # so that a crash fails this test rather than the whole run.
    module = impl.__name__
    code = textwrap.dedent(
        f"""
        import numpy as np, {module} as impl
        out = np.empty(4096, dtype=object)
        try:
            impl.GradientStreamSession("s", 4).encode_frames([1.0, 2.0], out=out)
        except TypeError as exc:
            print("TypeError", exc)
        else:
            print("accepted")
        del out
        print("alive")
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("TypeError"), done.stdout
    assert done.stdout.rstrip().endswith("alive")


# --------------------------------------------------------------------------- frames_len


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("chunk_size", [1, 3, 7, 64])
def test_frames_len_is_the_length_of_encode_frames_at_the_edges(impl, layout, chunk_size):
    s = session(impl, chunk_size, layout=layout)
    c = chunk_size
    for n in sorted({0, 1, c - 1, c, c + 1, 2 * c - 1, 2 * c, 2 * c + 1, 5 * c + 3}):
        length = s.frames_len(n)
        assert type(length) is int
        assert length == len(s.encode_frames(ramp(n))), n


@st.composite
def lengths(draw: Any) -> tuple[int, int]:
    """(chunk_size, n): n near multiples of the chunk size, at most 64 chunks."""
    chunk_size = draw(st.one_of(st.integers(0, 16), st.integers(1, 5000)))
    c = max(chunk_size, 1)
    k = draw(st.integers(0, 63))
    n = draw(st.one_of(st.integers(max(0, k * c - 2), k * c + 2), st.integers(0, 64 * c)))
    return chunk_size, n


@settings(max_examples=80, deadline=None, suppress_health_check=FIXTURE_OK)
@given(case=lengths(), layout=st.sampled_from(LAYOUTS))
def test_frames_len_equals_len_encode_frames(impl, case, layout):
    chunk_size, n = case
    s = session(impl, chunk_size, layout=layout)
    assert s.frames_len(n) == len(s.encode_frames(special(n)))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_frames_len_of_huge_gradients_without_values(impl, layout):
    # Frames are independent: n = q*c + r takes q full frames and one of r values. Far
    # beyond what could be encoded here, so frames_len must not touch any value.
    c = 65536
    s = session(impl, c, layout=layout)
    full = s.frames_len(c)
    for q, r in [(1, 0), (1000, 17), (15_000_000, 1), (2**32 - 2, c - 1)]:
        assert s.frames_len(q * c + r) == q * full + (s.frames_len(r) if r else 0)


@pytest.mark.parametrize("bad", [-1, -(2**40)])
def test_frames_len_negative_is_value_error(impl, bad):
    with pytest.raises(ValueError):
        session(impl).frames_len(bad)


@pytest.mark.parametrize("bad", [3.0, "3", None, [3]])
def test_frames_len_non_int_is_type_error(impl, bad):
    with pytest.raises(TypeError):
        session(impl).frames_len(bad)


@pytest.mark.parametrize(
    ("chunk_size", "n", "layout"),
    [(100, 250, "seed"), (100, 100, "seed"), (1000, 300, "seed"), (1000, 140, "compact")],
)
def test_frames_len_refuses_as_encode_frames_does(impl, chunk_size, n, layout):
    s = session(impl, chunk_size, max_payload_len=500, layout=layout)
    with pytest.raises(FrameError) as encoded:
        s.encode_frames(ramp(n))
    with pytest.raises(FrameError) as sized:
        s.frames_len(n)
    fields = ("detail", "chunk_index", "offset")
    assert [getattr(sized.value, f) for f in fields] == [getattr(encoded.value, f) for f in fields]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", [10, 25])
def test_frames_len_at_the_exact_payload_limit(impl, layout, n):
    # The limit set at the impl's own payload length for 10 values: accepted there, and
    # refused one byte below (where only the exact length, not a lower bound, can tell).
    exact = len(session(impl, 10, layout=layout).encode_gradient(ramp(10))[0].arrow_ipc_bytes)
    at = session(impl, 10, layout=layout, max_payload_len=exact)
    assert at.frames_len(n) == len(at.encode_frames(ramp(n)))
    below = session(impl, 10, layout=layout, max_payload_len=exact - 1)
    with pytest.raises(FrameError) as encoded:
        below.encode_frames(ramp(n))
    with pytest.raises(FrameError) as sized:
        below.frames_len(n)
    assert (sized.value.detail, sized.value.chunk_index) == (
        encoded.value.detail,
        encoded.value.chunk_index,
    )
    assert sized.value.chunk_index == 0


def test_frames_len_refuses_even_the_empty_gradient_as_encode_frames_does(impl):
    s = session(impl, max_payload_len=16)
    with pytest.raises(FrameError) as encoded:
        s.encode_frames([])
    with pytest.raises(FrameError) as sized:
        s.frames_len(0)
    assert (sized.value.detail, sized.value.chunk_index) == (
        encoded.value.detail,
        encoded.value.chunk_index,
    )


def test_frames_len_refuses_more_chunks_than_a_u32(impl):
    s = session(impl, 1)
    assert s.frames_len(10) > 0
    with pytest.raises(FrameError) as info:
        s.frames_len(2**32)
    assert info.value.offset is None
    # One chunk fewer is countable (and its length is computed without any value).
    assert s.frames_len(2**32 - 1) == (2**32 - 1) * s.frames_len(1)


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("fields", [(10, 12, 3), (10, 7, None), (0, 0, None), (5, 2**40, 0)])
def test_gradient_size_error_pickles(fields):
    e = GradientSizeError(*fields)
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is GradientSizeError
    assert (back.expected, back.received, back.chunk_index) == fields
    assert str(back) == str(e) and back.args == e.args
    assert isinstance(back, ValueError) and isinstance(back, GradientStreamError)


def test_raised_gradient_size_errors_pickle(impl):
    s = session(impl, 4)
    wire = s.encode_frames(ramp(10))
    for size in (5, 11):
        with pytest.raises(GradientSizeError) as info:
            s.decode_frames(wire, out=sentinel_out(size))
        back = pickle.loads(pickle.dumps(info.value))
        assert type(back) is GradientSizeError
        fields = (back.expected, back.received, back.chunk_index)
        assert fields == (info.value.expected, info.value.received, info.value.chunk_index)
        assert str(back) == str(info.value)


# --------------------------------------------------------------------------- differential


def _outcome(session_: Any, wire: bytes, out: np.ndarray) -> tuple[Any, ...]:
    try:
        got = session_.decode_frames(wire, out=out)
    except (GradientStreamError, TypeError, ValueError) as exc:
        fields = {f: getattr(exc, f) for f in ERROR_FIELDS if hasattr(exc, f)}
        if isinstance(exc, ArrowIpcError):
            # pyarrow and arrow-rs word a broken file differently: the chunk is what counts.
            return (type(exc).__name__, exc.chunk_index)
        return (type(exc).__name__, fields, str(exc))
    assert got is out
    return ("ok", out.shape, bits(out).tobytes())


@st.composite
def out_cases(draw: Any) -> tuple[Any, ...]:
    n = draw(st.integers(0, 120))
    chunk_size = draw(st.integers(1, 16))
    layout = draw(st.sampled_from(LAYOUTS))
    sender = ref.GradientStreamSession("s", chunk_size, layout=layout)
    frames = frames_of(sender, special(n)[::-1].copy())
    order = draw(st.permutations(range(len(frames))))
    frames = [frames[i] for i in order]
    mutation = draw(st.sampled_from(["none", "none", "drop", "cut", "junk", "crc", "repeat"]))
    if mutation == "drop" and len(frames) > 1:
        del frames[draw(st.integers(0, len(frames) - 1))]
    elif mutation == "crc":
        k = draw(st.integers(0, len(frames) - 1))
        frames[k] = frames[k][:12] + b"\x00\x00\x00\x00" + frames[k][16:]
    elif mutation == "repeat":
        frames.append(frames[draw(st.integers(0, len(frames) - 1))])
    wire = b"".join(frames)
    if mutation == "cut":
        wire = wire[: draw(st.integers(0, len(wire)))]
    elif mutation == "junk":
        wire += draw(st.binary(min_size=1, max_size=20))
    size = draw(st.one_of(st.integers(max(0, n - 3), n + 3), st.integers(0, 130), st.just(n)))
    shape: tuple[int, ...] = (size,)
    if size % 2 == 0 and draw(st.booleans()):
        shape = (2, size // 2)
    limit = draw(st.one_of(st.none(), st.integers(1, 130)))
    return n, wire, shape, limit, mutation


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=out_cases())
def test_native_and_reference_agree_on_decodes_into_out(case):
    pytest.importorskip("gradstream._native", reason="native extension not built")
    import gradstream as gs

    n, wire, shape, limit, mutation = case
    note(f"n={n} shape={shape} limit={limit} mutation={mutation} wire={len(wire)} bytes")
    kwargs = {} if limit is None else {"max_gradient_len": limit}
    outcomes = [
        _outcome(mod.GradientStreamSession("r", 8, **kwargs), wire, sentinel_out(shape))
        for mod in (gs, ref)
    ]
    event(outcomes[1][0])
    assert outcomes[0] == outcomes[1]


@pytest.mark.parametrize("view", ["float32", "uint8", "memoryview"])
def test_encode_frames_refuses_an_out_that_overlaps_the_gradient(impl: Any, view: str) -> None:
    # One buffer holding both: writing the frames would overwrite values not yet read.
    s = impl.GradientStreamSession("s", 16)
    g = np.arange(100, dtype=np.float32)
    buf = np.zeros(s.frames_len(100) // 4 + 200, np.float32)
    buf[:100] = g
    out: Any = {"float32": buf, "uint8": buf.view(np.uint8), "memoryview": memoryview(buf)}[view]
    before = buf.copy()
    with pytest.raises(ValueError, match="overlaps the gradient"):
        s.encode_frames(buf[:100], out=out)
    np.testing.assert_array_equal(buf, before)
    # The same bytes in a separate buffer are fine.
    assert s.encode_frames(g, out=bytearray(s.frames_len(100))) == s.frames_len(100)
