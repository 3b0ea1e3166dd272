"""The in-memory codec's fast paths on large gradients: the fused copy-and-CRC blocks
(16 KiB), the streaming stores into destinations of 4 MiB or more (``out=``) and the
fresh result buffers of the default calls (advised for huge pages, ``bytes`` written
frame by frame without a zero fill first). Each is held to the reference: the same
frames byte for byte, the same values bit for bit, the same errors for mutated bytes;
and the results keep their types and ownership, and are freed.

Sizes sit around a chunk (65536), a copy block (4096 values), the streaming threshold
and the huge-page threshold (4 MiB: 1,048,576 float32 values, 2,097,152 seed bytes).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zlib
from types import ModuleType
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

import gradstream as native
import gradstream.reference as reference
from gradstream.errors import ChecksumMismatchError, GradientStreamError
from support.frames import frame, split_frames
from support.memory import proc_status
from support.values import float32_bits as bits

CHUNK = 65536
SIZES = [0, 1, 4095, 4097, CHUNK, CHUNK + 1, 1_048_575, 1_100_000]
LAYOUTS = ["seed", "compact"]
# sha256 (first 16 hex digits) of the native frames of grad(n), chunk 65536, made by the
# build before the fast paths (the frames are the wire format: they must not change).
GOLDEN = dict(
    [
        (
            "seed",
            {
                0: "be84def637d10589",
                1: "5e518ff6b8549251",
                4095: "54df37b61b67e7c6",
                4097: "0d90ec84d3c1b9fd",
                65536: "eb1bcc288f0816bc",
                65537: "2a47ded87d67cb81",
                1048575: "9c3cc1fb767c6a51",
                1100000: "9c77cdbe2599a851",
            },
        ),
        (
            "compact",
            {
                0: "fd8f81a6f3ac1a46",
                1: "e280ed71a90e6504",
                4095: "57e832a55bcf21ac",
                4097: "31e2924540202c3d",
                65536: "56fb5866d8648d44",
                65537: "bf9b621ee261c09f",
                1048575: "b72f1d46f08d3165",
                1100000: "48a5ebf2b72903ff",
            },
        ),
    ]
)


def grad(n: int) -> np.ndarray:
    # Every bit pattern class: random bits, NaNs with payloads, infinities, signed zeros.
    return np.random.default_rng(n).integers(0, 2**32, n, dtype=np.uint32).view(np.float32)


def sessions(layout: str, **kw: Any) -> tuple[Any, Any]:
    return (
        native.GradientStreamSession("s", CHUNK, layout=layout, **kw),
        reference.GradientStreamSession("s", CHUNK, layout=layout, **kw),
    )


def outcome(session: Any, data: Any, out: np.ndarray | None = None) -> tuple[str, Any]:
    """What a decode gives: ("ok", its bits) or (error class, its fields)."""
    try:
        got = session.decode_frames(data) if out is None else session.decode_frames(data, out=out)
    except GradientStreamError as e:
        # The class and the chunk: Arrow's own messages differ between the two readers.
        return type(e).__name__, getattr(e, "chunk_index", None)
    return "ok", bits(got).tobytes()


@pytest.fixture(params=[(layout, n) for layout in LAYOUTS for n in SIZES], ids=str)
def case(request: pytest.FixtureRequest) -> tuple[str, int, Any, Any, np.ndarray]:
    """(layout, n, native session, reference session, gradient of n values)."""
    layout, n = request.param
    return (layout, n, *sessions(layout), grad(n))


def test_every_encode_call_gives_the_same_frames(
    case: tuple[str, int, Any, Any, np.ndarray],
) -> None:
    layout, n, nat, ref, g = case
    expected = nat.encode_frames(g)
    assert type(expected) is bytes
    assert hashlib.sha256(expected).hexdigest()[:16] == GOLDEN[layout][n]
    # Chunk by chunk (each payload into its own bytes), and read back by the reference.
    assert (
        b"".join(frame(c.chunk_index, c.total_chunks, c.payload) for c in nat.encode_gradient(g))
        == expected
    )
    assert bits(ref.decode_frames(expected)).tobytes() == bits(g).tobytes()
    buffer = nat.encode_frames(g, as_buffer=True)
    assert type(buffer) is pa.Buffer and not buffer.is_mutable
    assert buffer.to_pybytes() == expected
    frames = bytearray(b"\xa5" * (len(expected) + 3))
    assert nat.encode_frames(g, out=frames) == len(expected)
    assert frames[: len(expected)] == expected and frames[len(expected) :] == b"\xa5" * 3


def test_every_decode_call_gives_the_values_bit_for_bit(
    case: tuple[str, int, Any, Any, np.ndarray],
) -> None:
    _, n, nat, ref, g = case
    wire = ref.encode_frames(g)
    for data in (wire, bytearray(wire), memoryview(wire)):
        got = nat.decode_frames(data)
        assert bits(got).tobytes() == bits(g).tobytes()
    out = np.full(n, np.float32(7.0))
    assert nat.decode_frames(wire, out=out) is out
    assert bits(out).tobytes() == bits(g).tobytes()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sealed_and_compressed_large_gradients_round_trip(layout: str) -> None:
    g = grad(1_100_000)
    for kw in ({"seal": True}, {"compression": "lz4"}):
        nat, ref = sessions(layout, **kw)
        wire = nat.encode_frames(g)
        assert bits(ref.decode_frames(wire)).tobytes() == bits(g).tobytes()
        assert bits(nat.decode_frames(wire)).tobytes() == bits(g).tobytes()
        out = np.empty_like(g)
        nat.decode_frames(ref.encode_frames(g), out=out)
        assert bits(out).tobytes() == bits(g).tobytes()


def test_results_keep_their_types_flags_and_owners() -> None:
    for layout in LAYOUTS:
        nat, _ = sessions(layout)
        for n in (0, 1_100_000):
            g = grad(n)
            got = nat.decode_frames(nat.encode_frames(g))
            assert type(got) is np.ndarray and got.dtype == np.float32 and got.shape == (n,)
            # As before: a writeable array over memory of ours, kept alive by its base.
            assert got.flags.writeable and got.flags.c_contiguous and got.flags.aligned
            assert not got.flags.owndata
            assert type(got.base).__name__ == "PySliceContainer"
            got[:1] = 3.0  # writeable in fact, not only in its flags
            wide = native.GradientStreamSession("s", CHUNK, layout=layout, keep_dtype=True)
            g64 = np.arange(n, dtype=np.float64) / 3
            back = wide.decode_frames(wide.encode_frames(g64))
            assert back.dtype == np.float64 and back.flags.writeable
            assert back.tobytes() == g64.tobytes()
            assert type(back.base).__name__ == "PySliceContainer"


def _flip(wire: bytes, chunk: int, at: int, recrc: bool) -> bytes:
    """`wire` with byte `at` of chunk `chunk`'s payload flipped; its header's CRC that of
    the flipped payload (`recrc`: the decoder gets past the CRC) or of the original."""
    parts = split_frames(wire)
    index, total, payload = parts[chunk]
    bad = bytearray(payload)
    bad[at] ^= 0x10
    crc = None if recrc else zlib.crc32(payload)
    return b"".join(
        frame(index, total, bytes(bad), checksum=crc) if i == chunk else frame(i, t, p)
        for i, (_, t, p) in enumerate(parts)
    )


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mutated_bytes_give_the_references_errors(layout: str) -> None:
    nat, ref = sessions(layout)
    n = 3 * CHUNK + 5  # three full chunks (a template each) and a short one
    g = grad(n)
    wire = ref.encode_frames(g)
    payload_len = len(split_frames(wire)[1][2])
    values_end = payload_len - 200  # well inside the values of a full chunk
    spots = [0, 8, 100, 300, payload_len // 2, values_end, payload_len - 1]
    # Any flipped byte under the original CRC is a CRC error; under a CRC that fits,
    # a value byte is a new value and any other byte takes the Arrow path (the template
    # no longer matches): the reference's result or error, in both calls.
    for chunk in (0, 1, 3):
        for at in spots:
            at = min(at, len(split_frames(wire)[chunk][2]) - 1)
            for recrc in (False, True):
                bad = _flip(wire, chunk, at, recrc)
                want = outcome(ref, bad)
                assert recrc or want[0] == "ChecksumMismatchError"
                assert outcome(nat, bad) == want, (chunk, at, recrc)
                assert outcome(nat, bad, np.zeros(n, np.float32)) == want, (chunk, at, recrc)
    # A flipped value byte of a full chunk is a CRC error naming it, in both calls.
    bad = _flip(wire, 1, payload_len // 2, recrc=False)
    for out in (None, np.zeros(n, np.float32)):
        with pytest.raises(ChecksumMismatchError) as info:
            nat.decode_frames(bad) if out is None else nat.decode_frames(bad, out=out)
        assert info.value.chunk_index == 1


@pytest.mark.parametrize("impl", [native], ids=["native"])
def test_results_dropped_are_freed(impl: ModuleType) -> None:
    # 300 results of 8 MiB each way (2.4 GB in all, past the huge-page threshold): the
    # resident set stays within a few results of where it started.
    g = grad(2 << 20)
    s = impl.GradientStreamSession("s", CHUNK, layout="compact")
    wire = s.encode_frames(g)
    for _ in range(5):
        s.decode_frames(wire)
        s.encode_frames(g)
    start = proc_status("VmRSS")
    for _ in range(150):
        del_me = s.decode_frames(wire)
        del del_me
        del_me2 = s.encode_frames(g)
        del del_me2
        buf = s.encode_frames(g, as_buffer=True)
        del buf
    assert proc_status("VmRSS") - start < 64 << 20


def thp_mode() -> str:
    """The kernel's transparent huge page setting ("" where there is none)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read()
    except OSError:
        return ""


@pytest.mark.skipif(
    "[madvise]" not in thp_mode(),
    reason="the kernel's THP setting is not madvise: advice changes nothing to see",
)
def test_numpys_switch_turns_the_huge_page_advice_off() -> None:
    # Under NUMPY_MADVISE_HUGEPAGE=0 neither numpy nor gradstream advises, so large
    # results (8 MiB and more, each call) leave the process without huge pages.
    script = (
        "import re, numpy as np, gradstream as gs\n"
        "g = np.ones(4 << 20, np.float32)\n"
        "for layout in ('seed', 'compact'):\n"
        "    s = gs.GradientStreamSession('s', 65536, layout=layout)\n"
        "    kept = [s.encode_frames(g), s.encode_frames(g, as_buffer=True)]\n"
        "    kept.append(s.decode_frames(kept[0]))\n"
        "    kept.append(s.decode_frames(bytearray(kept[0])))\n"
        "rollup = open('/proc/self/smaps_rollup').read()\n"
        "print(re.search(r'AnonHugePages:\\s+(\\d+)', rollup).group(1))\n"
    )
    env = dict(os.environ, NUMPY_MADVISE_HUGEPAGE="0")
    got = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    )
    assert int(got.stdout) == 0
