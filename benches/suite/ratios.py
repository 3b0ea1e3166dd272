"""The ratios the benchmark checks, each of two figures measured in the same run: the
targets of issue 12's table (and the earlier issues' that still hold), issue 21's default
calls against baselines that also make new memory, and the figures they ask to see
reported beside them, with no target of their own."""

from __future__ import annotations

from .config import GIB, LAYOUTS, MIB, Config, size_text
from .results import Ratio, Results


def _ratio_of(
    res: Results,
    name: str,
    num: str,
    den: str | None,
    attr: str,
    op: str,
    target: float | None,
    target_text: str,
    den_attr: str | None = None,
) -> Ratio:
    a = res.ok(num)
    b = res.ok(den) if den is not None else None
    missing = [k for k, row in ((num, a), (den, b)) if k is not None and row is None]
    if missing:
        why = "; ".join(
            f"{k}: {res.rows[k].note}" if k in res.rows else f"{k}: not measured" for k in missing
        )
        return Ratio(name, num, den, None, op, target, target_text, None, f"not measured ({why})")
    x = getattr(a, attr)
    y = 1.0 if b is None else getattr(b, den_attr or attr)
    if x is None or not y:
        return Ratio(name, num, den, None, op, target, target_text, None, "no figure")
    value = float(x) / float(y)
    met: bool | None = None
    if target is not None:
        met = value >= target if op == ">=" else value <= target
    return Ratio(name, num, den, value, op, target, target_text, met)


def _at_least(
    res: Results,
    name: str,
    num: str,
    den: str,
    attr: str,
    target: float,
    against: str = "",
    den_attr: str | None = None,
) -> Ratio:
    """num / den >= target; `against` names the denominator in the target's text."""
    text = f">= {target:g} x" + (f" {against}" if against else "")
    return _ratio_of(res, name, num, den, attr, ">=", target, text, den_attr)


def _reported(
    res: Results, name: str, num: str, den: str, attr: str, den_attr: str | None = None
) -> Ratio:
    """num / den shown beside the targets, with none of its own."""
    return _ratio_of(res, name, num, den, attr, "report", None, "reported", den_attr)


def _codec_ratios(res: Results) -> list[Ratio]:
    ratios: list[Ratio] = []
    new_copy = res.ok("memcpy_new")
    # memcpy copies into a reused, pre-faulted buffer: like for like is encode and decode
    # into reused buffers (out=). Into new objects, the page faults of fresh memory are
    # the cost; the note compares those with numpy's own copy into a new array. Issue 12
    # sets targets for the compact layout; the seed layout (twice the bytes) is reported.
    for layout in LAYOUTS:
        for op, target in (("encode", 0.5), ("decode", 0.4)):
            key = f"native_{op}_out_{layout}_65536"
            name = f"native {op}_frames(out=), chunk 65536, {layout} / memcpy"
            if layout == "compact":
                ratio = _at_least(res, name, key, "memcpy", "gbps", target, "memcpy")
            else:
                ratio = _reported(res, name, key, "memcpy", "gbps")
            fresh = res.ok(f"native_{op}_{layout}_65536")
            if ratio.measured is not None and fresh and fresh.gbps and new_copy and new_copy.gbps:
                ratio.note = (
                    f"(new objects: {fresh.gbps / new_copy.gbps:.2f} x a copy into a new array)"
                )
            ratios.append(ratio)
    for layout in LAYOUTS:
        for chunk_size, target in ((4096, 10.0), (65536, 4.0)):
            for op in ("encode", "decode"):
                ratio = _at_least(
                    res,
                    f"native / reference {op}_frames(out=), chunk {chunk_size}, {layout}",
                    f"native_{op}_out_{layout}_{chunk_size}",
                    f"reference_{op}_out_{layout}_{chunk_size}",
                    "gbps",
                    target,
                )
                a = res.ok(f"native_{op}_{layout}_{chunk_size}")
                b = res.ok(f"reference_{op}_{layout}_{chunk_size}")
                if ratio.measured is not None and a and b and a.gbps and b.gbps:
                    ratio.note = f"(new objects: {a.gbps / b.gbps:.2f} x)"
                ratios.append(ratio)
    return ratios


def _default_call_ratios(res: Results) -> list[Ratio]:
    """Issue 12: the calls most users make, without out=, against the same call with out=
    measured in the same rounds (seed layout, chunk 65536); beside them, frames as a
    pyarrow.Buffer and what fresh memory itself runs at in those rounds (numpy's copy into
    a new array). Issue 21: the default calls against honest baselines that also make new
    memory, with nothing kept from call to call (``_fresh_memory_ratios``)."""
    return [
        *_default_ratios(res),
        _reported(
            res,
            "default encode_frames(g, as_buffer=True), seed / with out=",
            "native_encode_buffer_seed_65536",
            "native_encode_out_seed_65536",
            "gbps",
        ),
        _reported(
            res,
            "numpy copy into a new array in the same rounds / encode_frames(out=), seed",
            "fresh_copy_seed_65536",
            "native_encode_out_seed_65536",
            "gbps",
        ),
        *_fresh_memory_ratios(res),
    ]


def _side_by_side(res: Results, ratio: Ratio, attr: str, den_attr: str | None = None) -> Ratio:
    """The ratio with its two figures in its note: "(1.52 / 2.40 GB/s)"."""
    a = res.ok(ratio.numerator)
    b = res.ok(ratio.denominator) if ratio.denominator is not None else None
    x = getattr(a, attr, None) if a else None
    y = getattr(b, den_attr or attr, None) if b else None
    if ratio.measured is not None and x and y:
        ratio.note = f"({x:.2f} / {y:.2f} GB/s)" + (f" {ratio.note}" if ratio.note else "")
    return ratio


def _fresh_memory_ratios(res: Results) -> list[Ratio]:
    """Issue 21: each default call, its result in new memory, against a baseline that also
    writes new memory, in the same rounds: decode_frames against numpy's copy into a new
    array (section 2, chunk 65536), receive_from against raw TCP recv_into a new array
    (sections 1 and 3). Targets on the compact layout (4 wire bytes a value, as the
    baselines move); the seed layout (8) and encode_frames to bytes are reported, in wire
    GB/s where the wire is what was written or read."""
    ratios: list[Ratio] = []
    for layout in LAYOUTS:
        decode, fresh = f"native_decode_{layout}_65536", f"fresh_copy_{layout}_65536"
        name = f"default decode_frames(wire), {layout}: new array / numpy copy into a new array"
        if layout == "compact":
            ratio = _at_least(res, name, decode, fresh, "gbps", 0.6, "numpy's copy")
        else:
            ratio = _reported(res, name, decode, fresh, "gbps")
        ratios.append(_side_by_side(res, ratio, "gbps"))
    for layout in LAYOUTS:
        name = f"default encode_frames(g) to bytes, {layout}: wire GB/s / numpy copy, new array"
        ratio = _reported(
            res,
            name,
            f"native_encode_{layout}_65536",
            f"fresh_copy_{layout}_65536",
            "wire_gbps",
            den_attr="gbps",
        )
        ratios.append(_side_by_side(res, ratio, "wire_gbps", "gbps"))
    receive = "e2e_native_socket_compact_new"
    name = "default receive_from(sock), compact: new array / raw TCP recv_into a new array"
    ratio = _at_least(res, name, receive, "raw_tcp_new", "gbps", 0.8, "raw recv_into", "wire_gbps")
    ratios.append(_side_by_side(res, ratio, "gbps", "wire_gbps"))
    name = "default receive_from(sock), seed: wire GB/s / raw TCP recv_into a new array"
    ratio = _reported(res, name, "e2e_native_socket_seed_new", "raw_tcp_new", "wire_gbps")
    ratios.append(_side_by_side(res, ratio, "wire_gbps"))
    return ratios


def _default_ratios(res: Results) -> list[Ratio]:
    return [
        _at_least(
            res,
            f"default {call}, seed / with out=",
            num,
            den,
            "gbps",
            0.5,
            "out=",
        )
        for call, num, den in (
            ("decode_frames(wire)", "native_decode_seed_65536", "native_decode_out_seed_65536"),
            ("encode_frames(g)", "native_encode_seed_65536", "native_encode_out_seed_65536"),
            ("receive_from(sock)", "e2e_native_socket_seed_new", "e2e_native_socket_seed"),
        )
    ]


def _socket_ratios(res: Results) -> list[Ratio]:
    ratios = [
        _at_least(
            res,
            "end to end, socket path, seed: wire GB/s / raw loopback TCP",
            "e2e_native_socket_seed",
            "raw_tcp",
            "wire_gbps",
            0.9,
            "raw TCP",
        ),
        # Issue 12's fair baseline: the same pre-faulted destination, filled by recv_into
        # in slices, no CRC; the cache-hot figure (the kernel's ceiling) is reported beside.
        _at_least(
            res,
            "end to end, socket path, compact: gradient GB/s / raw TCP recv_into out= slices",
            "e2e_native_socket_compact",
            "raw_tcp_slices",
            "gbps",
            0.9,
            "raw recv_into",
            den_attr="wire_gbps",
        ),
        _reported(
            res,
            "end to end, socket path, compact: gradient GB/s / raw TCP cache-hot 1 MiB",
            "e2e_native_socket_compact",
            "raw_tcp_hot",
            "gbps",
            den_attr="wire_gbps",
        ),
        _at_least(
            res,
            "end to end, socket path, compact / gloo (gradient GB/s)",
            "e2e_native_socket_compact",
            "e2e_gloo",
            "gbps",
            1.0,
            "gloo",
        ),
        *(
            _reported(
                res,
                f"end to end, socket path, compact, chunk {key.rsplit('chunk', 1)[1]} / gloo",
                key,
                "e2e_gloo",
                "gbps",
            )
            for key in CHUNK_ROWS
        ),
        _at_least(
            res,
            "end to end, gs.sync connection (defaults) / gloo (gradient GB/s)",
            "e2e_native_connection",
            "e2e_gloo",
            "gbps",
            0.9,
            "gloo",
        ),
        # Issue 24: the same-host transport against one copy in memory, and against the
        # same connection over loopback TCP.
        _at_least(
            res,
            "end to end, gs.sync unix: connection / memcpy (gradient GB/s)",
            "e2e_native_unix",
            "memcpy",
            "gbps",
            0.4,
            "memcpy",
        ),
        _reported(
            res,
            "end to end, gs.sync unix: connection / over loopback TCP",
            "e2e_native_unix",
            "e2e_native_connection",
            "gbps",
        ),
        _reported(
            res,
            "end to end, socket path, compact / pickle protocol 5 out-of-band",
            "e2e_native_socket_compact",
            "e2e_pickle_oob",
            "gbps",
        ),
    ]
    return ratios


def _streams_ratios(res: Results) -> list[Ratio]:
    ratios: list[Ratio] = []
    for layout in LAYOUTS:
        streams = f"e2e_native_streams_{layout}"
        ratios += [
            _at_least(
                res,
                f"end to end, asyncio streams / reference over the same streams, {layout}",
                streams,
                f"e2e_reference_streams_{layout}",
                "gbps",
                3.0,
                "reference",
            ),
            _at_least(
                res,
                f"end to end, asyncio streams / native socket path, {layout}",
                streams,
                f"e2e_native_socket_{layout}",
                "gbps",
                0.7,
                "socket path",
            ),
            _reported(
                res,
                f"end to end, asyncio streams under uvloop / native socket path, {layout}",
                f"e2e_native_uvloop_{layout}",
                f"e2e_native_socket_{layout}",
                "gbps",
            ),
        ]
    return ratios


def _small_ratios(res: Results) -> list[Ratio]:
    attr = "round_trips_per_s"
    return [
        _at_least(
            res,
            "small-gradient round trips, native / raw socket ping-pong",
            "pingpong_native",
            "pingpong_raw",
            attr,
            0.5,
            "raw",
        ),
        _at_least(
            res,
            "small-gradient round trips, native / reference",
            "pingpong_native",
            "pingpong_reference",
            attr,
            3.0,
            "reference",
        ),
        # Each connection face against a ping-pong of its own kind that also sends an
        # ack of the same size (issue 23): blocking against raw blocking sockets,
        # asyncio against pure asyncio; "not measured" until section 4 has the rows.
        _at_least(
            res,
            "small-gradient round trips, blocking gradstream.sync Connection / raw "
            "blocking ping-pong with an ack",
            "pingpong_sync_connection",
            "pingpong_raw_ack",
            attr,
            0.5,
            "raw + ack",
        ),
        # Issue 24: a blocking unix: connection against a raw Unix-socket ping-pong.
        _at_least(
            res,
            "small-gradient round trips, blocking unix: Connection / raw Unix-socket "
            "ping-pong with an ack",
            "pingpong_sync_unix",
            "pingpong_raw_unix_ack",
            attr,
            0.5,
            "raw Unix + ack",
        ),
        # What limits it: the ping-pong plus the codec's own work, nothing else; the
        # target's room for all the rest is what this floor leaves above 0.5.
        _reported(
            res,
            "small-gradient round trips: the raw Unix ping-pong with an ack plus a round "
            "trip's codec work / the raw Unix ping-pong (the most a unix: Connection can reach)",
            "pingpong_unix_floor",
            "pingpong_raw_unix_ack",
            attr,
        ),
        _at_least(
            res,
            "small-gradient round trips, asyncio Connection / pure-asyncio ping-pong with an ack",
            "pingpong_connection",
            "pingpong_asyncio_ack",
            attr,
            1.0,
            "asyncio + ack",
        ),
        # The asyncio Connection against the blocking baseline: shown, no target (it
        # measures asyncio's own cost as much as gradstream's).
        _reported(
            res,
            "small-gradient round trips, asyncio Connection / raw blocking ping-pong with an ack",
            "pingpong_connection",
            "pingpong_raw_ack",
            attr,
        ),
    ]


def _connection_ratios(res: Results) -> list[Ratio]:
    return [
        _at_least(
            res,
            "gs.Connection (hello, seal, ack) / bare stream_to + receive_from",
            "conn_plain",
            "conn_bare",
            "gbps",
            0.95,
            "bare",
        ),
        _at_least(
            res,
            "TLS connection / plain connection",
            "conn_tls",
            "conn_plain",
            "gbps",
            0.6,
            "plain",
        ),
        _reported(
            res, "authkey connection / plain connection", "conn_authkey", "conn_plain", "gbps"
        ),
    ]


# Section 7: each optional driver against the path that serves its case without it, in
# the same rounds (docs/performance.md): it stays only while it is >= 1.1 x that path.
DRIVER_TARGET = 1.1
DRIVER_RATIOS = (
    (
        "driver caller_thread, socket: round trips / without it (tokio)",
        "pingpong_native",
        "pingpong_native_tokio",
        "round_trips_per_s",
    ),
    (
        "driver caller_thread, asyncio connection: round trips / without it (tokio)",
        "pingpong_connection",
        "pingpong_connection_tokio",
        "round_trips_per_s",
    ),
    (
        "driver caller_thread, blocking connection: round trips / without it (tokio)",
        "pingpong_sync_connection",
        "pingpong_sync_connection_tokio",
        "round_trips_per_s",
    ),
    (
        "driver handover, small: round trips / without it (generic asyncio)",
        "pingpong_streams",
        "pingpong_streams_generic",
        "round_trips_per_s",
    ),
    *(
        (
            f"driver handover, {layout}: GB/s / without it (generic asyncio)",
            f"e2e_native_streams_{layout}",
            f"e2e_native_streams_{layout}_generic",
            "gbps",
        )
        for layout in LAYOUTS
    ),
)
DRIVER_ROWS = frozenset(key for _, a, b, _ in DRIVER_RATIOS for key in (a, b))


# --p2p: the point-to-point rows of issue 23 (the socket path and a connection against gloo,
# and the socket path's own baseline), alone.
CHUNK_ROWS = ("e2e_native_socket_compact_chunk262144", "e2e_native_socket_compact_chunk1048576")
P2P_ROWS = frozenset(
    (
        "raw_tcp_slices",
        "e2e_native_socket_compact",
        "e2e_native_connection",
        "e2e_gloo",
        *CHUNK_ROWS,
    )
)


def p2p_ratios(res: Results) -> list[Ratio]:
    return [r for r in _socket_ratios(res) if r.numerator in P2P_ROWS and r.denominator in P2P_ROWS]


def driver_ratios(res: Results) -> list[Ratio]:
    return [
        _at_least(res, name, num, den, attr, DRIVER_TARGET, "without it")
        for name, num, den, attr in DRIVER_RATIOS
    ]


def compute_ratios(res: Results, cfg: Config) -> list[Ratio]:
    ratios = _codec_ratios(res) + _default_call_ratios(res) + _socket_ratios(res)
    ratios += _streams_ratios(res) + _small_ratios(res) + _connection_ratios(res)
    ratios += driver_ratios(res)
    rss_gib = cfg.rss_elements * 4 / GIB
    ratios.append(
        _rss_ratio(
            res,
            "rss_recv",
            f"peak RSS over baseline, {size_text(cfg.rss_elements * 4)} receive / gradient",
            1.25,
            rss_gib,
        )
    )
    ratios.append(
        _rss_ratio(
            res,
            "rss_send",
            f"peak RSS beyond the gradient, {size_text(cfg.rss_elements * 4)} send / gradient",
            0.25,
            rss_gib,
        )
    )
    return ratios


def _rss_ratio(res: Results, key: str, name: str, target: float, gib: float) -> Ratio:
    """Peak over baseline as a fraction of the gradient's size: 1.25 GiB for a 1 GiB receive
    is 1.25; the quick run's smaller gradient gets the same fraction."""
    text = f"<= {target:g} x gradient ({target * gib:.3g} GiB)"
    row = res.ok(key)
    if row is None or row.peak_over_baseline_mib is None or not row.gradient_bytes:
        note = res.rows[key].note if key in res.rows else "not measured"
        return Ratio(name, key, None, None, "<=", target, text, None, f"not measured ({note})")
    value = row.peak_over_baseline_mib * MIB / row.gradient_bytes
    return Ratio(name, key, None, value, "<=", target, text, value <= target)


def print_ratios(ratios: list[Ratio]) -> None:
    print("\nratios (measured in this run) against their targets", flush=True)
    width = max(len(r.name) for r in ratios)
    for r in ratios:
        measured = "-" if r.measured is None else f"{r.measured:.3f}"
        line = f"  {r.name:{width}} {measured:>8}  {r.target_text:34} {r.verdict}"
        if r.note:
            line += f"  {r.note}"
        print(line, flush=True)
    checked = [r for r in ratios if r.op != "report"]
    met = sum(r.met is True for r in checked)
    missed = sum(r.met is False for r in checked)
    print(
        f"  {met} of {len(checked)} targets met, {missed} not met, "
        f"{len(checked) - met - missed} not measured",
        flush=True,
    )
