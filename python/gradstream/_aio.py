"""The asyncio-streams half of the native session's streaming methods.

Sockets go to Rust and tokio entirely; for an asyncio ``StreamReader``/``StreamWriter``
the frames are still encoded and checked in Rust (``_FrameEncoder``, ``_FrameReceiver``,
GIL released), and this module only moves the bytes: ``write`` + ``drain`` out,
``readexactly`` in, each wait bounded by the session's timeout.
"""

from __future__ import annotations

import asyncio
import warnings
import weakref
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import numpy as np

from ._io import Stalled, within
from .errors import StreamIOError, StreamTimeoutError

T = TypeVar("T")


def _half(stream: Any, index: int, kind: type[T], method: str) -> T:
    """The reader (index 0) or writer (1) of a stream or a (reader, writer) pair."""
    if isinstance(stream, tuple) and len(stream) == 2:
        stream = stream[index]
    if not isinstance(stream, kind):
        raise TypeError(
            f"{method} takes a connected socket.socket, an asyncio.{kind.__name__} or a "
            f"(reader, writer) pair, not {type(stream).__name__}"
        )
    return stream


# The timeout bounds each step that moves bytes, not a whole frame: a slow peer that
# keeps reading or writing is making progress.
_PIECE = 64 * 1024


async def stream_to(session: Any, gradient: Any, stream: Any, progress: Any) -> int:
    writer = _half(stream, 1, asyncio.StreamWriter, "stream_to")
    frames = session._frame_encoder(gradient, progress)
    sent = 0
    for frame in frames:
        view = memoryview(frame)
        try:
            for start in range(0, len(view), _PIECE):
                piece = view[start : start + _PIECE]
                writer.write(piece)
                await within(writer.drain(), session.timeout)
                frames._sent(len(piece), 0)
        except Stalled:
            raise StreamTimeoutError(session.timeout, sent, frames.total_chunks) from None
        except OSError as exc:
            raise StreamIOError.from_os_error(exc) from exc
        sent += 1
        frames._sent(0, 1)
    return sent


async def receive(session: Any, stream: Any, receiver: Any, none_at_end: bool) -> Any:
    """One gradient through ``receiver`` (a native _FrameReceiver); at a clean end, None,
    or with none_at_end False the empty gradient."""
    reader = _half(stream, 0, asyncio.StreamReader, "receive_from")
    while True:
        want = receiver.want()
        # Grown as bytes arrive, not sized by the header: a 16-byte header must not
        # cost max_payload_len of memory before its payload shows up.
        unit = bytearray()
        try:
            while len(unit) < want:
                piece = await within(reader.read(want - len(unit)), session.timeout)
                if not piece:
                    got = receiver.end(len(unit))
                    if got is None and not none_at_end:
                        return receiver.finish()
                    return got
                unit += piece
        except Stalled:
            receiver.timed_out(session.timeout)
            raise  # timed_out raised StreamTimeoutError; this line is never reached
        except OSError as exc:
            raise StreamIOError.from_os_error(exc) from exc
        if receiver.feed(unit):
            return receiver.finish()


async def receive_iter(session: Any, stream: Any, progress: Any) -> AsyncIterator[np.ndarray]:
    """Gradients until the peer closes the connection between two of them."""
    while True:
        gradient = await session._receive(stream, progress, True)
        if gradient is None:
            return
        yield gradient


class Hub:
    """One event loop's link to the native transfers running on tokio.

    A finished transfer queues its result in Rust and writes to an eventfd; the loop
    watches that eventfd and resolves the awaiting futures on its own thread, so tokio
    threads never call into Python (see crates/gradstream-py/src/complete.rs for why).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        from ._native import _Completions

        # No reference to the loop: _hubs is keyed weakly by it, and the loop's reader
        # callback already keeps this hub alive for as long as the loop lives.
        self.native = _Completions()
        self.futures: dict[int, asyncio.Future[Any]] = {}
        loop.add_reader(self.native.fileno(), self._deliver)

    def track(self, job: int) -> asyncio.Future[Any]:
        future = asyncio.get_running_loop().create_future()
        self.futures[job] = future
        future.add_done_callback(lambda f: self._settled(job, f))
        return future

    def _settled(self, job: int, future: asyncio.Future[Any]) -> None:
        self.futures.pop(job, None)
        if future.cancelled() and not self.native.abort(job):
            warnings.warn(
                f"gradstream: a cancelled transfer (job {job}) was still running 5 s later; "
                "an out= array it was filling may still change",
                RuntimeWarning,
                stacklevel=1,
            )

    def _deliver(self) -> None:
        for job, ok, value in self.native.drain():
            future = self.futures.pop(job, None)
            if future is None or future.done():
                continue
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)


_hubs: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Hub] = weakref.WeakKeyDictionary()


def hub() -> Hub:
    """The hub of the running event loop (RuntimeError outside a running loop)."""
    loop = asyncio.get_running_loop()
    found = _hubs.get(loop)
    if found is None:
        found = _hubs[loop] = Hub(loop)
    return found
