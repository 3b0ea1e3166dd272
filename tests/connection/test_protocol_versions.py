"""Peers of another protocol version (docs/spec/protocol.md, versions): the test peer
speaking version 1, the protocol before the authkey's SPAKE2 exchange (HMAC tags under
the key itself), with and without an authkey, at the native listener and dialled by the
native client. Each side refuses the other at its hello, before any key is used, with a
ProtocolError that names the side to upgrade; the native listener goes on serving the
others.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

import gradstream as gs
from gradstream.errors import AuthenticationError, ProtocolError
from support import peer
from support.connections import KEY, LOCAL, run
from support.peer import messages as p

OLDER = (
    "expected a hello of version 2, got a hello of version 1 (an older gradstream: "
    "upgrade the peer)"
)
NEWER = (
    "expected a hello of version 1, got a hello of version 2 (a newer gradstream: "
    "upgrade this side)"
)

KEYS = pytest.mark.parametrize("authkey", [None, KEY], ids=["plain", "authkey"])


@KEYS
def test_an_older_client_is_refused_and_told_to_upgrade_this_side(
    authkey: bytes | None, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> BaseException:
        async with await gs.listen(LOCAL, authkey=authkey) as listener:
            with pytest.raises(ProtocolError) as info:
                await peer.connect(listener.address, authkey=authkey, version=p.OLD_VERSION)
            # The listener goes on: a client of this version is served.
            accepting = asyncio.create_task(listener.accept())
            async with await gs.connect(listener.address, authkey=authkey):
                await (await accepting).close()
            return info.value

    with caplog.at_level(logging.WARNING, logger="gradstream"):
        error = run(main)
    assert NEWER in str(error)  # what the older side's own check says
    refusals = [r.getMessage() for r in caplog.records if " refused " in r.getMessage()]
    assert len(refusals) == 1 and OLDER in refusals[0], refusals


@KEYS
def test_an_older_listener_is_refused_with_the_fix(authkey: bytes | None) -> None:
    async def main() -> tuple[BaseException, list[BaseException]]:
        async with await peer.listen(LOCAL, authkey=authkey, version=p.OLD_VERSION) as listener:
            with pytest.raises(ProtocolError) as info:
                await gs.connect(listener.address, authkey=authkey)
            # The older listener reads the hello, and refuses it (a generous bound).
            for _ in range(500):
                if listener.failures:
                    break
                await asyncio.sleep(0.01)
            return info.value, list(listener.failures)

    error, failures = run(main)
    assert isinstance(error, ProtocolError) and OLDER in str(error)
    assert error.expected == "a hello of version 2"
    assert [NEWER in str(f) for f in failures] == [True]


def test_an_older_peers_tag_is_never_computed_nor_checked() -> None:
    # A version 1 client that sends its HMAC tag right behind its hello: the listener
    # refuses the hello, and sends nothing but its own hello and SPAKE2 element (no
    # tag of any kind).
    async def main() -> bytes:
        async with await gs.listen(LOCAL, authkey=KEY) as listener:
            reader, writer = await asyncio.open_connection(*listener.address)
            old = p.encode_hello(p.Hello(1, 1, bytes(32), 1 << 30, 1 << 28), p.OLD_VERSION)
            writer.write(old + p.encode_auth(bytes(32)))
            got = await reader.read()
            writer.close()
            return got

    got = run(main)
    assert len(got) == 80 + 48 and got[80:84] == b"GSPK"


def test_a_version_1_hello_with_an_authkey_is_a_protocol_error_not_an_authentication_one() -> None:
    # The version decides first: an older peer is told to upgrade, not that its key is
    # wrong.
    async def main() -> BaseException:
        async with await peer.listen(LOCAL, authkey=KEY, version=p.OLD_VERSION) as listener:
            with pytest.raises((ProtocolError, AuthenticationError)) as info:
                await gs.connect(listener.address, authkey=KEY)
            return info.value

    assert type(run(main)) is ProtocolError
