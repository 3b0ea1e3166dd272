"""The ack (docs/spec/protocol.md, step 4): ``send`` returns only once the peer verified
the transfer, and raises DeliveryError when a hostile or failing receiver refuses it,
acks another digest or another counter, or closes first; a frame header where the ack
belongs is a ProtocolError. The real receiver refuses what its rules refuse, with the
reason, and the sender refuses before a byte goes what the peer's hello says it will not
take. The native sender against a receiver by hand, the native receiver against a sender
by hand, and real connections: native with native and with the test peer (``pair``), the
native listener's own keywords with either dialler (``dialler``), the native dialler's
checks with either listener (``acceptor``)."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Awaitable, Callable
from types import ModuleType
from typing import Any

import numpy as np
import pytest

import gradstream as gs
import gradstream.reference as ref
from gradstream.errors import (
    DeliveryError,
    GradientDtypeError,
    GradientSizeError,
    ProtocolError,
    SettingError,
    StreamIOError,
    TensorSetError,
)
from gradstream.reference._manifest import Entry, manifest_json
from gradstream.reference._tensors import manifest_frame
from support.connections import (
    LOCAL,
    Streams,
    frames_by_hand,
    hello_by_hand,
    hostile_listener,
    raw_peer,
    read_to_end,
    run,
    sealed_frames,
)
from support.peer import messages as p

GRAD = np.arange(3000, dtype=np.float32)
S = ref.GradientStreamSession("s", 1024)


def first_id(client: bytes, server: bytes, counter: int = 0) -> bytes:
    return p.transfer_id(client, server, p.TO_SERVER, counter)


Pair = tuple[ModuleType, ModuleType]


async def send_to_hostile(script: object) -> BaseException | int:
    """connect to a listener running ``script`` after its handshake, send GRAD; what
    send gave or raised, and whether the connection was closed after."""
    async with hostile_listener(script) as address:  # type: ignore[arg-type]
        conn = await gs.connect(address, session=gs.GradientStreamSession("s", 1024))
        try:
            return await conn.send(GRAD)
        except (DeliveryError, ProtocolError) as exc:
            assert conn.closed  # out of step: closed
            return exc
        finally:
            await conn.close()


def test_a_correct_ack_by_hand_is_accepted() -> None:
    async def script(streams: Streams, client: bytes, server: bytes) -> None:
        headers = await frames_by_hand(streams[0])
        digest = p.ack_digest(first_id(client, server), headers)
        streams[1].write(p.encode_ack(p.Ack(0, digest, None)))
        await read_to_end(streams[0])

    assert run(lambda: send_to_hostile(script)) == 3


def test_a_refusal_is_a_delivery_error_with_the_reason() -> None:
    async def script(streams: Streams, client: bytes, server: bytes) -> None:
        await frames_by_hand(streams[0])
        streams[1].write(p.encode_ack(p.Ack(0, bytes(32), "chunk 1 failed its CRC check")))

    exc = run(lambda: send_to_hostile(script))
    assert isinstance(exc, DeliveryError)
    assert exc.reason == "chunk 1 failed its CRC check"
    assert exc.peer is not None and exc.peer[0] == "127.0.0.1"
    assert str(exc).endswith("the peer refused it: chunk 1 failed its CRC check")


def test_an_ack_of_another_digest_is_a_delivery_error() -> None:
    async def script(streams: Streams, client: bytes, server: bytes) -> None:
        headers = await frames_by_hand(streams[0])
        headers[0], headers[1] = headers[1], headers[0]  # the frames in another order
        digest = p.ack_digest(first_id(client, server), headers)
        streams[1].write(p.encode_ack(p.Ack(0, digest, None)))

    exc = run(lambda: send_to_hostile(script))
    assert isinstance(exc, DeliveryError) and exc.reason is None
    assert "the peer acknowledged other frames than were sent" in str(exc)


def test_an_ack_keyed_by_another_transfer_id_is_a_delivery_error() -> None:
    async def script(streams: Streams, client: bytes, server: bytes) -> None:
        headers = await frames_by_hand(streams[0])
        # The right headers under the id of the other direction: a reflected ack.
        digest = p.ack_digest(p.transfer_id(client, server, p.TO_CLIENT, 0), headers)
        streams[1].write(p.encode_ack(p.Ack(0, digest, None)))

    exc = run(lambda: send_to_hostile(script))
    assert isinstance(exc, DeliveryError)
    assert "acknowledged other frames" in str(exc)


def test_an_ack_of_another_counter_is_a_delivery_error() -> None:
    async def script(streams: Streams, client: bytes, server: bytes) -> None:
        headers = await frames_by_hand(streams[0])
        digest = p.ack_digest(first_id(client, server), headers)
        streams[1].write(p.encode_ack(p.Ack(1, digest, None)))

    exc = run(lambda: send_to_hostile(script))
    assert isinstance(exc, DeliveryError)
    assert "the peer acknowledged transfer 1; this was transfer 0" in str(exc)


def test_closing_before_the_ack_is_a_delivery_error() -> None:
    async def script(streams: Streams, client: bytes, server: bytes) -> None:
        await frames_by_hand(streams[0])

    exc = run(lambda: send_to_hostile(script))
    assert isinstance(exc, DeliveryError)
    assert "the connection ended before the peer acknowledged the transfer" in str(exc)


def test_a_frame_header_where_the_ack_belongs_is_a_protocol_error() -> None:
    async def script(streams: Streams, client: bytes, server: bytes) -> None:
        await frames_by_hand(streams[0])
        streams[1].write(S.encode_frames(np.ones(3, np.float32)))  # a gradient back instead
        await read_to_end(streams[0])

    exc = run(lambda: send_to_hostile(script))
    assert isinstance(exc, ProtocolError)
    assert exc.expected == "an ack"
    assert exc.seen.startswith("a frame header (chunk 0 of 1,")
    assert "the peer started a transfer while this side waited for its ack" in exc.seen


def test_two_sends_at_once_from_both_sides_are_protocol_errors(pair: Pair) -> None:
    server_side, client_side = pair

    async def main() -> list[BaseException | int]:
        s = server_side.GradientStreamSession("s", 1024)
        async with await server_side.listen(LOCAL, session=s) as listener:
            c = client_side.GradientStreamSession("s", 1024)
            client = await client_side.connect(listener.address, session=c)
            server = await listener.accept()
            results = await asyncio.gather(
                client.send(GRAD), server.send(GRAD), return_exceptions=True
            )
            await client.close()
            await server.close()
            return results

    results = run(main)
    assert all(isinstance(r, ProtocolError) and r.expected == "an ack" for r in results), results


def test_a_second_gradient_is_acked_with_its_counter() -> None:
    async def script(streams: Streams, client: bytes, server: bytes) -> None:
        for k in range(3):
            headers = await frames_by_hand(streams[0])
            digest = p.ack_digest(first_id(client, server, k), headers)
            streams[1].write(p.encode_ack(p.Ack(k, digest, None)))
        await read_to_end(streams[0])

    async def main() -> list[int]:
        async with hostile_listener(script) as address:
            s = gs.GradientStreamSession("s", 1024)
            async with await gs.connect(address, session=s) as conn:
                return [await conn.send(GRAD) for _ in range(3)]

    assert run(main) == [3, 3, 3]


# --------------------------------------------------------------------------- the real receiver


def test_the_receiver_refuses_what_its_rules_refuse_and_says_why() -> None:
    # A sender by hand whose second chunk's CRC is wrong: the listener's connection raises
    # the ChecksumMismatchError, answers with a refusal naming it, and closes.

    async def main() -> tuple[BaseException, p.Ack, bytes]:
        s = gs.GradientStreamSession("s", 1024)
        async with await gs.listen(LOCAL, session=s) as listener:
            async with raw_peer(listener.address) as streams:
                nonces = await hello_by_hand(streams, p.ROLE_CLIENT)
                frames = bytearray(sealed_frames(GRAD, *nonces))
                second = 16 + struct.unpack_from("<I", frames, 8)[0]
                struct.pack_into("<I", frames, second + 12, 0xDEADBEEF)
                conn = await listener.accept()
                streams[1].write(bytes(frames))
                with pytest.raises(Exception) as info:
                    await conn.recv()
                assert conn.closed
                head = await streams[0].readexactly(16)
                rest = p.check_ack_head(head, None)
                ack = p.parse_ack(head + await streams[0].readexactly(rest), None)
                return info.value, ack, await read_to_end(streams[0])

    error, ack, after = run(main)
    assert type(error).__name__ == "ChecksumMismatchError"
    assert ack.counter == 0 and ack.reason == str(error)
    assert after == b""  # and nothing after the refusal


Receive = Callable[[Any], Awaitable[object]]
Send = Callable[[Any], Awaitable[int]]


def refused(
    pair: Pair, receive: Receive, refusal: type[Exception], send: Send, **listen: Any
) -> DeliveryError:
    """A real listener whose connection's ``receive`` raises ``refusal``, and the
    DeliveryError a real sender's ``send`` raises for it (its connection then closed)."""
    server, client = pair

    async def main() -> DeliveryError:
        async with await server.listen(LOCAL, **listen) as listener:

            async def receiving() -> None:
                async with await listener.accept() as conn:
                    with pytest.raises(refusal):
                        await receive(conn)
                    assert conn.closed  # a refused transfer leaves it out of step

            task = asyncio.create_task(receiving())
            async with await client.connect(listener.address) as conn:
                with pytest.raises(DeliveryError) as info:
                    await send(conn)
                assert conn.closed
            await task
            return info.value

    return run(main)


def test_the_sender_gets_the_receivers_reason(pair: Pair) -> None:
    # A one-frame gradient the receiver refuses (its out= is float64): every byte was
    # read, so the refusal is the last thing on the wire and reaches the sender.
    exc = refused(
        pair,
        lambda conn: conn.recv(out=np.empty(100, np.float64)),
        GradientDtypeError,
        lambda conn: conn.send(np.ones(100, np.float32)),
    )
    assert exc.reason == "the gradient is float32; out= is float64"


def test_a_tensor_set_over_the_receivers_limit_is_refused_with_the_reason(pair: Pair) -> None:
    exc = refused(
        pair,
        lambda conn: conn.recv_tensors(),
        TensorSetError,
        lambda conn: conn.send_tensors({"w": np.ones(11, np.float32)}),
        session=pair[0].GradientStreamSession("s", 1024, max_gradient_len=10),
    )
    assert exc.reason == "tensor set holds 11 values, above max_gradient_len 10"


def test_a_tensor_set_over_this_receive_s_max_values_is_refused_from_its_manifest(
    dialler: ModuleType,
) -> None:
    # 4 Mi values declared, 10 allowed: refused from the manifest, so the receiver
    # neither reads nor holds the values, and the sender is told why.
    exc = refused(
        (gs, dialler),
        lambda conn: conn.recv_tensors(max_values=10),
        TensorSetError,
        lambda conn: conn.send_tensors({"a": np.ones(6, np.float32), "b": np.ones(4 << 20)}),
    )
    assert (
        exc.reason == f"tensor set holds {6 + (4 << 20)} values, above this receive's max_values 10"
    )


def test_max_values_bounds_one_receive_and_the_session_s_limit_still_applies(
    dialler: ModuleType,
) -> None:
    server_side, client = gs, dialler
    small = server_side.GradientStreamSession("s", 1024, max_gradient_len=20)
    sets = [
        {"a": np.arange(6, dtype=np.float32), "b": np.ones((5,), np.float64)},  # 11 = max_values
        {"e": np.empty((0, 3), np.float32)},  # 0 values, max_values 0
        {"w": np.ones(20, np.float32)},  # no max_values: the session's 20
        {"w": np.arange(20, dtype=np.float32)},  # a bound past any int of the machine
    ]
    bounds = [11, 0, None, 2**64]

    async def main() -> None:
        async with await server_side.listen(LOCAL, session=small) as listener:
            async with await client.connect(listener.address) as conn:
                server = await listener.accept()
                for tensors, bound in zip(sets, bounds, strict=True):
                    receiving = asyncio.create_task(server.recv_tensors(max_values=bound))
                    await conn.send_tensors(tensors)
                    got = await receiving
                    assert list(got) == list(tensors)
                    for name, values in tensors.items():
                        assert got[name].dtype == values.dtype
                        assert got[name].tobytes() == values.tobytes()
                # Over both limits: the session's is checked first, and named.
                receiving = asyncio.create_task(server.recv_tensors(max_values=5))
                with pytest.raises(DeliveryError) as info:
                    await conn.send_tensors({"w": np.ones(21, np.float32)})
                with pytest.raises(TensorSetError) as refusal:
                    await receiving
                assert (
                    refusal.value.detail == "tensor set holds 21 values, above max_gradient_len 20"
                )
                assert info.value.reason == refusal.value.detail
                await server.close()

    run(main)


@pytest.mark.parametrize(
    "bad, error, text",
    [
        (-1, SettingError, "max_values must be at least 0, got -1"),
        (True, TypeError, "max_values must be an int, not bool"),
        (1.5, TypeError, "'float' object cannot be interpreted as an integer"),
        ("3", TypeError, "'str' object cannot be interpreted as an integer"),
    ],
)
def test_a_bad_max_values_is_refused_before_the_receive_begins(
    dialler: ModuleType, bad: object, error: type[Exception], text: str
) -> None:
    server_side, client = gs, dialler

    async def main() -> None:
        async with await server_side.listen(LOCAL) as listener:
            async with await client.connect(listener.address) as conn:
                server = await listener.accept()
                with pytest.raises(error) as info:
                    await server.recv_tensors(max_values=bad)
                assert str(info.value) == text
                # deadline= is checked first.
                with pytest.raises(SettingError) as first:
                    await server.recv_tensors(deadline=-1.0, max_values=bad)
                assert first.value.setting == "deadline"
                assert not server.closed  # nothing was read: still in step
                receiving = asyncio.create_task(server.recv_tensors(max_values=3))
                assert await conn.send_tensors({"x": np.ones(3, np.float32)}) == 2
                assert (await receiving)["x"].tolist() == [1.0, 1.0, 1.0]
                await server.close()

    run(main)


def test_max_values_refuses_a_set_from_its_manifest_alone() -> None:
    # A sender by hand sends the manifest of a 4 Mi-value set and then nothing: the
    # receiver refuses it at once, with no value on the wire, and tells the sender.
    text = manifest_json([Entry("w", "float32", (4 << 20,))])

    async def main() -> tuple[BaseException, p.Ack]:
        s = gs.GradientStreamSession("s", 1024)
        async with await gs.listen(LOCAL, session=s) as listener:
            async with raw_peer(listener.address) as streams:
                client, server = await hello_by_hand(streams, p.ROLE_CLIENT)
                transfer = p.transfer_id(client, server, p.TO_SERVER, 0)
                streams[1].write(manifest_frame(s.layout, s.compression, text, transfer))
                conn = await listener.accept()
                with pytest.raises(TensorSetError) as info:
                    await asyncio.wait_for(conn.recv_tensors(max_values=10), 5)
                assert conn.closed
                head = await streams[0].readexactly(16)
                rest = p.check_ack_head(head, None)
                return info.value, p.parse_ack(head + await streams[0].readexactly(rest), None)

    error, ack = run(main)
    assert str(error) == f"tensor set holds {4 << 20} values, above this receive's max_values 10"
    assert ack.counter == 0 and ack.reason == str(error)


def test_the_sender_refuses_a_gradient_over_the_peers_limit_before_a_byte(
    acceptor: ModuleType,
) -> None:
    server_side, client = acceptor, gs
    small = server_side.GradientStreamSession("s", 1024, max_gradient_len=100)

    async def main() -> None:
        async with await server_side.listen(LOCAL, session=small) as listener:
            async with await client.connect(listener.address) as conn:
                with pytest.raises(DeliveryError) as info:
                    await conn.send(np.ones(101, np.float32))
                assert info.value.detail == (
                    "the gradient holds 101 values, above the peer's max_gradient_len 100; "
                    "nothing was sent"
                )
                assert not conn.closed  # nothing was sent: still in step
                server = await listener.accept()
                receiving = asyncio.create_task(server.recv())
                assert await conn.send(np.ones(100, np.float32)) == 1
                assert len(await receiving) == 100
                await server.close()

    run(main)


def test_the_sender_refuses_a_payload_over_the_peers_limit_before_a_byte(
    acceptor: ModuleType,
) -> None:
    server_side, client = acceptor, gs
    small = server_side.GradientStreamSession("s", 1024, max_payload_len=2000)

    async def main() -> str:
        async with await server_side.listen(LOCAL, session=small) as listener:
            s = client.GradientStreamSession("s", 1024)
            async with await client.connect(listener.address, session=s) as conn:
                with pytest.raises(DeliveryError) as info:
                    await conn.send(GRAD)
                assert not conn.closed
                return info.value.detail

    detail = run(main)
    # The first chunk's (the largest) as the sender measures it before a byte: sealed as
    # every chunk of a connection is, in the connection's default layout (compact), its
    # values' payload (the core's check counts no gradient_shape metadata).
    sealed = client.GradientStreamSession("s", 1024, seal=True, layout="compact").encode_frames(
        GRAD
    )
    payload = struct.unpack_from("<I", sealed, 8)[0]
    assert detail == (
        f"chunk 0's payload of {payload} bytes is above the peer's max_payload_len 2000; use "
        "a smaller chunk_size"
    )


def test_a_sender_cut_off_midway_gets_the_refusal(pair: Pair) -> None:
    # The receiver refuses at chunk 1 (its out= is too small) while the sender still has
    # megabytes to write. The sender watches for the answer as it writes, stops at the
    # refusal and closes; the receiver drops what is still on the way until then, so
    # the refusal is not lost to a reset.
    exc = refused(
        pair,
        lambda conn: conn.recv(out=np.empty(100_000, np.float32)),
        GradientSizeError,
        lambda conn: conn.send(np.ones(1 << 22, np.float32)),
    )
    assert exc.reason == (
        "the gradient runs over the 100000 values out= has room for: 131072 values by chunk 1"
    )


def test_a_sender_without_a_listener_after_the_handshake() -> None:
    async def script(streams: Streams, client: bytes, server: bytes) -> None:
        pass  # the hostile listener closes right after the handshake

    exc = run(lambda: send_to_hostile(script))
    assert isinstance(exc, (DeliveryError, StreamIOError)), exc
