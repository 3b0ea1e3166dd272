"""A parameter server on Ray that sums its workers' gradients as they stream in.

The server is a Ray actor whose event-loop thread (``_loop``) owns a gradstream listener.
Each worker's ``ParameterClient`` opens one connection to it (through its Unix socket
when Ray places the worker on the server's node), says its rank, and then,
every step, sends its gradient (an array, or a named tensor set) and waits for the new
parameters on the same connection: sealed, CRC-checked and acknowledged both ways.

A step (``_Steps.run_step``) receives the workers' gradients one after another in rank
order, adding each into one float32 accumulator as its chunks arrive (``reduce_into``),
so the sum is ``((0 + g0) + g1) + g2`` bit for bit whatever the timing; the workers of
another node send one sum through their lowest rank, taken at its turn as one term
(``_ps_group``, docs/guides/ray.md "Workers of one node reduce there first"). Then it
calls the user's ``update(params, summed, count)`` and sends the result to every worker
that contributed (a group's leader passes it on). A worker whose gradient does not
arrive (its connection closes, or it sends nothing for ``timeout`` seconds, or
something that is not a gradient of the parameters' size) is lost: under
``on_worker_failure="raise"`` the step fails and every worker's ``push`` raises
``WorkerLostError``; under ``"skip"`` the step completes with the others and says who
was missing (``StepReport``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt
import ray

from .. import _connection
from .._address import peer_text
from .._connection import Connection
from .._dtypes import DTYPES
from ..errors import (
    GradientSizeError,
    GradientStreamError,
    ProtocolError,
    SettingError,
    WorkerLostError,
)
from . import _control, _loop, _same_node
from ._endpoint import node_host
from ._ps_group import add_and_clear, add_set, plan, plan_tensor
from ._same_node import LocalListener
from ._settings import RaySettings

log = logging.getLogger("gradstream.ray")

FAILURE_MODES = ("raise", "skip")
# The single-array parameters' name in a reply (a named set keeps its own names).
_ARRAY = "params"
# A reply's second tensor: the ranks missing from the step (float64, exact for any rank).
_MISSING = "gradstream.ray/missing"
# Its third: the next step's groups, each rank's leader or -1 (``_ps_group.plan``).
_PLAN = "gradstream.ray/plan"
# No parameter may take a name a reply uses for itself.
_RESERVED = "gradstream.ray"
_JOIN = "a join message"
_REPLY = "the new parameters"
_JOINED = "the answer to a join"
_PUSH = "a worker's gradient or bundle"
# take_turn reads another message (it answered a question first).
_AGAIN = object()
_CLOSED = "its connection closed before its gradient came (the worker died or left)"

Params = npt.NDArray[Any] | dict[str, npt.NDArray[Any]]


@dataclasses.dataclass(frozen=True)
class StepReport:
    """What one step of the server did: ``count`` workers' gradients were summed;
    ``missing`` holds the ranks whose gradient did not arrive (under ``"skip"``)."""

    step: int
    count: int
    missing: tuple[int, ...]


def _check_params(params: Any) -> Params:
    """The parameters as the server keeps them: one numpy array, or a dict of them (as
    given: ``_own`` copies what came from outside)."""
    if isinstance(params, np.ndarray | np.generic):
        return _float(np.asarray(params), "params")  # a numpy scalar (0-d arithmetic) as 0-d
    if isinstance(params, Mapping) and params:
        checked = {}
        for name, array in params.items():
            if not isinstance(name, str) or not name or name.startswith(_RESERVED):
                raise SettingError(
                    "params",
                    f"a parameter's name must be a non-empty str not starting with "
                    f"{_RESERVED!r}, got {name!r}",
                )
            if not isinstance(array, np.ndarray | np.generic):
                raise TypeError(f"params[{name!r}] must be a numpy array")
            checked[name] = _float(np.asarray(array), f"params[{name!r}]")
        return checked
    raise TypeError("params must be a numpy array or a non-empty dict of them")


def _float(array: npt.NDArray[Any], what: str) -> npt.NDArray[Any]:
    if array.dtype.name not in DTYPES:
        raise TypeError(f"{what} must be float32, float16, bfloat16 or float64, not {array.dtype}")
    return array


def _layout(params: Params) -> Any:
    """What a step's parameters must keep: names, shapes and dtypes."""
    if isinstance(params, dict):
        return {name: (a.shape, a.dtype.name) for name, a in params.items()}
    return (params.shape, params.dtype.name)


def _own(params: Params) -> Params:
    """A writeable copy of the server's own: what Ray hands an actor's constructor is a
    read-only view of its object store, which an update in place cannot write."""
    if isinstance(params, dict):
        return {name: np.array(array, copy=True) for name, array in params.items()}
    return np.array(params, copy=True)


def _zeros(params: Params) -> Params:
    if isinstance(params, dict):
        return {name: np.zeros(array.shape, np.float32) for name, array in params.items()}
    return np.zeros(params.shape, np.float32)


class _Lost(Exception):
    """Rank ``rank``'s gradient did not arrive this step; ``detail`` says why."""

    def __init__(self, rank: int, detail: str) -> None:
        super().__init__(detail)
        self.rank = rank
        self.detail = detail


class _Steps:
    """The server's state on its loop: the listener, the workers' connections by rank,
    and the steps."""

    def __init__(
        self,
        params: Params,
        update: Callable[[Any, Any, int], Any],
        workers: int,
        skip: bool,
        settings: RaySettings,
    ) -> None:
        self.params = params
        # Held while the update runs (on a thread of its own): ``params()`` copies the
        # parameters between steps, never halfway through an update in place.
        self.params_lock = threading.Lock()
        self.update = update
        self.layout = _layout(params)
        self.workers = workers
        self.skip = skip
        # Under "skip" an array's gradient is summed here first, so that one lost halfway
        # leaves the step's sum as it was. -0.0 + x is x for every float32 x (both zeros
        # included), so it holds exactly the gradient; it is set back after each use.
        self.scratch = (
            np.full(params.shape, -0.0, np.float32)
            if skip and isinstance(params, np.ndarray)
            else None
        )
        self.settings = settings
        self.reports: list[StepReport] = []
        # What stopped the server: a lost worker under "raise", every worker lost, or
        # an exception of the user's update (the workers' push raises it).
        self.failure: Exception | None = None
        self.members: dict[int, Connection] = {}
        # Each member's Ray node and the Unix socket it listens on for its node's
        # followers (either None), as its join said.
        self.placement: dict[int, tuple[str | None, str | None]] = {}
        # This step's groups (each grouped rank's leader), sent in the last reply.
        self.plan: dict[int, int] = {}
        self.node: str | None = None
        # Why each rank that is not a member now was lost.
        self.lost: dict[int, str] = {}
        self.joined = asyncio.Condition()
        # Set to end a connection's handler (the server then closes it).
        self.released: dict[Connection, asyncio.Event] = {}
        self.server: Any = None
        # The Unix socket for workers of this node (None: none).
        self.local: LocalListener | None = None
        self.task: asyncio.Task[None] | None = None

    async def start(self, host: str, node: str | None) -> tuple[str, int]:
        self.node = node
        # A join is an empty tensor and a gradient holds the parameters' values: a peer
        # that sends more is refused before its values move. Every worker keeps its
        # connection, and a restarted one opens another before the old one is noticed.
        keywords = self.settings.link_keywords(max_values=_size(self.params))
        self.server = await _connection.serve(
            (host, 0), self.admit, max_connections=2 * self.workers + 64, **keywords
        )
        # Workers of this node join through a Unix socket (shared memory).
        self.local = await LocalListener.start(
            "gradstream-ps-",
            self.admit,
            self.settings,
            2 * self.workers + 64,
            max_values=_size(self.params),
            who="workers",
        )
        self.task = asyncio.create_task(self.run())
        address: tuple[str, int] = self.server.address
        return address

    async def admit(self, conn: Connection) -> None:
        """A worker's connection: its join, answered; then it stays until released."""
        peer = conn.peer.address
        body, extra = _control.split(await conn.recv_tensors(), peer, _JOIN)
        if body["kind"] != "join":
            raise ProtocolError(_JOIN, f"a {body['kind']!r} message", peer)
        if extra:
            raise ProtocolError(_JOIN, "a join carrying tensors", peer)
        rank = _control.field(body, "rank", int, peer, _JOIN)
        where = _placement(body, peer)
        refusal = None
        if not 0 <= rank < self.workers:
            refusal = f"this server has {self.workers} workers, ranks 0 to {self.workers - 1}"
        elif self.failure is not None:
            refusal = f"the server stopped: {self.failure}"
        if refusal is not None:
            await conn.send_tensors(_control.message("refused", rank=rank, detail=refusal))
            return
        await conn.send_tensors(_control.message("joined", rank=rank, skip=self.skip))
        released = self.released[conn] = asyncio.Event()
        async with self.joined:
            if self.failure is not None:  # it failed while this join was answered
                await self.drop(conn)
                return
            old = self.members.get(rank)
            self.members[rank] = conn  # the latest join wins: a restarted worker's
            self.placement[rank] = where
            self.lost.pop(rank, None)
            self.joined.notify_all()
        if old is not None:
            await self.drop(old)
        log.info("parameter server: worker %d joined from %s", rank, peer_text(peer))
        await released.wait()

    async def member(self, rank: int) -> Connection:
        """Rank ``rank``'s connection, waiting up to ``timeout`` for it to join."""
        async with self.joined:
            try:
                await asyncio.wait_for(
                    self.joined.wait_for(lambda: rank in self.members),
                    self.settings.timeout,
                )
            except TimeoutError:
                before = self.lost.get(rank)
                was = f"{before}, and it " if before else "it "
                raise _Lost(
                    rank, f"{was}did not connect within {self.settings.timeout:g} s"
                ) from None
            return self.members[rank]

    async def drop(self, conn: Connection) -> None:
        event = self.released.pop(conn, None)
        if event is not None:
            event.set()  # its handler returns
        await conn.close()

    async def release_all(self) -> None:
        members, self.members = list(self.members.values()), {}
        for conn in members:
            await self.drop(conn)

    async def lose(self, rank: int, conn: Connection, why: str) -> None:
        """``conn`` failed rank ``rank``: closed, and the rank lost unless a newer
        connection of it joined meanwhile."""
        if self.members.get(rank) is conn:
            del self.members[rank]
            self.lost[rank] = why
        await self.drop(conn)

    async def run(self) -> None:
        # Step 0's clock (each rank's ``timeout``) starts with the first join, not with
        # the server: Ray may place the workers long after it.
        async with self.joined:
            await self.joined.wait_for(lambda: bool(self.members))
        step = 0
        while True:
            try:
                await self.run_step(step)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not isinstance(exc, WorkerLostError):
                    # Ray carries the exception to the workers by pickle, which drops
                    # its traceback; a note survives.
                    exc.add_note("".join(traceback.format_exception(exc)).rstrip())
                log.error("parameter server stopped at step %d: %s", step, exc, exc_info=exc)
                async with self.joined:  # no join slips in between
                    self.failure = exc
                    await self.release_all()
                return
            step += 1

    async def run_step(self, step: int) -> None:
        acc = _zeros(self.params)
        # Who gets the reply on its connection: the workers that sent to the server, the
        # leaders (for their groups), and followers whose gradient was lost with their
        # leader (they asked).
        taken: list[tuple[int, Connection]] = []
        covered: set[int] = set()  # ranks whose gradient came in a leader's bundle
        summed = 0
        missing: list[int] = []
        for rank in range(self.workers):
            if rank in covered:
                continue
            if self.skip and rank in self.lost:
                missing.append(rank)  # until it joins again
                continue
            try:
                conn = await self.member(rank)
                try:
                    held = await self.take_turn(step, rank, conn, acc)
                except _Lost as lost:
                    # Under "raise", run() records the failure before it closes any
                    # connection: a worker that finds its connection closed asks the
                    # server why, and must find the answer there.
                    if self.skip:
                        await self.lose(rank, conn, lost.detail)
                    raise
            except _Lost as lost:
                if not self.skip:
                    raise WorkerLostError(step, (lost.rank,), lost.detail) from None
                self.lost.setdefault(rank, lost.detail)  # one that never joined, too
                log.warning(
                    "parameter server: step %d goes on without worker %d: %s",
                    step,
                    rank,
                    lost.detail,
                )
                missing.append(rank)
                continue
            taken.append((rank, conn))
            if held is None:  # its gradient went down with its leader
                log.warning(
                    "parameter server: step %d goes on without worker %d: its gradient "
                    "went to its node's leader, which was lost",
                    step,
                    rank,
                )
                missing.append(rank)
                continue
            covered.update(held)
            summed += 1 + len(held)
        report = StepReport(step, summed, tuple(missing))
        if not summed:
            raise WorkerLostError(step, tuple(missing), "every worker is lost")
        self.params = await asyncio.to_thread(self.updated, acc, summed)
        self.reports.append(report)
        upcoming = plan(
            {rank: self.placement.get(rank, (None, None)) for rank in self.members}, self.node
        )
        reply = params_reply(report, self.params, plan_tensor(upcoming, self.workers))
        # To every worker at once, on the connection its gradient came on (a rank that
        # joined again meanwhile sends its next gradient on the new one): each send waits
        # for its worker's ack, and one after another they would add those waits up.
        sent = await asyncio.gather(
            *(conn.send_tensors(reply) for _, conn in taken), return_exceptions=True
        )
        for (rank, conn), outcome in zip(taken, sent, strict=True):
            if isinstance(outcome, GradientStreamError | OSError):
                # It contributed, but did not get this step's parameters: lost from the
                # next step on ("raise" fails that step unless it joins again in time).
                why = f"it did not take step {step}'s parameters: {outcome}"
                log.warning("parameter server: worker %d: %s", rank, why)
                await self.lose(rank, conn, why)
            elif isinstance(outcome, BaseException):
                raise outcome
        self.plan = upcoming

    async def take_turn(
        self, step: int, rank: int, conn: Connection, acc: Params
    ) -> list[int] | None:
        """Rank ``rank``'s turn: its gradient added into ``acc``, or its group's sum
        (then the followers it holds); None when it says its gradient went to a leader
        that was lost. A follower asking for the last step's reply gets it first."""
        # At most one question (an orphan's) and one leader's notice before its gradient
        # or sum: a peer repeating either is lost, not answered for ever.
        seen: set[str] = set()
        while True:
            body = await self.header(rank, conn)
            if body["kind"] in seen:
                raise _Lost(rank, f"it sent a second {body['kind']!r} message in its turn")
            seen.add(body["kind"])
            try:
                held = await self.answer(step, rank, conn, acc, body)
            except ProtocolError as exc:  # a field of the wrong type
                raise _Lost(rank, str(exc)) from exc
            if held is not _AGAIN:
                return held  # type: ignore[no-any-return]

    async def answer(
        self, step: int, rank: int, conn: Connection, acc: Params, body: dict[str, Any]
    ) -> Any:
        """What ``take_turn`` does with one message of rank ``rank``: ``_AGAIN`` when
        another follows (it answered a follower's question)."""
        kind = body["kind"]
        peer = conn.peer.address
        if kind == "grad":
            await self.take(rank, conn, acc)
            return []
        if kind == "leading":
            # A leader began its step: its sum comes after its followers' gradients,
            # within another ``timeout`` (it collects them within half of one).
            if (
                _control.field(body, "step", int, peer, _PUSH) != step
                or self.plan.get(rank) != rank
            ):
                raise _Lost(rank, f"it said it leads a group in step {body['step']}; it does not")
            return _AGAIN
        if kind == "bundle":
            held = self.bundled(step, rank, body, peer)
            await self.take(rank, conn, acc)
            return held
        if kind == "spoiled" and not self.skip:
            # Under "raise" a leader adds its followers' gradients straight into its sum:
            # one that failed halfway fails the step, named.
            follower = self.follower(step, rank, body, peer)
            raise _Lost(
                follower,
                f"its gradient failed on its way into its node's sum (leader: worker {rank})",
            )
        if kind == "orphan":
            was = _control.field(body, "step", int, peer, _PUSH)
            if was == step:
                if not self.skip:
                    raise _Lost(rank, "its gradient went to its node's leader, which was lost")
                return None
            last = self.reports[-1] if self.reports else None
            if last is not None and was == last.step:
                await self.answer_orphan(rank, conn, last)
                return _AGAIN
        raise _Lost(rank, f"it sent a {kind!r} message where its gradient was due")

    async def answer_orphan(self, rank: int, conn: Connection, last: StepReport) -> None:
        """Its leader held its gradient of step ``last`` but did not pass the reply on:
        the reply now (the parameters have not changed since: this step's update comes
        after every turn), and this step it sends to the server itself (a leader stays
        one: its followers count on it)."""
        alone = {r: leader for r, leader in self.plan.items() if r != rank}
        if self.plan.get(rank) == rank:
            alone[rank] = rank
        reply = params_reply(last, self.params, plan_tensor(alone, self.workers))
        try:
            await conn.send_tensors(reply)
        except (GradientStreamError, OSError) as exc:
            raise _Lost(rank, f"it did not take step {last.step}'s parameters: {exc}") from exc

    async def header(self, rank: int, conn: Connection) -> dict[str, Any]:
        """The message that leads a worker's push: what it sends (``grad``, ``bundle``)
        or asks (``orphan``)."""
        try:
            got = await conn.recv_tensors(max_values=0)
            if not got:
                raise _Lost(rank, _CLOSED)
            body, extra = _control.split(got, conn.peer.address, _PUSH)
        except (GradientStreamError, OSError) as exc:
            closed = " (its connection closed)" if conn.closed else ""
            raise _Lost(rank, f"{type(exc).__name__}: {exc}{closed}") from exc
        if extra:
            raise _Lost(rank, "it sent a message carrying tensors where its gradient was due")
        return body

    def bundled(self, step: int, rank: int, body: dict[str, Any], peer: Any) -> list[int]:
        """The followers a leader's bundle holds: some of those the plan gave it."""
        sent_for = _control.field(body, "step", int, peer, _PUSH)
        ranks = given = body.get("ranks")
        planned = [r for r, leader in sorted(self.plan.items()) if leader == rank and r != rank]
        ints = isinstance(ranks, list) and all(
            isinstance(r, int) and not isinstance(r, bool) for r in ranks
        )
        if sent_for != step or not isinstance(ranks, list) or not ints:
            ranks = None
        if ranks is None or ranks != sorted(set(ranks) & set(planned)):
            raise _Lost(
                rank,
                f"it sent a bundle of ranks {str(given)[:80]} for step {sent_for}; "
                f"in step {step} it leads {planned}",
            )
        return list(ranks)

    def follower(self, step: int, rank: int, body: dict[str, Any], peer: Any) -> int:
        """The follower a leader's ``spoiled`` message names (one the plan gave it)."""
        sent_for = _control.field(body, "step", int, peer, _PUSH)
        follower: int = _control.field(body, "rank", int, peer, _PUSH)
        if sent_for != step or follower == rank or self.plan.get(follower) != rank:
            raise _Lost(rank, f"it named worker {follower} of step {sent_for} spoiled")
        return follower

    def updated(self, summed: Params, count: int) -> Params:
        """The user's update (on a thread: it may take long, and the loop serves the
        connections meanwhile)."""
        with self.params_lock:
            new = _check_params(self.update(self.params, summed, count))
        if _layout(new) != self.layout:
            raise TypeError(
                f"update returned parameters of {_layout(new)}; they were {self.layout} "
                "(names, shapes and dtypes must stay: the workers' gradients are sized by them)"
            )
        return new

    def snapshot(self) -> Params:
        """A copy of the parameters, between two updates."""
        with self.params_lock:
            return _own(self.params)

    async def take(self, rank: int, conn: Connection, acc: Params) -> None:
        """Add rank ``rank``'s gradient into ``acc`` (through the scratch sum under
        "skip"; a set is received whole before it is added)."""
        scratch = self.scratch
        try:
            if isinstance(acc, dict):
                await self.take_set(rank, conn, acc)
                return
            await conn.recv(reduce_into=acc if scratch is None else scratch)
            if scratch is not None:
                await asyncio.to_thread(add_and_clear, acc, scratch)
        except (GradientStreamError, OSError) as exc:
            if scratch is not None:
                await asyncio.to_thread(scratch.fill, -0.0)
            if conn.closed and isinstance(exc, GradientSizeError) and exc.received == 0:
                # What a receive gives when the peer closed between gradients.
                raise _Lost(rank, _CLOSED) from exc
            closed = " (its connection closed)" if conn.closed else ""
            raise _Lost(rank, f"{type(exc).__name__}: {exc}{closed}") from exc

    async def take_set(self, rank: int, conn: Connection, acc: dict[str, Any]) -> None:
        got = await conn.recv_tensors()
        if not got:
            raise _Lost(rank, _CLOSED)
        if list(got) != list(acc) or any(got[n].shape != acc[n].shape for n in acc):
            wanted = {n: list(a.shape) for n, a in acc.items()}
            sent = {n: list(t.shape) for n, t in got.items()}
            raise _Lost(rank, f"it sent tensors {sent}; the parameters are {wanted}")
        await asyncio.to_thread(add_set, acc, got)

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        await self.release_all()
        if self.server is not None:
            await self.server.close()
        if self.local is not None:
            await self.local.close()


def params_reply(
    report: StepReport, params: Params, groups: npt.NDArray[np.float64]
) -> dict[str, Any]:
    """A step's reply to its workers: the message (step, count, whether the parameters
    are one array), the missing ranks, the next step's groups, then the parameters
    (``ParameterClient._read_reply`` reads it). The same bytes for every worker: a
    leader passes it on as it came."""
    array = not isinstance(params, dict)
    reply = _control.message("params", step=report.step, count=report.count, array=array)
    reply[_MISSING] = np.array(report.missing, np.float64)
    reply[_PLAN] = groups
    if isinstance(params, dict):
        reply.update(params)
    else:
        reply[_ARRAY] = params
    return reply


def _placement(body: dict[str, Any], peer: Any) -> tuple[str | None, str | None]:
    """A join's Ray node and Unix socket for followers (either may be absent)."""
    node, local = body.get("node"), body.get("local")
    if node is not None and (not isinstance(node, str) or not 0 < len(node) <= 128):
        raise ProtocolError(_JOIN, f"a join whose node is {str(node)[:80]!r}", peer)
    if local is not None and not (
        isinstance(local, str) and local.startswith("unix:") and len(local) <= 256
    ):
        raise ProtocolError(_JOIN, f"a join whose socket is {str(local)[:80]!r}", peer)
    return node, local


def _size(gradient: Any) -> int:
    """How many values a gradient holds: the parameters' own, or one as given to
    ``push`` (an array-like, or a mapping of them)."""
    if isinstance(gradient, Mapping):
        return sum(int(np.size(values)) for values in gradient.values())
    return int(np.size(gradient))


class _ParameterServer:
    """The actor (``ParameterServer = ray.remote(_ParameterServer)``)."""

    def __init__(
        self,
        params: Any,
        update: Callable[[Any, Any, int], Any],
        *,
        workers: int,
        on_worker_failure: str = "raise",
        **settings: Any,
    ) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise SettingError("workers", f"workers must be an int of at least 1, got {workers!r}")
        if on_worker_failure not in FAILURE_MODES:
            raise SettingError(
                "on_worker_failure",
                f"on_worker_failure must be 'raise' or 'skip', got {on_worker_failure!r}",
            )
        if not callable(update):
            raise TypeError("update must be callable: update(params, summed, count)")
        # The keywords of gradstream.ray.register: tls, authkey, timeout, ... Without
        # an authkey, one of its own, which its workers get through Ray (contact()).
        self._settings = RaySettings.checked(**settings).with_key()
        self._steps = _Steps(
            _own(_check_params(params)),
            update,
            workers,
            on_worker_failure == "skip",
            self._settings,
        )
        self._address = _loop.call(
            self._steps.start(self._settings.host or node_host(), _same_node.node_id())
        )

    def contact(self) -> tuple[tuple[str, int], RaySettings]:
        """Where workers connect, and how (for ``ParameterClient``): the server's settings,
        with a ``timeout`` and a ``deadline`` that cover the other ranks' turns, for a
        worker's send may stand still that long while the server takes the gradients
        before it (each rank before it may be silent for ``timeout`` before it is lost)."""
        workers = self._steps.workers
        own = self._settings
        waits = dataclasses.replace(
            own, timeout=own.timeout * (workers + 1), deadline=own.deadline + own.timeout * workers
        )
        return self._address, waits

    def same_node(self) -> tuple[str, str] | None:
        """The server's Ray node id and Unix socket (``"unix:PATH"``), for workers of
        that node; None when it has none."""
        local = self._steps.local
        return None if local is None else (_same_node.node_id(), local.address)

    def leader_address(self, rank: int) -> str | None:
        """The Unix socket rank ``rank`` (a leader of its node's workers) listens on."""
        return self.placement_of(rank)[1]

    def placement_of(self, rank: int) -> tuple[str | None, str | None]:
        """Rank ``rank``'s Ray node and Unix socket, as its last join said."""
        return self._steps.placement.get(rank, (None, None))

    def workers(self) -> int:
        """How many workers the server sums (a ``ParameterClient`` bounds the server's
        replies with it)."""
        return self._steps.workers

    def params(self) -> Params:
        """A copy of the current parameters (never halfway through an update)."""
        return self._steps.snapshot()

    def reports(self) -> list[StepReport]:
        """One report for each step done so far."""
        return list(self._steps.reports)

    def leader_passed(self, step: int, leader: int) -> tuple[Exception | None, bool]:
        """For a follower waiting on rank ``leader`` for step ``step``'s reply: why the
        server stopped (or None), and whether it has done that step or lost the leader
        (then the follower asks the server)."""
        steps = self._steps
        return steps.failure, len(steps.reports) > step or leader in steps.lost

    def failure(self) -> Exception | None:
        """Why the server stopped (a ``WorkerLostError``, or the exception the update
        raised), or None while it runs."""
        return self._steps.failure

    def close(self) -> None:
        """Stop listening and close every worker's connection."""
        _loop.call(self._steps.close())


ParameterServer = ray.remote(_ParameterServer)
