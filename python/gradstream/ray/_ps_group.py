"""A parameter server's workers of one node reduce there first (docs/guides/ray.md,
"Workers of one node"): the server names, in each step's reply, a group per Ray node
other than its own that has two workers or more, led by its lowest rank (``plan``). In
the next step each follower sends its gradient to the leader through the leader's Unix
socket (``Follower``); the leader adds them in rank order, its own first, sends the
server one sum with the ranks it holds (a bundle), and passes the server's reply to its
followers as it came (``Leader``). The link between the two nodes carries one gradient
each way per step instead of one per worker.

What a follower's gradient went through decides what it does when something fails, and
no gradient is ever counted twice:

- not acknowledged by its leader (no link, a leader too slow to take it, a link that
  broke): the leader does not hold it, so the follower sends it to the server itself;
- acknowledged, but no reply came from the leader: the server may or may not hold it, so
  the follower asks the server (an ``orphan`` message naming the step), which answers
  with that step's reply once it knows (the gradient was in a bundle) or counts the
  follower missing from the step (the bundle never came: its leader was lost).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from .. import TransferProgress
from .._connection import Connection
from ..errors import GradientStreamError, ProtocolError, StreamTimeoutError
from . import _control
from ._same_node import LocalListener, connect_locally
from ._settings import RaySettings

log = logging.getLogger("gradstream.ray")

# The leader's own gradient and its followers' must all be in within this share of the
# server's timeout, counted from the leader's push: the server waits that long for the
# leader's bundle, and a follower left out still has time to send its gradient itself.
COLLECT_SHARE = 0.5
DIRECT = -1
# At most this many workers in a group (a node with more has several): a bundle's
# message names its ranks within the 1024 bytes a message has.
MAX_GROUP = 64
_GRADIENT = "a follower's gradient"
_JOIN = "a follower's join"
_JOINED = "the leader's answer to a join"


def plan(
    members: Mapping[int, tuple[str | None, str | None]], server_node: str | None
) -> dict[int, int]:
    """The next step's groups: each grouped rank's leader (a leader leads itself). A
    member is ``rank: (its Ray node, its Unix socket for followers or None)``; the
    members of one node other than the server's, with a socket each, form a group when
    there are two or more, led by the lowest rank. The rest send to the server."""
    by_node: dict[str, list[int]] = {}
    for rank in sorted(members):
        node, local = members[rank]
        if node is not None and node != server_node and local is not None:
            by_node.setdefault(node, []).append(rank)
    leader_of: dict[int, int] = {}
    for ranks in by_node.values():
        for first in range(0, len(ranks), MAX_GROUP):
            group = ranks[first : first + MAX_GROUP]
            if len(group) >= 2:
                leader_of.update(dict.fromkeys(group, group[0]))
    return leader_of


def plan_tensor(leader_of: Mapping[int, int], workers: int) -> npt.NDArray[np.float64]:
    """A plan as a reply carries it: each rank's leader, or -1 (it sends to the server)."""
    tensor = np.full(workers, DIRECT, np.float64)
    for rank, leader in leader_of.items():
        tensor[rank] = leader
    return tensor


def read_plan(tensor: npt.NDArray[Any], workers: int, peer: Any, expected: str) -> dict[int, int]:
    """The groups of a reply's plan tensor, checked: a leader leads itself and its
    followers have higher ranks."""
    if tensor.shape != (workers,) or not np.all(tensor == np.floor(tensor)):
        raise ProtocolError(expected, "a plan that is not one leader per rank", peer)
    leader_of = {rank: int(v) for rank, v in enumerate(tensor.tolist()) if v != DIRECT}
    for rank, leader in leader_of.items():
        if not 0 <= leader <= rank or leader_of.get(leader) != leader:
            raise ProtocolError(expected, f"a plan giving rank {rank} the leader {leader}", peer)
    return leader_of


def _zero_plus(gradient: Any, into: npt.NDArray[np.float32] | None) -> Any:
    """``0 + gradient`` in float32, into ``into`` where it fits (else a new array, or a
    dict of them): a group's sum starts as the server's does, so a group of ranks 0..
    sums bit for bit as one server would."""
    if isinstance(gradient, Mapping):
        return {name: _zero_plus(values, None) for name, values in gradient.items()}
    array = np.asarray(gradient)
    if into is None or into.shape != array.shape:
        into = np.empty(array.shape, np.float32)
    np.add(np.float32(0.0), array, out=into, casting="same_kind")
    return into


def add_set(total: dict[str, Any], got: dict[str, npt.NDArray[Any]]) -> None:
    for name, tensor in got.items():
        np.add(total[name], tensor.astype(np.float32, copy=False), out=total[name])


class Leader:
    """A worker's socket for the followers of its node, and their links by rank."""

    def __init__(self, settings: RaySettings, base_timeout: float) -> None:
        self._settings = settings
        self._base_timeout = base_timeout
        self._listener: LocalListener | None = None
        self._links: dict[int, Connection] = {}
        self._released: dict[Connection, asyncio.Event] = {}
        self._arrived = asyncio.Condition()
        # The last step's sum and scratch arrays, used again while the gradient's shape
        # stays (a fresh 256 MiB array costs its pages' first touch every step).
        self._total: npt.NDArray[np.float32] | None = None
        self._scratch: npt.NDArray[np.float32] | None = None

    @property
    def address(self) -> str | None:
        return None if self._listener is None else self._listener.address

    async def start(self) -> None:
        self._listener = await LocalListener.start(
            "gradstream-psw-", self._admit, self._settings, 64, None, who="followers"
        )

    async def _admit(self, conn: Connection) -> None:
        """A follower's link: its join, answered; it stays until replaced or closed."""
        peer = conn.peer.address
        body, extra = _control.split(await conn.recv_tensors(max_values=0), peer, _JOIN)
        if body["kind"] != "join" or extra:
            raise ProtocolError(_JOIN, f"a {body['kind']!r} message", peer)
        rank = _control.field(body, "rank", int, peer, _JOIN)
        await conn.send_tensors(_control.message("joined", rank=rank))
        released = self._released[conn] = asyncio.Event()
        async with self._arrived:
            old = self._links.get(rank)
            self._links[rank] = conn
            self._arrived.notify_all()
        if old is not None:
            await self._drop(old)
        await released.wait()

    async def _drop(self, conn: Connection) -> None:
        event = self._released.pop(conn, None)
        if event is not None:
            event.set()
        await conn.close()

    async def drop(self, rank: int, conn: Connection | None = None) -> None:
        """Close ``rank``'s link (``conn`` only, when given: a newer join of that rank
        stays): a follower that finds it closed sends on its own."""
        link = self._links.get(rank)
        if link is not None and (conn is None or link is conn):
            del self._links[rank]
            await self._drop(link)

    async def collect(
        self, step: int, followers: list[int], gradient: Any, skip: bool
    ) -> tuple[Any, list[int], int | None]:
        """``0 + own``, then each follower's gradient of ``step`` added in rank order:
        the sum, the ranks it holds, and the rank whose gradient failed halfway into it
        under ``"raise"`` (then the sum is spoiled and the step fails: the server is
        told so). Every follower's gradient must be in within one budget from here
        (``COLLECT_SHARE`` of the server's timeout); one left out has its link closed,
        and sends to the server."""
        until = time.monotonic() + COLLECT_SHARE * self._base_timeout
        total = await asyncio.to_thread(_zero_plus, gradient, self._total)
        scratch = None
        if not isinstance(total, dict):
            self._total = total
            if skip:
                # Under "skip" a follower's gradient is received into scratch first (as
                # the server does), so that one failing halfway leaves the sum as it was.
                if self._scratch is None or self._scratch.shape != total.shape:
                    self._scratch = np.full(total.shape, -0.0, np.float32)
                scratch = self._scratch
        held: list[int] = []
        for rank in followers:
            progress = TransferProgress()
            link: list[Connection] = []
            try:
                # The budget bounds the receive only: a gradient received (and so
                # acknowledged) is added whatever the time, never half.
                got = await asyncio.wait_for(
                    self._receive(rank, step, total, scratch, progress, link),
                    until - time.monotonic(),
                )
            except (GradientStreamError, OSError, TimeoutError) as exc:
                why = "it sent nothing in time" if isinstance(exc, TimeoutError) else str(exc)
                log.info("parameter server: follower %d left out of step %d: %s", rank, step, why)
                await self.drop(rank, link[0] if link else None)
                if scratch is not None:
                    await asyncio.to_thread(scratch.fill, -0.0)
                elif progress.chunks and not isinstance(total, dict):
                    return total, held, rank  # part of it is in the sum
                continue
            if isinstance(got, dict):
                await asyncio.to_thread(add_set, total, got)
            elif scratch is not None:
                await asyncio.to_thread(add_and_clear, total, scratch)
            held.append(rank)
        return total, held, None

    async def _receive(
        self,
        rank: int,
        step: int,
        total: Any,
        scratch: Any,
        progress: TransferProgress,
        link_out: list[Connection],
    ) -> Any:
        """Follower ``rank``'s gradient of ``step``: a set (returned), or an array added
        into ``scratch`` (under "skip") or straight into ``total``."""
        async with self._arrived:
            await self._arrived.wait_for(lambda: rank in self._links)
            link = self._links[rank]
        link_out.append(link)
        peer = link.peer.address
        body, extra = _control.split(await link.recv_tensors(max_values=0), peer, _GRADIENT)
        if body["kind"] != "grad" or extra:
            raise ProtocolError(_GRADIENT, f"a {body['kind']!r} message", peer)
        sent_for = _control.field(body, "step", int, peer, _GRADIENT)
        if sent_for != step:
            raise ProtocolError(_GRADIENT, f"a gradient of step {sent_for}", peer)
        if isinstance(total, dict):
            size = sum(int(a.size) for a in total.values())
            got = await link.recv_tensors(max_values=size)
            if list(got) != list(total) or any(got[n].shape != total[n].shape for n in total):
                raise ProtocolError(_GRADIENT, f"tensors {list(got)!r}", peer)
            return got
        await link.recv(reduce_into=total if scratch is None else scratch, progress=progress)
        return None

    async def forward(self, reply: dict[str, Any], held: list[int]) -> None:
        """The server's reply, as it came, to the followers it covers (at once, each
        within the server's timeout); a follower that does not take it asks the server
        (its link is closed)."""
        links = [(rank, link) for rank in held if (link := self._links.get(rank)) is not None]
        sent = await asyncio.gather(
            *(link.send_tensors(reply, deadline=self._base_timeout) for _, link in links),
            return_exceptions=True,
        )
        for (rank, link), outcome in zip(links, sent, strict=True):
            if isinstance(outcome, GradientStreamError | OSError):
                await self.drop(rank, link)
            elif isinstance(outcome, BaseException):
                raise outcome

    async def drop_all(self) -> None:
        for rank in list(self._links):
            await self.drop(rank)

    async def close(self) -> None:
        await self.drop_all()
        if self._listener is not None:
            await self._listener.close()


def add_and_clear(total: npt.NDArray[Any], scratch: npt.NDArray[Any]) -> None:
    np.add(total, scratch, out=total)
    scratch.fill(-0.0)


class Follower:
    """A worker's link to its group's leader (``"unix:PATH"``), kept between steps."""

    def __init__(self, rank: int, settings: RaySettings, base_timeout: float) -> None:
        self._rank = rank
        self._settings = settings
        self.base_timeout = base_timeout
        self._address: str | None = None
        self._link: Connection | None = None

    async def link(self, address: str) -> Connection | None:
        """The link to the leader at ``address`` (joined), or None where it cannot be
        made (the follower then sends to the server)."""
        if self._link is not None and not self._link.closed and self._address == address:
            return self._link
        await self.close()
        try:
            conn, _ = await connect_locally(address, self._settings)
        except StreamTimeoutError as exc:  # a leader that does not answer: the server
            log.info("parameter server: no link to leader %s: %s", address, exc)
            return None
        if conn is None:
            return None
        try:
            # A leader that does not answer in time is not waited for: the server is.
            answer = await asyncio.wait_for(self._join(conn), COLLECT_SHARE * self.base_timeout)
            body, _ = _control.split(answer, address, _JOINED)
            if body["kind"] != "joined":
                raise ProtocolError(_JOINED, f"a {body['kind']!r} message", address)
        except (GradientStreamError, OSError, TimeoutError) as exc:
            log.info("parameter server: no link to leader %s: %s", address, exc)
            await conn.close()
            return None
        self._address, self._link = address, conn
        return conn

    async def _join(self, conn: Connection) -> Any:
        await conn.send_tensors(_control.message("join", rank=self._rank))
        return await conn.recv_tensors(max_values=0)

    async def hand_over(self, link: Connection, step: int, gradient: Any) -> bool:
        """Send ``gradient`` of ``step`` to the leader: True once it acknowledged it (it
        holds it), False when it did not (the link is closed; the server must get it)."""
        try:
            # A leader that is not collecting (it gave up on this step) does not take the
            # message: after this long it is sent to the server instead.
            await link.send_tensors(
                _control.message("grad", step=step),
                deadline=COLLECT_SHARE * self.base_timeout,
            )
            if isinstance(gradient, Mapping):
                await link.send_tensors(gradient)
            else:
                await link.send(gradient)
        except (GradientStreamError, OSError) as exc:
            log.info("parameter server: leader did not take the gradient: %s", exc)
            await self.close()
            return False
        return True

    async def close(self) -> None:
        link, self._link = self._link, None
        if link is not None:
            with contextlib.suppress(GradientStreamError, OSError):
                await link.close()
