"""The socket directories of the Ray transport, the parameter server and the torch
backend (``gradstream._local_socket``): private, removed, and swept when a killed process
left one behind, never while a listener holds it or just after it was made."""

from __future__ import annotations

import os
import stat
import tempfile
import time
from pathlib import Path

import gradstream.sync as gss
from gradstream._local_socket import SocketDirectory

PREFIX = "gradstream-test-sweep-"


def _aged(directory: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(directory, (then, then))


def test_a_directory_is_private_and_removed() -> None:
    made = SocketDirectory(PREFIX)
    path = Path(made.address.removeprefix("unix:"))
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    made.remove()
    assert not path.parent.exists()


def test_stale_directories_are_swept_and_live_or_young_ones_kept() -> None:
    root = Path(tempfile.gettempdir())
    stale = Path(tempfile.mkdtemp(prefix=PREFIX, dir=root))
    (stale / "s.sock.lock").touch()  # its listener was killed: nobody holds the lock
    _aged(stale, 3600)
    young = Path(tempfile.mkdtemp(prefix=PREFIX, dir=root))  # its listener comes soon
    live = SocketDirectory(PREFIX)
    live_dir = Path(live.address.removeprefix("unix:")).parent
    with gss.listen(live.address):  # holds s.sock.lock for its life
        _aged(live_dir, 3600)
        made = SocketDirectory(PREFIX)  # sweeps as it is made
        try:
            assert not stale.exists()
            assert young.exists() and live_dir.exists()
        finally:
            made.remove()
    live.remove()
    young.rmdir()
