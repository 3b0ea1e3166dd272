"""A worker's side of the parameter server (``_ps``): ``ParameterClient`` joins the
server under its rank and, each step, sends its gradient (to the server, or through its
node's leader: ``_ps_group``) and returns the new parameters."""

from __future__ import annotations

import asyncio
import contextlib
import errno
from collections.abc import Mapping
from typing import Any, NoReturn

import numpy as np
import numpy.typing as npt
import ray

from .. import _connection
from .._address import Address
from .._connection import Connection
from ..errors import (
    GradientStreamError,
    ProtocolError,
    SettingError,
    StreamIOError,
    StreamTimeoutError,
)
from . import _control, _loop, _same_node
from ._ps import _ARRAY, _JOINED, _MISSING, _PLAN, _REPLY, Params, StepReport, _size
from ._ps_group import Follower, Leader, read_plan
from ._same_node import connect_locally, on_this_node, reachable
from ._settings import RaySettings


class _LeaderGone(Exception):
    """A follower's leader will not pass the step's reply on: the server is asked."""


class ParameterClient:
    """A worker's side: ``push(gradient)`` sends this step's gradient to the server and
    returns the new parameters (``push_async`` in async code). Made in the worker (an
    actor, sync or async, or a task) from the server's handle and the worker's rank."""

    def __init__(self, server: Any, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise SettingError("rank", f"rank must be an int of at least 0, got {rank!r}")
        self._server = server
        self.rank = rank
        self.last_report: StepReport | None = None
        (address, settings), workers, same_node = ray.get(
            [server.contact.remote(), server.workers.remote(), server.same_node.remote()]
        )
        self._tcp: tuple[str, int] = address
        self._settings: RaySettings = settings
        # A server on this worker's Ray node is reached through its Unix socket (Ray's
        # node id decides, never whether the path exists).
        node, local = same_node or (None, None)
        self._address: Address = reachable(settings, on_this_node(node, local)) or address
        self._workers: int = workers
        self._conn: Connection | None = None
        self._skip = False  # the server's on_worker_failure is "skip" (its join says)
        # The groups of the step this worker pushes next (from the last reply; none
        # after a join or a failed push: then it sends to the server).
        self._plan: dict[int, int] = {}
        self._step: int | None = None
        # A worker not on the server's node may lead its node's group (it listens on a
        # Unix socket for followers) or follow a leader there. Each waits for the other
        # within a share of the server's own timeout per rank.
        base_timeout = settings.timeout / (workers + 1)
        self._leader: Leader | None = None
        self._follower = Follower(rank, settings, base_timeout)
        if not isinstance(self._address, str):
            self._leader = Leader(settings, base_timeout)
            _loop.call(self._leader.start())
        # Join now: the server counts this rank from the first step whose turn reaches
        # it after this (a restarted worker rejoins here), and a TLS or authkey problem
        # shows in the constructor.
        _loop.call(self._connection())

    def push(self, gradient: Any) -> Params:
        """Send ``gradient`` (an array of the parameters' size, or a dict like the
        parameters) and return the new parameters, once every worker's gradient of this
        step was summed and the update ran."""
        try:
            return _loop.call(self._push(gradient))
        except (GradientStreamError, OSError) as exc:
            _why(ray.get(self._server.failure.remote()), exc)

    async def push_async(self, gradient: Any) -> Params:
        """``push`` for async code (an async actor): the caller's loop stays free."""
        try:
            return await _loop.wait(self._push(gradient))
        except (GradientStreamError, OSError) as exc:
            _why(await self._server.failure.remote(), exc)

    async def _connection(self) -> Connection:
        """The connection to the server, joined under this rank (again after the server
        closed it: a worker it lost rejoins). A refused join is a ``SettingError``
        naming the server's reason."""
        conn = self._conn
        if conn is None or conn.closed:
            self._plan, self._step = {}, None  # a join carries no plan: direct first
            conn = await self._connect()
            try:
                leader = self._leader
                where = {"node": _same_node.node_id()}
                if leader is not None and leader.address is not None:
                    where["local"] = leader.address
                await conn.send_tensors(_control.message("join", rank=self.rank, **where))
                # The answer is a message alone: a set holding values is refused from its
                # manifest.
                answer = await conn.recv_tensors(max_values=0)
                body, _ = _control.split(answer, self._address, _JOINED)
                if body["kind"] == "refused":
                    detail = _control.field(body, "detail", str, self._address, _JOINED)
                    raise SettingError(
                        "rank", f"the parameter server refused rank {self.rank}: {detail}"
                    )
                if body["kind"] != "joined":
                    raise ProtocolError(_JOINED, f"a {body['kind']!r} message", self._address)
                self._skip = _control.field(body, "skip", bool, self._address, _JOINED)
            except BaseException:
                await conn.close()
                raise
            self._conn = conn
        return conn

    async def _connect(self) -> Connection:
        """A new connection to the server: through its Unix socket when it is on this
        node (no TLS there: the authkey admits), else, or where that socket cannot be
        reached (logged), over TCP."""
        if isinstance(self._address, str):
            conn, _ = await connect_locally(self._address, self._settings)
            if conn is not None:
                return conn
            self._address = self._tcp  # from here on: the socket cannot be reached
        return await _connection.connect(self._address, **self._settings.link_keywords())

    async def _push(self, gradient: Any) -> Params:
        conn = await self._connection()
        # The reply holds the parameters (the gradient's size), the missing ranks and
        # the next step's plan (one value per worker each): a larger one is refused from
        # its manifest.
        most = _size(gradient) + 2 * self._workers
        groups, step = self._plan, self._step
        self._plan, self._step = {}, None  # after a failure, the next push goes direct
        leader = groups.get(self.rank)
        try:
            if leader is None or step is None:
                reply = await self._push_direct(conn, gradient, most)
            elif leader == self.rank:
                followers = [
                    r for r, lead in sorted(groups.items()) if lead == leader and r != leader
                ]
                reply = await self._push_as_leader(conn, step, gradient, followers, most)
            else:
                reply = await self._push_as_follower(conn, step, gradient, leader, most)
        except BaseException:
            if self._leader is not None:
                # Its followers, finding their links closed, ask the server or send to it.
                await self._leader.drop_all()
            raise
        return self._read_reply(reply)

    async def _push_direct(self, conn: Connection, gradient: Any, most: int) -> dict[str, Any]:
        await conn.send_tensors(_control.message("grad"))
        if isinstance(gradient, Mapping):
            await conn.send_tensors(gradient)
        else:
            await conn.send(gradient)
        return await self._reply(conn, most)

    async def _push_as_leader(
        self, conn: Connection, step: int, gradient: Any, followers: list[int], most: int
    ) -> dict[str, Any]:
        """Its group's sum (own gradient first, then the followers' in rank order) to the
        server, and the reply on to the followers it holds."""
        assert self._leader is not None  # only a worker with a socket is made a leader
        # The server takes this notice in the leader's turn, which may come later: the
        # followers' gradients are collected meanwhile.
        leading = asyncio.ensure_future(conn.send_tensors(_control.message("leading", step=step)))
        try:
            total, held, spoiled = await self._leader.collect(step, followers, gradient, self._skip)
        except BaseException:
            leading.cancel()  # this push failed: no waiting for the server's turn
            with contextlib.suppress(BaseException):
                await leading
            raise
        await leading
        if spoiled is not None:
            # Under "raise": the server fails the step naming that follower.
            await conn.send_tensors(_control.message("spoiled", step=step, rank=spoiled))
            return await self._reply(conn, most)
        await conn.send_tensors(_control.message("bundle", step=step, ranks=held))
        if isinstance(total, dict):
            await conn.send_tensors(total)
        else:
            await conn.send(total)
        del total
        reply = await self._reply(conn, most)
        await self._leader.forward(reply, held)
        return reply

    async def _push_as_follower(
        self, conn: Connection, step: int, gradient: Any, leader: int, most: int
    ) -> dict[str, Any]:
        """The gradient to its node's leader, the reply from it; where the leader did not
        take the gradient, to the server; where it took it and no reply came, the
        server is asked (``_ps_group``'s rules: never counted twice)."""
        address = await self._server.leader_address.remote(leader)
        link = None if address is None else await self._follower.link(address)
        if link is None or not await self._follower.hand_over(link, step, gradient):
            return await self._push_direct(conn, gradient, most)
        with contextlib.suppress(GradientStreamError, OSError, _LeaderGone):
            reply = await self._from_leader(link, most, step, leader)
            if reply:
                return reply
        await self._follower.close()
        await conn.send_tensors(_control.message("orphan", step=step))
        return await self._reply(conn, most)

    async def _from_leader(
        self, link: Connection, most: int, step: int, leader: int
    ) -> dict[str, npt.NDArray[Any]]:
        """The reply as the leader passes it on; asked after each quarter of the server's
        timeout whether the server stopped (its failure raised), lost the leader or did
        the step (the leader hangs: ``_LeaderGone``, and the caller asks the server
        instead, within the time the server waits for it)."""
        reply = asyncio.ensure_future(link.recv_tensors(max_values=most))
        span = self._follower.base_timeout / 4
        passed_before = False
        try:
            while True:
                done, _ = await asyncio.wait({reply}, timeout=span)
                if done:
                    got: dict[str, npt.NDArray[Any]] = reply.result()
                    return got
                failure, passed = await self._server.leader_passed.remote(step, leader)
                if failure is not None:
                    raise failure
                if passed and passed_before:  # a span after: not a reply on its way
                    raise _LeaderGone
                passed_before = passed
        finally:
            if not reply.done():
                reply.cancel()
                with contextlib.suppress(BaseException):
                    await reply

    async def _reply(self, conn: Connection, max_values: int) -> dict[str, npt.NDArray[Any]]:
        """The server's reply (from the server, or from this node's leader), which comes
        once every rank's gradient of the step was taken: waited for in spans of
        ``timeout`` while the server, asked through Ray after each silent span, still
        runs (a dead server is Ray's error, a failed one its failure)."""
        while True:
            try:
                got: dict[str, np.ndarray] = await conn.recv_tensors(max_values=max_values)
                if not got:
                    raise StreamIOError(
                        errno.ENOTCONN, "the parameter server closed the connection before replying"
                    )
                return got
            except StreamTimeoutError:
                if conn.closed:
                    raise
                failure = await self._server.failure.remote()
                if failure is not None:
                    raise failure from None

    def _read_reply(self, reply: dict[str, npt.NDArray[Any]]) -> Params:
        """The parameters of a reply: its message, the missing ranks, then the
        parameters (one array, or the named set)."""
        peer = self._address
        body, tensors = _control.split(reply, peer, _REPLY)
        if body["kind"] != "params":
            raise ProtocolError(_REPLY, f"a {body['kind']!r} message", peer)
        step = _control.field(body, "step", int, peer, _REPLY)
        count = _control.field(body, "count", int, peer, _REPLY)
        array = _control.field(body, "array", bool, peer, _REPLY)
        names = list(reply)[1:]
        if names[:2] != [_MISSING, _PLAN] or (array and names[2:] != [_ARRAY]):
            raise ProtocolError(_REPLY, f"a reply of the tensors {names[:4]!r}", peer)
        ranks = tensors[0]
        if ranks.ndim != 1 or not np.all((ranks >= 0) & (ranks == np.floor(ranks))):
            raise ProtocolError(_REPLY, "missing ranks that are not counts", peer)
        groups = read_plan(tensors[1], self._workers, peer, _REPLY)
        self.last_report = StepReport(step, count, tuple(int(r) for r in ranks))
        self._plan, self._step = groups, step + 1
        if array:
            return reply[_ARRAY]
        return {name: reply[name] for name in names[2:]}

    def close(self) -> None:
        """Close the connection to the server (and to this node's other workers)."""
        _loop.call(self._close())

    async def _close(self) -> None:
        await self._follower.close()
        if self._leader is not None:
            await self._leader.close()
        if self._conn is not None:
            await self._conn.close()
            self._conn = None


def _why(failure: Exception | None, exc: BaseException) -> NoReturn:
    """A push failed with ``exc``: the server's failure, when it stopped, says why."""
    if failure is not None:
        raise failure from exc
    raise exc
