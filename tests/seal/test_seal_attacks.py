"""Each attack the seal is for (docs/spec/decoding-rules.md), from a hostile or confused
peer, in every mode: both implementations on either end, both layouts, compressed, and
tensor sets. Each is shown first without the seal, where the CRC-checked frames bring back
a wrong gradient as if it were right, then sealed, where it is a FrameError naming what
the seal said and what was expected: from a ``seal=True`` receiver and, in the same words,
from a receiver made without ``seal`` (every receiver verifies a seal it finds). Such a
receiver still takes unsealed frames, but not sealed and unsealed chunks in one gradient.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import pytest

from gradstream.errors import FrameError
from support.frames import split_frames
from support.impls import PAIR_IDS, PAIRS, load_impl
from support.seals import (
    MODE_IDS,
    MODES,
    bit_equal,
    frames,
    gradient,
    mode,
    note_of,
    outcome,
    sealed_session,
    splice,
    swap_indices,
    swap_tensors,
    transfer_of,
)


def sessions(pair: tuple[str, str], seal: bool, modes: tuple[str, str | None]) -> tuple[Any, Any]:
    """(sender, receiver): the sender in the mode, the receiver in its defaults."""
    tx = sealed_session(load_impl(pair[0]), seal=seal, **mode(*modes))
    rx = sealed_session(load_impl(pair[1]), seal=seal)
    return tx, rx


def receivers(pair: tuple[str, str]) -> list[Any]:
    """The receivers that refuse an attack on sealed frames: ``seal=True``, and without."""
    return [sealed_session(load_impl(pair[1]), seal=seal) for seal in (True, False)]


def chunks_of(pair: tuple[str, str], wire: bytes) -> list[Any]:
    """The frames of ``wire`` as the receiving implementation's GradientChunks."""
    chunk = load_impl(pair[1]).GradientChunk
    return [chunk("s", i, t, p, zlib.crc32(p)) for i, t, p in split_frames(wire)]


def assert_frame_error(
    got: Any, detail: str, chunk_index: int | None, offset: Any = "skip"
) -> None:
    assert type(got) is FrameError, got
    assert (got.detail, got.chunk_index) == (detail, chunk_index)
    if offset != "skip":
        assert got.offset == offset


@pytest.mark.parametrize("modes", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
def test_swapped_chunk_indices_with_valid_crcs(pair: tuple[str, str], modes: Any) -> None:
    g = gradient(10, seed=1)
    tx, rx = sessions(pair, False, modes)
    wire = swap_indices(tx.encode_frames(g))
    got = rx.decode_frames(wire)
    # Unsealed, the CRCs hold and a wrong gradient comes back as if verified.
    assert not bit_equal(got, g)
    assert bit_equal(got[:4], g[4:8]) and bit_equal(got[4:8], g[:4])

    tx, _ = sessions(pair, True, modes)
    wire = swap_indices(tx.encode_frames(g))
    chunks = chunks_of(pair, wire)
    for rx in receivers(pair):
        got = outcome(lambda rx=rx: rx.decode_frames(wire))
        assert_frame_error(got, "chunk 1 of 3 is sealed as chunk 0 of 3", 1, offset=0)
        got = outcome(lambda rx=rx: rx.decode_chunks(chunks))
        assert_frame_error(got, "chunk 0 of 3 is sealed as chunk 1 of 3", 0, offset=None)


@pytest.mark.parametrize("modes", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
def test_frames_spliced_from_another_transfer_of_the_same_size(
    pair: tuple[str, str], modes: Any
) -> None:
    a, b = gradient(10, seed=2), gradient(10, seed=3)
    tx, rx = sessions(pair, False, modes)
    got = rx.decode_frames(splice(tx.encode_frames(a), tx.encode_frames(b), 1))
    assert bit_equal(got, np.concatenate([a[:4], b[4:8], a[8:]]))

    tx, _ = sessions(pair, True, modes)
    ours, theirs = tx.encode_frames(a), tx.encode_frames(b)
    first, other = transfer_of(ours), transfer_of(theirs)
    assert first != other
    detail = f"chunk 1 is sealed for transfer {other}; chunk 0 is sealed for transfer {first}"
    for rx in receivers(pair):
        got = outcome(lambda rx=rx: rx.decode_frames(splice(ours, theirs, 1)))
        assert_frame_error(got, detail, 1)


@pytest.mark.parametrize("modes", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
def test_two_same_shape_tensors_swapped_inside_a_set(pair: tuple[str, str], modes: Any) -> None:
    tensors = {
        "fc1.weight": gradient(6, 4).reshape(2, 3),
        "fc2.weight": gradient(6, 5).reshape(2, 3),
    }
    tx, rx = sessions(pair, False, modes)
    got = rx.decode_tensors(swap_tensors(tx.encode_tensors(tensors), per_tensor=2))
    assert bit_equal(got["fc1.weight"], tensors["fc2.weight"])

    tx, _ = sessions(pair, True, modes)
    swapped = swap_tensors(tx.encode_tensors(tensors), 2)
    # A tensor from another set of the same shapes: the manifest's transfer is expected.
    ours, theirs = tx.encode_tensors(tensors), tx.encode_tensors(tensors)
    parts, other = frames(ours), frames(theirs)
    for rx in receivers(pair):
        got = outcome(lambda rx=rx: rx.decode_tensors(swapped))
        detail = (
            "chunk 0 is sealed for tensor position 1 of a tensor set, expected tensor "
            "position 0 of a tensor set"
        )
        assert_frame_error(got, detail, 0)
        assert got.__notes__ == [note_of("fc1.weight", 1, 2)]
        got = outcome(lambda rx=rx: rx.decode_tensors(b"".join(parts[:3] + other[3:])))
        detail = (
            f"chunk 0 is sealed for transfer {transfer_of(theirs)}, expected transfer "
            f"{transfer_of(ours)}"
        )
        assert_frame_error(got, detail, 0)
        assert got.__notes__ == [note_of("fc2.weight", 2, 2)]


@pytest.mark.parametrize("modes", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
def test_an_unsealed_payload_to_a_sealing_receiver(pair: tuple[str, str], modes: Any) -> None:
    g = gradient(10, seed=6)
    tx, _ = sessions(pair, False, modes)
    _, rx = sessions(pair, True, modes)
    got = outcome(lambda: rx.decode_frames(tx.encode_frames(g)))
    assert_frame_error(got, "chunk 0 is not sealed; this receiver expects sealed chunks", 0, 0)
    # One unsealed chunk among sealed ones.
    sealed = sealed_session(load_impl(pair[0]), seal=True, **mode(*modes))
    wire = splice(sealed.encode_frames(g), tx.encode_frames(g), 2)
    got = outcome(lambda: rx.decode_frames(wire))
    assert_frame_error(got, "chunk 2 is not sealed; this receiver expects sealed chunks", 2)
    # A set: the manifest (no note), then a tensor (noted).
    tensors = {"w": gradient(3, 7)}
    got = outcome(lambda: rx.decode_tensors(tx.encode_tensors(tensors)))
    assert_frame_error(got, "chunk 0 is not sealed; this receiver expects sealed chunks", 0)
    assert not getattr(got, "__notes__", [])
    parts = frames(sealed.encode_tensors(tensors))
    unsealed = frames(tx.encode_tensors(tensors))
    got = outcome(lambda: rx.decode_tensors(parts[0] + unsealed[1]))
    assert_frame_error(got, "chunk 0 is not sealed; this receiver expects sealed chunks", 0)
    assert got.__notes__ == [note_of("w", 1, 1)]


@pytest.mark.parametrize("modes", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
def test_a_sealed_payload_to_a_receiver_without_seal_is_accepted(
    pair: tuple[str, str], modes: Any
) -> None:
    g = gradient(10, seed=8)
    tx, _ = sessions(pair, True, modes)
    _, rx = sessions(pair, False, modes)
    assert bit_equal(rx.decode_frames(tx.encode_frames(g)), g)
    assert bit_equal(rx.decode_chunks(tx.encode_gradient(g)), g)
    tensors = {"a": gradient(5, 9).reshape(5, 1), "b": gradient(2, 10)}
    got = rx.decode_tensors(tx.encode_tensors(tensors))
    assert list(got) == ["a", "b"]
    assert all(bit_equal(got[k], tensors[k]) for k in tensors)


@pytest.mark.parametrize("modes", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("pair", PAIRS, ids=PAIR_IDS)
def test_sealed_and_unsealed_chunks_in_one_gradient_to_a_receiver_without_seal(
    pair: tuple[str, str], modes: Any
) -> None:
    g = gradient(10, seed=11)
    plain, rx = sessions(pair, False, modes)
    sealed = sealed_session(load_impl(pair[0]), seal=True, **mode(*modes))
    ours, unsealed = sealed.encode_frames(g), plain.encode_frames(g)
    transfer = transfer_of(ours)
    # An unsealed chunk after sealed ones, and a sealed chunk after unsealed ones.
    got = outcome(lambda: rx.decode_frames(splice(ours, unsealed, 2)))
    assert_frame_error(got, f"chunk 2 is not sealed; chunk 0 is sealed for transfer {transfer}", 2)
    got = outcome(lambda: rx.decode_frames(splice(unsealed, ours, 1)))
    assert_frame_error(got, "chunk 1 is sealed; chunk 0 is not sealed", 1)
    # The first chunk taken decides, whichever index it has.
    chunks = chunks_of(pair, splice(unsealed, ours, 0))
    got = outcome(lambda: rx.decode_chunks(chunks))
    assert_frame_error(got, f"chunk 1 is not sealed; chunk 0 is sealed for transfer {transfer}", 1)
    # A set: its tensors follow its manifest, sealed or not.
    tensors = {"w": gradient(3, 7), "v": gradient(2, 8)}
    sealed_set, plain_set = (
        frames(sealed.encode_tensors(tensors)),
        frames(plain.encode_tensors(tensors)),
    )
    got = outcome(lambda: rx.decode_tensors(b"".join(plain_set[:2] + sealed_set[2:])))
    assert_frame_error(got, "chunk 0 is sealed; the tensor set's manifest is not sealed", 0)
    assert got.__notes__ == [note_of("v", 2, 2)]
    got = outcome(lambda: rx.decode_tensors(b"".join(sealed_set[:1] + plain_set[1:])))
    assert_frame_error(got, "chunk 0 is not sealed; this receiver expects sealed chunks", 0)
    assert got.__notes__ == [note_of("w", 1, 2)]
    # Unsealed throughout, as ipfrs-transport sends them: taken.
    assert bit_equal(rx.decode_frames(unsealed), g)
