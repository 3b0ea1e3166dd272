"""Compressed-buffer bombs (issue 11, hole 1): CRC-valid payloads whose compressed buffers
declare, and really decompress to, far more bytes than their columns need, and a receive
of one measured for peak RSS in a fresh process.

The payloads are built with the payload surgery of support/payloads.py around a real
compressed payload; the compressed streams are made by pyarrow's streaming compressor
from constant bytes, so a bomb of gigabytes costs kilobytes (zstd) or megabytes (lz4)
and no more memory than one block to build.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import socket
import subprocess
import sys
import threading
import zlib
from typing import Any

import numpy as np
import pyarrow as pa

from gradstream.errors import GradientStreamError
from support import TESTS
from support.frames import frame
from support.payloads import Batch, rebuild, the_batch, with_buffer, write_ipc_file

ROWS = 2**26  # the bomb's rows: a float16 gradient of 128 MiB
BLOCK = 16 << 20  # what the streaming compressor is handed at a time


@functools.lru_cache(maxsize=16)
def stream(codec: str, size: int, fill: int = 0) -> bytes:
    """A compressed stream (an LZ4 frame or a Zstandard frame, as Arrow IPC buffers hold)
    of ``size`` bytes all equal to ``fill``."""
    sink = pa.BufferOutputStream()
    block = np.full(min(size, BLOCK), fill, np.uint8)
    with pa.CompressedOutputStream(sink, codec) as out:
        left = size
        while left:
            out.write(block[: min(left, BLOCK)])
            left -= min(left, BLOCK)
    data: bytes = sink.getvalue().to_pybytes()
    return data


def declared(size: int, data: bytes) -> bytes:
    """A compressed IPC buffer: its declared uncompressed length, then ``data``."""
    return size.to_bytes(8, "little", signed=True) + data


@functools.lru_cache(maxsize=16)
def template(codec: str, dtype: str = "float16", layout: str = "compact", nullable: bool = False):
    """A real compressed payload of 8 values of ``dtype`` (its value field ``nullable`` or
    not; in the seed layout with the non-nullable int32 index before it), written by
    pyarrow: the file the bombs are rebuilt from."""
    fields = [pa.field("value", pa.from_numpy_dtype(np.dtype(dtype)), nullable=nullable)]
    columns = [pa.array(np.zeros(8, dtype))]
    if layout == "seed":
        fields.insert(0, pa.field("index", pa.int32(), nullable=False))
        columns.insert(0, pa.array(np.arange(8, dtype=np.int32)))
    schema = pa.schema(fields)
    return write_ipc_file(schema, pa.record_batch(columns, schema=schema), codec)


def with_rows(payload: bytes, rows: int, buffers: dict[int, bytes]) -> bytes:
    """``payload`` (one batch) rebuilt to declare ``rows`` rows in the batch and in every
    field node, with buffer i's bytes replaced by ``buffers[i]`` (buffers past the last
    one are added)."""
    batch: Batch = the_batch(payload)
    more = max(buffers, default=-1) + 1 - len(batch.buffers)
    batch = batch._replace(
        rows=rows,
        nodes=[(rows, 0)] * len(batch.nodes),
        buffers=batch.buffers + [(len(batch.body), 0)] * max(more, 0),
    )
    for i, data in buffers.items():
        batch = with_buffer(batch, i, data)
    return rebuild(payload, batch)


@functools.lru_cache(maxsize=8)
def bomb(codec: str, rows: int = ROWS, bytes_a_row: int = 8) -> bytes:
    """The attack: a compact float16 payload of ``rows`` rows whose validity bitmap
    (0xff bytes: all valid) and value buffer (zeros) each declare, and decompress to,
    ``bytes_a_row`` bytes a row. A reader that trusts the declared lengths allocates
    both and accepts a gradient of zeros."""
    size = bytes_a_row * rows
    if size > 2**30:  # concatenated frames decompress as one stream: build 1 GiB once
        assert codec == "zstd" and size % 2**30 == 0
        validity = stream(codec, 2**30, 0xFF) * (size // 2**30)
        values = stream(codec, 2**30) * (size // 2**30)
    else:
        validity, values = stream(codec, size, 0xFF), stream(codec, size)
    return with_rows(
        template(codec), rows, {0: declared(size, validity), 1: declared(size, values)}
    )


@functools.lru_cache(maxsize=4)
def at_the_bound(codec: str, rows: int = ROWS) -> bytes:
    """The same payload made honest: no validity bitmap, and a value buffer of exactly
    the 2 bytes a row float16 needs. Accepted: a gradient of ``rows`` zeros."""
    return with_rows(
        template(codec), rows, {0: b"", 1: declared(2 * rows, stream(codec, 2 * rows))}
    )


# --------------------------------------------------------------------------- peak RSS


def _status(key: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(key)


def _reset_peak() -> int:
    """Reset this process's peak RSS to its RSS where the kernel allows, and return the
    baseline the peak is then to be measured from."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status("VmRSS")
    except OSError:
        return _status("VmHWM")


def _send_then_close(sock: socket.socket, wire: bytes) -> None:
    try:
        sock.sendall(wire)
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass  # the receiver gave up and closed first


async def receive(session: Any, wire: bytes, path: str = "socket") -> Any:
    """receive_from over a socketpair (the socket itself, or with ``path`` "streams" an
    asyncio stream over it) from a hostile peer, a thread writing ``wire`` and then
    closing: the gradient, or the GradientStreamError raised."""
    a, b = socket.socketpair()
    peer = threading.Thread(target=_send_then_close, args=(a, wire))
    peer.start()
    writer = None
    try:
        rx: Any = b
        if path == "streams":
            rx, writer = await asyncio.open_connection(sock=b)
        return await session.receive_from(rx)
    except GradientStreamError as exc:
        return exc
    finally:
        if writer is not None:
            writer.close()
        b.close()
        await asyncio.to_thread(peer.join)
        a.close()


def describe(outcome: Any) -> dict[str, Any]:
    if isinstance(outcome, np.ndarray):
        return {"accepted": True, "dtype": str(outcome.dtype), "size": int(outcome.size)}
    return {
        "accepted": False,
        "error": type(outcome).__name__,
        "detail": getattr(outcome, "detail", str(outcome)),
    }


def measure(impl_name: str, path: str, settings: dict[str, Any]) -> dict[str, Any]:
    """In this (fresh) process: receive the payload in ``path`` as a one-chunk gradient
    from a hostile peer over a socketpair; the outcome and how far the peak RSS rose above
    the RSS before the receive (the peer's frame is made before it)."""
    from support.impls import load_impl

    mod = load_impl(impl_name)
    session = mod.GradientStreamSession("bomb", **settings)
    with open(path, "rb") as f:
        payload = f.read()
    wire = frame(0, 1, payload, zlib.crc32(payload))
    asyncio.run(receive(session, frame(0, 1, template("zstd"))))  # warm up: runtime, pools
    base = _reset_peak()
    outcome = asyncio.run(receive(session, wire))
    grown = _status("VmHWM") - base
    return {**describe(outcome), "growth": grown, "payload": len(payload)}


def measure_in_subprocess(
    impl_name: str, payload: bytes, tmp: os.PathLike[str], **settings: Any
) -> dict[str, Any]:
    """``measure`` in a fresh Python process, so that no other test's memory counts."""
    path = os.path.join(tmp, "payload.bin")
    with open(path, "wb") as f:
        f.write(payload)
    script = (
        f"import sys, json; sys.path.insert(0, {str(TESTS)!r})\n"
        "from support.bomb import measure\n"
        f"print(json.dumps(measure({impl_name!r}, {path!r}, {settings!r})))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result
