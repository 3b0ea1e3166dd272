"""``gradstream keygen`` (docs/guides/connections.md, the authkey): a random key in the
form ``--authkey-file`` reads, on stdout or in a new file only its owner can read, never
over an existing one; the key it makes admits a peer that holds the same file.
"""

from __future__ import annotations

import asyncio
import base64
import stat
from pathlib import Path

import gradstream as gs
from gradstream._cli_link import read_authkey
from gradstream.errors import AuthenticationError
from support import connections
from support.cli import assert_one_line_error, run


def test_a_key_is_32_random_bytes_as_a_line_of_base64() -> None:
    keys = [run("keygen") for _ in range(2)]
    for done in keys:
        assert done.returncode == 0 and done.stderr == ""
        line = done.stdout
        assert line.endswith("\n") and len(line) == 44, line
        assert len(base64.urlsafe_b64decode(line.strip() + "=")) == 32
    assert keys[0].stdout != keys[1].stdout


def test_out_writes_a_new_file_of_mode_0600(tmp_path: Path) -> None:
    path = tmp_path / "round.key"
    done = run("keygen", "--out", str(path))
    assert done.returncode == 0 and done.stdout == "" and done.stderr == ""
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_authkey(str(path)) == path.read_bytes()  # what --authkey-file reads
    assert len(path.read_bytes()) == 44


def test_an_existing_file_is_never_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "round.key"
    path.write_bytes(b"the key of another round, keep it")
    done = run("keygen", "--out", str(path))
    assert done.returncode == 1
    assert_one_line_error(done.stderr, f"--out {path} exists: a key file is never overwritten")
    assert path.read_bytes() == b"the key of another round, keep it"


def test_the_key_admits_only_the_holders_of_the_file(tmp_path: Path) -> None:
    paths = [tmp_path / "a.key", tmp_path / "b.key"]
    for path in paths:
        assert run("keygen", "--out", str(path)).returncode == 0
    key, other = (p.read_bytes() for p in paths)

    async def main() -> bool:
        async with await gs.listen(connections.LOCAL, authkey=key) as listener:
            try:
                await gs.connect(listener.address, authkey=other)
            except AuthenticationError:
                pass
            else:
                raise AssertionError("another key was admitted")
            accepting = asyncio.create_task(listener.accept())
            async with await gs.connect(listener.address, authkey=key) as conn:
                authenticated = conn.peer.authenticated
                await (await accepting).close()
            return authenticated

    assert connections.run(main)
