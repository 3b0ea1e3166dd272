"""The ratios the benchmark checks, each of two figures measured in the same run."""

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
    target: float,
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
    met = value >= target if op == ">=" else value <= target
    return Ratio(name, num, den, value, op, target, target_text, met)


def compute_ratios(res: Results, cfg: Config) -> list[Ratio]:
    ratios: list[Ratio] = []
    new_copy = res.ok("memcpy_new")
    # memcpy copies into a reused, pre-faulted buffer: like for like is encode and decode
    # into reused buffers (out=). Into new objects, the page faults of fresh memory are
    # the cost; the note compares those with numpy's own copy into a new array.
    for layout in LAYOUTS:
        for op, target in (("encode", 0.5), ("decode", 0.4)):
            key = f"native_{op}_out_{layout}_65536"
            ratio = _ratio_of(
                res,
                f"native {op}_frames(out=), chunk 65536, {layout} / memcpy",
                key,
                "memcpy",
                "gbps",
                ">=",
                target,
                f">= {target:g} x memcpy",
            )
            fresh = res.ok(f"native_{op}_{layout}_65536")
            if ratio.measured is not None and fresh and fresh.gbps and new_copy and new_copy.gbps:
                ratio.note = (
                    f"(new objects: {fresh.gbps / new_copy.gbps:.2f} x a copy into a new array)"
                )
            ratios.append(ratio)
    for layout in LAYOUTS:
        for chunk_size, target in ((4096, 10.0), (65536, 4.0)):
            for op in ("encode", "decode"):
                ratio = _ratio_of(
                    res,
                    f"native / reference {op}_frames(out=), chunk {chunk_size}, {layout}",
                    f"native_{op}_out_{layout}_{chunk_size}",
                    f"reference_{op}_out_{layout}_{chunk_size}",
                    "gbps",
                    ">=",
                    target,
                    f">= {target:g} x",
                )
                a = res.ok(f"native_{op}_{layout}_{chunk_size}")
                b = res.ok(f"reference_{op}_{layout}_{chunk_size}")
                if ratio.measured is not None and a and b and a.gbps and b.gbps:
                    ratio.note = f"(new objects: {a.gbps / b.gbps:.2f} x)"
                ratios.append(ratio)
    hot = res.ok("raw_tcp_hot")
    for name, key, attr, target in (
        ("seed: wire GB/s", "e2e_native_socket_seed", "wire_gbps", 0.9),
        ("compact: gradient GB/s", "e2e_native_socket_compact", "gbps", 0.86),
    ):
        ratio = _ratio_of(
            res,
            f"end to end, socket path, {name} / raw loopback TCP",
            key,
            "raw_tcp",
            attr,
            ">=",
            target,
            f">= {target:g} x raw TCP",
            den_attr="wire_gbps",
        )
        row = res.ok(key)
        if ratio.measured is not None and row and hot and hot.wire_gbps:
            ratio.note = (
                f"({getattr(row, attr) / hot.wire_gbps:.2f} x raw TCP through 1 MiB buffers)"
            )
        ratios.append(ratio)
    ratios.append(
        _ratio_of(
            res,
            "end to end, socket path, compact / gloo (gradient GB/s)",
            "e2e_native_socket_compact",
            "e2e_gloo",
            "gbps",
            ">=",
            1.0,
            ">= gloo",
        )
    )
    for layout in LAYOUTS:
        ratios.append(
            _ratio_of(
                res,
                f"end to end, asyncio streams / reference, {layout}",
                f"e2e_native_streams_{layout}",
                f"e2e_reference_socket_{layout}",
                "gbps",
                ">=",
                3.0,
                ">= 3 x reference",
            )
        )
    ratios.append(
        _ratio_of(
            res,
            "small-gradient round trips, native / raw socket ping-pong",
            "pingpong_native",
            "pingpong_raw",
            "round_trips_per_s",
            ">=",
            0.5,
            ">= 0.5 x raw",
        )
    )
    ratios.append(
        _ratio_of(
            res,
            "small-gradient round trips, native / reference",
            "pingpong_native",
            "pingpong_reference",
            "round_trips_per_s",
            ">=",
            3.0,
            ">= 3 x reference",
        )
    )
    ratios.append(
        _ratio_of(
            res,
            "small-gradient round trips, connection / raw ping-pong with acks",
            "pingpong_connection",
            "pingpong_raw_ack",
            "round_trips_per_s",
            ">=",
            0.5,
            ">= 0.5 x raw with acks",
        )
    )
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
        verdict = "not measured" if r.met is None else ("met" if r.met else "NOT MET")
        line = f"  {r.name:{width}} {measured:>8}  {r.target_text:34} {verdict}"
        if r.note:
            line += f"  {r.note}"
        print(line, flush=True)
