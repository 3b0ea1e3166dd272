"""A long path in a box, for the tests and the benchmark (issue 25: this kernel's ``tc``
has no ``netem``, so delay cannot come from the kernel): a TCP relay on 127.0.0.1 that
holds each direction of each connection through it (a flow) to the two limits a long
path sets one TCP flow,

- a delay: a byte taken from one end is written to the other ``rtt / 2`` later;
- a window: at most ``window`` bytes of a flow in flight, a byte counting from when the
  relay takes it until one ``rtt`` later (or until it was written, if that is later), so
  a flow moves at most ``window / rtt`` bytes per second;

and, on demand, the failures of one: every connection reset (an RST to both ends), at
once or once a number of bytes went towards the target, and a stall (nothing moves
for a while). The relay runs its own asyncio loop in a thread, so blocking and asyncio
code use it alike; it shares the machine's cores with both ends, which is why a row
measured through it is compared with raw TCP through the same relay, never with the
nominal ``window / rtt``.

    with Relay(("127.0.0.1", port), rtt=0.04, window=4 << 20) as relay:
        conn = gs.sync.connect(relay.address, authkey=KEY)
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from types import TracebackType
from typing import Any

# What one read takes from a flow at most (the window bounds it further).
READ_MAX = 256 * 1024


class _Flow:
    """One direction of one connection: what the relay took and has not written yet, and
    the bytes in flight by the window's rule."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.in_flight = 0
        self.room = asyncio.Event()
        self.room.set()
        # (due, taken, bytes); empty bytes: the end's FIN.
        self.queue: asyncio.Queue[tuple[float, float, bytes]] = asyncio.Queue()

    def release(self, n: int) -> None:
        self.in_flight -= n
        if self.in_flight < self.relay.window:
            self.room.set()

    async def take(self, reader: asyncio.StreamReader, towards_target: bool) -> None:
        """Read from one end while the window has room; each piece queued for ``rtt / 2``
        later."""
        loop = asyncio.get_running_loop()
        relay = self.relay
        while True:
            await self.room.wait()
            await relay.flowing.wait()
            data = await reader.read(min(READ_MAX, relay.window - self.in_flight))
            if not data:
                break  # the end's FIN, passed on rtt / 2 later as the data is
            now = loop.time()
            self.in_flight += len(data)
            if self.in_flight >= relay.window:
                self.room.clear()
            self.queue.put_nowait((now + relay.rtt / 2, now, data))
            if towards_target:
                relay.note_forward(len(data))
            else:
                relay.note_return(len(data))
        now = loop.time()
        self.queue.put_nowait((now + relay.rtt / 2, now, b""))

    async def give(self, writer: asyncio.StreamWriter) -> None:
        """Write each queued piece to the other end once it is due; the end's write side
        closed after the last one."""
        loop = asyncio.get_running_loop()
        relay = self.relay
        # Nothing held in asyncio's buffer once a write returns: what is written is on
        # the socket, so the end (a FIN, or the relay closing) loses none of it.
        writer.transport.set_write_buffer_limits(0)
        while True:
            due, taken, data = await self.queue.get()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            await relay.flowing.wait()
            if not data:
                break
            writer.write(data)
            await writer.drain()
            # In flight until one rtt after it was taken, or until now if that is later.
            until = taken + relay.rtt
            if until > loop.time():
                loop.call_at(until, self.release, len(data))
            else:
                self.release(len(data))
        with contextlib.suppress(OSError):
            if writer.can_write_eof():
                writer.write_eof()


def _reset(pair: tuple[asyncio.StreamWriter, asyncio.StreamWriter]) -> None:
    """Close both ends so that each gets an RST (SO_LINGER 0), not a FIN."""
    for end in pair:
        sock = end.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        end.transport.abort()


class Relay:
    """The relay (see the module): listens on 127.0.0.1, a fresh port, and connects each
    connection it accepts to ``target``."""

    def __init__(self, target: tuple[str, int], *, rtt: float, window: int) -> None:
        if rtt < 0 or window < 1:
            raise ValueError(f"rtt must be >= 0 and window >= 1, got {rtt!r}, {window!r}")
        self.target = target
        self.rtt = rtt
        self.window = window
        self.forwarded = 0  # bytes taken towards the target, all connections
        self.returned = 0  # bytes taken towards the dialler, all connections
        self._reset_back_at: int | None = None
        self.connections = 0
        self._reset_at: int | None = None
        self._stalled_until = 0.0
        self._open: list[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = []
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._server: asyncio.Server | None = None
        self.flowing: asyncio.Event
        self._thread = threading.Thread(target=self._run, name="wan-relay", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._server is None:
            raise RuntimeError("the relay did not start")
        host, port = self._server.sockets[0].getsockname()[:2]
        self.address: tuple[str, int] = (host, port)

    # -- the loop's side

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def start() -> None:
            self.flowing = asyncio.Event()
            self.flowing.set()
            self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)

        self._loop.run_until_complete(start())
        self._loop.call_soon(self._ready.set)  # set once the loop runs (close() stops it)
        self._loop.run_forever()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self.connections += 1
        pair = (writer, up_writer)
        self._open.append(pair)
        there, back = _Flow(self), _Flow(self)
        tasks = [
            asyncio.ensure_future(there.take(reader, True)),
            asyncio.ensure_future(there.give(up_writer)),
            asyncio.ensure_future(back.take(up_reader, False)),
            asyncio.ensure_future(back.give(writer)),
        ]
        try:
            # Until both directions ended, or one end failed (a reset): then the rest stop,
            # and the other end is reset too, as it would be on a real path.
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            failed = any(not t.cancelled() and t.exception() is not None for t in done)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if failed:
            _reset(pair)
        for end in pair:
            end.transport.abort()
        with contextlib.suppress(ValueError):
            self._open.remove(pair)

    def note_forward(self, n: int) -> None:
        self.forwarded += n
        if self._reset_at is not None and self.forwarded >= self._reset_at:
            self._reset_at = None
            self._reset_all()

    def note_return(self, n: int) -> None:
        self.returned += n
        if self._reset_back_at is not None and self.returned >= self._reset_back_at:
            self._reset_back_at = None
            self._reset_all()

    def _reset_all(self) -> None:
        """An RST to both ends of every connection open now."""
        for pair in list(self._open):
            _reset(pair)

    # -- the caller's side

    def _call(self, fn: Any, *args: Any) -> None:
        """Run ``fn(*args)`` on the relay's loop, then let the loop close what it aborted
        (an aborted socket is closed one step later): on return, it is done."""

        async def call() -> None:
            fn(*args)
            for _ in range(3):
                await asyncio.sleep(0)

        asyncio.run_coroutine_threadsafe(call(), self._loop).result(10)

    def reset(self) -> None:
        """Reset every connection open now (both ends see ECONNRESET)."""
        self._call(self._reset_all)

    def vanish(self) -> None:
        """As if the target's process went: stop accepting (a dial is refused) and reset
        every connection open now, at once."""

        def gone() -> None:
            if self._server is not None:
                self._server.close()
            self._reset_all()

        self._call(gone)

    def reset_when(self, forwarded: int | None = None, *, returned: int | None = None) -> None:
        """Reset every connection open once ``forwarded`` bytes in all went towards the
        target through the relay, or ``returned`` bytes back towards the dialler (each
        counted since it started)."""

        def arm() -> None:
            self._reset_at = forwarded
            self._reset_back_at = returned
            self.note_forward(0)
            self.note_return(0)

        self._call(arm)

    def stall(self, seconds: float) -> None:
        """Nothing moves either way from now until ``seconds`` from now (reads and writes
        wait); a stall within a stall ends when the later one does."""
        if not seconds > 0:
            raise ValueError(f"a stall lasts more than 0 seconds, not {seconds!r}")

        def stop() -> None:
            until = self._loop.time() + seconds
            self._stalled_until = max(self._stalled_until, until)
            self.flowing.clear()
            self._loop.call_at(until, self._stall_over)

        self._call(stop)

    def _stall_over(self) -> None:
        if self._loop.time() >= self._stalled_until:
            self.flowing.set()

    def close(self) -> None:
        """Stop accepting; let the connections open now end (at most 5 s, then reset)."""
        if not self._loop.is_running():
            return

        async def shut() -> None:
            # What is in flight still goes (an ack behind a closed connection's last
            # bytes), for at most a few seconds; then what is left is reset.
            if self._server is not None:
                self._server.close()
            for _ in range(500):
                if not self._open:
                    break
                await asyncio.sleep(0.01)
            self._reset_all()
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            if others:
                await asyncio.wait(others, timeout=5)

        asyncio.run_coroutine_threadsafe(shut(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def __enter__(self) -> Relay:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
