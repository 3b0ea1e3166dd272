"""docs/guides/connections.md, "Two machines: mutual TLS and an authkey", run as written:
its openssl commands make the CA, the receiver's and the workers' certificates and the
key; its ``recv`` and ``send`` command lines run a mutual-TLS, authkey round with three
workers at once; its two Python programs run the same round; and the lines it says each
side prints when a key or a certificate is wrong are the lines the commands print.

Every block is read from the page's text (so editing the page without the code, or the
code without the page, fails here). The receiver runs on 127.0.0.1 in place of 10.0.0.5,
and each worker in a folder of its own holding only the files the section says to copy
to it.
"""

from __future__ import annotations

import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from support import ROOT
from support.cli import CLI, TIMEOUT, Child, error_lines, free_port, start

PAGE = ROOT / "docs" / "guides" / "connections.md"
SECTION = "## Two machines: mutual TLS and an authkey"
RECEIVER = "10.0.0.5:7000"
LISTEN = "10.0.0.5:7000"  # the receiver listens on its own address
WORKERS = ["worker-1", "worker-2", "worker-3"]
WORKER_FILES = ["ca.pem", "round.key"]  # and its own .pem and .key
RECEIVER_FILES = ["ca.pem", "round.key", "receiver.pem", "receiver.key"]
# The files the wrong cases of step 4 use, besides the README's (made by the fixture).
WRONG_FILES = ["other.key", "other-ca.pem", "rogue.pem", "rogue.key"]
# The placeholder of a worker's address (any port) in the README's lines.
WORKER_ADDRESS = "10.0.0.7:51234"

needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


def section() -> str:
    text = PAGE.read_text()
    start_at = text.index(f"\n{SECTION}\n")
    end = text.find("\n## ", start_at + 1)
    return text[start_at : None if end < 0 else end]


def blocks(language: str) -> list[str]:
    """The section's fenced blocks in ``language``, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```$", section(), re.DOTALL | re.MULTILINE)


def command(block: str) -> list[str]:
    """A one-command shell block (a comment-free line, continued by backslashes) as argv."""
    return shlex.split(block.replace("\\\n", " "))


def copy(source: Path, folder: Path, names: list[str]) -> Path:
    folder.mkdir()
    for name in names:
        shutil.copy(source / name, folder / name)
    return folder


def worker_machine(made: Path, tmp_path: Path, name: str, grad: np.ndarray) -> Path:
    """A worker's folder: what the README copies to it, and its grad.npy."""
    folder = copy(made, tmp_path / name, [*WORKER_FILES, f"{name}.pem", f"{name}.key"])
    np.save(folder / "grad.npy", grad)
    return folder


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The README's certificate commands, run by sh in a fresh folder for a receiver at
    127.0.0.1; and, for the wrong cases, another key, another CA and a certificate of it."""
    if shutil.which("openssl") is None:
        pytest.skip("needs openssl")
    folder = tmp_path_factory.mktemp("round")
    script = blocks("sh")[0]
    assert f"RECEIVER_IP={RECEIVER.split(':')[0]}\n" in script
    script = script.replace(f"RECEIVER_IP={RECEIVER.split(':')[0]}", "RECEIVER_IP=127.0.0.1")
    # `gradstream` is this test's (the venv's), whatever PATH holds.
    assert "gradstream keygen --out round.key\n" in script
    script = script.replace("gradstream keygen", f"{shlex.join(CLI)} keygen")
    subprocess.run(["sh", "-e", "-c", script], cwd=folder, check=True, capture_output=True)
    wrong = """
        openssl rand -out other.key 32
        openssl req -x509 -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:P-256 \
            -days 1 -subj "/CN=other CA" -keyout other-ca.key -out other-ca.pem
        openssl req -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:P-256 \
            -subj "/O=lab/CN=rogue" -keyout rogue.key -out rogue.csr
        openssl x509 -req -in rogue.csr -CA other-ca.pem -CAkey other-ca.key \
            -CAcreateserial -days 1 -extfile worker.ext -out rogue.pem
    """
    subprocess.run(["sh", "-e", "-c", wrong], cwd=folder, check=True, capture_output=True)
    return folder


def normal(line: str) -> str:
    """A line with what differs from run to run (times, rates, worker addresses and
    numbers) replaced, and the receiver's address as 127.0.0.1's."""
    line = line.replace(LISTEN, "RECEIVER").replace(RECEIVER, "RECEIVER")
    line = re.sub(r"127\.0\.0\.1:\d+ \(subject", "WORKER (subject", line)
    line = re.sub(r"10\.0\.0\.\d+:\d+ \(subject", "WORKER (subject", line)
    line = re.sub(r"listening on 127\.0\.0\.1:\d+", "listening on RECEIVER", line)
    line = re.sub(r"\d+\.\d+ s, \d+\.\d+ GB/s", "T s, R GB/s", line)
    return re.sub(r"worker-\d", "worker-N", line)


def start_receiver(spawn: list[Child], folder: Path, *, forever: bool = False) -> tuple[Child, int]:
    """The README's recv command line, listening on 127.0.0.1 (any port)."""
    argv = command(blocks("sh")[1])
    assert argv[:3] == ["gradstream", "recv", LISTEN], argv
    argv[2] = "127.0.0.1:0"
    if forever:
        at = argv.index("--count")
        argv[at : at + 2] = ["--forever"]
    receiver = start(spawn, *argv[1:], cwd=folder)
    line = receiver.first_line()
    match = re.fullmatch(r"listening on 127\.0\.0\.1:(\d+)", line)
    assert match, line
    return receiver, int(match[1])


def worker_argv(port: int, name: str) -> list[str]:
    """The README's send command line for worker ``name``, to 127.0.0.1:``port``."""
    block = blocks("sh")[2]
    assert block.count("worker-1") == 2, block
    argv = command(block.replace("worker-1", name))
    assert argv[:3] == ["gradstream", "send", RECEIVER], argv
    argv[2] = f"127.0.0.1:{port}"
    return argv[1:]


# --------------------------------------------------------------------------- the commands


@needs_openssl
def test_the_command_lines_run_a_round_of_three_workers_at_once(
    made: Path, tmp_path: Path, spawn: list[Child]
) -> None:
    receiver_folder = copy(made, tmp_path / "receiver", RECEIVER_FILES)
    receiver, port = start_receiver(spawn, receiver_folder)
    grads = {name: np.full(1_048_576, i + 1, np.float32) for i, name in enumerate(WORKERS)}
    workers = [
        start(spawn, *worker_argv(port, name), cwd=worker_machine(made, tmp_path, name, grad))
        for name, grad in grads.items()
    ]
    said = re.search(r"The worker prints `(sent grad\.npy: [^`]+)`", " ".join(section().split()))
    assert said is not None
    for worker in workers:
        status, stdout, stderr = worker.finish()
        assert status == 0, stderr
        assert stderr == ""
        assert normal(stdout) == normal(said[1])
    status, stdout, stderr = receiver.finish()
    assert status == 0, stderr
    assert stderr == ""
    assert [normal(line) for line in stdout.splitlines()] == [
        normal(line) for line in blocks("text")[0].splitlines()
    ]
    # Each file is one worker's gradient, each worker's is in one file, and the line
    # naming a file names the worker whose gradient it holds.
    for line in stdout.splitlines()[1:-1]:
        name = re.search(r'"CN=(worker-\d),O=lab", authenticated\) -> (round-\d\.npy)$', line)
        assert name is not None, line
        assert np.array_equal(np.load(receiver_folder / name[2]), grads[name[1]])


# --------------------------------------------------------------------------- from Python


@needs_openssl
def test_the_python_programs_run_the_same_round(
    made: Path, tmp_path: Path, spawn: list[Child]
) -> None:
    receiver_py, worker_py = blocks("python")
    port = free_port()
    assert LISTEN in receiver_py and RECEIVER in worker_py
    receiver_folder = copy(made, tmp_path / "receiver", RECEIVER_FILES)
    (receiver_folder / "receiver.py").write_text(receiver_py.replace(LISTEN, f"127.0.0.1:{port}"))
    receiver = start(spawn, "receiver.py", command=[sys.executable], cwd=receiver_folder)
    assert receiver.first_line() == f"listening on ('127.0.0.1', {port})"
    grads = [np.random.default_rng(i).standard_normal(8, np.float32) for i in range(3)]
    workers = []
    for name, grad in zip(WORKERS, grads, strict=True):
        folder = worker_machine(made, tmp_path, name, grad)
        (folder / "worker.py").write_text(worker_py.replace(RECEIVER, f"127.0.0.1:{port}"))
        workers.append(start(spawn, "worker.py", name, command=[sys.executable], cwd=folder))
    text = " ".join(section().split())
    on_receiver, on_worker = re.findall(r"`(Peer\(address=\([^`]*\))`", text)
    for worker in workers:
        status, stdout, stderr = worker.finish()
        assert status == 0, stderr
        assert stdout.splitlines() == [
            "receiver: " + on_worker.replace("'10.0.0.5', 7000", f"'127.0.0.1', {port}"),
            "sent 16 chunks, acknowledged",
        ]
    status, stdout, stderr = receiver.finish()
    assert status == 0, stderr
    lines = stdout.splitlines()
    assert lines[-1] == "averaged 3 gradients into mean.npy"
    pattern = re.escape(on_receiver).replace(re.escape("'10.0.0.7', 51234"), r"'127\.0\.0\.1', \d+")
    pattern = "worker: " + pattern.replace(re.escape("worker-1"), r"(worker-\d)")
    names = []
    for line in lines[1:-1]:
        match = re.fullmatch(pattern, line)
        assert match, (line, pattern)
        names.append(match[1])
    assert sorted(names) == WORKERS
    mean = np.load(receiver_folder / "mean.npy")
    assert mean.shape == (1_048_576,) and mean.dtype == np.float32


# --------------------------------------------------------------------------- wrong keys

# Step 4's cases, by their heading: what the worker does differently from the README's
# send line (flags dropped, flags given instead, or the host it dials).
CASES: dict[str, tuple[list[str], list[str], str | None]] = {
    "another key (worker: --authkey-file other.key)": (
        ["--authkey-file"], ["--authkey-file", "other.key"], None),
    "no key (worker: no --authkey-file)": (["--authkey-file"], [], None),
    "no certificate (worker: no --tls-cert, --tls-key)": (["--tls-cert", "--tls-key"], [], None),
    "another CA (worker: --tls-ca other-ca.pem)": (
        ["--tls-ca"], ["--tls-ca", "other-ca.pem"], None),
    "a certificate of another CA (worker: --tls-cert rogue.pem --tls-key rogue.key)": (
        ["--tls-cert", "--tls-key"], ["--tls-cert", "rogue.pem", "--tls-key", "rogue.key"], None),
    "a name the certificate does not hold (worker: receiver.lab:7000)": ([], [], "localhost"),
}  # fmt: skip


def wrong_cases() -> list[tuple[str, str, str]]:
    """(heading, the worker's line, the receiver's line) of each case in step 4."""
    cases = []
    lines = blocks("text")[1].splitlines()
    for at in range(0, len(lines), 3):
        heading, worker, receiver = lines[at : at + 3]
        assert worker.startswith("  worker    ") and receiver.startswith("  receiver  "), lines
        cases.append((heading, worker[12:], receiver[12:]))
    return cases


def expected(line: str, port: int) -> re.Pattern[str]:
    """A README line as a pattern for a run on 127.0.0.1:``port`` ("receiver.lab" read
    as localhost, any worker port)."""
    for readme, here in [
        (RECEIVER, f"127.0.0.1:{port}"),
        (LISTEN, f"127.0.0.1:{port}"),
        ("receiver.lab:7000", f"localhost:{port}"),
        ("receiver.lab", "localhost"),
        ("10.0.0.5", "127.0.0.1"),
    ]:
        line = line.replace(readme, here)
    pattern = re.escape(line).replace(re.escape(WORKER_ADDRESS), r"127\.0\.0\.1:\d+")
    return re.compile(pattern)


def with_case(argv: list[str], drop: list[str], add: list[str], host: str | None) -> list[str]:
    out = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in drop:
            skip = True
        else:
            out.append(arg)
    if host is not None:
        out[1] = out[1].replace("127.0.0.1", host)
    return [*out, *add]


@needs_openssl
def test_each_side_prints_what_the_readme_says_when_a_key_or_certificate_is_wrong(
    made: Path, tmp_path: Path, spawn: list[Child]
) -> None:
    cases = wrong_cases()
    assert [heading for heading, _, _ in cases] == list(CASES)
    receiver, port = start_receiver(
        spawn, copy(made, tmp_path / "receiver", RECEIVER_FILES), forever=True
    )
    folder = worker_machine(made, tmp_path, "worker-1", np.ones(4, np.float32))
    for name in WRONG_FILES:
        shutil.copy(made / name, folder / name)
    for heading, worker_line, _ in cases:
        argv = with_case(worker_argv(port, "worker-1"), *CASES[heading])
        done = subprocess.run(
            [*CLI, *argv], capture_output=True, text=True, timeout=TIMEOUT, cwd=folder
        )
        assert done.returncode == 1, heading
        [line] = error_lines(done.stderr)
        assert expected(worker_line, port).fullmatch(line), (heading, line)
    receiver.proc.send_signal(signal.SIGTERM)
    status, _, stderr = receiver.finish()
    assert status == 0, stderr
    refusals = error_lines(stderr)
    assert len(refusals) == len(cases), stderr
    for (heading, _, receiver_line), line in zip(cases, refusals, strict=True):
        assert expected(receiver_line, port).fullmatch(line), (heading, line)
