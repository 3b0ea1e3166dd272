"""Memory kept for the next result (``gradstream.keep_memory``, ``kept_memory``,
``release_memory``; the core's ``kept`` allocator): released large results' blocks serve
the next results, and what that must never do: hand one block to two live results, show
a previous result's values, keep more than the limit, keep small blocks, or break after a
fork. Each result is held to the reference's, value for value.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest

import gradstream as native
import gradstream.reference as reference
from gradstream.errors import SettingError
from support.values import float32_bits as bits

MIB = 2**20
KEEP_FROM = 4 * MIB
BIG = 2_000_000  # float32 values: 8 MB, over the 4 MiB from which blocks are kept


def grad(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


@pytest.fixture(autouse=True)
def fresh_limit() -> Iterator[None]:
    """Each test from nothing kept, at the default limit; the default restored after."""
    limit = native.kept_memory().limit
    native.release_memory()
    yield
    native.keep_memory(limit)
    native.release_memory()


@pytest.fixture
def session() -> native.GradientStreamSession:
    return native.GradientStreamSession("kept", 65536)


def test_a_dropped_result_serves_the_next_and_the_values_are_the_new_ones(
    session: native.GradientStreamSession,
) -> None:
    first, second = grad(BIG, 1), grad(BIG, 2)
    wire_first, wire_second = session.encode_frames(first), session.encode_frames(second)
    result = session.decode_frames(wire_first)
    address = result.ctypes.data
    del result
    kept = native.kept_memory()
    assert kept.blocks == 1 and kept.held >= first.nbytes
    again = session.decode_frames(wire_second)
    after = native.kept_memory()
    assert after.reused == kept.reused + 1 and after.held == 0
    assert again.ctypes.data == address
    ref = reference.GradientStreamSession("kept", 65536).decode_frames(wire_second)
    assert np.array_equal(bits(again), bits(ref))


@pytest.mark.parametrize("layout", ["seed", "compact"])
@pytest.mark.parametrize("n", [KEEP_FROM // 4 * 3 // 4, BIG // 2 + 1, BIG - 1, BIG])
def test_a_smaller_result_in_a_kept_block_holds_exactly_its_own_values(layout: str, n: int) -> None:
    """No value of the previous, larger result shows through, whatever the size."""
    session = native.GradientStreamSession("kept", 65536, layout=layout)
    old = np.full(BIG, np.float32(7.5))
    session.decode_frames(session.encode_frames(old))  # dropped at once
    g = grad(n, n)
    wire = session.encode_frames(g)
    result = session.decode_frames(wire)
    assert result.shape == (n,) and result.dtype == np.float32
    ref = reference.GradientStreamSession("kept", 65536, layout=layout).decode_frames(wire)
    assert np.array_equal(bits(result), bits(ref))


def test_live_results_never_share_a_block(session: native.GradientStreamSession) -> None:
    grads = [grad(BIG, seed) for seed in range(4)]
    wires = [session.encode_frames(g) for g in grads]
    session.decode_frames(wires[0])  # dropped at once: its block is kept
    results = [session.decode_frames(w) for w in wires]
    for i, a in enumerate(results):
        for b in results[i + 1 :]:
            assert not np.shares_memory(a, b)
    for r, g in zip(results, grads, strict=True):
        assert np.array_equal(bits(r), bits(g))


def test_keeping_nothing_and_releasing(session: native.GradientStreamSession) -> None:
    wire = session.encode_frames(grad(BIG, 3))
    session.decode_frames(wire)  # dropped at once
    held = native.kept_memory().held
    assert held >= BIG * 4
    assert native.release_memory() == held
    assert native.kept_memory()[1:3] == (0, 0)
    native.keep_memory(0)
    session.decode_frames(wire)  # dropped at once
    assert native.kept_memory()[:3] == (0, 0, 0)


def test_the_limit_bounds_what_is_held(session: native.GradientStreamSession) -> None:
    native.keep_memory(BIG * 4 + MIB)
    wires = [session.encode_frames(grad(BIG, s)) for s in range(3)]
    results = [session.decode_frames(w) for w in wires]
    del results
    kept = native.kept_memory()
    assert kept.blocks == 1 and kept.held <= kept.limit
    # Lowering the limit gives back at once what is over it.
    native.keep_memory(MIB)
    assert native.kept_memory()[1:3] == (0, 0)


def test_small_results_are_not_kept(session: native.GradientStreamSession) -> None:
    # 14 chunks of 65536 values: the result's room (whole chunks) stays under 4 MiB.
    wire = session.encode_frames(grad(14 * 65536 - 1000, 4))
    session.decode_frames(wire)  # dropped at once
    assert native.kept_memory().blocks == 0


def test_frames_as_a_buffer_are_kept_and_stay_the_same_frames(
    session: native.GradientStreamSession,
) -> None:
    g = grad(BIG, 5)
    expected = session.encode_frames(g)
    first = session.encode_frames(g, as_buffer=True)
    del first
    reused = native.kept_memory().reused
    second = session.encode_frames(g, as_buffer=True)
    assert native.kept_memory().reused == reused + 1
    assert second.to_pybytes() == expected


def test_receive_from_a_socket_into_a_kept_block() -> None:
    sender = native.GradientStreamSession("kept", 65536)
    receiver = native.GradientStreamSession("kept", 65536)
    grads = [grad(BIG, 10 + i) for i in range(3)]

    async def transfers() -> list[np.ndarray]:
        a, b = socket.socketpair()
        with a, b:
            first, _ = await asyncio.gather(receiver.receive_from(b), sender.stream_to(grads[0], a))
            assert np.array_equal(bits(first), bits(grads[0]))
            del first
            before = native.kept_memory().reused
            second, _ = await asyncio.gather(
                receiver.receive_from(b), sender.stream_to(grads[1], a)
            )
            assert native.kept_memory().reused > before
            third, _ = await asyncio.gather(receiver.receive_from(b), sender.stream_to(grads[2], a))
            return [second, third]

    second, third = asyncio.run(transfers())
    assert np.array_equal(bits(second), bits(grads[1]))
    assert np.array_equal(bits(third), bits(grads[2]))
    assert not np.shares_memory(second, third)


@pytest.mark.parametrize("bad", [-1, 1.5, "1", True, None])
def test_a_limit_that_is_not_a_byte_count_is_refused(bad: object) -> None:
    before = native.kept_memory().limit
    with pytest.raises(SettingError) as caught:
        native.keep_memory(bad)  # type: ignore[arg-type]
    assert caught.value.setting == "limit"
    assert native.kept_memory().limit != bad
    assert native.kept_memory().limit == before


def frames_of(session: native.GradientStreamSession, g: np.ndarray) -> bytes:
    """The frames of `g` by way of a pyarrow.Buffer, which the bytes slot never sees."""
    return session.encode_frames(g, as_buffer=True).to_pybytes()


def run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(("text", "limit"), [("0", 0), ("12345", 12345), (" 1048576 ", MIB)])
def test_the_environment_sets_the_limit_at_import(text: str, limit: int) -> None:
    done = run(
        "import gradstream; print(gradstream.kept_memory().limit)", {"GRADSTREAM_KEEP_MEMORY": text}
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) == limit


@pytest.mark.parametrize("text", ["lots", "-5", "1.5"])
def test_a_bad_environment_value_fails_the_import_naming_the_variable(text: str) -> None:
    done = run("import gradstream", {"GRADSTREAM_KEEP_MEMORY": text})
    assert done.returncode != 0
    assert "SettingError" in done.stderr and "GRADSTREAM_KEEP_MEMORY" in done.stderr


def test_a_child_forked_while_other_threads_decode_can_decode() -> None:
    """Every process-wide lock of ours (the allocator's, the template cache's) is held by
    fork handlers across a fork: a child forked while a thread decodes (a template
    lookup per chunk, large blocks kept and taken) finds them free, never held for ever
    by a thread it does not have. Before the handlers, such a child hung in the template
    cache's lock about once in a few hundred forks."""
    code = """
import os, threading, numpy as np, gradstream as gs
s = gs.GradientStreamSession("fork", 4096)
wire = s.encode_frames(np.ones(2_000_000, np.float32))
stop = threading.Event()
def churn():
    while not stop.is_set():
        s.decode_frames(wire)
t = threading.Thread(target=churn); t.start()
for _ in range(100):
    pid = os.fork()
    if pid == 0:
        ok = float(s.decode_frames(wire).sum()) == 2_000_000.0
        os._exit(0 if ok else 3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
stop.set(); t.join()
print("ok")
"""
    done = run(code, {})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_a_dropped_bytes_result_is_written_again_with_a_fresh_hash(
    session: native.GradientStreamSession,
) -> None:
    """The last large ``bytes`` nobody else holds is the next one of its length: the new
    frames in it, and its hash the new frames' hash (the cached one was reset)."""
    first, second = grad(BIG, 20), grad(BIG, 21)
    wire = session.encode_frames(first)
    old_id, old_hash = id(wire), hash(wire)
    # The frames of a pyarrow.Buffer: made without the bytes slot.
    expected = session.encode_frames(second, as_buffer=True).to_pybytes()
    del wire
    before = native.kept_memory()
    assert before.blocks >= 1 and before.held >= len(expected)
    again = session.encode_frames(second)
    assert id(again) == old_id
    assert native.kept_memory().reused == before.reused + 1
    assert again == expected
    assert hash(again) == hash(expected) != old_hash
    assert {again: 1}[expected] == 1


@pytest.mark.parametrize("hold", ["name", "memoryview", "dict key", "list"])
def test_a_bytes_result_someone_still_holds_is_never_written_again(
    session: native.GradientStreamSession, hold: str
) -> None:
    g = grad(BIG, 22)
    wire = session.encode_frames(g)
    copy = bytes(wire)
    held: object = {
        "name": wire,
        "memoryview": memoryview(wire),
        "dict key": {wire: 0},
        "list": [wire],
    }[hold]
    del wire
    other = session.encode_frames(grad(BIG, 23))
    assert other != copy
    if hold == "memoryview":
        assert isinstance(held, memoryview)
        assert held.tobytes() == copy
    elif hold == "name":
        assert held == copy
    elif hold == "dict key":
        assert isinstance(held, dict)
        assert next(iter(held)) == copy
    else:
        assert isinstance(held, list)
        assert held[0] == copy


def test_a_bytes_result_of_another_length_is_not_reused(
    session: native.GradientStreamSession,
) -> None:
    session.encode_frames(grad(BIG, 24))  # dropped at once: the slot holds it
    shorter = grad(BIG - 65536, 25)
    expected = frames_of(session, shorter)
    reused = native.kept_memory().reused
    other = session.encode_frames(shorter)
    assert native.kept_memory().reused == reused
    assert other == expected
    del other
    # Now the slot holds the shorter one, and the same length again is written into it.
    again = session.encode_frames(shorter)
    assert native.kept_memory().reused == reused + 1
    assert again == expected


def test_keeping_nothing_drops_the_last_bytes(session: native.GradientStreamSession) -> None:
    wire = session.encode_frames(grad(BIG, 27))
    del wire
    assert native.kept_memory().held > 0
    native.keep_memory(0)
    assert native.kept_memory()[1:3] == (0, 0)
    reused = native.kept_memory().reused
    session.encode_frames(grad(BIG, 28))
    session.encode_frames(grad(BIG, 28))
    assert native.kept_memory().reused == reused
