"""``gradstream recv unix:PATH`` / ``gradstream send unix:PATH``: the same-host transport
from the command line (docs/guides/same-host.md), a gradient's values, dtype and shape
kept, the peer named by its path, pid and uid; a unix: address without a path refused
before anything opens."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from support.cli import Child, assert_one_line_error, bit_equal, gradient, run, save, start


def test_a_gradient_goes_through_a_unix_socket_from_the_command_line(
    spawn: list[Child], tmp_path: Path
) -> None:
    address = f"unix:{tmp_path / 'cli.sock'}"
    g = gradient(6400, seed=3, shape=(64, 100))
    receiver = start(spawn, "recv", address, "--out", str(tmp_path / "got.npy"))
    assert receiver.first_line() == f"listening on {address}"
    sent = run("send", address, save(tmp_path, "g.npy", g))
    assert sent.returncode == 0, sent.stderr
    assert "acknowledged" in sent.stdout
    said = receiver.wait_for(lambda line: line.startswith("received"))
    assert f"from {address} (pid " in said and f"uid {os.getuid()})" in said, said
    status, _, stderr = receiver.finish()
    assert status == 0, stderr
    got = np.load(tmp_path / "got.npy")
    assert got.shape == g.shape and bit_equal(got, g)


def test_a_unix_address_without_a_path_is_refused_at_once(tmp_path: Path) -> None:
    done = run("send", "unix:", save(tmp_path, "g.npy", gradient(10)))
    assert done.returncode == 2
    assert_one_line_error(done.stderr, "bad address 'unix:'", "no path after 'unix:'")
