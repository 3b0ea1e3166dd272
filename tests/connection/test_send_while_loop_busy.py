"""An asyncio small send's frames keep moving while the event loop is busy: only the
wait for its ack is polled on the loop (crates/gradstream-py/src/complete.rs,
Completions::drive); frames the socket did not take at once are written by tokio."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np

import gradstream as gs
from support.connections import raw_listener


def test_asyncio_small_send_goes_on_while_the_loop_is_busy() -> None:
    """A small send whose frames did not all fit in the socket at once goes on writing
    while the event loop is busy (in tokio), as a large one does: a peer reading with a
    per-step timeout shorter than the loop's busy spell still gets the gradient."""
    values = np.arange(30_000, dtype=np.float32)  # 120 KB <= SEND_MAX
    wire_len = len(gs.GradientStreamSession().encode_frames(values))
    srv = raw_listener(rcvbuf=4096)
    sends = [0]

    arrivals: list[tuple[float, int]] = []
    go = threading.Event()

    def slow_reader() -> None:
        peer, _ = srv.accept()
        with peer:
            go.wait(30)  # let the sender's socket fill up
            got = 0
            while True:
                chunk = peer.recv(65536)
                if not chunk:
                    break
                got += len(chunk)
                arrivals.append((time.monotonic(), got))

    reader = threading.Thread(target=slow_reader, daemon=True)
    reader.start()

    async def main() -> float:
        conn = await gs.connect(srv.getsockname(), protocol="seed")
        for _ in range(64):  # fill the socket buffers until a send cannot finish at once
            sends[0] += 1
            task = asyncio.create_task(conn.send(values))
            await asyncio.sleep(0.2)
            if not task.done():
                break
            await task
        assert not task.done(), "every send fit in the socket: no stall to show"
        busy_from = time.monotonic()
        go.set()  # the peer reads from now on
        time.sleep(3.0)  # the loop is busy (a CPU-bound step, a blocking call)
        await task
        await conn.close()
        return busy_from

    busy_from = asyncio.run(main())
    reader.join(10)
    whole = wire_len * sends[0]
    done = [t for t, got in arrivals if got >= whole]
    assert done, "the peer never got the whole gradient"
    took = done[0] - busy_from
    assert took < 2.0, f"the peer got the last byte {took:.1f}s into the loop's 3 s busy spell"
