"""The benchmark (``python benches/bench.py``, ``make bench``) at a tiny size: it runs, and
its JSON holds every row and ratio.

The benchmark runs as a real process tree (it forks its own children); the whole run is
bounded by a timeout, and its children die with it (PR_SET_PDEATHSIG). It lives outside the
package, in benches/: the script runs as a subprocess, and the suite behind it (a package,
benches/suite/) is loaded by path for the in-process checks.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from support import ROOT

BENCHES = ROOT / "benches"
BENCH = [sys.executable, str(BENCHES / "bench.py")]


def _load_suite() -> ModuleType:
    """benches/suite/ as a package of its own name (benches/ stays off sys.path: its
    scripts' module names, such as ``compression``, are too plain to put there)."""
    init = BENCHES / "suite" / "__init__.py"
    spec = importlib.util.spec_from_file_location(
        "gradstream_bench_suite", init, submodule_search_locations=[str(init.parent)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


bench = _load_suite()

TIMEOUT = 120.0  # the tiny run takes a few seconds

CHUNK_SIZES = (4096, 65536, 1_048_576)
LAYOUTS = ("seed", "compact")
TIMED_ROWS = {
    "memcpy",
    "memcpy_new",
    "crc32fast",
    "zlib_crc32",
    "raw_tcp",
    "raw_tcp_new",
    "raw_tcp_hot",
    *(
        f"{impl}_{op}_{layout}_{chunk}"
        for impl in ("native", "reference")
        for op in ("encode", "decode", "encode_out", "decode_out")
        for layout in LAYOUTS
        for chunk in CHUNK_SIZES
    ),
    *(
        f"e2e_{impl_path}_{layout}"
        for impl_path in ("native_socket", "native_streams", "reference_socket")
        for layout in LAYOUTS
    ),
    "e2e_pickle",
    "e2e_pickle_oob",
    "e2e_gloo",
}
PING_PONG_ROWS = {
    "pingpong_native",
    "pingpong_reference",
    "pingpong_raw",
    "pingpong_connection",
    "pingpong_raw_ack",
}
RSS_ROWS = {"rss_send", "rss_recv"}
# Ratio name -> the row keys it divides (each ratio has a target it is checked against).
RATIO_ROWS = {
    **{
        f"native {op}_frames(out=), chunk 65536, {layout} / memcpy": (
            f"native_{op}_out_{layout}_65536",
            "memcpy",
        )
        for op in ("encode", "decode")
        for layout in LAYOUTS
    },
    **{
        f"native / reference {op}_frames(out=), chunk {chunk}, {layout}": (
            f"native_{op}_out_{layout}_{chunk}",
            f"reference_{op}_out_{layout}_{chunk}",
        )
        for op in ("encode", "decode")
        for layout in LAYOUTS
        for chunk in (4096, 65536)
    },
    "end to end, socket path, seed: wire GB/s / raw loopback TCP": (
        "e2e_native_socket_seed",
        "raw_tcp",
    ),
    "end to end, socket path, compact: gradient GB/s / raw loopback TCP": (
        "e2e_native_socket_compact",
        "raw_tcp",
    ),
    "end to end, socket path, compact / gloo (gradient GB/s)": (
        "e2e_native_socket_compact",
        "e2e_gloo",
    ),
    **{
        f"end to end, asyncio streams / reference, {layout}": (
            f"e2e_native_streams_{layout}",
            f"e2e_reference_socket_{layout}",
        )
        for layout in LAYOUTS
    },
    "small-gradient round trips, native / raw socket ping-pong": (
        "pingpong_native",
        "pingpong_raw",
    ),
    "small-gradient round trips, native / reference": ("pingpong_native", "pingpong_reference"),
    "small-gradient round trips, connection / raw ping-pong with acks": (
        "pingpong_connection",
        "pingpong_raw_ack",
    ),
}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    cmd = [*BENCH, "--quick", "--tiny", "--json", str(out)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired as exc:  # subprocess.run killed it
        pytest.fail(f"benches/bench.py --tiny did not finish in {TIMEOUT:g} s: {exc.stdout!r}")
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    return json.loads(out.read_text()), done.stdout


def test_every_row_is_there_and_ran_or_skipped(tiny_run: tuple[dict[str, Any], str]) -> None:
    doc, _ = tiny_run
    rows = {row["key"]: row for row in doc["rows"]}
    assert set(rows) == TIMED_ROWS | PING_PONG_ROWS | RSS_ROWS
    assert {row["status"] for row in rows.values()} <= {"ok", "skipped"}
    for key, row in rows.items():
        if row["status"] == "skipped":
            assert row["note"], key
            continue
        if key in TIMED_ROWS:
            assert row["gbps"] > 0 and row["seconds"] > 0, key
            # memcpy is sampled again in every round of section 2
            assert len(row["samples"]) >= doc["config"]["repeats"], key
        elif key in PING_PONG_ROWS:
            assert row["round_trips_per_s"] > 0, key
        else:
            assert row["peak_over_baseline_mib"] is not None, key


def test_wire_bytes_follow_the_layout(tiny_run: tuple[dict[str, Any], str]) -> None:
    doc, _ = tiny_run
    rows = {row["key"]: row for row in doc["rows"]}
    seed = rows["e2e_native_socket_seed"]
    assert 1.9 < seed["wire_bytes"] / seed["gradient_bytes"] < 2.2  # index + value columns
    compact = rows["e2e_native_socket_compact"]
    if compact["status"] == "ok":
        assert 1.0 < compact["wire_bytes"] / compact["gradient_bytes"] < 1.2


def test_skips_are_the_expected_ones(tiny_run: tuple[dict[str, Any], str]) -> None:
    doc, _ = tiny_run
    rows = {row["key"]: row for row in doc["rows"]}
    torch = importlib.util.find_spec("torch") is not None
    assert (rows["e2e_gloo"]["status"] == "skipped") != torch
    for impl in ("native", "reference"):
        compact = doc["layouts"][impl] == "available"
        for key, row in rows.items():
            if key.startswith((f"{impl}_", f"e2e_{impl}_")) and key.endswith(
                ("_compact", *(f"_compact_{c}" for c in CHUNK_SIZES))
            ):
                assert (row["status"] == "ok") == compact, key
    skipped = {k for k, row in rows.items() if row["status"] == "skipped"}
    assert all("compact" in k or k == "e2e_gloo" for k in skipped)


def test_every_ratio_is_there(tiny_run: tuple[dict[str, Any], str]) -> None:
    doc, stdout = tiny_run
    rows = {row["key"]: row for row in doc["rows"]}
    ratios = {r["name"]: r for r in doc["ratios"]}
    rss = {name: r for name, r in ratios.items() if name.startswith("peak RSS")}
    assert set(ratios) - set(rss) == set(RATIO_ROWS)
    assert {r["numerator"] for r in rss.values()} == RSS_ROWS
    for name, (num, den) in RATIO_ROWS.items():
        r = ratios[name]
        assert (r["numerator"], r["denominator"]) == (num, den), name
        measured = rows[num]["status"] == "ok" and rows[den]["status"] == "ok"
        if measured:
            assert r["measured"] > 0 and isinstance(r["met"], bool), name
            assert r["met"] == (
                r["measured"] >= r["target"] if r["op"] == ">=" else r["measured"] <= r["target"]
            )
        else:
            assert r["measured"] is None and r["met"] is None and "not measured" in r["note"]
        assert name in stdout
    for r in rss.values():
        assert r["measured"] > 0 and isinstance(r["met"], bool) and r["op"] == "<="
    assert "total run time" in stdout


def test_machine_is_described(tiny_run: tuple[dict[str, Any], str]) -> None:
    doc, stdout = tiny_run
    machine = doc["machine"]
    assert machine["nproc"] >= 1 and machine["python"] and machine["numpy"]
    assert machine["pyarrow"] and machine["cpu_model"]
    assert stdout.startswith("machine: ")
    assert doc["runtime_s"] > 0


def test_bad_options_are_usage_errors() -> None:
    assert bench.main(["--elements", "0"]) == 2
    with pytest.raises(SystemExit) as exc:
        bench.main(["--no-such-option"])
    assert exc.value.code == 2


# A stand-in for torch and torch.distributed, just enough to drive the benchmark's gloo code
# path (which real torch would run) through two processes over 127.0.0.1.
FAKE_TORCH = """
import numpy as np
__version__ = "0.0-stand-in"
int32, float32 = np.int32, np.float32
class Tensor(np.ndarray):
    def numpy(self):
        return self.view(np.ndarray)
def from_numpy(a):
    return a.view(Tensor)
def zeros(n, dtype):
    return np.zeros(n, dtype).view(Tensor)
def ones(n, dtype):
    return np.ones(n, dtype).view(Tensor)
def empty(n, dtype):
    return np.empty(n, dtype).view(Tensor)
"""
FAKE_DIST = """
import os, socket, struct, time
_sock = None
def init_process_group(backend, init_method, rank, world_size, timeout):
    global _sock
    assert backend == "gloo" and world_size == 2 and os.environ["GLOO_SOCKET_IFNAME"] == "lo"
    host, port = init_method.removeprefix("tcp://").rsplit(":", 1)
    assert host == "127.0.0.1"
    if rank == 0:
        with socket.create_server((host, int(port))) as server:
            _sock, _ = server.accept()
        return
    for _ in range(400):
        try:
            _sock = socket.create_connection((host, int(port)))
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("no rank 0")
def _exactly(n):
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = _sock.recv_into(view[got:])
        assert k, "peer closed"
        got += k
    return buf
def send(tensor, dst):
    data = tensor.numpy().tobytes()
    _sock.sendall(struct.pack("<Q", len(data)) + data)
def recv(tensor, src):
    (n,) = struct.unpack("<Q", _exactly(8))
    assert n == tensor.nbytes
    tensor.numpy().reshape(-1).view("u1")[:] = memoryview(_exactly(n))
def barrier():
    _sock.sendall(b"b")
    assert _exactly(1) == b"b"
def destroy_process_group():
    _sock.close()
"""


def test_gloo_path_runs_with_a_stand_in_torch(tmp_path: Path) -> None:
    package = tmp_path / "site" / "torch"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(FAKE_TORCH)
    (package / "distributed.py").write_text(FAKE_DIST)
    out = tmp_path / "bench.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(package.parent), *sys.path])}
    cmd = [*BENCH, "--tiny", "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=env)
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    doc = json.loads(out.read_text())
    assert doc["machine"]["torch"] == "0.0-stand-in"
    gloo = next(row for row in doc["rows"] if row["key"] == "e2e_gloo")
    assert gloo["status"] == "ok" and gloo["gbps"] > 0, gloo
    assert len(gloo["samples"]) == doc["config"]["repeats"]
    vs_gloo = next(r for r in doc["ratios"] if r["denominator"] == "e2e_gloo")
    compact = next(row for row in doc["rows"] if row["key"] == "e2e_native_socket_compact")
    assert (vs_gloo["measured"] is not None) == (compact["status"] == "ok")
