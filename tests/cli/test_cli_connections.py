"""``gradstream recv`` / ``send`` over connections, as real processes on 127.0.0.1: TLS,
mutual TLS and an authkey with several workers at once, ``--count`` across connections,
``--forever`` ended by a signal, the acknowledgement that makes a lost gradient fail its
sender, wrong keys and certificates (a clear line on each side), ``--protocol seed``,
and the flag combinations refused.

Certificates are made at test time with trustme (the ``certs`` fixture, support.certs).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
from pathlib import Path

import numpy as np
import pytest

from gradstream._cli_base import CliError
from gradstream._cli_link import read_authkey
from support import peer
from support.certs import CLIENT_CN, Certificates
from support.cli import (
    TIMEOUT,
    Child,
    assert_one_line_error,
    bit_equal,
    error_lines,
    feed,
    gradient,
    python_frames,
    run,
    save,
    start,
    start_receiver,
)
from support.wan import Relay

GOOD_LINE = re.compile(
    r"^received gradient(?: (\d+)(?:/\d+)?)?: .* from 127\.0\.0\.1:\d+(.*) -> (.+)$"
)


@pytest.fixture
def authkey(tmp_path: Path) -> str:
    path = tmp_path / "round.key"
    path.write_bytes(os.urandom(32))
    return str(path)


def receiver_tls(certs: Certificates, *, mutual: bool = True) -> list[str]:
    args = ["--tls-cert", str(certs.path("server.pem")), "--tls-key", str(certs.path("server.key"))]
    return [*args, "--tls-ca", str(certs.ca_file)] if mutual else args


def worker_tls(certs: Certificates, *, mutual: bool = True) -> list[str]:
    args = ["--tls-ca", str(certs.ca_file)]
    if mutual:
        args += ["--tls-cert", str(certs.path("client.pem"))]
        args += ["--tls-key", str(certs.path("client.key"))]
    return args


def received(stdout: str) -> list[tuple[int, str, Path]]:
    """(number, identity, file) of each 'received gradient' line (number 1 for the
    one gradient of a run of one)."""
    found = []
    for line in stdout.splitlines():
        if match := GOOD_LINE.match(line):
            found.append((int(match[1] or 1), match[2], Path(match[3])))
    return found


def assert_saved_in_order(folder: Path, grads: list[np.ndarray]) -> None:
    """``folder/o-0.npy``, ``o-1.npy``, ... hold ``grads`` bit for bit, in that order."""
    for i, grad in enumerate(grads):
        assert bit_equal(np.load(folder / f"o-{i}.npy"), grad), i


def after_a_good_worker(receiver: Child, where: str, path: str, *secured: str) -> str:
    """A worker that may send ends the run (--count 1): the receiver's stderr, once it
    exited 0."""
    good = run("send", where, path, *secured)
    assert good.returncode == 0, good.stderr
    status, _, stderr = receiver.finish()
    assert status == 0, stderr
    return stderr


def index_of(grad: np.ndarray, files: list[Path]) -> int:
    """The position in `files` of the one file bit-equal to `grad` (exactly one)."""
    hits = [i for i, f in enumerate(files) if bit_equal(np.load(f), grad)]
    assert len(hits) == 1, hits
    return hits[0]


# --------------------------------------------------------------------------- several workers


def test_mutual_tls_authkey_receiver_takes_several_workers_at_once(
    tmp_path: Path, spawn: list[Child], certs: Certificates, authkey: str
) -> None:
    grads = [gradient(2000 + i, seed=i) for i in range(4)]
    files = [save(tmp_path, f"w{i}.npy", g) for i, g in enumerate(grads)]
    out = tmp_path / "out"
    out.mkdir()
    receiver, port = start_receiver(
        spawn, "--out", str(out / "g.npy"), "--count", "4",
        *receiver_tls(certs), "--authkey-file", authkey,
    )  # fmt: skip
    secured = [*worker_tls(certs), "--authkey-file", authkey]
    # Three workers at once; the first sends two files over its one connection.
    workers = [
        start(spawn, "send", f"127.0.0.1:{port}", *names, *secured, "--chunk-size", "500")
        for names in ([files[0], files[1]], [files[2]], [files[3]])
    ]
    for worker in workers:
        status, stdout, stderr = worker.finish()
        assert status == 0, stderr
        assert stderr == ""
        assert all(line.endswith(", acknowledged") for line in stdout.splitlines())
    status, stdout, stderr = receiver.finish()
    assert status == 0, stderr
    assert stderr == ""
    lines = received(stdout)
    assert [n for n, _, _ in lines] == [1, 2, 3, 4]
    for _, identity, _ in lines:
        # RFC 4514 text: the common name first.
        assert identity.startswith(f' (subject "CN={CLIENT_CN},')
        assert identity.endswith('", authenticated)')
    saved = sorted(out.iterdir())
    assert [p.name for p in saved] == [f"g-{i}.npy" for i in range(4)]
    assert {index_of(g, saved) for g in grads} == {0, 1, 2, 3}
    assert index_of(grads[0], saved) < index_of(grads[1], saved)  # one connection, in order


def test_recv_serves_a_worker_while_another_is_connected(
    tmp_path: Path, spawn: list[Child]
) -> None:
    # A connection that stays open and idle does not hold up the next worker.
    first, second = gradient(300, seed=1), gradient(400, seed=2)
    out = tmp_path / "o.npy"
    receiver, port = start_receiver(spawn, "--out", str(out), "--count", "2")

    async def main() -> None:
        held = await peer.connect(("127.0.0.1", port))  # the test peer, idle
        async with held:
            sent = await asyncio.to_thread(
                run, "send", f"127.0.0.1:{port}", save(tmp_path, "s.npy", second)
            )
            assert sent.returncode == 0, sent.stderr
            await held.send(first)

    asyncio.run(main())
    status, _, stderr = receiver.finish()
    assert status == 0, stderr
    assert bit_equal(np.load(tmp_path / "o-0.npy"), second)
    assert bit_equal(np.load(tmp_path / "o-1.npy"), first)


@pytest.mark.parametrize("security", ["tls", "authkey"])
def test_what_a_line_says_of_the_peer(
    tmp_path: Path, spawn: list[Child], certs: Certificates, authkey: str,
    security: str,
) -> None:  # fmt: skip
    # TLS without client certificates: the listener knows only the address. An authkey
    # the worker proved: authenticated, without a subject.
    if security == "tls":
        recv_args, send_args = receiver_tls(certs, mutual=False), worker_tls(certs, mutual=False)
    else:
        recv_args = send_args = ["--authkey-file", authkey]
    receiver, port = start_receiver(spawn, "--out", str(tmp_path / "o.npy"), *recv_args)
    grad = gradient(10)
    sent = run("send", f"127.0.0.1:{port}", save(tmp_path, "g.npy", grad),
               *send_args)  # fmt: skip
    assert sent.returncode == 0, sent.stderr
    status, stdout, stderr = receiver.finish()
    assert status == 0, stderr
    [(_, identity, path)] = received(stdout)
    assert identity == ("" if security == "tls" else " (authenticated)")
    assert bit_equal(np.load(path), grad)


def test_count_numbers_files_across_connections_in_arrival_order(
    tmp_path: Path, spawn: list[Child]
) -> None:
    a, b, c = gradient(100, seed=1), gradient(200, seed=2), gradient(300, seed=3)
    receiver, port = start_receiver(spawn, "--out", str(tmp_path / "o.npy"), "--count", "3")
    where = f"127.0.0.1:{port}"
    first = run("send", where, save(tmp_path, "a.npy", a), save(tmp_path, "b.npy", b),
                )  # fmt: skip
    assert first.returncode == 0, first.stderr
    second = run("send", where, save(tmp_path, "c.npy", c))
    assert second.returncode == 0, second.stderr
    status, stdout, stderr = receiver.finish()
    assert status == 0, stderr
    assert [n for n, _, _ in received(stdout)] == [1, 2, 3]
    assert_saved_in_order(tmp_path, [a, b, c])


# --------------------------------------------------------------------------- --forever


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_forever_until_a_signal(tmp_path: Path, spawn: list[Child], signum: signal.Signals) -> None:
    grads = [gradient(100, seed=1), gradient(100, seed=2)]
    receiver, port = start_receiver(spawn, "--out", str(tmp_path / "o.npy"), "--forever")
    for i, grad in enumerate(grads):
        sent = run("send", f"127.0.0.1:{port}", save(tmp_path, f"g{i}.npy", grad))
        assert sent.returncode == 0, sent.stderr
    receiver.wait_for(lambda line: line.startswith("received gradient 2: "))
    # A peer still in its handshake does not hold the stop up.
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT):
        receiver.proc.send_signal(signum)
        status, stdout, stderr = receiver.finish()
    assert status == 0, stderr
    assert stderr == ""
    assert [n for n, _, _ in received(stdout)] == [1, 2]
    last = stdout.splitlines()[-1]
    assert last.startswith(f"stopped by {signum.name} after 2 gradients; all ")
    assert last.endswith("chunk CRC-32 checks passed")
    assert sorted(p.name for p in tmp_path.glob("o*")) == ["o-0.npy", "o-1.npy"]
    assert_saved_in_order(tmp_path, grads)


def test_forever_bounds_each_gradient_by_max_bytes(tmp_path: Path, spawn: list[Child]) -> None:
    # With no count there is no total: each gradient gets the whole bound (1K: room for
    # 128 values), the next as much again.
    receiver, port = start_receiver(
        spawn, "--out", str(tmp_path / "o.npy"), "--forever", "--max-bytes", "1K"
    )
    where = f"127.0.0.1:{port}"
    fits = [save(tmp_path, f"f{i}.npy", gradient(128, seed=i)) for i in range(3)]
    assert run("send", where, *fits).returncode == 0
    over = run("send", where, save(tmp_path, "big.npy", gradient(129)))
    assert over.returncode == 1
    assert_one_line_error(over.stderr, "129 values", "128", "(DeliveryError)")
    receiver.wait_for(lambda line: line.startswith("received gradient 3: "))
    receiver.proc.send_signal(signal.SIGTERM)
    status, stdout, _ = receiver.finish()
    assert status == 0
    assert len(received(stdout)) == 3


# --------------------------------------------------------------------------- acknowledgements


def test_a_gradient_past_the_count_fails_its_sender(tmp_path: Path, spawn: list[Child]) -> None:
    # Before acknowledgements, `send a.npy a.npy` to `recv --count 1` printed "sent" twice
    # and the second gradient was lost without a word.
    grad = gradient(1000)
    path = save(tmp_path, "a.npy", grad)
    receiver, port = start_receiver(spawn, "--out", str(tmp_path / "o.npy"))
    sent = run("send", f"127.0.0.1:{port}", path, path)
    assert sent.returncode == 1
    assert sent.stdout.count("sent ") == 1
    assert_one_line_error(
        sent.stderr,
        f"gradstream: error: sending {path} (2 of 2) failed: gradient not delivered to "
        f"127.0.0.1:{port}: ",
        "(DeliveryError)",
    )
    status, _, stderr = receiver.finish()
    assert status == 0, stderr
    assert bit_equal(np.load(tmp_path / "o.npy"), grad)


# --------------------------------------------------------------------------- wrong keys


@pytest.mark.parametrize("worker_key", ["wrong", "none"])
def test_a_wrong_authkey_fails_on_both_sides(
    tmp_path: Path, spawn: list[Child], authkey: str, worker_key: str
) -> None:
    receiver, port = start_receiver(
        spawn, "--out", str(tmp_path / "o.npy"), "--authkey-file", authkey
    )
    where = f"127.0.0.1:{port}"
    path = save(tmp_path, "g.npy", gradient(10))
    key_args = []
    if worker_key == "wrong":
        (tmp_path / "wrong.key").write_bytes(os.urandom(32))
        key_args = ["--authkey-file", str(tmp_path / "wrong.key")]
    bad = run("send", where, path, *key_args)
    assert bad.returncode == 1
    assert bad.stdout == ""
    assert_one_line_error(
        bad.stderr,
        f"gradstream: error: cannot connect to {where}: authentication with {where} failed: ",
        "(AuthenticationError)",
    )
    if worker_key == "none":
        assert "the peer requires an authkey" in bad.stderr
    stderr = after_a_good_worker(receiver, where, path, "--authkey-file", authkey)
    assert_one_line_error(
        stderr,
        f"gradstream: warning: listener {where} refused 127.0.0.1:",
        ": authentication with 127.0.0.1:",
    )


@pytest.mark.parametrize(
    ("case", "worker_class"),
    [("no certificate", "TlsError"), ("another CA", "TlsError"), ("plaintext", "")],
)
def test_a_wrong_certificate_fails_on_both_sides(
    tmp_path: Path, spawn: list[Child], certs: Certificates, case: str,
    worker_class: str,
) -> None:  # fmt: skip
    receiver, port = start_receiver(spawn, "--out", str(tmp_path / "o.npy"), *receiver_tls(certs))
    where = f"127.0.0.1:{port}"
    path = save(tmp_path, "g.npy", gradient(10))
    worker = {
        "no certificate": worker_tls(certs, mutual=False),
        "another CA": [
            "--tls-ca", str(certs.path("stranger.pem")),
            "--tls-cert", str(certs.path("client.pem")), "--tls-key", str(certs.path("client.key")),
        ],
        "plaintext": [],
    }[case]  # fmt: skip
    bad = run("send", where, path, *worker)
    assert bad.returncode == 1
    # A plaintext worker meets a TLS listener: a TlsError or, seeing its hello answered by
    # a TLS alert or a close, a ProtocolError; either names the class. The listener that
    # refuses a certificate closes at once, and a reset may overtake its alert: then the
    # line says what that likely means.
    assert_one_line_error(bad.stderr, f"gradstream: error: cannot connect to {where}: ")
    reset = "Connection reset by peer (StreamIOError) (under TLS, often the receiver refusing"
    expected = worker_class or "TlsError|ProtocolError"
    assert re.search(rf"\(({expected})\)$", bad.stderr.strip()) or (
        case != "plaintext" and reset in bad.stderr
    ), bad.stderr
    stderr = after_a_good_worker(receiver, where, path, *worker_tls(certs))
    assert_one_line_error(
        stderr, f"gradstream: warning: listener {where} refused 127.0.0.1:", ": TLS with "
    )


# --------------------------------------------------------------------------- --protocol seed


def test_seed_protocol_between_the_commands(tmp_path: Path, spawn: list[Child]) -> None:
    grads = [gradient(700, seed=1), gradient(50, seed=2)]
    receiver, port = start_receiver(
        spawn, "--out", str(tmp_path / "o.npy"), "--count", "2",
        "--protocol", "seed",
    )  # fmt: skip
    paths = [save(tmp_path, f"g{i}.npy", g) for i, g in enumerate(grads)]
    sent = run("send", f"127.0.0.1:{port}", *paths, "--protocol", "seed",
               "--chunk-size", "100")  # fmt: skip
    assert sent.returncode == 0, sent.stderr
    assert "acknowledged" not in sent.stdout  # bare frames: nothing answers
    status, stdout, stderr = receiver.finish()
    assert status == 0, stderr
    assert [identity for _, identity, _ in received(stdout)] == ["", ""]
    assert_saved_in_order(tmp_path, grads)


def test_a_seed_sender_at_a_gradstream_receiver_is_refused_by_name(
    tmp_path: Path, spawn: list[Child]
) -> None:
    receiver, port = start_receiver(spawn, "--out", str(tmp_path / "o.npy"))
    path = save(tmp_path, "g.npy", gradient(10))
    # The seed sender cannot know (nothing answers bare frames); the listener says why.
    run("send", f"127.0.0.1:{port}", path, "--protocol", "seed")
    stderr = after_a_good_worker(receiver, f"127.0.0.1:{port}", path)
    assert_one_line_error(
        stderr,
        f"gradstream: warning: listener 127.0.0.1:{port} refused 127.0.0.1:",
        "frame header (chunk 0 of 1, ",
        "protocol=",
    )


def test_a_gradstream_sender_at_a_seed_receiver_fails_at_once(
    tmp_path: Path, spawn: list[Child]
) -> None:
    receiver, port = start_receiver(spawn, "--out", str(tmp_path / "o.npy"), "--protocol", "seed")
    where = f"127.0.0.1:{port}"
    bad = run("send", where, save(tmp_path, "g.npy", gradient(10)))
    assert bad.returncode == 1
    # Its hello reads as a frame header of total_chunks 0: the seed side refuses it and
    # closes, and the sender, waiting for a hello, is told.
    assert_one_line_error(bad.stderr, f"cannot connect to {where}: ", "(ProtocolError)")
    status, _, stderr = feed(receiver, port, python_frames(np.ones(3, np.float32)))
    assert status == 0, stderr
    assert_one_line_error(stderr, "gradstream: warning: gradient from 127.0.0.1:", "(FrameError)")


# --------------------------------------------------------------------------- flags


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["recv", "0", "--protocol", "seed", "--authkey-file", "k"],
         "--protocol seed speaks the bare frames of ipfrs-transport 0.2.0"),
        (["send", "h:1", "g.npy", "--protocol", "seed", "--tls-ca", "ca.pem"],
         "drop --tls-ca or use --protocol gradstream"),
        (["recv", "0", "--protocol", "seed", "--tls-cert", "c", "--tls-key", "k"],
         "drop --tls-cert and --tls-key"),
        (["recv", "0", "--tls-cert", "c.pem"], "--tls-cert needs --tls-key too"),
        (["send", "h:1", "g.npy", "--tls-key", "k.pem", "--tls-ca", "ca"],
         "--tls-key needs --tls-cert too"),
        (["recv", "0", "--tls-ca", "ca.pem"], "recv --tls-ca (asking workers for certificates)"),
        (["send", "h:1", "g.npy", "--tls-cert", "c", "--tls-key", "k"], "send --tls-cert needs "
         "--tls-ca"),
        (["recv", "0", "--count", "2", "--forever"], "not allowed with argument"),
        (["recv", "0", "--count", "0"], "--count must be >= 1"),
        (["recv", "0", "--max-connections", "0"], "--max-connections must be >= 1"),
        (["recv", "0", "--protocol", "tls"], "invalid choice: 'tls'"),
    ],
)  # fmt: skip
def test_flags_that_do_not_go_together_are_usage_errors(
    tmp_path: Path, args: list[str], needle: str
) -> None:
    # None of the files named exists: the combination is refused before any is read.
    if args[0] == "recv":
        args = [*args, "--out", str(tmp_path / "o.npy")]
    result = run(*args)
    assert result.returncode == 2
    assert_one_line_error(result.stderr, needle)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["recv", "send"])
@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b"", "is empty: an authkey is 16 bytes or more (make one with: gradstream keygen"),
        (b"x" * 15, "holds 15 bytes: an authkey is 16 bytes or more"),
        (b"x" * (64 * 1024 + 1), "holds 65,537 bytes: not a key file?"),
        (None, "cannot read --authkey-file "),  # then the path, then the OS's words
    ],
)
def test_an_authkey_file_that_is_no_key(
    tmp_path: Path, command: str, content: bytes | None, needle: str
) -> None:
    key = tmp_path / "round.key"
    if content is not None:
        key.write_bytes(content)
    where = ["recv", "0", "--out", str(tmp_path / "o.npy")] if command == "recv" else [
        "send", "127.0.0.1:1", save(tmp_path, "g.npy", gradient(3))
    ]  # fmt: skip
    result = run(*where, "--authkey-file", str(key))
    assert result.returncode == 1
    assert_one_line_error(result.stderr, "gradstream: error: ", f"{key}", needle)


def test_an_authkey_is_the_file_s_bytes(tmp_path: Path) -> None:
    key = tmp_path / "k"
    key.write_bytes(b"sixteen bytes!!\n")  # the newline is part of the key
    assert read_authkey(str(key)) == b"sixteen bytes!!\n"
    key.write_bytes(b"sixteen bytes!!")
    with pytest.raises(CliError, match="holds 15 bytes"):
        read_authkey(str(key))


def test_tls_files_that_are_not_there_name_their_flag(tmp_path: Path) -> None:
    missing = [str(tmp_path / "no.pem"), str(tmp_path / "no.key")]
    result = run("recv", "0", "--out", str(tmp_path / "o.npy"),
                 "--tls-cert", missing[0], "--tls-key", missing[1])  # fmt: skip
    assert result.returncode == 1
    assert_one_line_error(result.stderr, f"cannot read --tls-cert {tmp_path / 'no.pem'}: ")


def test_a_tls_file_that_is_not_pem_fails_the_listen(tmp_path: Path) -> None:
    (tmp_path / "c.pem").write_text("not a certificate\n")
    (tmp_path / "k.pem").write_text("not a key\n")
    files = [str(tmp_path / "c.pem"), str(tmp_path / "k.pem")]
    result = run("recv", "0", "--out", str(tmp_path / "o.npy"),
                 "--tls-cert", files[0], "--tls-key", files[1])  # fmt: skip
    assert result.returncode == 1
    assert_one_line_error(result.stderr, "gradstream: error: cannot listen on 127.0.0.1:0: ")


# --------------------------------------------------------------------------- logging


def test_verbose_shows_the_library_s_info_lines(tmp_path: Path, spawn: list[Child]) -> None:
    receiver, port = start_receiver(spawn, "--out", str(tmp_path / "o.npy"), "-v")
    sent = run("send", f"127.0.0.1:{port}", save(tmp_path, "g.npy", gradient(5)),
               "-v")  # fmt: skip
    assert sent.returncode == 0, sent.stderr
    assert any(line.startswith("gradstream: info: connected to 127.0.0.1:")
               for line in error_lines(sent.stderr))  # fmt: skip
    status, _, stderr = receiver.finish()
    assert status == 0, stderr
    lines = error_lines(stderr)
    assert lines and all(line.startswith("gradstream: info: ") for line in lines), stderr
    assert any(line.startswith("gradstream: info: listening on 127.0.0.1:") for line in lines)


def test_send_over_several_streams(tmp_path: Path, spawn: list[Child], authkey: str) -> None:
    """--streams 4: the gradient's chunks spread over four connections arrive bit for
    bit; without an authkey or TLS it is a command-line mistake, before any dialling."""
    grad = gradient(20_000, seed=6)
    receiver, port = start_receiver(
        spawn, "--out", str(tmp_path / "o.npy"), "--authkey-file", authkey
    )
    src = save(tmp_path, "g.npy", grad)
    sent = run("send", f"127.0.0.1:{port}", src, "--chunk-size", "1000",
               "--streams", "4", "--authkey-file", authkey)  # fmt: skip
    assert sent.returncode == 0, sent.stderr
    status, stdout, stderr = receiver.finish()
    assert status == 0, stderr
    [(_, _, path)] = received(stdout)
    assert bit_equal(np.load(path), grad)
    refused = run("send", "127.0.0.1:9", src, "--streams", "2")
    assert refused.returncode == 2
    assert "--streams 2: several streams need an authkey or TLS" in refused.stderr
    out_of_range = run("send", "127.0.0.1:9", src, "--streams", "0", "--authkey-file", authkey)
    assert out_of_range.returncode == 2 and "--streams" in out_of_range.stderr


def test_send_resumes_across_a_reset(tmp_path: Path, spawn: list[Child], authkey: str) -> None:
    """--resume on one stream, through the test bed's relay, which resets the connection
    at half the gradient: the command dials again, sends what the receiver lacks, and
    the file arrives bit for bit; --resume without an authkey or TLS is a command-line
    mistake, before any dialling."""
    grad = gradient(2_000_000, seed=7)
    receiver, port = start_receiver(
        spawn, "--out", str(tmp_path / "o.npy"), "--authkey-file", authkey
    )
    src = save(tmp_path, "g.npy", grad)
    with Relay(("127.0.0.1", port), rtt=0.01, window=1 << 20) as relay:
        relay.reset_when(grad.nbytes // 2)
        sent = run("send", f"127.0.0.1:{relay.address[1]}", src, "--chunk-size", "10000",
                   "--resume", "--authkey-file", authkey)  # fmt: skip
        assert sent.returncode == 0, sent.stderr
        assert relay.connections == 2  # dialled once more
    status, stdout, stderr = receiver.finish()
    assert status == 0, stderr
    [(_, _, path)] = received(stdout)
    assert bit_equal(np.load(path), grad)
    refused = run("send", "127.0.0.1:9", src, "--resume")
    assert refused.returncode == 2
    assert "--resume: resume needs an authkey or TLS" in refused.stderr
