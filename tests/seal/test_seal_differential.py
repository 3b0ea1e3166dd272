"""The two implementations held against each other on sealed chunks: each decodes what the
other seals, in any layout, compression, chunking and dtype; and for every attack drawn
(indices traded, a chunk spliced from another transfer, a chunk unsealed, a seal rewritten
by hand: another total, another position, a malformed text, a copy changed in one place
only) both refuse the same bytes with the same error, text and fields, whether the
receiver was made with ``seal=True`` or not (every receiver verifies a seal it finds,
docs/spec/decoding-rules.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import gradstream as gs
import gradstream.reference as ref
from gradstream.reference._writer import encode_payload
from support.frames import join_frames, split_frames
from support.impls import CODECS, LAYOUTS, examples
from support.seals import (
    bit_equal,
    error_fields,
    gradient,
    lone_seal_text,
    outcome,
    seal_of,
    sealed_session,
    splice,
    swap_indices,
)

IMPLS = {"native": gs, "reference": ref}


@settings(max_examples=examples(40), deadline=None)
@given(
    n=st.integers(0, 300),
    chunk_size=st.integers(1, 64),
    layout=st.sampled_from(LAYOUTS),
    codec=st.sampled_from([None, *CODECS]),
    wire_dtype=st.sampled_from([None, "float16", "float64"]),
    encoder=st.sampled_from(list(IMPLS)),
    seed=st.integers(0, 2**16),
)
def test_each_decodes_what_the_other_seals(
    n: int,
    chunk_size: int,
    layout: str,
    codec: str | None,
    wire_dtype: str | None,
    encoder: str,
    seed: int,
) -> None:
    g = gradient(n, seed)
    kwargs: dict[str, Any] = {"layout": layout, "compression": codec, "wire_dtype": wire_dtype}
    tx = sealed_session(IMPLS[encoder], chunk_size, seal=True, **kwargs)
    wire = tx.encode_frames(g)
    seals = [seal_of(p) for _, _, p in split_frames(wire)]
    assert len({s[:32] for s in seals if s}) == 1 and None not in seals
    for name, impl in IMPLS.items():
        for seal in (False, True):
            rx = sealed_session(impl, 3, seal=seal)
            back = rx.decode_frames(wire)
            want = tx.decode_frames(wire)
            assert bit_equal(back, want), (name, seal)
            assert bit_equal(rx.decode_chunks(tx.encode_gradient(g)), want)


def _rewritten(wire: bytes, k: int, seal: str | None, layout: str, values: np.ndarray) -> bytes:
    """``wire`` with frame k's payload, whose values are ``values``, written again (by the
    reference's writer) with the gradstream_seal ``seal`` (or none)."""
    parts = split_frames(wire)
    index, total, _ = parts[k]
    parts[k] = (index, total, encode_payload(values, layout, seal=seal))
    return join_frames(parts)


def _one_copy_changed(wire: bytes, k: int, footer: bool) -> bytes:
    """Frame k with the first hex digit of its transfer id changed in one of its seal's two
    copies (the footer's, or the schema message's), the CRC recomputed."""
    parts = split_frames(wire)
    index, total, payload = parts[k]
    text = seal_of(payload)
    assert text is not None
    at = payload.rindex(text.encode()) if footer else payload.index(text.encode())
    digit = b"0" if payload[at : at + 1] != b"0" else b"1"
    parts[k] = (index, total, payload[:at] + digit + payload[at + 1 :])
    return join_frames(parts)


ATTACKS = ["swap", "splice", "unsealed", "total", "position", "malformed", "footer", "message"]


def _described(got: Any) -> Any:
    """An outcome as both sides must agree on it: the error's fields, or the values' bits."""
    if isinstance(got, np.ndarray):
        return ("values", got.dtype.str, got.tobytes())
    return error_fields(got)


@settings(max_examples=examples(60), deadline=None)
@given(
    n=st.integers(2, 200),
    chunk_size=st.integers(1, 50),
    layout=st.sampled_from(LAYOUTS),
    codec=st.sampled_from([None, "lz4"]),
    encoder=st.sampled_from(list(IMPLS)),
    attack=st.sampled_from(ATTACKS),
    data=st.data(),
)
def test_both_refuse_every_attack_with_the_same_error(
    n: int,
    chunk_size: int,
    layout: str,
    codec: str | None,
    encoder: str,
    attack: str,
    data: st.DataObject,
) -> None:
    tx = sealed_session(IMPLS[encoder], chunk_size, seal=True, layout=layout, compression=codec)
    g = gradient(n, data.draw(st.integers(0, 2**16)))
    wire = tx.encode_frames(g)
    total = len(split_frames(wire))
    k = data.draw(st.integers(0, total - 1))
    transfer = bytes.fromhex((seal_of(split_frames(wire)[0][2]) or "")[:32])
    values = g[k * chunk_size : (k + 1) * chunk_size]
    if attack == "swap":
        if total < 2:
            return
        other = data.draw(st.integers(0, total - 1).filter(lambda j: j != k))
        attacked = swap_indices(wire, k, other)
    elif attack == "splice":
        attacked = splice(wire, tx.encode_frames(gradient(n, 99)), k)
    elif attack == "unsealed":
        attacked = _rewritten(wire, k, None, layout, values)
    elif attack == "total":
        attacked = _rewritten(wire, k, lone_seal_text(transfer, k, total + 1), layout, values)
    elif attack == "position":
        position = data.draw(st.sampled_from([0, 1, 0xFFFFFFFE, 0x7FFFFFFF]))
        attacked = _rewritten(wire, k, lone_seal_text(transfer, k, total, position), layout, values)
    elif attack == "malformed":
        text = lone_seal_text(transfer, k, total)
        bad = data.draw(
            st.sampled_from([text.upper(), text[:-1], text + "0", text.replace(":", "-", 1), ""])
        )
        attacked = _rewritten(wire, k, bad, layout, values)
    else:
        attacked = _one_copy_changed(wire, k, footer=attack == "footer")
    # The seal read is the footer's: a copy changed in the schema message alone is not
    # what the readers see; and in a gradient of one chunk, a changed id (or a whole other
    # transfer) has no other chunk to disagree with (only a connection, which expects an
    # exact id, tells).
    refused = attack != "message" and not (attack in ("footer", "splice") and total == 1)
    outcomes, defaults = {}, {}
    for name, impl in IMPLS.items():
        rx = sealed_session(impl, 3, seal=True)
        got = outcome(lambda rx=rx: rx.decode_frames(attacked))
        assert isinstance(got, gs.GradientStreamError) == refused, (name, attack, got)
        outcomes[name] = _described(got)
        # A receiver without seal=True verifies the seals it finds: the same outcome, in
        # the same words, but for a chunk unsealed among sealed ones (one unsealed
        # chunk alone is a whole unsealed gradient, which it takes).
        default = outcome(lambda impl=impl: sealed_session(impl, 3).decode_frames(attacked))
        defaults[name] = _described(default)
        if attack != "unsealed":
            assert defaults[name] == outcomes[name], (name, attack)
        elif total == 1:
            assert isinstance(default, np.ndarray) and default.size == n
        else:
            # Once one chunk of a gradient is sealed, every chunk must be, either way round.
            assert type(default) is gs.FrameError, (name, default)
            mixed = (
                "chunk 1 is sealed; chunk 0 is not sealed"
                if k == 0
                else f"chunk {k} is not sealed; chunk 0 is sealed for transfer {transfer.hex()}"
            )
            assert default.detail == mixed
    assert outcomes["native"] == outcomes["reference"], attack
    assert defaults["native"] == defaults["reference"], attack
