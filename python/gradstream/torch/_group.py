"""The ``"gradstream"`` process group: a ring of gradstream connections, one to the
next rank (sends) and one from the previous rank (receives), opened through the
group's store; each collective a coroutine on the backend's loop (``_loop``)."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import os
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Work as _BaseWork
from torch.futures import Future

from .._connection import Connection, connect, listen
from .._session import GradientStreamSession
from ..errors import (
    DeliveryError,
    GradientSizeError,
    SettingError,
    StreamIOError,
    StreamTimeoutError,
)
from . import _loop

_KEY = "gradstream/authkey"
_ADDRESS = "gradstream/address/{}"


@dataclasses.dataclass(frozen=True)
class Options:
    """What ``configure`` set: the host every rank listens on (and publishes), the TLS
    of its listener (``listen_tls``) and of its connection to the next rank
    (``connect_tls``), and the authkey (None: a random one from rank 0, through the
    store)."""

    host: str = "127.0.0.1"
    listen_tls: Any = None
    connect_tls: Any = None
    authkey: bytes | None = None


_options = [Options()]


def configure(
    *,
    host: str | None = None,
    listen_tls: Any = None,
    connect_tls: Any = None,
    authkey: bytes | None = None,
) -> Options:
    """Set the options of the groups made from now on (before ``init_process_group``);
    what is not given keeps its default. Returns them."""
    now = _options[0]
    _options[0] = Options(
        host=now.host if host is None else host,
        listen_tls=now.listen_tls if listen_tls is None else listen_tls,
        connect_tls=now.connect_tls if connect_tls is None else connect_tls,
        authkey=now.authkey if authkey is None else bytes(authkey),
    )
    return _options[0]


def options() -> Options:
    """The options groups are made with."""
    return _options[0]


def _session() -> GradientStreamSession:
    # The compact layout, dtypes and shapes kept: the bits a rank sends are the bits
    # the next one gets.
    return GradientStreamSession(layout="compact", keep_shape=True, keep_dtype=True)


_WIRE = {
    torch.float32: (torch.float32, np.float32),
    torch.float64: (torch.float64, np.float64),
    torch.float16: (torch.float16, np.float16),
    # bfloat16 travels as its raw 16-bit values, viewed as float16 (no conversion: the
    # bits are copied; the sum is done by torch in bfloat16).
    torch.bfloat16: (torch.float16, np.float16),
}


class _Flat:
    """A tensor as the ring moves it: a 1-D torch view and a numpy view of the same
    memory in a dtype gradstream carries. A tensor that is not contiguous is copied
    in and written back by ``done``."""

    def __init__(self, tensor: torch.Tensor) -> None:
        if tensor.device.type != "cpu":
            raise TypeError(
                f"the gradstream backend takes CPU tensors, got one on {tensor.device}: "
                "use .cpu(), or the gloo/nccl backend for device tensors"
            )
        self.tensor = tensor
        self.flat = tensor.detach().reshape(-1) if tensor.is_contiguous() else None
        work = self.flat if self.flat is not None else tensor.detach().contiguous().reshape(-1)
        self.torch = work
        if tensor.dtype in _WIRE:
            wire = work.view(_WIRE[tensor.dtype][0])
        elif work.numel() * work.element_size() % 2 == 0:
            # Other dtypes (int64 buffers, ...) only move as bits (broadcast, gather).
            wire = work.view(torch.uint8).view(torch.float16)
        else:
            raise TypeError(
                f"the gradstream backend moves {tensor.dtype} tensors of an even byte "
                f"count only, got {work.numel() * work.element_size()} bytes"
            )
        self.wire: np.ndarray = wire.numpy()

    def done(self) -> None:
        if self.flat is None:
            self.tensor.copy_(self.torch.view(self.tensor.shape))


def _bounds(length: int, parts: int) -> list[tuple[int, int]]:
    return [(i * length // parts, (i + 1) * length // parts) for i in range(parts)]


_REDUCE = {
    dist.ReduceOp.SUM: "sum",
    dist.ReduceOp.AVG: "avg",
    dist.ReduceOp.MIN: "min",
    dist.ReduceOp.MAX: "max",
    dist.ReduceOp.PRODUCT: "product",
}


def _op_name(op: Any) -> str:
    for known, name in _REDUCE.items():
        if op == known:
            return name
    raise SettingError(
        "op", f"the gradstream backend reduces with SUM, AVG, MIN, MAX or PRODUCT, not {op}"
    )


class _Work(_BaseWork):
    """A collective's Work: its future completes when the data is in place."""

    def __init__(self, future: Future[Any]) -> None:
        super().__init__()
        self._future = future

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self._future.wait()
        return True

    def is_completed(self) -> bool:
        return bool(self._future.done())

    def get_future(self) -> Future[Any]:
        return self._future


class GradstreamProcessGroup(dist.ProcessGroup):  # type: ignore[misc]  # torch is Any here
    """The process group of backend ``"gradstream"`` (made by ``init_process_group``)."""

    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> None:
        super().__init__(rank, size)
        self._seconds = timeout.total_seconds()
        self._failed: BaseException | None = None
        self._next: Connection | None = None
        self._prev: Connection | None = None
        self._turn: asyncio.Lock | None = None
        if size > 1:
            self._open(store)

    # -- the ring ------------------------------------------------------------------

    def _open(self, store: Any) -> None:
        """Listen, publish "host:port" in the store, connect to the next rank and accept
        the previous one (the only peer let in: the listener closes after it)."""
        settings = options()
        key = settings.authkey
        if key is None:
            if self.rank() == 0:
                store.set(_KEY, os.urandom(32))
            key = bytes(store.get(_KEY))
        common = {"authkey": key, "timeout": self._seconds, "deadline": self._seconds}
        listener = _loop.submit(
            listen(f"{settings.host}:0", session=_session(), tls=settings.listen_tls, **common)
        ).result()
        _, port = listener.address
        store.set(_ADDRESS.format(self.rank()), f"{settings.host}:{port}")
        after = bytes(store.get(_ADDRESS.format((self.rank() + 1) % self.size()))).decode()

        async def both() -> tuple[Connection, Connection]:
            try:
                return await asyncio.wait_for(
                    asyncio.gather(
                        connect(after, session=_session(), tls=settings.connect_tls, **common),
                        listener.accept(),
                    ),
                    self._seconds,
                )
            finally:
                await listener.close()

        try:
            self._next, self._prev = _loop.submit(both()).result()
        except (StreamIOError, TimeoutError) as exc:
            raise StreamIOError(
                f"gradstream backend: rank {self.rank()} could not join the ring (connect "
                f"to rank {(self.rank() + 1) % self.size()} at {after}, accept rank "
                f"{(self.rank() - 1) % self.size()}) within {self._seconds:g} s: "
                f"{exc or 'timed out'}"
            ) from exc

    def _lock(self) -> asyncio.Lock:
        if self._turn is None:
            self._turn = asyncio.Lock()
        return self._turn

    def _run(self, name: str, body: Callable[[], Awaitable[None]], result: Any) -> _Work:
        """Run ``body`` on the loop after the collectives before it (FIFO); the Work's
        future gets ``result``, or the error. A failed collective breaks the group:
        every later one fails with the same error."""
        future: Future[Any] = Future()

        async def step() -> None:
            async with self._lock():
                if self._failed is not None:
                    raise self._failed
                try:
                    await asyncio.wait_for(body(), self._seconds)
                except TimeoutError:
                    self._failed = self._stalled(
                        f"gradstream backend: {name} on rank {self.rank()} did not finish "
                        f"within the group's timeout of {self._seconds:g} s (a rank stalled "
                        "or died)"
                    )
                    raise self._failed from None
                except BaseException as exc:
                    self._failed = exc
                    raise

        def finished(done: Any) -> None:
            error = None if done.cancelled() else done.exception()
            if done.cancelled():
                error = StreamIOError(f"gradstream backend: {name} was cancelled")
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

        _loop.submit(step()).add_done_callback(finished)
        return _Work(future)

    def _stalled(self, message: str) -> StreamTimeoutError:
        error = StreamTimeoutError(self._seconds)
        error.args = (message,)
        return error

    def _lost(self, other: int, exc: BaseException) -> StreamIOError:
        """The error of a connection to rank ``other`` that failed or closed: that rank
        died, left, or its connection broke; a StreamTimeoutError when it stalled past the
        group's timeout (the cause chained)."""
        if isinstance(exc, StreamTimeoutError):
            return self._stalled(
                f"gradstream backend: rank {self.rank()} heard nothing from rank {other} "
                f"within the group's timeout of {self._seconds:g} s (that rank stalled or "
                f"died): {exc}"
            )
        return StreamIOError(
            f"gradstream backend: rank {self.rank()} lost its connection to rank {other} "
            f"(that rank died or left the group, or the network failed): {exc}"
        )

    async def _send(self, what: np.ndarray) -> None:
        assert self._next is not None
        try:
            await self._next.send(what)
        except (StreamIOError, DeliveryError) as exc:
            # A peer's refusal (a DeliveryError with a reason: CRC, seal) stays itself.
            if isinstance(exc, DeliveryError) and getattr(exc, "reason", None):
                raise
            raise self._lost((self.rank() + 1) % self.size(), exc) from exc

    async def _recv(self, out: np.ndarray | None = None, into: np.ndarray | None = None) -> None:
        assert self._prev is not None
        before = (self.rank() - 1) % self.size()
        try:
            got = await self._prev.recv(out=out, reduce_into=into)
        except StreamIOError as exc:
            raise self._lost(before, exc) from exc
        except GradientSizeError as exc:
            # The end of a closed connection (0 values) meets a segment's out=.
            if not self._prev.closed:
                raise
            raise self._lost(before, StreamIOError("it closed the connection")) from exc
        if self._prev.closed and got.size == 0:
            raise self._lost(before, StreamIOError("it closed the connection"))

    async def _exchange(
        self, send: np.ndarray, out: np.ndarray | None = None, into: np.ndarray | None = None
    ) -> None:
        """Send to the next rank while receiving from the previous one (empty segments
        are skipped by both ends alike); the first failure cancels the other half."""
        target = out if out is not None else into
        jobs: list[asyncio.Future[None]] = []
        if send.size:
            jobs.append(asyncio.ensure_future(self._send(send)))
        if target is not None and target.size:
            jobs.append(asyncio.ensure_future(self._recv(out, into)))
        try:
            await asyncio.gather(*jobs)
        except BaseException:
            for job in jobs:
                job.cancel()
            raise

    async def _reduce_scatter(
        self, flat: _Flat, parts: list[tuple[int, int]], op: str, shift: int
    ) -> None:
        """Ring reduce-scatter: after it, rank r holds the whole of segment
        (r + 1 - shift) mod n, added up in ring order starting at the rank after it."""
        n, r = self.size(), self.rank()
        native = flat.tensor.dtype == torch.float32 and op in ("sum", "avg")
        scratch = None if native else np.empty(max(b - a for a, b in parts), flat.wire.dtype)
        for k in range(shift, n - 1 + shift):
            a, b = parts[(r - k) % n]
            c, d = parts[(r - k - 1) % n]
            if native:
                await self._exchange(flat.wire[a:b], into=flat.wire[c:d])
            else:
                assert scratch is not None
                got = scratch[: d - c]
                await self._exchange(flat.wire[a:b], out=got)
                _combine(flat.torch[c:d], torch.from_numpy(got), flat.torch.dtype, op)

    async def _allreduce(self, flat: _Flat, op: str) -> None:
        """Ring reduce-scatter, then ring all-gather: segment j is added up in ring
        order starting at rank j, ((x_j + x_j+1) + x_j+2) + ..., on one rank, then
        copied to every other: every rank ends with the same bits."""
        n, r = self.size(), self.rank()
        parts = _bounds(flat.wire.size, n)
        await self._reduce_scatter(flat, parts, op, 0)
        for k in range(n - 1):
            a, b = parts[(r + 1 - k) % n]
            c, d = parts[(r - k) % n]
            await self._exchange(flat.wire[a:b], out=flat.wire[c:d])
        if op == "avg":
            flat.torch.div_(n)

    async def _ring_gather(self, pieces: Sequence[np.ndarray]) -> None:
        """pieces[rank] holds this rank's; after, every piece holds its rank's."""
        n, r = self.size(), self.rank()
        for k in range(n - 1):
            await self._exchange(pieces[(r - k) % n], out=pieces[(r - k - 1) % n])

    async def _broadcast(self, flat: _Flat, root: int) -> None:
        """Down the ring from ``root``: each rank receives from the one before and
        passes it on, but to ``root``."""
        n, r = self.size(), self.rank()
        if r != root and flat.wire.size:
            await self._recv(out=flat.wire)
        if (r + 1) % n != root and flat.wire.size:
            await self._send(flat.wire)

    # -- the ProcessGroup API --------------------------------------------------------

    def getBackendName(self) -> str:
        return "gradstream"

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work:
        op = _op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        flats = [_Flat(t) for t in tensors]
        for f in flats:
            if f.tensor.dtype not in _WIRE:
                raise TypeError(
                    f"the gradstream backend reduces float32, float64, float16 and bfloat16 "
                    f"tensors, not {f.tensor.dtype}"
                )

        async def body() -> None:
            for f in flats:
                if self.size() > 1:
                    await self._allreduce(f, op)
                f.done()

        return self._run("allreduce", body, tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work:
        root = opts.rootRank if opts is not None else 0
        flats = [_Flat(t) for t in tensors]

        async def body() -> None:
            for f in flats:
                if self.size() > 1:
                    await self._broadcast(f, root)
                f.done()

        return self._run("broadcast", body, tensors)

    def allgather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> _Work:
        groups = [[_Flat(t) for t in outs] for outs in outputs]

        async def body() -> None:
            for outs, tensor in zip(groups, inputs, strict=True):
                outs[self.rank()].torch.copy_(tensor.detach().reshape(-1))
                if self.size() > 1:
                    await self._ring_gather([f.wire for f in outs])
                for f in outs:
                    f.done()

        return self._run("allgather", body, outputs)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> _Work:
        whole = _Flat(output)

        async def body() -> None:
            pieces = whole.torch.chunk(self.size())
            pieces[self.rank()].copy_(input.detach().reshape(-1))
            wires = np.split(whole.wire, self.size())
            if self.size() > 1:
                await self._ring_gather(wires)
            whole.done()

        return self._run("allgather", body, output)

    all_gather_single = _allgather_base

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> _Work:
        """Rank r gets segment r of the reduced ``input`` (size x output's length),
        added up in ring order starting at rank r + 1."""
        op = _op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        work = _Flat(input.detach().clone())
        if work.tensor.dtype not in _WIRE:
            raise TypeError(f"the gradstream backend reduces float tensors, not {input.dtype}")

        async def body() -> None:
            n, r = self.size(), self.rank()
            parts = _bounds(work.wire.size, n)
            if n > 1:
                await self._reduce_scatter(work, parts, op, 1)
            a, b = parts[r]
            mine = work.torch[a:b]
            if op == "avg":
                mine.div_(n)
            output.detach().view(-1).copy_(mine)

        return self._run("reduce_scatter", body, output)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> _Work:
        whole = torch.cat([t.detach().reshape(-1) for t in inputs[0]])
        return self.reduce_scatter_single(outputs[0], whole, opts)

    def barrier(self, opts: Any = None) -> _Work:
        token = torch.zeros(1)

        async def body() -> None:
            if self.size() > 1:
                await self._allreduce(_Flat(token), "sum")

        return self._run("barrier", body, None)

    def shutdown(self) -> None:
        """Close the ring's connections once the collectives queued before have run
        (``destroy_process_group`` calls it); later collectives fail as closed."""
        self._close(wait=True)

    def abort(self) -> None:
        """Close the ring's connections now: the collectives under way fail."""
        self._close(wait=False)

    def _close(self, *, wait: bool) -> None:
        links = [c for c in (self._next, self._prev) if c is not None]
        if not links:
            return

        async def close() -> None:
            if wait:
                async with self._lock():
                    if self._failed is None:
                        self._failed = StreamIOError("the gradstream process group was shut down")
            elif self._failed is None:
                self._failed = StreamIOError("the gradstream process group was aborted")
            for link in links:
                await link.close()

        _loop.submit(close()).result(timeout=self._seconds)

    def size(self) -> int:
        return int(super().size())

    def rank(self) -> int:
        return int(super().rank())


def _combine(mine: torch.Tensor, got: torch.Tensor, dtype: torch.dtype, op: str) -> None:
    """``mine = mine (op) got``, in ``dtype`` (got holds its bits)."""
    other = got.view(dtype)
    if op in ("sum", "avg"):
        mine.add_(other)
    elif op == "min":
        torch.minimum(mine, other, out=mine)
    elif op == "max":
        torch.maximum(mine, other, out=mine)
    else:
        mine.mul_(other)
