"""The ``"gradstream"`` process group: a ring of gradstream connections, one to the
next rank (sends) and one from the previous rank (receives), opened through the
group's store (``_ring``); each collective a coroutine on the backend's loop
(``_loop``)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Work as _BaseWork
from torch.futures import Future

from .._connection import Connection
from .._local_socket import SocketDirectory
from ..errors import (
    DeliveryError,
    GradientDtypeError,
    GradientSizeError,
    SettingError,
    StreamIOError,
    StreamTimeoutError,
)
from . import _loop
from ._flat import _bounds, _combine, _Flat, _op_name, _others, _rows
from ._links import COLLECTIVE, P2P, Key, Links
from ._options import as_delivered, options
from ._ring import meet

log = logging.getLogger("gradstream.torch")


def _sums_float32(flat: _Flat, op: str) -> bool:
    """Whether a reduction adds up float32 values: the receiver then sums each segment
    as it arrives (``reduce_into=``), and ``reduce_wire_dtype`` applies."""
    return bool(flat.tensor.dtype == torch.float32 and op in ("sum", "avg"))


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
        self._reduce_wire_dtype = options().reduce_wire_dtype
        self._failed: BaseException | None = None
        self._next: Connection | None = None
        self._prev: Connection | None = None
        self._turn: asyncio.Lock | None = None
        self._links: Links | None = None
        self._socket_dir: SocketDirectory | None = None
        if size > 1:
            ring = meet(store, rank, size, self._seconds)
            self._next, self._prev, self._links = ring.next, ring.prev, ring.links
            self._socket_dir = ring.socket_dir

    def _lock(self) -> asyncio.Lock:
        if self._turn is None:
            self._turn = asyncio.Lock()
        return self._turn

    def _run(
        self,
        name: str,
        body: Callable[[], Awaitable[None]],
        result: Any,
        turn: Callable[[], asyncio.Lock] | None = None,
    ) -> _Work:
        """Run ``body`` on the loop after the collectives before it (FIFO; with ``turn``,
        after the calls before it that hold that lock: a point-to-point channel's); the
        Work's future gets ``result``, or the error. A failed call breaks the group:
        every later one fails with the same error."""
        future: Future[Any] = Future()

        async def step() -> None:
            async with self._lock() if turn is None else turn():
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

    async def _send(self, what: np.ndarray, wire: Literal["int8"] | None = None) -> None:
        assert self._next is not None
        await self._send_on(self._next, (self.rank() + 1) % self.size(), what, wire)

    async def _send_on(
        self, link: Connection, other: int, what: np.ndarray, wire: Literal["int8"] | None = None
    ) -> None:
        try:
            await link.send(what, wire_dtype=wire)
        except (StreamIOError, DeliveryError) as exc:
            # A peer's refusal (a DeliveryError with a reason: CRC, seal) stays itself.
            if isinstance(exc, DeliveryError) and getattr(exc, "reason", None):
                raise
            raise self._lost(other, exc) from exc

    async def _recv(self, out: np.ndarray | None = None, into: np.ndarray | None = None) -> None:
        assert self._prev is not None
        await self._recv_on(self._prev, (self.rank() - 1) % self.size(), out, into)

    async def _recv_on(
        self,
        link: Connection,
        before: int,
        out: np.ndarray | None = None,
        into: np.ndarray | None = None,
    ) -> None:
        try:
            got = await link.recv(out=out, reduce_into=into)
        except StreamIOError as exc:
            raise self._lost(before, exc) from exc
        except GradientSizeError as exc:
            # The end of a closed connection (0 values) meets a segment's out=.
            if not link.closed or exc.received:
                raise
            raise self._lost(before, StreamIOError("it closed the connection")) from exc
        if link.closed and got.size == 0:
            raise self._lost(before, StreamIOError("it closed the connection"))

    async def _exchange(
        self,
        send: np.ndarray,
        out: np.ndarray | None = None,
        into: np.ndarray | None = None,
        wire: Literal["int8"] | None = None,
    ) -> None:
        """Send to the next rank (on ``wire``, else as it is) while receiving from the
        previous one (empty segments are skipped by both ends alike); the first failure
        cancels the other half."""
        target = out if out is not None else into
        jobs: list[asyncio.Future[None]] = []
        if send.size:
            jobs.append(asyncio.ensure_future(self._send(send, wire)))
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
        native = _sums_float32(flat, op)
        wire = self._reduce_wire(flat, op)
        scratch = None if native else np.empty(max(b - a for a, b in parts), flat.wire.dtype)
        for k in range(shift, n - 1 + shift):
            a, b = parts[(r - k) % n]
            c, d = parts[(r - k - 1) % n]
            if native:
                await self._exchange(flat.wire[a:b], into=flat.wire[c:d], wire=wire)
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
        wire = self._reduce_wire(flat, op)
        if wire is not None:
            # This rank's finished segment, as the others will get it: every rank ends
            # with the same bits (a block forwarded on the int8 wire keeps them).
            a, b = parts[(r + 1) % n]
            as_delivered(flat.wire[a:b], wire)
        for k in range(n - 1):
            a, b = parts[(r + 1 - k) % n]
            c, d = parts[(r - k) % n]
            await self._exchange(flat.wire[a:b], out=flat.wire[c:d], wire=wire)
        if op == "avg":
            flat.torch.div_(n)

    def _reduce_wire(self, flat: _Flat, op: str) -> Literal["int8"] | None:
        """The wire of a reduction's values: ``configure(reduce_wire_dtype=)`` for float32
        tensors summed or averaged, else none (they move as they are)."""
        return self._reduce_wire_dtype if _sums_float32(flat, op) else None

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

    def _get_backend(self, device: Any) -> GradstreamProcessGroup:
        """The group itself: it is its own backend, on every device it takes (CPU).
        ``batch_isend_irecv`` asks it whether it coalesces (it does not)."""
        return self

    def _set_group_name(self, name: str) -> None:
        # A Python group has no C++ backend to keep its name in: kept here, where
        # DeviceMesh (FSDP's fully_shard) reads it.
        self._name = name

    @property
    def group_name(self) -> str:
        name = getattr(self, "_name", None)
        if name is None:
            raise RuntimeError("the gradstream process group has no name yet")
        return str(name)

    def _set_group_desc(self, desc: str) -> None:
        self._desc = desc

    @property
    def group_desc(self) -> str:
        return str(getattr(self, "_desc", "undefined"))

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work:
        op = _op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        flats = [_Flat(t).reducible() for t in tensors]

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
        return self._gather_into([output], [input], output)

    all_gather_single = _allgather_base

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> _Work:
        """``_allgather_base`` of each pair in turn, one Work (FSDP's path)."""
        return self._gather_into(outputs, inputs, outputs)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def _gather_into(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], result: Any
    ) -> _Work:
        wholes = [_Flat(t) for t in outputs]
        if len(wholes) != len(inputs):
            raise ValueError(f"{len(outputs)} output tensors for {len(inputs)} inputs")

        async def body() -> None:
            for whole, input in zip(wholes, inputs, strict=True):
                pieces = whole.torch.chunk(self.size())
                pieces[self.rank()].copy_(input.detach().reshape(-1))
                wires = np.split(whole.wire, self.size())
                if self.size() > 1:
                    await self._ring_gather(wires)
                whole.done()

        return self._run("allgather", body, result)

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> _Work:
        """Rank r gets segment r of the reduced ``input`` (size x output's length),
        added up in ring order starting at rank r + 1."""
        return self._scatter_reduced([output], [input], opts, output)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> _Work:
        """``reduce_scatter_single`` of each pair in turn, one Work (FSDP's path)."""
        return self._scatter_reduced(outputs, inputs, opts, outputs)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def _scatter_reduced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any, result: Any
    ) -> _Work:
        op = _op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        works = [_Flat(t.detach().clone()).reducible() for t in inputs]
        if len(works) != len(outputs):
            raise ValueError(f"{len(outputs)} output tensors for {len(inputs)} inputs")

        async def body() -> None:
            n, r = self.size(), self.rank()
            for work, output in zip(works, outputs, strict=True):
                parts = _bounds(work.wire.size, n)
                if n > 1:
                    await self._reduce_scatter(work, parts, op, 1)
                a, b = parts[r]
                mine = work.torch[a:b]
                if op == "avg":
                    mine.div_(n)
                output.detach().view(-1).copy_(mine)

        return self._run("reduce_scatter", body, result)

    def reduce_scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> _Work:
        whole = torch.cat([t.detach().reshape(-1) for t in inputs[0]])
        return self.reduce_scatter_single(outputs[0], whole, opts)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work:
        """``allreduce`` of each tensor in turn (each in the documented order), one Work."""
        return self.allreduce(tensors, opts)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work:
        """An all-reduce: the root gets the reduced tensor, and so does every other rank."""
        return self.allreduce(tensors, opts)

    def allgather_coalesced(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> _Work:
        """``outputs[k][i]`` gets rank k's ``inputs[i]``: an ``allgather`` per input."""
        by_input = [list(column) for column in zip(*outputs, strict=True)]
        return self.allgather(by_input, inputs, opts)

    # -- point to point, and the collectives made of pairs ---------------------------

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int = 0) -> _Work:
        """Send ``tensors`` to rank ``dstRank`` on the channel of ``tag``; the Work
        completes once that rank has them (its ack). Sends on one channel go in call
        order; channels (another rank, another tag) do not wait for each other."""
        return self._point(True, dstRank, tag, tensors)

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int = 0) -> _Work:
        """Receive into ``tensors`` what rank ``srcRank`` sends with ``tag``, in the
        order it sent on that channel; the Work completes once the data is in place."""
        return self._point(False, srcRank, tag, tensors)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> _Work:
        raise SettingError(
            "src",
            "the gradstream backend receives from a given rank only (each sender has a "
            "connection of its own, which a receive must pick): pass src= to recv/irecv",
        )

    def gather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> _Work:
        """Each rank's ``inputs[0]`` into the root's ``outputs[0][rank]``, straight from
        each rank to the root."""
        root, r = (opts.rootRank if opts is not None else 0), self.rank()
        mine = _Flat(inputs[0])
        if r != root:
            return self._swap("gather", {root: mine}, {}, None, outputs)
        into = [_Flat(t) for t in outputs[0]]
        return self._swap("gather", {}, _others(into, r), (into[r], mine), outputs)

    def scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> _Work:
        """The root's ``inputs[0][rank]`` into each rank's ``outputs[0]``, straight from
        the root to each rank."""
        root, r = (opts.rootRank if opts is not None else 0), self.rank()
        mine = _Flat(outputs[0])
        if r != root:
            return self._swap("scatter", {}, {root: mine}, None, outputs)
        parts = [_Flat(t) for t in inputs[0]]
        return self._swap("scatter", _others(parts, r), {}, (mine, parts[r]), outputs)

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> _Work:
        """Rows ``input_split_sizes[k]`` of ``input`` (equal parts when empty) to rank k;
        rows ``output_split_sizes[k]`` of ``output`` from it."""
        outs = _rows(output, output_split_sizes, self.size(), "output")
        ins = _rows(input, input_split_sizes, self.size(), "input")
        return self._all_to_all(outs, ins, output)

    all_to_all_single = alltoall_base

    def alltoall(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> _Work:
        """``inputs[k]`` to rank k, ``outputs[k]`` from it."""
        n = self.size()
        if len(outputs) != n or len(inputs) != n:
            raise ValueError(
                f"all_to_all takes one tensor per rank ({n}), got {len(outputs)} outputs "
                f"and {len(inputs)} inputs"
            )
        return self._all_to_all([_Flat(t) for t in outputs], [_Flat(t) for t in inputs], outputs)

    def _all_to_all(self, outs: list[_Flat], ins: list[_Flat], result: Any) -> _Work:
        r = self.rank()
        return self._swap("alltoall", _others(ins, r), _others(outs, r), (outs[r], ins[r]), result)

    def _swap(
        self,
        name: str,
        sends: dict[int, _Flat],
        recvs: dict[int, _Flat],
        local: tuple[_Flat, _Flat] | None,
        result: Any,
    ) -> _Work:
        """A collective made of pairs: ``local`` (to, from) copied on this rank, then
        ``_pairs(sends, recvs)``; queued with the other collectives."""

        async def body() -> None:
            if local is not None:
                local[0].torch.copy_(local[1].torch)
                local[0].done()
            await self._pairs(sends, recvs)

        return self._run(name, body, result)

    def _other(self, rank: int, call: str) -> int:
        if not 0 <= rank < self.size() or rank == self.rank():
            raise ValueError(
                f"gradstream backend: {call} rank {rank}, which is not another rank of "
                f"this group of {self.size()} (this is rank {self.rank()})"
            )
        return int(rank)

    def _point(self, outgoing: bool, other: int, tag: int, tensors: list[torch.Tensor]) -> _Work:
        call = "send to" if outgoing else "recv from"
        key = (self._other(other, call), P2P, int(tag))
        flats = [_Flat(t) for t in tensors]
        move = self._send_to if outgoing else self._recv_from
        links = self._links
        assert links is not None  # a group of one has no other rank (_other)

        async def body() -> None:
            for flat in flats:
                await move(key, flat)

        name = f"{call} rank {key[0]} (tag {key[2]})"
        return self._run(name, body, tensors, turn=lambda: links.turn(outgoing, key))

    async def _send_to(self, key: Key, flat: _Flat) -> None:
        """``flat`` on the connection of channel ``key`` (opened on first use)."""
        if not flat.wire.size:
            return  # the receiver skips it too: its tensor is empty as well
        assert self._links is not None
        try:
            link = await self._links.outbound(key)
        except StreamIOError as exc:
            raise self._lost(key[0], exc) from exc
        try:
            await self._send_on(link, key[0], flat.wire)
        except DeliveryError as exc:  # the receiver refused it: its words
            exc.args = (
                f"gradstream backend: rank {key[0]} refused rank {self.rank()}'s send "
                f"({_channel(key)}): {exc.reason}",
            )
            raise

    async def _recv_from(self, key: Key, flat: _Flat) -> None:
        """The next message of channel ``key`` into ``flat``."""
        if flat.wire.size:
            assert self._links is not None
            link = await self._links.inbound(key)
            try:
                await self._recv_on(link, key[0], out=flat.wire)
            except (GradientSizeError, GradientDtypeError) as exc:
                exc.args = (
                    f"gradstream backend: rank {self.rank()}'s recv from rank {key[0]} "
                    f"({_channel(key)}) into {flat.tensor.numel()} values of "
                    f"{flat.tensor.dtype}: {exc}; a send and its recv take tensors of one "
                    "size and dtype",
                )
                raise
        flat.done()

    async def _pairs(self, sends: dict[int, _Flat], recvs: dict[int, _Flat]) -> None:
        """Send each of ``sends`` to its rank and receive each of ``recvs`` from its
        rank, all at once (a connection per direction and pair); the first failure
        cancels the rest."""
        moves = [self._send_to((k, COLLECTIVE, 0), f) for k, f in sends.items()]
        moves += [self._recv_from((k, COLLECTIVE, 0), f) for k, f in recvs.items()]
        jobs = [asyncio.ensure_future(move) for move in moves]
        try:
            await asyncio.gather(*jobs)
        finally:  # after a failure (none is left running after a success)
            for job in jobs:
                job.cancel()

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
        links = self._links
        if links is None:
            return

        async def close() -> None:
            if wait:
                async with self._lock():
                    if self._failed is None:
                        self._failed = StreamIOError("the gradstream process group was shut down")
                # The sends and receives queued before, each bounded by the timeout.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(_queued(links.turns()), self._seconds)
            elif self._failed is None:
                self._failed = StreamIOError("the gradstream process group was aborted")
            await links.close()

        try:
            _loop.submit(close()).result(timeout=3 * self._seconds)
        finally:
            if self._socket_dir is not None:
                self._socket_dir.remove()

    def size(self) -> int:
        return int(super().size())

    def rank(self) -> int:
        return int(super().rank())


def _channel(key: Key) -> str:
    return f"tag {key[2]}" if key[1] == P2P else "a collective"


async def _queued(turns: list[asyncio.Lock]) -> None:
    """Once the calls queued on ``turns`` now have run."""
    for turn in turns:
        async with turn:
            pass
