"""Same-host connections: ``listen("unix:PATH")`` / ``connect("unix:PATH")`` (both
faces), the hello, authkey, seals and acks of TCP with the payloads through shared-memory
rings (crates/gradstream-core/src/shm), the peer's pid and uid from the kernel, the
listener's own user admitted by default, the socket file made 0600, a stale one replaced
and any other file left alone; TLS and the seed protocol refused with the fix named."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import shutil
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gradstream as gs
import gradstream.sync as gss
from gradstream.errors import SettingError

KEY = b"sixteen bytes or more"


@pytest.fixture
def path(tmp_path: Path) -> str:
    return f"unix:{tmp_path / 'g.sock'}"


def file_of(address: str) -> Path:
    return Path(address.removeprefix("unix:"))


def gradients() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [
        rng.standard_normal((300, 1000)).astype(np.float32),  # larger than a ring
        rng.standard_normal(17).astype(np.float64),
        np.arange(1000, dtype=np.float16).reshape(10, 100),
    ]


def test_gradients_go_both_ways_on_an_asyncio_unix_connection(path: str) -> None:
    async def main() -> None:
        async with await gs.listen(path, authkey=KEY) as listener:
            assert listener.address == path
            mode = stat.S_IMODE(os.stat(file_of(path)).st_mode)
            assert mode == 0o600, oct(mode)
            accepting = asyncio.ensure_future(listener.accept())
            async with await gs.connect(path, authkey=KEY) as here:
                async with await accepting as there:
                    for peer in (here.peer, there.peer):
                        assert peer.address == path and peer.authenticated
                        assert (peer.pid, peer.uid) == (os.getpid(), os.getuid())
                    for g in gradients():
                        _, got = await asyncio.gather(here.send(g), there.recv())
                        assert got.dtype == g.dtype and got.shape == g.shape
                        assert np.array_equal(got, g)
                        _, back = await asyncio.gather(there.send(got), here.recv())
                        assert np.array_equal(back, g)
        assert not file_of(path).exists(), "the socket file outlived its listener"

    asyncio.run(main())


@contextlib.contextmanager
def echoing(path: str) -> Iterator[None]:
    """A blocking listener at ``path`` whose first connection, in a thread, sends back
    each gradient it gets until the peer closes; the thread must have ended by then."""
    with gss.listen(path) as listener:

        def echo() -> None:
            with listener.accept() as conn:
                for got in conn:
                    conn.send(got)

        server = threading.Thread(target=echo)
        server.start()
        yield
        server.join(timeout=30)
        assert not server.is_alive()


def test_a_blocking_unix_connection_echoes_until_closed(path: str) -> None:
    with echoing(path), gss.connect(path) as conn:
        assert conn.peer.uid == os.getuid()
        for g in gradients():
            conn.send(g)
            assert np.array_equal(conn.recv(), g)


def test_small_and_large_transfers_take_turns_between_the_callers_thread_and_tokio(
    path: str,
) -> None:
    """On a blocking unix: connection a small transfer runs on the caller's thread, its
    socket off tokio's reactor; a large one (more than a ring: its receive goes past
    the caller's read budget, its send is spawned) goes on in tokio, which takes the
    socket back. Both ends switch so on one connection and every gradient comes back
    whole and in order."""
    tiny = np.arange(1_000, dtype=np.float32)
    big = np.random.default_rng(3).standard_normal(3_000_000).astype(np.float32)  # 12 MB
    with echoing(path), gss.connect(path) as conn:
        for values in (tiny, big, tiny, tiny, big, tiny):
            conn.send(values)
            assert np.array_equal(conn.recv(), values)


def test_tls_and_the_seed_protocol_are_refused_naming_the_fix(path: str, tmp_path: Path) -> None:
    tls = {"cert": tmp_path / "c.pem", "key": tmp_path / "k.pem"}
    for call in (gss.connect, gss.listen):
        with pytest.raises(SettingError, match=r"takes no TLS.*authkey= still applies") as info:
            call(path, tls=tls)
        assert info.value.setting == "tls"
        with pytest.raises(SettingError, match="speaks gradstream") as info:
            call(path, protocol="seed")
        assert info.value.setting == "protocol"

    async def main() -> None:
        with pytest.raises(SettingError, match="takes no TLS"):
            await gs.connect(path, tls=tls)

    asyncio.run(main())


def test_a_listener_admits_only_the_user_it_is_told(
    path: str, caplog: pytest.LogCaptureFixture
) -> None:
    other = os.getuid() + 1
    with caplog.at_level(logging.INFO, logger="gradstream"):
        with gss.listen(path, allowed_uid=other, handshake_timeout=2):
            with pytest.raises((OSError, gs.GradientStreamError)):
                gss.connect(path, handshake_timeout=2)
    said = caplog.text
    assert f"a process of uid {os.getuid()}, where this listener admits uid {other}" in said


def test_allowed_uid_none_admits_any_user(path: str) -> None:
    with gss.listen(path, allowed_uid=None) as listener:
        # Open to every user's processes: the uid check is what would refuse one.
        mode = stat.S_IMODE(os.stat(file_of(path)).st_mode)
        assert mode == 0o666, oct(mode)
        accepting = threading.Thread(target=lambda: listener.accept().close())
        accepting.start()
        gss.connect(path).close()
        accepting.join(timeout=30)
        assert not accepting.is_alive()


@pytest.mark.parametrize(
    ("value", "error"),
    [("0", TypeError), (True, TypeError), (-1, SettingError), (2**32, SettingError)],
)
def test_allowed_uid_is_checked(path: str, value: object, error: type) -> None:
    with pytest.raises(error, match="allowed_uid"):
        gss.listen(path, allowed_uid=value)


def test_unix_paths_are_checked_before_anything_opens(tmp_path: Path) -> None:
    with pytest.raises(SettingError, match="no path after 'unix:'"):
        gss.connect("unix:")
    long = "unix:" + str(tmp_path / ("x" * 120))
    with pytest.raises(SettingError, match="at most 107 bytes"):
        gss.listen(long)


def test_a_stale_socket_file_is_replaced_and_no_other_file_touched(path: str) -> None:
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(file_of(path)))
    stale.close()  # its listener died: nobody listens there
    with gss.listen(path) as listener:
        with pytest.raises(OSError, match="a listener is already at unix:"):
            gss.listen(path)
        assert listener.address == path
    precious = file_of(path).with_name("precious")
    precious.write_bytes(b"keep me")
    with pytest.raises(OSError, match="is not a socket"):
        gss.listen(f"unix:{precious}")
    assert precious.read_bytes() == b"keep me"


def test_a_dialler_refuses_a_listener_of_another_user_before_sending(path: str) -> None:
    # Anyone who can write the socket's directory could have put a listener there.
    other = os.getuid() + 1
    with gss.listen(path, allowed_uid=None):
        with pytest.raises(OSError, match=f"is a process of uid {os.getuid()}, not of uid {other}"):
            gss.connect(path, allowed_uid=other)


def test_allowed_uid_and_tuple_hosts_are_for_unix_addresses_only() -> None:
    with pytest.raises(SettingError, match="allowed_uid is for unix: addresses") as info:
        gss.connect("127.0.0.1:9", allowed_uid=0)
    assert info.value.setting == "allowed_uid"
    with pytest.raises(SettingError, match="not a \\(host, port\\) pair"):
        gss.connect(("unix:/x", 0))


@pytest.mark.skipif(os.getuid() != 0, reason="connecting as another user needs root")
def test_a_listener_told_another_user_admits_that_users_processes() -> None:
    nobody = 65534
    folder = tempfile.mkdtemp(dir="/tmp")
    os.chmod(folder, 0o755)  # nobody may reach the socket file
    path = f"unix:{folder}/g.sock"
    g = np.arange(5000, dtype=np.float32)
    with gss.listen(path, allowed_uid=nobody) as listener:
        mode = stat.S_IMODE(os.stat(file_of(path)).st_mode)
        assert mode == 0o666, oct(mode)  # open to the file system; the uid check decides
        child = os.fork()
        if child == 0:  # pragma: no cover - the child's exit code is the assertion
            code = 1
            try:
                os.setuid(nobody)
                with gss.connect(path, allowed_uid=0) as conn:
                    conn.send(g)
                code = 0
            finally:
                os._exit(code)
        with listener.accept() as conn:
            assert conn.peer.uid == nobody and conn.peer.pid == child
            assert np.array_equal(conn.recv(), g)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    shutil.rmtree(folder)  # the socket file went; its lock file (g.sock.lock) stays


@pytest.mark.parametrize(
    "make",
    [
        lambda peer: gs.ProtocolError("a hello", "noise", peer),
        lambda peer: gs.AuthenticationError("wrong key", peer),
        lambda peer: gs.TlsError("no certificate", peer),
        lambda peer: gs.DeliveryError("not acknowledged", peer, "refused"),
        lambda peer: gs.ObjectUnavailableError("obj", peer, "gone"),
    ],
    ids=["protocol", "authentication", "tls", "delivery", "object"],
)
def test_errors_keep_a_unix_peer_as_its_address(make: Any) -> None:
    error = make("unix:/run/g.sock")
    assert error.peer == "unix:/run/g.sock"
    assert "unix:/run/g.sock" in str(error)
    again = pickle.loads(pickle.dumps(error))
    assert (again.peer, str(again)) == (error.peer, str(error))
    assert make(("::1", 7)).peer == ("::1", 7)


def _rings_mapped() -> int:
    """Mappings of a gradstream ring (this side's own, or a peer's) in this process."""
    with open("/proc/self/maps") as maps:
        return sum("memfd:gradstream-ring" in line for line in maps)


_DYING_SENDER = """
import sys, numpy as np, gradstream.sync as gs
with gs.connect(sys.argv[1], authkey=sys.argv[2].encode()) as conn:
    print("connected", flush=True)
    conn.send(np.ones(64 << 20, np.float32))  # 256 MiB: far more than the rings hold
"""


def test_a_peer_killed_mid_transfer_leaves_no_ring_behind(path: str) -> None:
    import subprocess
    import sys

    before = _rings_mapped()  # left by nothing else, if earlier tests closed theirs
    with gss.listen(path, authkey=KEY) as listener:
        child = subprocess.Popen(
            [sys.executable, "-c", _DYING_SENDER, path, KEY.decode()],
            stdout=subprocess.PIPE,
        )
        try:
            with listener.accept(timeout=30) as conn:
                assert child.stdout is not None and child.stdout.readline() == b"connected\n"
                # Both rings mapped here: ours, and the sender's, which it filled and
                # waits on (nobody reads).
                deadline = time.monotonic() + 10
                while _rings_mapped() < before + 2 and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert _rings_mapped() == before + 2
                time.sleep(0.2)
                child.kill()
                child.wait()
                with pytest.raises(gs.GradientStreamError):
                    conn.recv()
            # The connection closed: neither ring is left, the dead peer's included
            # (this process held the last mapping of it).
            assert _rings_mapped() == before
        finally:
            child.kill()
            child.wait()


def test_errors_of_a_unix_connection_name_its_path(path: str) -> None:
    with gss.listen(path, authkey=KEY):
        with pytest.raises(gs.AuthenticationError) as caught:
            gss.connect(path, authkey=b"another key of sixteen bytes")
    assert caught.value.peer == path
    assert path in str(caught.value)
