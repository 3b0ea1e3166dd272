"""The plain-Python parts connections stand on (docs/guides/connections.md): the TLS
settings and their file checks (``_tls_settings``), addresses and the Peer
(``_address``), the keyword checks and defaults (``_checks``), the log lines and the rate
limit on refusal logs (``_logs``), one transfer at a time (``_turns``). The subject text
is the TLS layer's (test_tls_subject.py)."""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import re

import pytest

import gradstream as gs
from gradstream import _address, _checks, _logs, _tls_settings, _turns
from gradstream.errors import SettingError


@pytest.fixture
def pem(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "x.pem"
    path.write_text("-----BEGIN CERTIFICATE-----\n")
    return path


# --------------------------------------------------------------------------- TLS


def test_tls_and_peer_are_the_packages() -> None:
    assert gs.TLS is _tls_settings.TLS
    assert gs.Peer is _address.Peer


def test_tls_keeps_the_paths_as_str(pem: pathlib.Path) -> None:
    tls = gs.TLS(cert=pem, key=str(pem), ca=pem)
    assert (tls.cert, tls.key, tls.ca) == (str(pem), str(pem), str(pem))
    assert gs.TLS(ca=pem) == gs.TLS(ca=str(pem))
    with pytest.raises(dataclasses.FrozenInstanceError):
        tls.ca = None  # type: ignore[misc]


def test_tls_refuses_a_missing_file(tmp_path: pathlib.Path) -> None:
    missing = tmp_path / "nope.pem"
    with pytest.raises(SettingError) as info:
        gs.TLS(ca=missing)
    assert info.value.setting == "ca"
    assert str(info.value) == f"TLS ca= file {str(missing)!r} does not exist"


def test_tls_refuses_a_directory(tmp_path: pathlib.Path) -> None:
    with pytest.raises(SettingError, match="is a directory, not a PEM file"):
        gs.TLS(ca=tmp_path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads every file")
def test_tls_refuses_an_unreadable_file(pem: pathlib.Path) -> None:
    pem.chmod(0)
    with pytest.raises(SettingError, match="cannot be read: Permission denied"):
        gs.TLS(ca=pem)


def test_tls_needs_a_key_with_its_cert_and_something(pem: pathlib.Path) -> None:
    with pytest.raises(SettingError, match="TLS cert= needs key= too") as info:
        gs.TLS(cert=pem, ca=pem)
    assert info.value.setting == "key"
    with pytest.raises(SettingError, match="TLS key= needs cert= too"):
        gs.TLS(key=pem)
    with pytest.raises(SettingError, match=r"TLS\(\) needs cert= and key="):
        gs.TLS()
    with pytest.raises(TypeError, match=r"TLS ca= must be None, a str or an os\.PathLike"):
        gs.TLS(ca=b"ca.pem")  # type: ignore[arg-type]


def test_each_side_needs_its_part_of_tls(pem: pathlib.Path) -> None:
    with pytest.raises(SettingError, match="a listener's TLS needs cert= and key="):
        _tls_settings.listener_tls(gs.TLS(ca=pem))
    with pytest.raises(SettingError, match="a client's TLS needs ca="):
        _tls_settings.client_tls(gs.TLS(cert=pem, key=pem))
    with pytest.raises(TypeError, match=r"tls must be None or a gradstream\.TLS, not dict"):
        _tls_settings.client_tls({"ca": pem})


# --------------------------------------------------------------------------- addresses


@pytest.mark.parametrize(
    ("address", "parsed"),
    [
        ("127.0.0.1:7000", ("127.0.0.1", 7000)),
        ("localhost:0", ("localhost", 0)),
        ("[::1]:7000", ("::1", 7000)),
        (("10.0.0.5", 65535), ("10.0.0.5", 65535)),
        (("::1", 1), ("::1", 1)),
    ],
)
def test_addresses_parse(address: object, parsed: tuple[str, int]) -> None:
    assert _address.parse_address(address) == parsed


@pytest.mark.parametrize(
    ("address", "message"),
    [
        ("127.0.0.1", "address '127.0.0.1' must be 'host:port'"),
        ("::1:7000", "an IPv6 host goes in brackets, e.g. '[::1]:7000'"),
        ("[nope]:7000", "'nope' in brackets is not an IPv6 address"),
        ("host:http", "address 'host:http' has no port number after its ':'"),
        ("host:70000", "the port of address 'host:70000' must be in 0..65535, got 70000"),
        (":7000", "address ':7000' has no host"),
        (("h", -1), "must be in 0..65535, got -1"),
    ],
)
def test_bad_addresses_are_setting_errors(address: object, message: str) -> None:
    with pytest.raises(SettingError, match=re.escape(message)) as info:
        _address.parse_address(address)
    assert info.value.setting == "address"


@pytest.mark.parametrize("address", [7000, ("h", 1, 2), ("h", True), (1, 2), ("h", "7000")])
def test_addresses_of_other_types_are_type_errors(address: object) -> None:
    with pytest.raises(TypeError):
        _address.parse_address(address)


# --------------------------------------------------------------------------- keywords


def test_the_keyword_checks() -> None:
    assert _checks.check_protocol("seed") == "seed"
    with pytest.raises(SettingError, match="protocol must be 'gradstream' or 'seed', got 'http'"):
        _checks.check_protocol("http")
    assert _checks.check_authkey(bytearray(16)) == bytes(16)
    with pytest.raises(SettingError, match="authkey must hold at least 16 bytes, got 15"):
        _checks.check_authkey(b"x" * 15)
    with pytest.raises(TypeError, match="authkey must be None or bytes, not str"):
        _checks.check_authkey("x" * 16)
    assert _checks.check_handshake_timeout(2) == 2.0
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(SettingError, match="handshake_timeout must be a positive number"):
            _checks.check_handshake_timeout(bad)
    with pytest.raises(TypeError):
        _checks.check_handshake_timeout(None)
    with pytest.raises(SettingError, match="max_connections must be at least 1, got 0"):
        _checks.check_count(0, "max_connections")
    with pytest.raises(TypeError):
        _checks.check_count(True, "max_connections")


def test_seed_carries_neither_tls_nor_authkey(pem: pathlib.Path) -> None:
    with pytest.raises(SettingError, match=r"protocol='seed' .* cannot carry authkey=") as info:
        _checks.check_plain_seed("seed", None, bytes(16))
    assert info.value.setting == "protocol"
    with pytest.raises(SettingError, match="cannot carry tls="):
        _checks.check_plain_seed("seed", gs.TLS(ca=pem), None)
    _checks.check_plain_seed("gradstream", gs.TLS(ca=pem), bytes(16))


def test_the_defaults() -> None:
    assert _checks.HANDSHAKE_TIMEOUT == 10.0
    # The listener's, as docs/guides/limits.md gives them (and the core's
    # Admission::default, whose test holds the same figures).
    assert _checks.MAX_PENDING_HANDSHAKES == 256
    assert _checks.MAX_PENDING_PER_SOURCE == 64
    assert _checks.HELLO_TIMEOUT == 3.0
    assert _checks.MAX_AUTH_FAILURES == 10
    assert _checks.AUTH_FAILURE_WINDOW == 60.0
    assert _checks.MAX_CONNECTIONS == 256
    assert _checks.CONNECTION_DEADLINE == 300.0
    assert _checks.MIN_AUTHKEY_LEN == 16


# --------------------------------------------------------------------------- the peer


def test_peer_is_frozen() -> None:
    peer = gs.Peer(("127.0.0.1", 1), "CN=a", True)
    assert (peer.address, peer.tls_subject, peer.authenticated) == (("127.0.0.1", 1), "CN=a", True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        peer.authenticated = False  # type: ignore[misc]


# --------------------------------------------------------------------------- refusal logs


def test_refusal_logs_are_limited_and_the_rest_counted(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    log = _logs.RefusalLog("127.0.0.1:7000", clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="gradstream"):
        written = [log.refused(("10.0.0.1", k), "bad hello") for k in range(25)]
        assert written == [True] * 10 + [False] * 15
        now[0] += 1.0
        assert log.refused(("10.0.0.2", 9), "silent")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 11
    assert lines[0] == "listener 127.0.0.1:7000 refused 10.0.0.1:0: bad hello"
    assert lines[10] == (
        "listener 127.0.0.1:7000 refused 10.0.0.2:9: silent (15 more refusals were not logged)"
    )
    assert {r.levelno for r in caplog.records} == {logging.WARNING}


# --------------------------------------------------------------------------- waits, texts, turns


def test_seconds_are_checked_as_the_sessions_are() -> None:
    assert _checks.check_seconds(None) is None
    assert _checks.check_seconds(2) == 2.0
    for bad in (0, -1.5, float("nan"), float("inf")):
        with pytest.raises(SettingError, match="deadline must be None or a positive number"):
            _checks.check_seconds(bad, "deadline")
    with pytest.raises(TypeError, match="timeout must be None or a number, not str"):
        _checks.check_seconds("1")


def test_the_texts_of_the_logs() -> None:
    assert _logs.silent_text(0.3) == "silent past handshake_timeout (0.3 s)"
    assert _logs.silent_text(10.0) == "silent past handshake_timeout (10 s)"
    assert _logs.describe_side("gradstream", True, True) == "gradstream, TLS, authkey"
    assert _logs.describe_side("seed", False, False) == "seed"


def test_turns_let_one_transfer_run_at_a_time() -> None:
    turns = _turns.Turns()
    with turns.turn(_turns.Phase.SENDING, "send"):
        with pytest.raises(SettingError, match="recv while this connection is sending"):
            with turns.turn(_turns.Phase.RECEIVING, "recv"):
                pass
        assert turns.phase is _turns.Phase.SENDING
    assert turns.phase is _turns.Phase.IDLE
    assert turns.close() and not turns.close()
    with pytest.raises(OSError, match="send on a closed connection"):
        with turns.turn(_turns.Phase.SENDING, "send"):
            pass
