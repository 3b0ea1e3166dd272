"""The wire, pinned: SHA-256 of the native ``encode_frames`` output for fixed gradients.

Default frames are byte-identical to what ipfrs-transport 0.2.0 sends. The differential
tests compare native against reference, and the round-trip tests compare a session with
itself: neither notices both sides drifting together (a new arrow-rs writing other
padding, a refactor reordering columns). These hashes do. A change here is a change of
wire format: it needs a reason in docs/spec/wire-format.md, not a new hash.

The gradients are built from integer arithmetic only (no RNG, no float maths), so the
bytes do not depend on numpy's version.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pytest

from support.values import SPECIAL_BITS

pytest.importorskip("gradstream._native")
import gradstream as gs


def mixed_bits(n: int) -> np.ndarray:
    """n float32 values from a multiplicative hash of their index: every exponent, NaN
    payloads and subnormals among them."""
    bits = (np.arange(n, dtype=np.uint64) * np.uint64(2654435761)) % np.uint64(2**32)
    return bits.astype(np.uint32).view(np.float32)


def specials() -> np.ndarray:
    return SPECIAL_BITS.view(np.float32)


# (name, gradient, session keywords, SHA-256 of the frames)
GOLDEN: list[tuple[str, Any, dict[str, Any], str]] = [
    (
        "empty-seed",
        lambda: np.zeros(0, np.float32),
        {"chunk_size": 65536},
        "be84def637d105896b1b60e71b1365fd943adc1ecc486022bbe7cbd980e81bad",
    ),
    (
        "empty-compact",
        lambda: np.zeros(0, np.float32),
        {"layout": "compact"},
        "fd8f81a6f3ac1a46c9b9fc775d7e627d5a174bc8e794fcac29bb89ff8d9576d3",
    ),
    (
        "specials-seed-7",
        specials,
        {"chunk_size": 7},
        "ad44a4625deda86bffb2a5f83ec0c59fe42d5d344468654bb6d8d6351f2a0e5a",
    ),
    (
        "specials-compact-7",
        specials,
        {"chunk_size": 7, "layout": "compact"},
        "f8cdf755fd3d14e351d55060e6025f7c1fcde2b5e0df9664b742e5a574a2d9bd",
    ),
    (
        "mixed-seed-7",
        lambda: mixed_bits(100),
        {"chunk_size": 7},
        "8f1834294e72598c4b087b94e71fce7864f0b174f4f833b40e2bf28419593389",
    ),
    (
        "mixed-compact-7",
        lambda: mixed_bits(100),
        {"chunk_size": 7, "layout": "compact"},
        "3a18a200019dd79c94292b57d48baa0576260b2771392f1bfa165451f6281764",
    ),
    (
        "mixed-seed-4096",
        lambda: mixed_bits(10_000),
        {"chunk_size": 4096},
        "635dc378c4824030b2c39a10e2337b3ab5791b1ed7d8d242644c22eecd65ec43",
    ),
    (
        "mixed-compact-4096",
        lambda: mixed_bits(10_000),
        {"chunk_size": 4096, "layout": "compact"},
        "484aeeec20083aa1b5f7c3f664fbb47e0ba218fe26be2fc752d6b37985dd1a30",
    ),
    (
        "mixed-seed-65536",
        lambda: mixed_bits(70_001),
        {"chunk_size": 65536},
        "c2970e2e39eb3c23632a57fecb56ca05f1502354af1b8ef504a41567bc8b7331",
    ),
    (
        "mixed-compact-65536",
        lambda: mixed_bits(70_001),
        {"chunk_size": 65536, "layout": "compact"},
        "e7ad90375f942445129cc42aece5a24a2d6d4b96a26632383e814629c98df347",
    ),
    # The opt-in extensions are our own wire: pinned too.
    (
        "shaped-seed-7",
        lambda: mixed_bits(24).reshape(2, 3, 4),
        {"chunk_size": 7, "keep_shape": True},
        "f7814e96b7199ac2ed0c037f47b9b7d8ee44b376e6bbad2f8c9eb20774aa3cb7",
    ),
    (
        "float16-compact-7",
        lambda: (np.arange(30, dtype=np.uint16) * np.uint16(2221)).view(np.float16),
        {"chunk_size": 7, "layout": "compact", "keep_dtype": True},
        "a778d7c2103f93d5357fd9a1e222578827f0190250137e97d6ca21687a047d96",
    ),
    (
        "bfloat16-wire-seed-7",
        lambda: mixed_bits(30),
        {"chunk_size": 7, "wire_dtype": "bfloat16"},
        "01fded267420515d99ef15d0e5e88dd958677e566ed7362b0825479cd9a7455b",
    ),
]


@pytest.mark.parametrize(
    ("make", "settings", "digest"),
    [pytest.param(make, settings, digest, id=name) for name, make, settings, digest in GOLDEN],
)
def test_native_frames_keep_their_bytes(make: Any, settings: dict[str, Any], digest: str) -> None:
    kwargs = dict(settings)
    chunk_size = kwargs.pop("chunk_size", 65536)
    session = gs.GradientStreamSession("golden", chunk_size, **kwargs)
    wire = session.encode_frames(make())
    assert hashlib.sha256(wire).hexdigest() == digest
    # The same bytes through every encoder entry point.
    chunks = session.encode_gradient(make())
    joined = b"".join(
        np.array(
            [c.chunk_index, c.total_chunks, len(c.arrow_ipc_bytes), c.checksum], "<u4"
        ).tobytes()
        + c.arrow_ipc_bytes
        for c in chunks
    )
    assert joined == wire


def test_the_session_id_never_reaches_the_wire() -> None:
    g = mixed_bits(100)
    a = gs.GradientStreamSession("a", 7).encode_frames(g)
    b = gs.GradientStreamSession("a much longer session id", 7).encode_frames(g)
    assert a == b
