"""Memory comes back: with a 256 MiB gradient held, encoding and decoding it (in memory,
over a socket, over a connection) and then dropping every result leaves the process's
RSS within 64 MiB of where it was before the calls. Nothing in the library keeps a
released result's memory for later (a caller who reuses memory passes ``out=``:
docs/guides/buffers.md).

In a subprocess of its own: what other tests left in this process's heap would blur the
figures.
"""

from __future__ import annotations

import json
import subprocess
import sys

MIB = 2**20
# How far above its start RSS may end: arenas, caches of a few chunks, the runtime's
# threads.
SLACK = 64 * MIB

CASE = """
import asyncio, gc, json, socket, sys
import numpy as np
import gradstream as gs

def rss():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE

PAGE = __import__("os").sysconf("SC_PAGE_SIZE")
g = np.random.default_rng(0).standard_normal(64 * 2**20).astype(np.float32)  # 256 MiB
seed, compact = gs.GradientStreamSession("seed"), gs.GradientStreamSession("c", layout="compact")


async def over_a_socket(session):
    a, b = socket.socketpair()
    with a, b:
        got, _ = await asyncio.gather(session.receive_from(b), session.stream_to(g, a))
    return got


async def over_a_connection(session):
    async with await gs.listen(("127.0.0.1", 0), session=session) as listener:

        async def receive():
            async with await listener.accept() as conn:
                return await conn.recv()

        receiving = asyncio.create_task(receive())
        async with await gs.connect(listener.address, session=session) as conn:
            await conn.send(g)
        return await receiving


def calls(session):
    \"\"\"Every result of one round in one session, checked; the RSS they took.\"\"\"
    wire = session.encode_frames(g)
    buffer = session.encode_frames(g, as_buffer=True)
    results = [wire, buffer, session.decode_frames(wire), session.decode_frames(buffer)]
    results.append(asyncio.run(over_a_socket(session)))
    results.append(asyncio.run(over_a_connection(session)))
    for r in results[2:]:
        assert np.array_equal(r, g)
    return results, rss()


gc.collect()
before = rss()
rounds = []
for _ in range(2):
    for session in (seed, compact):
        results, peak = calls(session)
        del results
        gc.collect()
        rounds.append({"layout": session.layout, "peak": peak - before, "after": rss() - before})
print(json.dumps(rounds))
"""


def test_rss_returns_after_every_result_is_dropped() -> None:
    done = subprocess.run([sys.executable, "-c", CASE], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    rounds = json.loads(done.stdout)
    shown = [
        f"{r['layout']}: peak {r['peak'] / MIB:+.0f} MiB, after {r['after'] / MIB:+.0f} MiB"
        for r in rounds
    ]
    for r in rounds:
        # The results were really made (two frame streams and four arrays of the
        # gradient: 1.5 GiB at least) ...
        assert r["peak"] > 1024 * MIB, shown
        # ... and their memory went back once they were dropped.
        assert r["after"] <= SLACK, shown
