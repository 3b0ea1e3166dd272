"""The benchmark (``python benches/bench.py``, ``make bench``) at a tiny size: it runs, and
its JSON holds every row and ratio.

The benchmark runs as a real process tree (it forks its own children); the whole run is
bounded by a timeout, and its children die with it (PR_SET_PDEATHSIG). It lives outside the
package, in benches/: the script runs as a subprocess, and the suite behind it (a package,
benches/suite/) is loaded by path for the in-process checks.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import multiprocessing
import os
import re
import subprocess
import sys
import time
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
    "raw_tcp_slices",
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
        for impl_path in (
            "native_socket",
            "native_streams",
            "native_uvloop",
            "reference_socket",
            "reference_streams",
        )
        for layout in LAYOUTS
    ),
    # the default call, receive_from into a new array
    *(f"e2e_native_socket_{layout}_new" for layout in LAYOUTS),
    # beside the default calls: frames as a pyarrow.Buffer, numpy's copy into a new array
    *(
        f"{row}_{layout}_65536"
        for row in ("native_encode_buffer", "fresh_copy")
        for layout in LAYOUTS
    ),
    "e2e_pickle",
    "e2e_pickle_oob",
    "e2e_gloo",
    *(f"conn_{kind}" for kind in ("bare", "plain", "authkey", "tls")),
    # section 7: a driver turned off, beside the row that has it
    *(f"e2e_native_streams_{layout}_generic" for layout in LAYOUTS),
    # issue 23's point-to-point rows: a gs.sync connection, larger chunks
    "e2e_native_connection",
    "e2e_native_unix",  # issue 24: the same-host transport
    "e2e_native_socket_compact_chunk262144",
    "e2e_native_socket_compact_chunk1048576",
}
PING_PONG_ROWS = {
    "pingpong_native",
    "pingpong_reference",
    "pingpong_raw",
    # a Connection's round trips, and their baselines: a ping-pong with an ack, raw
    # blocking for the blocking face, pure asyncio for the asyncio one
    "pingpong_connection",
    "pingpong_raw_ack",
    "pingpong_sync_connection",
    "pingpong_asyncio_ack",
    # section 7: without the caller-thread driver, and asyncio streams with and without
    # the handover
    "pingpong_native_tokio",
    "pingpong_connection_tokio",
    "pingpong_sync_connection_tokio",
    "pingpong_sync_unix",
    "pingpong_raw_unix_ack",
    "pingpong_unix_floor",  # the raw Unix ping-pong plus a round trip's codec work
    "pingpong_streams",
    "pingpong_streams_generic",
}
RSS_ROWS = {"rss_send", "rss_recv"}
REPORTED = None  # a ratio shown beside the targets, with none of its own
# Ratio name -> the row keys it divides and its target (issue 12's table, the earlier
# issues' targets that still hold, and what issue 12 asks to see reported).
RATIO_ROWS: dict[str, tuple[str, str, float | None]] = {
    **{
        f"native {op}_frames(out=), chunk 65536, {layout} / memcpy": (
            f"native_{op}_out_{layout}_65536",
            "memcpy",
            target if layout == "compact" else REPORTED,
        )
        for op, target in (("encode", 0.5), ("decode", 0.4))
        for layout in LAYOUTS
    },
    **{
        f"native / reference {op}_frames(out=), chunk {chunk}, {layout}": (
            f"native_{op}_out_{layout}_{chunk}",
            f"reference_{op}_out_{layout}_{chunk}",
            target,
        )
        for op in ("encode", "decode")
        for layout in LAYOUTS
        for chunk, target in ((4096, 10.0), (65536, 4.0))
    },
    **{
        f"default {call}, seed / with out=": (num, den, 0.5)
        for call, num, den in (
            ("decode_frames(wire)", "native_decode_seed_65536", "native_decode_out_seed_65536"),
            ("encode_frames(g)", "native_encode_seed_65536", "native_encode_out_seed_65536"),
            ("receive_from(sock)", "e2e_native_socket_seed_new", "e2e_native_socket_seed"),
        )
    },
    "default encode_frames(g, as_buffer=True), seed / with out=": (
        "native_encode_buffer_seed_65536",
        "native_encode_out_seed_65536",
        REPORTED,
    ),
    "numpy copy into a new array in the same rounds / encode_frames(out=), seed": (
        "fresh_copy_seed_65536",
        "native_encode_out_seed_65536",
        REPORTED,
    ),
    # issue 21: the default calls against baselines that make new memory too
    **{
        f"default decode_frames(wire), {layout}: new array / numpy copy into a new array": (
            f"native_decode_{layout}_65536",
            f"fresh_copy_{layout}_65536",
            0.6 if layout == "compact" else REPORTED,
        )
        for layout in LAYOUTS
    },
    **{
        f"default encode_frames(g) to bytes, {layout}: wire GB/s / numpy copy, new array": (
            f"native_encode_{layout}_65536",
            f"fresh_copy_{layout}_65536",
            REPORTED,
        )
        for layout in LAYOUTS
    },
    "default receive_from(sock), compact: new array / raw TCP recv_into a new array": (
        "e2e_native_socket_compact_new",
        "raw_tcp_new",
        0.8,
    ),
    "default receive_from(sock), seed: wire GB/s / raw TCP recv_into a new array": (
        "e2e_native_socket_seed_new",
        "raw_tcp_new",
        REPORTED,
    ),
    "end to end, socket path, seed: wire GB/s / raw loopback TCP": (
        "e2e_native_socket_seed",
        "raw_tcp",
        0.9,
    ),
    "end to end, socket path, compact: gradient GB/s / raw TCP recv_into out= slices": (
        "e2e_native_socket_compact",
        "raw_tcp_slices",
        0.9,
    ),
    "end to end, socket path, compact: gradient GB/s / raw TCP cache-hot 1 MiB": (
        "e2e_native_socket_compact",
        "raw_tcp_hot",
        REPORTED,
    ),
    "end to end, socket path, compact / gloo (gradient GB/s)": (
        "e2e_native_socket_compact",
        "e2e_gloo",
        1.0,
    ),
    **{
        f"end to end, socket path, compact, chunk {chunk} / gloo": (
            f"e2e_native_socket_compact_chunk{chunk}",
            "e2e_gloo",
            REPORTED,
        )
        for chunk in (262144, 1048576)
    },
    "end to end, gs.sync connection (defaults) / gloo (gradient GB/s)": (
        "e2e_native_connection",
        "e2e_gloo",
        0.9,
    ),
    "end to end, gs.sync unix: connection / memcpy (gradient GB/s)": (
        "e2e_native_unix",
        "memcpy",
        0.4,
    ),
    "end to end, gs.sync unix: connection / over loopback TCP": (
        "e2e_native_unix",
        "e2e_native_connection",
        REPORTED,
    ),
    "end to end, socket path, compact / pickle protocol 5 out-of-band": (
        "e2e_native_socket_compact",
        "e2e_pickle_oob",
        REPORTED,
    ),
    **{
        f"end to end, asyncio streams / reference over the same streams, {layout}": (
            f"e2e_native_streams_{layout}",
            f"e2e_reference_streams_{layout}",
            3.0,
        )
        for layout in LAYOUTS
    },
    **{
        f"end to end, asyncio streams / native socket path, {layout}": (
            f"e2e_native_streams_{layout}",
            f"e2e_native_socket_{layout}",
            0.7,
        )
        for layout in LAYOUTS
    },
    **{
        f"end to end, asyncio streams under uvloop / native socket path, {layout}": (
            f"e2e_native_uvloop_{layout}",
            f"e2e_native_socket_{layout}",
            REPORTED,
        )
        for layout in LAYOUTS
    },
    "small-gradient round trips, native / raw socket ping-pong": (
        "pingpong_native",
        "pingpong_raw",
        0.5,
    ),
    "small-gradient round trips, native / reference": (
        "pingpong_native",
        "pingpong_reference",
        3.0,
    ),
    "small-gradient round trips, blocking gradstream.sync Connection / raw blocking "
    "ping-pong with an ack": ("pingpong_sync_connection", "pingpong_raw_ack", 0.5),
    "small-gradient round trips, blocking unix: Connection / raw Unix-socket ping-pong with "
    "an ack": ("pingpong_sync_unix", "pingpong_raw_unix_ack", 0.5),
    "small-gradient round trips: the raw Unix ping-pong with an ack plus a round trip's codec "
    "work / the raw Unix ping-pong (the most a unix: Connection can reach)": (
        "pingpong_unix_floor",
        "pingpong_raw_unix_ack",
        REPORTED,
    ),
    "small-gradient round trips, asyncio Connection / pure-asyncio ping-pong with an ack": (
        "pingpong_connection",
        "pingpong_asyncio_ack",
        1.0,
    ),
    "small-gradient round trips, asyncio Connection / raw blocking ping-pong with an ack": (
        "pingpong_connection",
        "pingpong_raw_ack",
        REPORTED,
    ),
    "gs.Connection (hello, seal, ack) / bare stream_to + receive_from": (
        "conn_plain",
        "conn_bare",
        0.95,
    ),
    "TLS connection / plain connection": ("conn_tls", "conn_plain", 0.6),
    "authkey connection / plain connection": ("conn_authkey", "conn_plain", REPORTED),
    # Section 7: each driver against the path that serves its case without it.
    "driver caller_thread, socket: round trips / without it (tokio)": (
        "pingpong_native",
        "pingpong_native_tokio",
        1.1,
    ),
    "driver caller_thread, asyncio connection: round trips / without it (tokio)": (
        "pingpong_connection",
        "pingpong_connection_tokio",
        1.1,
    ),
    "driver caller_thread, blocking connection: round trips / without it (tokio)": (
        "pingpong_sync_connection",
        "pingpong_sync_connection_tokio",
        1.1,
    ),
    "driver handover, small: round trips / without it (generic asyncio)": (
        "pingpong_streams",
        "pingpong_streams_generic",
        1.1,
    ),
    **{
        f"driver handover, {layout}: GB/s / without it (generic asyncio)": (
            f"e2e_native_streams_{layout}",
            f"e2e_native_streams_{layout}_generic",
            1.1,
        )
        for layout in LAYOUTS
    },
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
    expected = TIMED_ROWS | PING_PONG_ROWS | RSS_ROWS
    assert set(rows) == expected
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


def test_the_unix_floor_is_the_raw_ping_pong_and_the_codec_work(
    tiny_run: tuple[dict[str, Any], str],
) -> None:
    doc, _ = tiny_run
    rows = {row["key"]: row for row in doc["rows"]}
    floor, raw = rows["pingpong_unix_floor"], rows["pingpong_raw_unix_ack"]
    assert floor["status"] == raw["status"] == "ok"
    codec = float(re.search(r"2 x ([\d.,]+) codec", floor["note"]).group(1))  # type: ignore[union-attr]
    assert codec > 0
    assert floor["seconds"] == pytest.approx(raw["seconds"] + 2 * codec * 1e-6, rel=0.01)


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
    uvloop = importlib.util.find_spec("uvloop") is not None
    for layout in LAYOUTS:
        row = rows[f"e2e_native_uvloop_{layout}"]
        if layout == "seed" or doc["layouts"]["native"] == "available":
            assert (row["status"] == "ok") == uvloop, row
    trustme = importlib.util.find_spec("trustme") is not None
    assert all((rows[f"conn_{k}"]["status"] == "ok") == trustme for k in ("bare", "tls"))
    skipped = {k for k, row in rows.items() if row["status"] == "skipped"}
    assert all("compact" in k or k == "e2e_gloo" or "uvloop" in k for k in skipped)


def test_every_ratio_is_there(tiny_run: tuple[dict[str, Any], str]) -> None:
    doc, stdout = tiny_run
    rows = {row["key"]: row for row in doc["rows"]}
    ratios = {r["name"]: r for r in doc["ratios"]}
    rss = {name: r for name, r in ratios.items() if name.startswith("peak RSS")}
    assert set(ratios) - set(rss) == set(RATIO_ROWS)
    assert {r["numerator"] for r in rss.values()} == RSS_ROWS
    for name, (num, den, target) in RATIO_ROWS.items():
        r = ratios[name]
        assert (r["numerator"], r["denominator"], r["target"]) == (num, den, target), name
        assert (r["op"] == "report") == (target is REPORTED), name
        measured = all(k in rows and rows[k]["status"] == "ok" for k in (num, den))
        if not measured:
            assert r["measured"] is None and r["met"] is None and "not measured" in r["note"]
        elif target is REPORTED:
            assert r["measured"] > 0 and r["met"] is None, name
        else:
            assert r["measured"] > 0 and isinstance(r["met"], bool), name
            assert r["met"] == (r["measured"] >= r["target"]), name
        if not measured:
            verdict = "not measured"
        elif target is REPORTED:
            verdict = "reported"
        else:
            verdict = "met" if r["met"] else "NOT MET"
        line = next(line for line in stdout.splitlines() if line.strip().startswith(name))
        assert f" {verdict}" in line, line
    for r in rss.values():
        assert r["measured"] > 0 and isinstance(r["met"], bool) and r["op"] == "<="
    checked = [r for r in ratios.values() if r["op"] != "report"]
    met = sum(r["met"] is True for r in checked)
    assert f"{met} of {len(checked)} targets met" in stdout
    assert "total run time" in stdout


def test_machine_is_described(tiny_run: tuple[dict[str, Any], str]) -> None:
    doc, stdout = tiny_run
    machine = doc["machine"]
    assert machine["nproc"] >= 1 and machine["python"] and machine["numpy"]
    assert machine["pyarrow"] and machine["cpu_model"]
    assert stdout.startswith("machine: ")
    assert doc["runtime_s"] > 0 and doc["date"].endswith(" UTC")


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
    # A file store: rank 0 writes its port into the file, rank 1 reads it there.
    store = init_method.removeprefix("file://")
    if rank == 0:
        with socket.create_server(("127.0.0.1", 0)) as server:
            with open(store + ".tmp", "w") as f:
                f.write(str(server.getsockname()[1]))
            os.replace(store + ".tmp", store)
            _sock, _ = server.accept()
        return
    for _ in range(400):
        try:
            with open(store) as f:
                _sock = socket.create_connection(("127.0.0.1", int(f.read())))
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


# Optional peers that are installed but do not import: their rows are skipped, not failed.
BROKEN = 'raise ImportError("a stand-in that does not import")\n'


def test_gloo_path_runs_with_a_stand_in_torch_and_broken_peers_skip(tmp_path: Path) -> None:
    site = tmp_path / "site"
    package = site / "torch"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(FAKE_TORCH)
    (package / "distributed.py").write_text(FAKE_DIST)
    for name in ("uvloop", "trustme"):
        (site / f"{name}.py").write_text(BROKEN)
    out = tmp_path / "bench.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *sys.path])}
    cmd = [*BENCH, "--tiny", "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=env)
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    doc = json.loads(out.read_text())
    rows = {row["key"]: row for row in doc["rows"]}
    assert doc["machine"]["torch"] == "0.0-stand-in"
    gloo = rows["e2e_gloo"]
    assert gloo["status"] == "ok" and gloo["gbps"] > 0, gloo
    assert len(gloo["samples"]) == doc["config"]["repeats"]
    vs_gloo = next(r for r in doc["ratios"] if r["denominator"] == "e2e_gloo")
    assert (vs_gloo["measured"] is not None) == (
        rows["e2e_native_socket_compact"]["status"] == "ok"
    )
    for key, why in (
        *((f"e2e_native_uvloop_{layout}", "uvloop is not importable") for layout in LAYOUTS),
        *((f"conn_{kind}", "trustme is not importable") for kind in ("bare", "tls")),
    ):
        assert (rows[key]["status"], rows[key]["note"]) == ("skipped", why), rows[key]
    tls = next(r for r in doc["ratios"] if r["numerator"] == "conn_tls")
    assert tls["measured"] is None and "trustme is not importable" in tls["note"]
    assert rows["e2e_native_streams_seed"]["status"] == "ok"  # the default loop's row stays


# ------------------------------------------------------------------- the ratios, in-process


def _results(**gbps: float) -> Any:
    res = bench.results.Results()
    for key, value in gbps.items():
        row = bench.results.Row(key, "e2e", key)
        row.gbps = row.wire_gbps = value
        res.rows[key] = row  # not add(): no progress lines on stderr
    return res


def _ratio(res: Any, numerator: str) -> Any:
    cfg = bench.config.make_config(False, True, None)
    return next(r for r in bench.ratios.compute_ratios(res, cfg) if r.numerator == numerator)


@pytest.mark.parametrize(
    ("plain", "met", "verdict"),
    [(0.96, True, "met"), (0.95, True, "met"), (0.94, False, "NOT MET")],
)
def test_a_ratio_is_met_at_its_target_and_not_below(plain: float, met: bool, verdict: str) -> None:
    r = _ratio(_results(conn_plain=plain, conn_bare=1.0), "conn_plain")
    assert (r.measured, r.met, r.verdict) == (pytest.approx(plain), met, verdict)


def test_a_reported_ratio_has_a_figure_and_no_verdict() -> None:
    r = _ratio(_results(conn_authkey=0.5, conn_plain=2.0), "conn_authkey")
    assert (r.measured, r.met, r.target, r.verdict) == (0.25, None, None, "reported")


def test_a_ratio_of_a_missing_or_skipped_row_is_not_measured() -> None:
    res = _results(conn_tls=1.0)
    res.rows["conn_plain"] = bench.results.Row("conn_plain", "e2e", "x", "skipped", "why not")
    r = _ratio(res, "conn_tls")
    assert (r.measured, r.met, r.verdict) == (None, None, "not measured")
    assert "conn_plain: why not" in r.note
    r = _ratio(res, "pingpong_connection")  # a key no section measured in this run
    assert r.verdict == "not measured" and "pingpong_connection: not measured" in r.note


def test_a_zero_denominator_is_no_figure_rather_than_a_crash() -> None:
    r = _ratio(_results(conn_plain=1.0, conn_bare=0.0), "conn_plain")
    assert (r.measured, r.met, r.note) == (None, None, "no figure")


# ------------------------------------------------------ the connection rows, in-process


class _Script:
    """A stand-in for benches/connections.py's module: `measure` as given."""

    def __init__(self, measure: Any) -> None:
        self.measure = measure


def _connection_rows(monkeypatch: pytest.MonkeyPatch, measure: Any) -> dict[str, Any]:
    rows_module = bench.connection_rows
    monkeypatch.setattr(rows_module, "_script", lambda: _Script(measure))
    tiny = bench.config.make_config(False, True, None)
    cfg = dataclasses.replace(tiny, deadline=0.4, repeats=2)  # a 1 s alarm
    res = bench.results.Results()
    rows_module.bench_connections(cfg, res)
    return res.rows


def _hang_with_a_child(elements: int, repeats: int, layout: str) -> dict[str, list[float]]:
    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,))
    child.start()
    HUNG.append(child)
    time.sleep(600)
    return {}


HUNG: list[Any] = []


def test_a_connection_measurement_that_hangs_fails_its_rows_and_its_child_dies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rows = _connection_rows(monkeypatch, _hang_with_a_child)
    assert {k: r.status for k, r in rows.items()} == {
        f"conn_{kind}": "failed" for kind in ("bare", "plain", "authkey", "tls")
    }
    assert all("did not finish in time" in r.note for r in rows.values())
    (child,) = HUNG
    assert child.exitcode is not None  # killed, and reaped


def test_a_connection_measurement_short_of_repeats_fails_only_that_row(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    times = {"bare": [0.1, 0.1], "plain": [0.1], "authkey": [0.2, 0.2], "tls": [0.2, 0.4]}
    rows = _connection_rows(monkeypatch, lambda *_: times)
    assert rows["conn_plain"].status == "failed" and rows["conn_plain"].note == "missing repeats"
    tls = rows["conn_tls"]
    assert tls.status == "ok" and tls.samples == [0.2, 0.4]
    assert tls.gbps == pytest.approx(tls.gradient_bytes / 0.3 / 1e9)


# ------------------------------------------------------- the performance page's tables

PERF_PAGE = [sys.executable, str(BENCHES / "perf_page.py")]


def _perf_page() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gradstream_perf_page", BENCHES / "perf_page.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_performance_tables_are_made_from_the_tiny_run(
    tiny_run: tuple[dict[str, Any], str], tmp_path: Path
) -> None:
    doc, _ = tiny_run
    source = tmp_path / "run.json"
    source.write_text(json.dumps(doc))
    done = subprocess.run([*PERF_PAGE, str(source)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    m = doc["machine"]
    assert lines[0].startswith("`python benches/bench.py` (tiny run, median of 3,")
    for fact in (m["cpu_model"], f"Python {m['python']}", f"numpy {m['numpy']}", doc["date"]):
        assert fact in lines[0]
    assert f"pyarrow {m['pyarrow']}" in lines[0]
    table = [line for line in lines if line.startswith("|")]
    # every line of a table has as many cells as its header
    for header in (line for line in table if line.startswith(("| ratio", "| figure"))):
        start = table.index(header)
        width = header.count("|")
        block = [line for line in table[start:] if line.count("|") == width]
        assert block[1].replace("|", "").strip("-") == ""
    ratio_lines = [line for line in table if not line.startswith(("| ratio", "|---"))]
    for r in doc["ratios"]:
        (line,) = [
            x for x in ratio_lines if x.startswith(f"| {r['name']}") and r["target_text"] in x
        ]
        assert line.endswith(("| met |", "| **not met** |", "| reported |", "| not measured |"))
    for row in doc["rows"]:
        shown = row["section"] != "codec" or row["key"].endswith("_65536")
        assert any(line.startswith(f"| {row['name']} |") for line in table) == shown, row["key"]
    for title in bench.results.SECTIONS.values():
        assert f"**{title}**" in lines


def test_the_performance_tables_of_a_missing_or_broken_file_are_an_error(tmp_path: Path) -> None:
    broken = tmp_path / "broken.json"
    broken.write_text('{"rows": []')
    for path in (tmp_path / "missing.json", broken):
        done = subprocess.run([*PERF_PAGE, str(path)], capture_output=True, text=True)
        assert done.returncode == 1 and done.stdout == ""
        assert str(path) in done.stderr


def test_install_makes_a_run_the_one_the_page_shows(
    tiny_run: tuple[dict[str, Any], str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    page = _perf_page()
    monkeypatch.setattr(page, "LATEST", tmp_path / "results" / "latest.json")
    source = tmp_path / "run.json"
    source.write_text(json.dumps(tiny_run[0]))
    assert page.main([str(source), "--install"]) == 0
    assert page.LATEST.read_text() == source.read_text()
    broken = tmp_path / "broken.json"
    broken.write_text('{"rows": []')
    assert page.main([str(broken), "--install"]) == 1
    assert page.LATEST.read_text() == source.read_text()  # a broken run is not installed


def test_the_performance_page_shows_the_tables_of_a_recorded_run() -> None:
    """docs/performance.md holds no typed figure: the docs hook puts perf_page.py's tables
    of benches/results/latest.json (a real run's JSON) where its marker is."""
    text = (ROOT / "docs" / "performance.md").read_text()
    assert text.count("<!-- perf-tables -->") == 1
    page = _perf_page()
    doc = json.loads(page.LATEST.read_text())
    lines = page.markdown(doc).splitlines()
    assert re.match(r"`python benches/bench.py` \((full|quick) run, median of \d+, ", lines[0])
    assert "| ratio (two figures of this run) | measured | target | |" in lines
    assert "| figure | GB/s | wire GB/s | other | note |" in lines
    assert all(line.count("|") in (0, 5, 6) for line in lines[1:]), "a table line lost a cell"


def test_the_drivers_section_runs_alone(tmp_path: Path) -> None:
    """``--drivers``: only section 7's rows, each driver's ratio against the path without it."""
    out = tmp_path / "drivers.json"
    cmd = [*BENCH, "--tiny", "--drivers", "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    doc = json.loads(out.read_text())
    drivers = {name: rows for name, rows in RATIO_ROWS.items() if name.startswith("driver ")}
    assert {r["name"] for r in doc["ratios"]} == set(drivers)
    assert {row["key"] for row in doc["rows"]} == {
        k for num, den, _ in drivers.values() for k in (num, den)
    }
    assert all(row["status"] == "ok" for row in doc["rows"])
    assert all(r["measured"] > 0 and isinstance(r["met"], bool) for r in doc["ratios"])
