"""What runs in memory: the machine's limits (section 1: memcpy, CRC-32) and
encode_frames / decode_frames (section 2)."""

from __future__ import annotations

import zlib
from functools import partial
from typing import Any

import numpy as np

from .config import (
    CHUNK_SIZES,
    F32,
    LAYOUTS,
    Config,
    SessionSpec,
    layout_arg,
    make_gradient,
    same_bits,
    size_text,
    timed,
)
from .results import Results, Row, timed_row

# --------------------------------------------------------------------------- section 1


class Memcpy:
    """numpy memcpy of `size` bytes into a reused, pre-faulted buffer. Sampled in section 1
    and again once per round of section 2, so that its figure spans the codec's stretch.
    Each sample is the second of two copies back to back: on these VMs the first copy after
    other work (or a pause) takes up to twice as long, and the limit is the steady rate."""

    def __init__(self, size: int) -> None:
        self.src = make_gradient(size // 4)
        self.dst = np.zeros_like(self.src)
        self.samples: list[float] = []

    def sample(self) -> None:
        np.copyto(self.dst, self.src)
        self.samples.append(timed(lambda: np.copyto(self.dst, self.src))[1])

    def row(self) -> Row:
        return timed_row(
            "memcpy",
            "limits",
            f"numpy memcpy {size_text(self.src.nbytes)} (np.copyto, reused buffer)",
            self.samples,
            elements=self.src.size,
            gradient_bytes=self.src.nbytes,
            note=f"{len(self.samples)} samples, spread over section 2 (each a 2nd copy)",
        )


def bench_limits(cfg: Config, res: Results, memcpy: Memcpy) -> None:
    size = cfg.limit_bytes
    label = size_text(size)
    for _ in range(cfg.repeats):
        memcpy.sample()
    src = memcpy.src
    t = [timed(src.copy)[1] for _ in range(cfg.repeats)]
    res.add(
        timed_row(
            "memcpy_new",
            "limits",
            f"numpy copy {label} into a new array (page faults incl.)",
            t,
            elements=src.size,
            gradient_bytes=size,
            note="information only",
        )
    )
    from gradstream import _native

    data = src.tobytes()
    expected = zlib.crc32(data)
    got = None
    t = []
    for _ in range(cfg.repeats):
        got, seconds = timed(lambda: _native.GradientChunk.compute_checksum(data))
        t.append(seconds)
    row = timed_row(
        "crc32fast",
        "limits",
        f"crc32fast {label} (GradientChunk.compute_checksum, bytes)",
        t,
        gradient_bytes=size,
    )
    if got != expected:
        row.status, row.note = "failed", f"CRC {got} differs from zlib's {expected:#010x}"
    res.add(row)
    t = [timed(lambda: zlib.crc32(data))[1] for _ in range(cfg.repeats)]
    res.add(timed_row("zlib_crc32", "limits", f"zlib.crc32 {label}", t, gradient_bytes=size))


# --------------------------------------------------------------------------- section 2


def bench_codec(
    cfg: Config,
    res: Results,
    grad: F32,
    available: dict[str, str | None],
    memcpy: Memcpy,
) -> None:
    """Per layout and chunk size: rounds of native encode, native decode, reference encode,
    reference decode and one memcpy sample."""
    for layout in LAYOUTS:
        for chunk_size in CHUNK_SIZES:
            label = f"{layout}, chunk {chunk_size:,}, {size_text(grad.nbytes)}"
            sessions: dict[str, Any] = {}
            for impl in ("native", "reference"):
                why = available[impl]
                if layout == "compact" and why is not None:
                    for op in ("encode", "decode"):
                        key = f"{impl}_{op}_{layout}_{chunk_size}"
                        res.add(Row(key, "codec", f"{impl} {op}_frames, {label}", "skipped", why))
                    continue
                spec = SessionSpec(impl, chunk_size, layout_arg(layout, available, impl))
                sessions[impl] = spec.make()
            _codec_rounds(cfg, res, grad, sessions, layout, chunk_size, label, memcpy)


def _codec_rounds(
    cfg: Config,
    res: Results,
    g: F32,
    sessions: dict[str, Any],
    layout: str,
    chunk_size: int,
    label: str,
    memcpy: Memcpy,
) -> None:
    """Each round: per implementation, encode and decode into new objects, then into
    buffers reused from round to round (`out=`, as a training loop would), and a memcpy."""
    ops = ("encode", "decode", "encode_out", "decode_out")
    times: dict[str, dict[str, list[float]]] = {i: {op: [] for op in ops} for i in sessions}
    # Beside the native calls into new objects, in the same rounds: numpy's copy into a
    # new array (what fresh memory costs here after a round's pause: the baseline of the
    # default calls, whose results are new memory too) and frames as a pyarrow.Buffer
    # (Rust's memory, where `bytes` is Python's). At chunk 65536, the default calls'
    # ratios' size.
    beside = chunk_size == 65536
    fresh_copy: list[float] = []
    as_buffer: list[float] = []
    wire_len: dict[str, int] = {}
    problems: dict[str, str] = {}
    reused: dict[str, tuple[bytearray, F32]] = {}
    for rep in range(cfg.repeats):
        memcpy.sample()
        for impl, session in sessions.items():
            if impl in problems:
                continue
            try:
                if impl == "native" and beside:
                    buffer, t_buffer = timed(partial(session.encode_frames, g, as_buffer=True))
                    del buffer
                wire, t_enc = timed(partial(session.encode_frames, g))
                if impl == "native" and beside:
                    # The baseline and the decode face the same memory: an untimed copy
                    # first faults in a gradient's worth of fresh pages and frees them, the
                    # timed copy takes those, frees them, and the decode's new array gets
                    # them next. Whichever call came first after the reference's rounds
                    # otherwise took pages the host had reclaimed meanwhile (free-page
                    # reporting), ~7 x slower to fault in here: measured, 0.10 x with the
                    # copy first in the round, 10 x with it just before the decode; the
                    # position, not the call. This is a training loop's state: it frees and
                    # makes arrays of one size step after step.
                    np.copy(g)  # untimed, its array freed at once
                    copy, t_copy = timed(partial(np.copy, g))
                    del copy
                back, t_dec = timed(partial(session.decode_frames, wire))
                if impl not in reused:
                    # Fault the pages in once, as a buffer kept across steps would be.
                    reused[impl] = (bytearray(len(wire)), np.ones_like(g))
                frames, values = reused[impl]
                n, t_enc_out = timed(partial(session.encode_frames, g, out=frames))
                # Decoded from the immutable `bytes`: a mutable buffer (the bytearray) is
                # copied before it is read without the GIL, which is not what is measured.
                _, t_dec_out = timed(partial(session.decode_frames, wire, out=values))
            except Exception as exc:
                problems[impl] = f"{type(exc).__name__}: {exc}"
                continue
            for op, t in zip(ops, (t_enc, t_dec, t_enc_out, t_dec_out), strict=True):
                times[impl][op].append(t)
            if impl == "native" and beside:
                fresh_copy.append(t_copy)
                as_buffer.append(t_buffer)
            wire_len[impl] = len(wire)
            if rep == cfg.repeats - 1:
                if not same_bits(back, g) or not same_bits(values, g):
                    problems[impl] = "decode_frames(encode_frames(g)) differs from g"
                elif n != len(wire) or frames != wire:
                    problems[impl] = "encode_frames(g, out=) wrote other bytes"
            del wire, back
    for impl in sessions:
        for op, samples in times[impl].items():
            key = f"{impl}_{op}_{layout}_{chunk_size}"
            what = op.replace("_out", "_frames(out=), reused buffers")
            if not op.endswith("_out"):
                what = f"{op}_frames"
            name = f"{impl} {what}, {label}"
            if impl in problems:
                res.add(Row(key, "codec", name, "failed", problems[impl]))
                continue
            res.add(
                timed_row(
                    key,
                    "codec",
                    name,
                    samples,
                    elements=g.size,
                    gradient_bytes=g.nbytes,
                    wire_bytes=wire_len[impl],
                )
            )
    if "native" in sessions and "native" not in problems and fresh_copy:
        res.add(
            timed_row(
                f"native_encode_buffer_{layout}_{chunk_size}",
                "codec",
                f"native encode_frames(as_buffer=True), {label}",
                as_buffer,
                elements=g.size,
                gradient_bytes=g.nbytes,
                wire_bytes=wire_len["native"],
            )
        )
        res.add(
            timed_row(
                f"fresh_copy_{layout}_{chunk_size}",
                "codec",
                f"numpy copy into a new array, in the same rounds, {size_text(g.nbytes)}",
                fresh_copy,
                elements=g.size,
                gradient_bytes=g.nbytes,
                note="beside the decode, on the memory it gets next (an untimed copy before it)",
            )
        )
