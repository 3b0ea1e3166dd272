"""A rank that dies or stalls mid-training makes the next collective fail on the others
with gradstream's error within the group's timeout (4 s here), never a hang; the group
then fails every later collective at once. A send to a rank that dies, and a recv from
it, fail the same way. TLS (mutual) with a configured authkey works
end to end, ranks of one host meet on Unix sockets unless told otherwise, and a rank
with another authkey is refused at the rendezvous, over TCP and over a Unix socket."""

from __future__ import annotations

import pathlib

import pytest

pytest.importorskip("torch")
pytest.importorskip("trustme")

from backend_launch import launch, outcome

from support.certs import make_certificates

TIMEOUT = 4.0


@pytest.mark.parametrize(("how", "size"), [("die", 3), ("stall", 2)])
def test_a_lost_rank_fails_the_others_within_the_timeout(
    tmp_path: pathlib.Path, how: str, size: int
) -> None:
    codes = launch(how, size, tmp_path)
    assert codes == [0] * (size - 1) + [3]
    for rank in range(size - 1):
        got = outcome(tmp_path, rank)
        assert got["error"] in ("StreamIOError", "StreamTimeoutError"), got
        assert got["seconds"] < TIMEOUT + 2.0, got
        assert got["later"] is not None and got["later_seconds"] < 1.0, got
        if how == "die":
            assert f"lost its connection to rank {size - 1}" in got["message"], got
        if how == "stall":
            assert got["error"] == "StreamTimeoutError", got
            assert "within the group's timeout of 4 s" in got["message"], got


def test_a_rank_lost_to_send_and_recv_fails_them_within_the_timeout(
    tmp_path: pathlib.Path,
) -> None:
    assert launch("lost-peer", 3, tmp_path) == [0, 0, 3]
    sender, receiver = outcome(tmp_path, 0), outcome(tmp_path, 1)
    # Its send under way when the receiver died: at once, naming the rank.
    assert sender["error"] in ("StreamIOError", "DeliveryError"), sender
    assert "rank 2" in sender["message"], sender
    assert sender["seconds"] < TIMEOUT + 2.0, sender
    # Waiting for a message that never comes: the group's timeout.
    assert receiver["error"] == "StreamTimeoutError", receiver
    assert "recv from rank 2 (tag 0) on rank 1" in receiver["message"], receiver
    assert TIMEOUT - 0.5 < receiver["seconds"] < TIMEOUT + 2.0, receiver


def test_tls_and_authkey_end_to_end(tmp_path: pathlib.Path) -> None:
    (tmp_path / "certs").mkdir()
    make_certificates(tmp_path / "certs")
    assert launch("secured-same-tcp", 2, tmp_path) == [0, 0]
    first, second = outcome(tmp_path, 0), outcome(tmp_path, 1)
    assert "error" not in first and "error" not in second, (first, second)
    assert first["sum"] == second["sum"]
    # same_host="tcp": these ranks of one host met over TLS.
    for got in (first, second):
        assert all(not route.startswith("unix:") for route in got["routes"]), got
        # The previous rank's connection, accepted: its client certificate was verified.
        assert got["tls"][1], got
        assert got["socket_left"] is None, got


def test_ranks_of_one_host_meet_on_unix_sockets_under_the_authkey(tmp_path: pathlib.Path) -> None:
    (tmp_path / "certs").mkdir()
    make_certificates(tmp_path / "certs")
    assert launch("secured-same-unix", 3, tmp_path) == [0, 0, 0]
    got = [outcome(tmp_path, rank) for rank in range(3)]
    assert all("error" not in g for g in got), got
    assert got[0]["sum"] == got[1]["sum"] == got[2]["sum"]
    for g in got:
        # Both ring connections on Unix sockets (TLS is for ranks of other hosts).
        assert all(route.startswith("unix:") for route in g["routes"]), g
        assert g["tls"] == [None, None], g
        assert g["socket_left"] is False, g


@pytest.mark.parametrize("same_host", ["tcp", "unix"])
def test_another_authkey_is_refused(tmp_path: pathlib.Path, same_host: str) -> None:
    (tmp_path / "certs").mkdir()
    make_certificates(tmp_path / "certs")
    assert launch(f"secured-mismatch-{same_host}", 2, tmp_path) == [0, 0]
    got = [outcome(tmp_path, rank) for rank in range(2)]
    assert all("error" in g for g in got), got
    assert any(g["error"] == "AuthenticationError" for g in got), got
    assert all(g["seconds"] < 5.0 + 3.0 for g in got), got
