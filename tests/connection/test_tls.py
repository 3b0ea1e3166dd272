"""TLS (docs/guides/connections.md), with certificates made at test time (trustme, IP SAN
127.0.0.1): a TLS connection carries gradients and its bytes on the wire hold none of
them; mutual TLS names the client's certificate and refuses a client without one; a
certificate for another name, an unknown CA, TLS 1.2, a missing ALPN and a plaintext peer
on either side are each refused with a TlsError (or a clear ProtocolError), and the
listener goes on. Native with native and with the test peer (Python's ``ssl``) on either
side (``pair``: listener, dialler), or the native listener against a raw TLS peer. What a
native dialler says and what a native listener logs is checked wherever one is there;
the test peer only has to fail where the native side refuses it."""

from __future__ import annotations

import asyncio
import logging
import ssl
from types import ModuleType
from typing import Any

import numpy as np
import pytest

import gradstream as gs
from gradstream.errors import ProtocolError, SettingError, TlsError
from support.certs import CLIENT_CN, Certificates
from support.connections import KEY, LOCAL, Proxy, read_to_end, run

# What the test peer raises where the native side refuses it: its ssl's own errors, a
# connection the native side ended, or the protocol's errors.
PEER_FAILS = (ssl.SSLError, ConnectionError, ProtocolError, TlsError)

GRAD = np.arange(50_000, dtype=np.float32) * np.float32(1.25) + np.float32(0.1)


def refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if " refused " in r.getMessage()]


async def refusal_logged(caplog: pytest.LogCaptureFixture) -> None:
    """Until the listener has logged a refusal (the client may know first)."""
    while not refusals(caplog):
        await asyncio.sleep(0.01)


Pair = tuple[ModuleType, ModuleType]


def refused_as(side: ModuleType, native: type[Exception]) -> Any:
    """What ``side`` raises when it is refused: the native dialler's ``native`` error, or
    whatever the test peer meets."""
    return native if side is gs else PEER_FAILS


async def deliver(
    client: ModuleType, listener: Any, via: tuple[str, int] | None = None, **connect: Any
) -> tuple[Any, Any, np.ndarray]:
    """A real client of ``client`` sends GRAD (to ``via`` when given, else to the
    listener): (its view of the peer, the listener's, what arrived)."""

    async def receive() -> tuple[Any, np.ndarray]:
        async with await listener.accept() as conn:
            return conn.peer, await conn.recv()

    receiving = asyncio.create_task(receive())
    async with await client.connect(via or listener.address, **connect) as conn:
        assert await conn.send(GRAD) == 1
        client_view = conn.peer
    server_view, got = await receiving
    return client_view, server_view, got


def delivered(pair: Pair, listen: dict[str, Any], **connect: Any) -> tuple[Any, Any, np.ndarray]:
    """``deliver`` to a listener made with ``listen``."""
    server, client = pair

    async def main() -> tuple[Any, Any, np.ndarray]:
        async with await server.listen(LOCAL, **listen) as listener:
            return await deliver(client, listener, **connect)

    return run(main)


def test_a_tls_connection_carries_gradients(pair: Pair, certs: Certificates) -> None:
    client_view, server_view, got = delivered(pair, {"tls": certs.server}, tls=certs.client)
    assert np.array_equal(got, GRAD)
    # The client verified the server's certificate; the server verified nobody.
    assert client_view.authenticated and client_view.tls_subject is None
    assert not server_view.authenticated and server_view.tls_subject is None


def test_tls_and_authkey_together(pair: Pair, certs: Certificates) -> None:
    listen = {"tls": certs.server, "authkey": KEY}
    _, server_view, got = delivered(pair, listen, tls=certs.client, authkey=KEY)
    assert np.array_equal(got, GRAD) and server_view.authenticated


def test_the_wire_of_a_tls_transfer_holds_no_arrow_and_no_values(
    pair: Pair, certs: Certificates
) -> None:
    server, client = pair

    async def capture(tls: bool) -> bytes:
        async with await server.listen(LOCAL, tls=certs.server if tls else None) as listener:
            proxy = Proxy(listener.address)
            address = await proxy.start()
            settings = certs.client if tls else None
            _, _, got = await deliver(client, listener, address, tls=settings)
            assert np.array_equal(got, GRAD)
            await proxy.close()
            return bytes(proxy.upstream)

    plain = run(lambda: capture(False))
    wire = run(lambda: capture(True))
    values = GRAD.tobytes()
    windows = [values[k : k + 32] for k in range(0, len(values) - 32, 4096)]
    # The plaintext capture shows both, so the test can tell.
    assert b"ARROW1" in plain and all(w in plain for w in windows)
    assert len(wire) > len(values)
    assert b"ARROW1" not in wire and b"GSHL" not in wire
    assert not any(w in wire for w in windows)


def test_mutual_tls_names_the_client(pair: Pair, certs: Certificates) -> None:
    client_view, server_view, got = delivered(
        pair, {"tls": certs.mutual_server}, tls=certs.mutual_client
    )
    assert np.array_equal(got, GRAD)
    assert server_view.authenticated
    subject = server_view.tls_subject
    assert subject is not None
    # trustme's subject (organisation, unit, common name) as RFC 4514 text: the most
    # specific first (a test peer's listener: cryptography's text).
    assert subject.startswith(f"CN={CLIENT_CN},OU=Testing cert #"), subject
    assert subject.endswith(",O=trustme v1.2.1"), subject
    assert client_view.authenticated and client_view.tls_subject is None


def test_a_subject_with_separators_reads_the_same_on_either_listener(
    pair: Pair, certs: Certificates
) -> None:
    # A commonName "a,O=lab+x\\y" must not read as more attributes: the native listener
    # writes the escaped RFC 4514 text cryptography writes.
    _, server_view, _ = delivered(pair, {"tls": certs.mutual_server}, tls=certs.tricky_client)
    subject = server_view.tls_subject
    assert subject is not None
    assert subject == "CN=a\\,O=lab\\+x\\\\y,OU=ml\\+ops,O=Lab\\, Inc.", subject


def test_mutual_tls_refuses_a_client_without_a_certificate(
    pair: Pair, certs: Certificates, caplog: pytest.LogCaptureFixture
) -> None:
    server, client = pair

    async def main() -> BaseException:
        async with await server.listen(LOCAL, tls=certs.mutual_server) as listener:
            # The client learns it on its side (TLS 1.3: at its first read, the hello's).
            with pytest.raises(refused_as(client, TlsError)) as info:
                await client.connect(listener.address, tls=certs.client)
            # The listener goes on: a client with a certificate is served.
            _, server_view, _ = await deliver(client, listener, tls=certs.mutual_client)
            assert server_view.tls_subject is not None
            return info.value

    with caplog.at_level(logging.WARNING, logger="gradstream"):
        exc = run(main)
    if client is gs:
        # The listener's alert, or (Python's ssl sends none) its close before the hello.
        assert isinstance(exc, TlsError)
        assert exc.detail.startswith(
            (
                "the listener requires a client certificate (mutual TLS): give tls=TLS(cert=, "
                "key=, ca=) (",
                "the listener closed the connection after the TLS handshake: it requires a "
                "client certificate",
            )
        ), exc.detail
    if server is gs:
        lines = refusals(caplog)
        assert len(lines) == 1
        assert "the client presented no certificate (this listener requires one" in lines[0]


# What the native dialler (rustls) says of a server certificate it cannot verify.
UNVERIFIED = {
    "san-mismatch": 'invalid peer certificate: certificate not valid for name "127.0.0.1"',
    "unknown-ca": "invalid peer certificate: UnknownIssuer",
}


@pytest.mark.parametrize(
    ("case", "server_tls", "client_tls"),
    [("san-mismatch", "wrong_name_server", "client"), ("unknown-ca", "server", "stranger_client")],
    ids=["san-mismatch", "unknown-ca"],
)
def test_a_server_certificate_the_client_cannot_verify_is_refused(
    pair: Pair,
    certs: Certificates,
    case: str,
    server_tls: str,
    client_tls: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    server, client = pair

    async def main() -> BaseException:
        async with await server.listen(LOCAL, tls=getattr(certs, server_tls)) as listener:
            with pytest.raises(refused_as(client, TlsError)) as info:
                await client.connect(listener.address, tls=getattr(certs, client_tls))
            if server is gs:
                await refusal_logged(caplog)
            return info.value

    with caplog.at_level(logging.WARNING, logger="gradstream"):
        exc = run(main)
    if client is gs:
        assert isinstance(exc, TlsError)
        assert exc.detail.startswith(UNVERIFIED[case]), exc.detail
        assert exc.peer is not None and exc.peer[0] == "127.0.0.1"
    if server is gs:
        lines = refusals(caplog)
        assert len(lines) == 1 and "the client broke off the TLS handshake" in lines[0]


def raw_tls_context(
    certs: Certificates, *, tls12: bool = False, alpn: bool = True
) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(certs.ca_file))
    if tls12:
        context.maximum_version = ssl.TLSVersion.TLSv1_2
    if alpn:
        context.set_alpn_protocols(["gradstream/1"])
    return context


def test_a_tls_1_2_client_is_refused(certs: Certificates, caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        async with await gs.listen(LOCAL, tls=certs.server) as listener:
            with pytest.raises((ssl.SSLError, ConnectionError)):
                await asyncio.open_connection(
                    *listener.address, ssl=raw_tls_context(certs, tls12=True)
                )
            await deliver(gs, listener, tls=certs.client)

    with caplog.at_level(logging.WARNING, logger="gradstream"):
        run(main)
    lines = refusals(caplog)
    assert len(lines) == 1 and "TLS with 127.0.0.1:" in lines[0]
    assert "the peer does not offer TLS 1.3" in lines[0], lines[0]


def test_a_tls_client_without_alpn_is_refused(
    certs: Certificates, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> bytes:
        async with await gs.listen(LOCAL, tls=certs.server) as listener:
            reader, writer = await asyncio.open_connection(
                *listener.address, ssl=raw_tls_context(certs, alpn=False)
            )
            got = await read_to_end(reader)
            writer.close()
            return got

    with caplog.at_level(logging.WARNING, logger="gradstream"):
        assert run(main) == b""  # dropped before the listener's hello
    lines = refusals(caplog)
    assert len(lines) == 1
    assert "the peer negotiated no ALPN; 'gradstream/1' is required" in lines[0]


def test_a_plaintext_client_at_a_tls_listener(
    pair: Pair, certs: Certificates, caplog: pytest.LogCaptureFixture
) -> None:
    server, client = pair

    async def main() -> BaseException:
        async with await server.listen(LOCAL, tls=certs.server) as listener:
            with pytest.raises(refused_as(client, ProtocolError)) as info:
                await client.connect(listener.address)
            await deliver(client, listener, tls=certs.client)
            return info.value

    with caplog.at_level(logging.WARNING, logger="gradstream"):
        exc = run(main)
    if client is gs:
        assert isinstance(exc, ProtocolError)
        assert "a TLS listener drops a plaintext client" in exc.seen
    if server is gs:
        lines = refusals(caplog)
        assert len(lines) == 1 and "the peer does not speak TLS" in lines[0]


def test_a_tls_client_at_a_plaintext_listener(
    pair: Pair, certs: Certificates, caplog: pytest.LogCaptureFixture
) -> None:
    server, client = pair

    async def main() -> tuple[BaseException, list[str]]:
        async with await server.listen(LOCAL) as listener:
            with pytest.raises(refused_as(client, TlsError)) as info:
                await client.connect(listener.address, tls=certs.client)
            if server is gs:
                await refusal_logged(caplog)
            await deliver(client, listener)
            failures = [str(f) for f in getattr(listener, "failures", [])]
            return info.value, failures

    with caplog.at_level(logging.WARNING, logger="gradstream"):
        exc, failures = run(main)
    if client is gs:
        assert isinstance(exc, TlsError)
        assert exc.detail.startswith("the peer does not speak TLS"), exc.detail
    # The native listener logs it; the test peer's keeps it.
    lines = refusals(caplog) if server is gs else failures
    assert len(lines) == 1 and "got a TLS ClientHello" in lines[0]


def test_tls_files_that_do_not_load_are_setting_errors(certs: Certificates, tmp_path: Any) -> None:
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate\n")
    quoted = repr(str(bad))

    async def main() -> None:
        with pytest.raises(SettingError) as info:
            await gs.listen(LOCAL, tls=gs.TLS(cert=bad, key=bad))
        assert info.value.setting == "tls"
        assert info.value.detail.startswith(f"TLS cert= {quoted} and key= {quoted} do not load: ")
        with pytest.raises(SettingError) as info:
            await gs.connect("127.0.0.1:9", tls=gs.TLS(ca=bad))
        assert info.value.detail.startswith(f"TLS ca= {quoted} does not load: ")

    run(main)
