"""The asyncio side of the native session's streaming methods: the bytes of asyncio
streams, and each event loop's hub for the transfers that run natively.

Sockets go to Rust: a small transfer runs on the caller's thread (waiting for a socket
to become readable in this loop's ``Readiness``, ``receive_socket``), any other on tokio
(its result comes back through the loop's ``Hub``), and so do asyncio streams on a plain
socket (``_handover``); for any other asyncio ``StreamReader``/``StreamWriter`` (TLS, uvloop) the
frames are still encoded and checked in Rust (the engine's ``FrameEncoder`` and
``FrameReceiver``, GIL released), and this module only moves the bytes: ``write`` +
``drain`` out, ``read`` in, each wait bounded by the session's timeout. Called by
``_session`` alone; it calls the engine's public methods only.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import weakref
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

from ._io import Clock, Stalled
from .errors import StreamIOError

T = TypeVar("T")


def coroutine_of(work: Awaitable[T]) -> Coroutine[Any, Any, T]:
    """``work`` as a coroutine, for ``asyncio.run_coroutine_threadsafe`` from another
    thread (the loops of gradstream.ray and gradstream.torch): a coroutine as it is; any
    other awaitable (what ``connect``, ``listen`` and ``serve`` return) awaited by one."""
    if isinstance(work, Coroutine):
        return work

    async def awaited() -> T:
        return await work

    return awaited()


def half_of(stream: Any, index: int, kind: type[T]) -> T | None:
    """The reader (index 0) or writer (1) of a stream or a (reader, writer) pair; None
    when it is not one."""
    if isinstance(stream, tuple) and len(stream) == 2:
        stream = stream[index]
    return stream if isinstance(stream, kind) else None


def _half(stream: Any, index: int, kind: type[T], method: str) -> T:
    """``half_of``, or the TypeError naming ``method``."""
    half = half_of(stream, index, kind)
    if half is None:
        kept = stream[index] if isinstance(stream, tuple) and len(stream) == 2 else stream
        raise TypeError(
            f"{method} takes a connected socket.socket, an asyncio.{kind.__name__} or a "
            f"(reader, writer) pair, not {type(kept).__name__}"
        )
    return half


def writer_of(stream: Any, method: str) -> asyncio.StreamWriter:
    """The StreamWriter of an asyncio stream or a (reader, writer) pair; TypeError naming
    ``method`` for anything else."""
    return _half(stream, 1, asyncio.StreamWriter, method)


def reader_in(stream: Any) -> asyncio.StreamReader | None:
    """The StreamReader of an asyncio stream or a (reader, writer) pair, or None."""
    return half_of(stream, 0, asyncio.StreamReader)


def reader_of(stream: Any, method: str) -> asyncio.StreamReader:
    """The StreamReader of an asyncio stream or a (reader, writer) pair."""
    return _half(stream, 0, asyncio.StreamReader, method)


def _noted(error: BaseException, source: Any) -> BaseException:
    """``error`` with the note ``source`` (an encoder or receiver) gives for where it
    stands, if any (a tensor set's `while sending tensor ...`)."""
    note = source.note()
    if note is not None:
        error.add_note(note)
    return error


# The timeout bounds each step that moves bytes, not a whole frame: a slow peer that
# keeps reading or writing is making progress.
_PIECE = 64 * 1024


async def send(frames: Any, writer: asyncio.StreamWriter) -> int:
    """Write every frame of ``frames`` (the engine's FrameEncoder or TensorFrameEncoder)
    to ``writer``, under the waits it says (its ``waits``: the session's timeout and the
    transfer's deadline, which runs from now); the number of frames."""
    clock = Clock(*frames.waits)
    clock.start()
    sent = 0
    for frame in frames:
        view = memoryview(frame)
        try:
            for start in range(0, len(view), _PIECE):
                piece = view[start : start + _PIECE]
                writer.write(piece)
                await clock.within(writer.drain())
                frames.sent(len(piece), 0)
        except Stalled as stalled:
            frames.timed_out(stalled.limit, stalled.late)
            raise  # timed_out raised StreamTimeoutError; this line is never reached
        except OSError as exc:
            raise _noted(StreamIOError.from_os_error(exc), frames) from exc
        sent += 1
        frames.sent(0, 1)
    return sent


async def receive(receiver: Any, reader: asyncio.StreamReader, none_at_end: bool) -> Any:
    """Feed ``receiver`` (the engine's FrameReceiver or TensorSetReceiver) from
    ``reader`` until it is done, under the waits it says (the deadline runs from the first
    byte); what it gives. At a clean end before the first byte, None, or with
    none_at_end False what the receiver gives for an empty stream."""
    clock = Clock(*receiver.waits)
    while True:
        want = receiver.want()
        # Kept as the pieces that arrive, not sized by the header: a 16-byte header must
        # not cost max_payload_len of memory before its payload shows up. Joined into
        # one immutable bytes (or a lone piece as it is), the receiver reads it in place.
        pieces: list[bytes] = []
        got = 0
        try:
            while got < want:
                piece = await clock.within(reader.read(want - got))
                if not piece:
                    ended = receiver.end(got)
                    if ended is None and not none_at_end:
                        return receiver.finish()
                    return ended
                pieces.append(piece)
                got += len(piece)
                clock.start()
        except Stalled as stalled:
            receiver.timed_out(stalled.limit, stalled.late)
            raise  # timed_out raised StreamTimeoutError; this line is never reached
        except OSError as exc:
            raise _noted(StreamIOError.from_os_error(exc), receiver) from exc
        if receiver.feed(pieces[0] if len(pieces) == 1 else b"".join(pieces)):
            return receiver.finish()


# What a native SocketReceive's poll() says (crates/gradstream-py/src/fastpath.rs): the
# result is here, wait for readability, or hand the receive to tokio.
_DONE, _WAIT, _SLOW = 0, 1, 2

# A watched socket wakes its waiter once, then stays quiet until the next wait re-arms it.
_ONCE = select.EPOLLIN | select.EPOLLONESHOT


def _timed_out(woken: asyncio.Future[bool]) -> None:
    if not woken.done():
        woken.set_result(False)


class Readiness:
    """One event loop's watch on the sockets its small receives wait for.

    ``loop.add_reader`` and ``remove_reader`` cost a small receive about 15 us of Python
    and two ``epoll_ctl`` calls per wait, and take the loop's one reader slot of the
    caller's descriptor (replacing a reader of the caller's own). So the sockets are
    watched in an epoll set of our own, which the loop watches once (as it does the hub's
    eventfd): a wait re-arms a one-shot entry (one ``epoll_ctl``) and the loop's selector
    never holds a caller's socket. The kernel drops a socket's entry when the socket is
    closed; a wait that ends without the socket becoming readable (its timeout, a
    cancellation) removes the entry it armed, so nothing stays armed for a socket.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._epoll = select.epoll()
        # The waiter of each watched descriptor: True when it became readable, False
        # when the wait's time ran out first.
        self._waiters: dict[int, asyncio.Future[bool]] = {}
        loop.add_reader(self._epoll.fileno(), self._fire)

    def _fire(self) -> None:
        for fd, _ in self._epoll.poll(0):
            woken = self._waiters.get(fd)
            if woken is not None and not woken.done():
                woken.set_result(True)

    def arm(self, fd: int) -> asyncio.Future[bool]:
        """A future that ``fd`` becoming readable resolves (at once if it already is)."""
        woken = asyncio.get_running_loop().create_future()
        self._waiters[fd] = woken
        try:
            self._epoll.modify(fd, _ONCE)
        except FileNotFoundError:  # first watched here, or closed and its number reused
            self._epoll.register(fd, _ONCE)
        return woken

    def settle(self, fd: int, woken: asyncio.Future[bool]) -> None:
        """``woken``'s wait is over: unless ``fd`` became readable, which disarmed its
        entry, the entry goes too."""
        if self._waiters.get(fd) is woken:
            del self._waiters[fd]
        if not (woken.done() and not woken.cancelled() and woken.result()):
            with contextlib.suppress(OSError):  # closed meanwhile (the kernel dropped it)
                self._epoll.unregister(fd)


async def receive_socket(receive: Any, sock: Any) -> Any:
    """Run the engine's ``SocketReceive`` for ``sock``: a gradient already there is taken
    on this thread; with nothing there yet, wait until the socket is readable (at most as
    long as the receive says) and look again; anything else (and any receive of a socket
    handed over by an asyncio stream) goes on in tokio under the loop's hub. (One
    coroutine, inlined: a small receive feels every microsecond.)"""
    step, value = receive.poll()
    if step == _WAIT:
        watch = hub().readiness
        fd = sock.fileno()
        while step == _WAIT:
            woken = watch.arm(fd)
            timer = None
            if value is not None:
                timer = asyncio.get_running_loop().call_later(value, _timed_out, woken)
            try:
                await woken
            finally:
                if timer is not None:
                    timer.cancel()
                watch.settle(fd, woken)
            step, value = receive.poll()
    if step == _SLOW:
        found = hub()
        return await found.run(receive.hand_over(found.native))
    return value


def _wake(woken: asyncio.Future[Any]) -> None:
    if not woken.done():
        woken.set_result(True)


async def drive(found: Hub, driven: Any) -> Any:
    """Run a connection's transfer that the loop's thread drives itself (the engine's
    ``Driven``, crates/gradstream-py/src/complete.rs): polled again each time its socket is
    ready (readable, watched in the loop's ``Readiness``; or writable) or it is woken (a
    timer of its deadline: its job comes out of the hub's eventfd); its result.
    Cancelled, the transfer's future is dropped before the cancellation goes on."""
    fd, job = driven.fd, driven.job
    try:
        step, value = driven.poll()
        while step == _WAIT:
            if value:  # the socket would not take more: wait until it is writable
                loop = asyncio.get_running_loop()
                woken = loop.create_future()
                found.futures[job] = woken
                loop.add_writer(fd, _wake, woken)
                try:
                    await woken
                finally:
                    loop.remove_writer(fd)
                    found.futures.pop(job, None)
            else:
                watch = found.readiness
                woken = watch.arm(fd)
                found.futures[job] = woken
                try:
                    await woken
                finally:
                    found.futures.pop(job, None)
                    watch.settle(fd, woken)
            step, value = driven.poll()
    except asyncio.CancelledError:
        driven.stop()
        raise
    return value


class Hub:
    """One event loop's link to the native transfers running on tokio.

    A finished transfer queues its result in Rust and writes to an eventfd; the loop
    watches that eventfd and resolves the awaiting futures on its own thread, so tokio
    threads never call into Python (see crates/gradstream-py/src/complete.rs for why).
    A transfer the loop drives itself (``drive``) is woken the same way: its future
    resolves with None.

    A transfer whose awaiting task is cancelled is stopped; ``run`` lets the cancellation
    go on only once the transfer's future is gone on tokio, waiting for that on the loop
    (never blocking it), so that nothing writes into a caller's ``out=`` afterwards
    (docs/guides/connections.md "Delivery").
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        from ._native import Completions

        # No reference to the loop: _hubs is keyed weakly by it, and the loop's reader
        # callback already keeps this hub alive for as long as the loop lives.
        self.native = Completions()
        self.futures: dict[int, asyncio.Future[Any]] = {}
        # Cancelled jobs still running on tokio, each resolved once its future is gone.
        self.stopping: dict[int, asyncio.Future[None]] = {}
        loop.add_reader(self.native.fileno(), self._deliver)
        self.readiness = Readiness(loop)

    def track(self, job: int) -> asyncio.Future[Any]:
        future = asyncio.get_running_loop().create_future()
        self.futures[job] = future
        future.add_done_callback(lambda f: self._settled(job, f))
        return future

    async def run(self, job: int) -> Any:
        """The result of ``job``; when the awaiting task is cancelled, the cancellation
        goes on once the job's future is gone (``stop``)."""
        future = self.track(job)
        try:
            return await future
        except asyncio.CancelledError:
            await self.stop(job)
            raise

    def _settled(self, job: int, future: asyncio.Future[Any]) -> None:
        self.futures.pop(job, None)
        if future.cancelled():
            self._abort(job)

    def _abort(self, job: int) -> None:
        if job not in self.stopping and not self.native.abort(job):
            self.stopping[job] = asyncio.get_running_loop().create_future()

    async def stop(self, job: int) -> None:
        """Stop ``job`` (its awaiting task was cancelled) and wait, on the loop, until its
        future is gone on tokio: at most the end of the step it is in. A second
        cancellation meanwhile does not cut the wait short (the caller's out= must be left
        alone first); the caller raises CancelledError after."""
        self._abort(job)
        ended = self.stopping.get(job)
        while ended is not None and not ended.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(ended)

    def _deliver(self) -> None:
        for job, ok, value in self.native.drain():
            ended = self.stopping.pop(job, None)
            if ended is not None:  # a stopped job's end (or its result, just before)
                if not ended.done():
                    ended.set_result(None)
                continue
            future = self.futures.pop(job, None)
            if future is None or future.done():
                continue
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)


_hubs: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Hub] = weakref.WeakKeyDictionary()


# The last loop asked for and its hub, both weakly: most programs run one loop, and a
# WeakKeyDictionary lookup costs a small transfer a measurable part of its time.
_last: tuple[weakref.ref[asyncio.AbstractEventLoop], weakref.ref[Hub]] | None = None


def hub() -> Hub:
    """The hub of the running event loop (RuntimeError outside a running loop)."""
    global _last
    loop = asyncio.get_running_loop()
    last = _last
    if last is not None and last[0]() is loop:
        cached = last[1]()
        if cached is not None:
            return cached
    found = _hubs.get(loop)
    if found is None:
        found = _hubs[loop] = Hub(loop)
    _last = (weakref.ref(loop), weakref.ref(found))
    return found
