"""No offline guessing of the authkey (docs/spec/threat-model.md, "What the authkey
resists"): what one connection gives an attacker, as a client at a listener, as a fake
listener a client dials, or as an eavesdropper who records a connection, lets it test no
guessed key offline.

Protocol version 1 let it: a listener sent its tag, HMAC-SHA256 over the authkey and the
hellos, to any client whose hello asked for authentication, and a client sent its own to
whatever listener it dialled; a dictionary of keys was then tested against that one tag
at the speed of HMAC (the issue's attack found ``summer2026summer`` in 0.001 s). Version
2's SPAKE2 exchange sends no function of the key alone: the attack code below, run on
what a connection now gives, finds nothing, while the same code finds the key in a
version 1 transcript and in a version 2 connection whose one online guess was right (the
only guess a fake peer gets: SPAKE2 lets it test the key its own element was made with,
once a connection; and a listener answers only a client tag it verified, so a fake
client learns even that only by sending a tag the listener counts as a failure).

The attack code speaks both versions by itself (a version 1 listener, a version 2 one),
with ``spake2`` and the standard library only, so that this file also runs against a
build from before the change, where the first three tests fail.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import struct
from dataclasses import dataclass, field

import pytest
from spake2 import SPAKE2_A, SPAKE2_B  # type: ignore[import-untyped]
from spake2.parameters.ed25519 import ParamsEd25519  # type: ignore[import-untyped]

import gradstream as gs
from gradstream.errors import GradientStreamError
from support.connections import LOCAL, Proxy, run

KEY = b"summer2026summer"  # 16 bytes, the minimum: the key the attack found
# A guesser's dictionary, the key among its words.
WORDS = [
    f"{season}{year}{season}".encode()
    for season in ("spring", "summer", "autumn", "winter")
    for year in range(2000, 2031)
]
assert KEY in WORDS
WRONG_GUESS = WORDS[0]  # the one key a fake peer's element is made with

ID_CLIENT, ID_SERVER = b"gradstream client", b"gradstream server"
LABELS_V1 = (b"gradstream/1 client", b"gradstream/1 server")
LABELS_V2 = (b"gradstream/2 client", b"gradstream/2 server")


def hello(role: int, version: int, auth: int = 1) -> bytes:
    head = b"GSHL" + bytes(8) + struct.pack("<HH", version, 80)
    body = (
        struct.pack("<BBH", role, auth, 0) + os.urandom(32) + struct.pack("<QI", 1 << 30, 1 << 28)
    )
    return head + body + bytes(16)


@dataclass
class Seen:
    """What one connection gave the attacker: both hellos, every 48-byte message after
    them (key exchange and auth messages), and, for a fake peer, the scalar and the key
    its own element was made with."""

    client_hello: bytes
    server_hello: bytes
    messages: list[bytes] = field(default_factory=list)
    seed: bytes | None = None  # a fake peer's: its SPAKE2 scalar's 64 bytes
    role: int = 0  # a fake peer's role: 1 client (SPAKE2's A), 2 server (B)

    def version(self) -> int:
        return int(struct.unpack_from("<H", self.server_hello, 12)[0])

    def tags(self) -> list[bytes]:
        return [m[16:] for m in self.messages if m[:4] == b"GSAU"]

    def elements(self) -> dict[bytes, bytes]:
        """The SPAKE2 elements, by who sent them: b"A" the client's, b"B" the server's."""
        pakes = [m[16:] for m in self.messages if m[:4] == b"GSPK"]
        return dict(zip((b"A", b"B"), pakes, strict=False))


def exchange(role: int, guess: bytes, seed: bytes) -> tuple[object, bytes]:
    """A fake peer's SPAKE2 side, made with the key it guessed: (state, its message)."""
    side = SPAKE2_A if role == 1 else SPAKE2_B
    state = side(guess, idA=ID_CLIENT, idB=ID_SERVER, entropy_f=lambda n: seed[::-1])
    element = state.start()[1:]
    return state, b"GSPK" + bytes(12) + element


# --------------------------------------------------------------------------- the attack, offline


def version1_guesses(seen: Seen) -> list[bytes]:
    """The words whose version 1 tag is one the connection carried."""
    nonces = seen.client_hello[20:52] + seen.server_hello[20:52]
    hellos = hashlib.sha256(seen.client_hello + seen.server_hello).digest()
    tags = set(seen.tags())
    return [
        word
        for word in WORDS
        if any(
            hmac.new(word, label + nonces + hellos, "sha256").digest() in tags
            for label in LABELS_V1
        )
    ]


def version2_guesses(seen: Seen) -> list[bytes]:
    """The words under which the victim's version 2 tag is what the fake peer computes
    from its own scalar: SPAKE2's key needs one side's scalar, and a fake peer has only
    its own, whose element was made with one guess. For each word w it takes the
    victim's element E and computes Z = scalar * (E - w * blinding), the key
    K = SHA-256(SHA-256(w) || SHA-256(idA) || SHA-256(idB) || X || Y || Z) and the
    victim's tag under K. (An eavesdropper, with no scalar at all, has nothing to
    compute.)"""
    if seen.seed is None or seen.version() < 2:
        return []
    group = ParamsEd25519.group
    scalar = group.random_scalar(lambda n: seen.seed[::-1])
    elements = seen.elements()
    victim_side = b"B" if seen.role == 1 else b"A"
    victim = group.bytes_to_element(elements[victim_side])
    blinding = ParamsEd25519.N if victim_side == b"B" else ParamsEd25519.M
    victim_label = LABELS_V2[0 if victim_side == b"A" else 1]
    hellos = hashlib.sha256(seen.client_hello + seen.server_hello).digest()
    found = []
    for word in WORDS:
        w = group.password_to_scalar(word)
        z = victim.add(blinding.scalarmult(-w)).scalarmult(scalar).to_bytes()
        transcript = b"".join(
            [hashlib.sha256(x).digest() for x in (word, ID_CLIENT, ID_SERVER)]
            + [elements[b"A"], elements[b"B"], z]
        )
        key = hashlib.sha256(transcript).digest()
        if hmac.new(key, victim_label + hellos, "sha256").digest() in seen.tags():
            found.append(word)
    return found


def guesses(seen: Seen) -> list[bytes]:
    return version1_guesses(seen) + version2_guesses(seen)


# --------------------------------------------------------------------------- the attacks, online


async def fake_client(address: tuple[str, int], guess: bytes) -> Seen:
    """Connect to a listener, ask for authentication in the listener's own version, run
    its exchange with ``guess`` (version 2), and keep all it sends."""
    reader, writer = await asyncio.open_connection(*address)
    try:
        server_hello = await reader.readexactly(80)
        version = struct.unpack_from("<H", server_hello, 12)[0]
        seen = Seen(hello(1, version), server_hello, seed=os.urandom(64), role=1)
        writer.write(seen.client_hello)
        if version < 2:
            seen.messages.append(await reader.readexactly(48))  # its tag, at once
            return seen
        assert seen.seed is not None
        state, message = exchange(1, guess, seen.seed)
        seen.messages.append(message)
        writer.write(message)
        seen.messages.append(await reader.readexactly(48))  # the listener's element
        # The listener answers only a tag it verified: send this side's, under the guess.
        key = state.finish(b"B" + seen.messages[-1][16:])  # type: ignore[attr-defined]
        hellos = hashlib.sha256(seen.client_hello + seen.server_hello).digest()
        tag = hmac.new(key, LABELS_V2[0] + hellos, "sha256").digest()
        writer.write(b"GSAU" + bytes(12) + tag)
        try:  # the listener's tag if the guess was right, else the end
            seen.messages.append(await reader.readexactly(48))
        except asyncio.IncompleteReadError as end:
            assert end.partial == b""
        return seen
    finally:
        writer.close()


async def fake_listener(guess: bytes) -> Seen:
    """Listen; let the native client with KEY dial; answer in the client's version, run
    the exchange with ``guess`` (version 2); keep all the client sends."""
    got: asyncio.Future[Seen] = asyncio.get_running_loop().create_future()

    async def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            client_hello = await reader.readexactly(80)
            version = struct.unpack_from("<H", client_hello, 12)[0]
            seen = Seen(client_hello, hello(2, version), seed=os.urandom(64), role=2)
            writer.write(seen.server_hello)
            if version >= 2:
                assert seen.seed is not None
                seen.messages.append(await reader.readexactly(48))  # the client's element
                _, message = exchange(2, guess, seen.seed)
                seen.messages.append(message)
                writer.write(message)
            seen.messages.append(await reader.readexactly(48))  # the client's tag
            got.set_result(seen)
        except BaseException as exc:
            got.set_exception(exc)
        finally:
            writer.close()

    server = await asyncio.start_server(on_connection, "127.0.0.1", 0)
    try:
        with pytest.raises(GradientStreamError):
            await gs.connect(server.sockets[0].getsockname()[:2], authkey=KEY, timeout=5)
        return await got
    finally:
        server.close()


# --------------------------------------------------------------------------- the tests


def test_a_client_at_the_listener_gets_nothing_to_test_guessed_keys_against() -> None:
    # The reproduction: one connection, then the dictionary offline.
    async def main() -> Seen:
        async with await gs.listen(LOCAL, authkey=KEY) as listener:
            return await fake_client(listener.address, WRONG_GUESS)

    seen = run(main)
    assert guesses(seen) == []


def test_a_fake_listener_gets_nothing_to_test_guessed_keys_against() -> None:
    seen = run(lambda: fake_listener(WRONG_GUESS))
    assert seen.tags(), "the client sent its tag (it does, after the exchange)"
    assert guesses(seen) == []


def test_a_recorded_connection_gives_nothing_to_test_guessed_keys_against() -> None:
    # An eavesdropper records a whole handshake between two sides that hold the key.
    async def main() -> Seen:
        async with await gs.listen(LOCAL, authkey=KEY) as listener:
            proxy = Proxy(listener.address)
            accepting = asyncio.create_task(listener.accept())
            async with await gs.connect(await proxy.start(), authkey=KEY):
                async with await accepting:
                    pass
            await proxy.close()
        up, down = bytes(proxy.upstream), bytes(proxy.downstream)
        seen = Seen(up[:80], down[:80])
        for stream in (up, down):
            seen.messages += [stream[i : i + 48] for i in range(80, len(stream) - 47, 48)]
        return seen

    seen = run(main)
    assert len(seen.tags()) == 2
    assert guesses(seen) == []


def test_the_attack_code_finds_the_key_where_there_is_something_to_find() -> None:
    # A version 1 transcript (two test peers of the older version, by hand): the tags
    # are HMACs under the key, and the dictionary finds it.
    client_hello, server_hello = hello(1, 1), hello(2, 1)
    nonces = client_hello[20:52] + server_hello[20:52]
    hellos = hashlib.sha256(client_hello + server_hello).digest()
    tag = hmac.new(KEY, LABELS_V1[1] + nonces + hellos, "sha256").digest()
    old = Seen(client_hello, server_hello, [b"GSAU" + bytes(12) + tag])
    assert guesses(old) == [KEY]

    # Version 2, a fake client whose one online guess was the key: its computation gives
    # the listener's tag under that word, and under no other.
    async def main() -> Seen:
        async with await gs.listen(LOCAL, authkey=KEY) as listener:
            return await fake_client(listener.address, KEY)

    assert guesses(run(main)) == [KEY]
