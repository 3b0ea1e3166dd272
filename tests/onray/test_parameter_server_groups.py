"""The parameter server's workers of one node reduce there first (docs/guides/ray.md,
"Workers of one node"). Workers here take themselves for workers of other Ray nodes
(``NodeWorker``): the groups, the sum's order bit for bit, and what a leader's death
does to its followers under "raise" and "skip" (a gradient is never counted twice nor
silently dropped)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import ray
from ray.exceptions import RayError

import gradstream as gs
import gradstream.ray as gsray
from gradstream.ray._ps_group import MAX_GROUP, plan, plan_tensor, read_plan
from support.rayactors import (
    NodeWorker,
    Worker,
    gradient,
    grouped_sum,
    outcomes,
    update,
    wait_until,
)

SEED = 23
SHAPE = (20_000,)


def start(params: Any, workers: int, mode: str = "raise", **keywords: Any) -> Any:
    return gsray.ParameterServer.options(num_cpus=0).remote(
        params, update, workers=workers, on_worker_failure=mode, **keywords
    )


def grads(step: int, ranks: list[int]) -> dict[int, Any]:
    return {rank: gradient(SEED, step, rank, SHAPE) for rank in ranks}


def test_plan_groups_each_other_node_by_lowest_rank() -> None:
    members = {
        0: ("server", "unix:/a"),  # the server's node: never grouped
        1: ("B", "unix:/b1"),
        2: ("C", "unix:/c2"),  # alone on its node
        3: ("B", None),  # no socket: sends to the server itself
        4: ("B", "unix:/b4"),
        5: ("D", "unix:/d5"),
        6: ("D", "unix:/d6"),
        7: (None, None),
    }
    assert plan(members, "server") == {1: 1, 4: 1, 5: 5, 6: 5}
    crowd = {rank: ("B", f"unix:/{rank}") for rank in range(MAX_GROUP + 2)}
    leaders = plan(crowd, "server")
    assert {leaders[r] for r in crowd} == {0, MAX_GROUP}  # two groups, the second of 2


def test_a_reply_plan_that_is_not_one_leader_per_rank_is_refused() -> None:
    good = plan_tensor({1: 1, 3: 1}, 4)
    assert read_plan(good, 4, "peer", "a reply") == {1: 1, 3: 1}
    for bad in (
        np.array([0.0, 1.0, -1.0]),  # too short
        np.array([-1.0, 2.0, 2.0, -1.0]),  # rank 1 led by a higher rank
        np.array([-1.0, 1.0, 3.0, -1.0]),  # a leader that does not lead itself
        np.array([-1.0, 0.5, -1.0, -1.0]),
    ):
        with pytest.raises(gs.ProtocolError):
            read_plan(bad, 4, "peer", "a reply")


def test_workers_of_a_node_send_one_sum_and_it_adds_in_the_documented_order(
    cluster: str,
) -> None:
    """Ranks 1, 3, 4 on node B and 2, 5 on node C (0 on the server's): from step 1 each
    node's group sends one sum, and the server's sum is
    ((0 + g0) + (((0 + g1) + g3) + g4)) + ((0 + g2) + g5) bit for bit."""
    params = np.random.default_rng(1).standard_normal(SHAPE, dtype=np.float32)
    ps = start(params, 6)
    nodes = {1: "B", 3: "B", 4: "B", 2: "C", 5: "C"}
    workers = [
        Worker.remote(ps, 0, SEED),
        *(NodeWorker.remote(ps, rank, SEED, nodes[rank]) for rank in range(1, 6)),
    ]
    try:
        want = params
        for step in range(3):
            got = ray.get([w.step.remote(step, SHAPE) for w in reversed(workers)])
            g = grads(step, list(range(6)))
            order: list[Any] = list(range(6)) if step == 0 else [0, [1, 3, 4], [2, 5]]
            summed = grouped_sum(g, order)
            if step:
                # The grouped order is not the flat one for these values: the test
                # tells which one the server took.
                assert summed.tobytes() != grouped_sum(g, list(range(6))).tobytes()
            want = update(want, summed, 6)
            for params_got, report in got:
                assert params_got.tobytes() == want.tobytes()
                assert report == gsray.StepReport(step=step, count=6, missing=())
        roles = ray.get([w.role.remote() for w in workers[1:]])
        assert roles == [([3, 4], False), ([5], False), ([], True), ([], True), ([], True)]
    finally:
        for actor in [*workers, ps]:
            ray.kill(actor)


def _group_of_three(mode: str, stall: str = "") -> tuple[Any, list[Any], Any]:
    """Rank 0 on the server's node, ranks 1 (the leader, stalling at ``stall``), 2, 3
    on node B; one clean step (direct) and one grouped."""
    params = np.random.default_rng(2).standard_normal(SHAPE, dtype=np.float32)
    ps = start(params, 4, mode, timeout=8)
    workers = [
        Worker.remote(ps, 0, SEED),
        NodeWorker.remote(ps, 1, SEED, "B", stall),
        NodeWorker.remote(ps, 2, SEED, "B"),
        NodeWorker.remote(ps, 3, SEED, "B"),
    ]
    want = params
    for step in range(2):
        ray.get([w.step.remote(step, SHAPE) for w in workers])
        order: list[Any] = [0, 1, 2, 3] if step == 0 else [0, [1, 2, 3]]
        want = update(want, grouped_sum(grads(step, [0, 1, 2, 3]), order), 4)
    assert ray.get([w.role.remote() for w in workers[1:]]) == [
        ([2, 3], False),
        ([], True),
        ([], True),
    ]
    ray.get(workers[1].arm.remote())
    return ps, workers, want


def _all_failed_for_want_of(got: list[Any], missing: tuple[int, ...]) -> None:
    for outcome in got:
        assert isinstance(outcome, RayError)
        assert isinstance(outcome.cause, gs.WorkerLostError), outcome
        assert outcome.cause.missing == missing


@pytest.mark.parametrize("mode", ["raise", "skip"])
def test_a_leader_killed_before_its_step_its_followers_send_to_the_server(
    cluster: str, mode: str
) -> None:
    ps, workers, before = _group_of_three(mode)
    try:
        ray.kill(workers[1])
        got = outcomes([workers[r].step.remote(2, SHAPE) for r in (0, 2, 3)])
        if mode == "raise":
            _all_failed_for_want_of(got, (1,))
            return
        want = update(before, grouped_sum(grads(2, [0, 2, 3]), [0, 2, 3]), 3)
        for params_got, report in got:
            assert params_got.tobytes() == want.tobytes()
            assert report == gsray.StepReport(step=2, count=3, missing=(1,))
        # The next step groups the two that are left, led by rank 2.
        got = outcomes([workers[r].step.remote(3, SHAPE) for r in (0, 2, 3)])
        nxt = update(want, grouped_sum(grads(3, [0, 2, 3]), [0, [2, 3]]), 3)
        assert all(params_got.tobytes() == nxt.tobytes() for params_got, _ in got)
        assert ray.get([workers[r].role.remote() for r in (2, 3)]) == [([3], False), ([], True)]
    finally:
        for actor in [*workers, ps]:
            ray.kill(actor)


@pytest.mark.parametrize("mode", ["raise", "skip"])
def test_a_leader_killed_holding_its_followers_gradients(cluster: str, mode: str) -> None:
    """Under "skip" the step goes on without the group (its followers' gradients went
    down with the leader, and the report says they were missing); under "raise" it
    fails for everyone."""
    ps, workers, before = _group_of_three(mode, stall="collect")
    try:
        refs = [w.step.remote(2, SHAPE) for w in workers]
        assert wait_until(lambda: ray.get(workers[1].is_stalled.remote(), timeout=5), 20)
        ray.kill(workers[1])
        got = outcomes([refs[0], refs[2], refs[3]])
        if mode == "raise":
            _all_failed_for_want_of(got, (1,))
            return
        want = update(before, grouped_sum(grads(2, [0]), [0]), 1)
        for params_got, report in got:
            assert params_got.tobytes() == want.tobytes()
            assert report == gsray.StepReport(step=2, count=1, missing=(1, 2, 3))
    finally:
        for actor in [*workers, ps]:
            ray.kill(actor)


@pytest.mark.parametrize("kill", [True, False], ids=["killed", "hung"])
def test_a_leader_lost_before_passing_the_reply_on_counts_its_group_once(
    cluster: str, kill: bool
) -> None:
    """The server took the group's sum and replied to the leader, which died (or hangs)
    before passing the reply on: the followers get step 2's reply from the server (their
    gradients counted once), and send step 3's themselves."""
    ps, workers, before = _group_of_three("skip", stall="forward")
    try:
        refs = [w.step.remote(2, SHAPE) for w in workers]
        assert wait_until(lambda: ray.get(workers[1].is_stalled.remote(), timeout=5), 20)
        if kill:
            ray.kill(workers[1])
        want = update(before, grouped_sum(grads(2, [0, 1, 2, 3]), [0, [1, 2, 3]]), 4)
        params_got, report = ray.get(refs[0], timeout=60)
        assert params_got.tobytes() == want.tobytes()
        # Rank 0's next push lets the server reach the followers' turns of step 3 (a
        # NodeWorker runs calls side by side: theirs wait for their step 2).
        nxt = [workers[0].step.remote(3, SHAPE)]
        for rank in (2, 3):  # as a training loop would: each pushes once it has step 2's
            params_got, report = ray.get(refs[rank], timeout=60)
            assert params_got.tobytes() == want.tobytes()
            assert report == gsray.StepReport(step=2, count=4, missing=())
            nxt.append(workers[rank].step.remote(3, SHAPE))
        third = update(want, grouped_sum(grads(3, [0, 2, 3]), [0, 2, 3]), 3)
        for params_got, report in outcomes(nxt):
            assert params_got.tobytes() == third.tobytes()
            assert report == gsray.StepReport(step=3, count=3, missing=(1,))
    finally:
        for actor in [*workers, ps]:
            ray.kill(actor)


def test_a_follower_killed_before_its_step_is_lost_as_any_worker(cluster: str) -> None:
    ps, workers, before = _group_of_three("skip")
    try:
        ray.kill(workers[3])
        started = time.monotonic()
        got = outcomes([workers[r].step.remote(2, SHAPE) for r in (0, 1, 2)])
        want = update(before, grouped_sum(grads(2, [0, 1, 2]), [0, [1, 2]]), 3)
        for params_got, report in got:
            assert params_got.tobytes() == want.tobytes()
            assert report == gsray.StepReport(step=2, count=3, missing=(3,))
        assert time.monotonic() - started < 30
    finally:
        for actor in [*workers, ps]:
            ray.kill(actor)


@pytest.mark.parametrize(
    "message",
    [
        {"kind": "bundle", "step": 0, "ranks": [1]},  # a group the server never made
        {"kind": "bundle", "step": 0, "ranks": "1"},
        {"kind": "spoiled", "step": 0, "rank": 1},  # blaming an honest worker
        {"kind": "orphan", "step": 99},
        {"kind": "orphan", "step": True},
        {"kind": "params", "step": 0},
        {"kind": "leading", "step": 0},  # the rogue leads no group (alone on its node)
    ],
    ids=[
        "foreign-bundle",
        "ranks-not-a-list",
        "blame",
        "orphan-of-no-step",
        "bool-step",
        "kind",
        "leading-no-group",
    ],
)
@pytest.mark.parametrize("mode", ["raise", "skip"])
def test_a_worker_that_sends_a_false_group_message_is_lost_itself(
    cluster: str, mode: str, message: dict[str, Any]
) -> None:
    """Rank 0 is a peer with the job's key that sends ``message`` in its turn: it is the
    one lost (never rank 1, whose gradient is taken as usual)."""
    import asyncio

    from gradstream.ray import _control

    ps = start(np.zeros(SHAPE, np.float32), 2, mode, timeout=8)
    address, settings = ray.get(ps.contact.remote())

    async def rogue() -> None:
        conn = await gs.connect(tuple(address), authkey=settings.authkey)
        async with conn:
            join = _control.message("join", rank=0, node="X", local="unix:/nowhere")
            await conn.send_tensors(join)
            await conn.recv_tensors()
            kind = message["kind"]
            fields = {k: v for k, v in message.items() if k != "kind"}
            await conn.send_tensors(_control.message(kind, **fields))
            await conn.recv_tensors()  # until the server closes it

    honest = NodeWorker.remote(ps, 1, SEED, "B")
    try:
        ray.get(honest.role.remote())  # joined: its turn comes after the rogue's
        asyncio.run(rogue())
        outcome = outcomes([honest.step.remote(0, SHAPE)])[0]
        if mode == "raise":
            assert isinstance(outcome, RayError)
            assert isinstance(outcome.cause, gs.WorkerLostError), outcome
            assert outcome.cause.missing == (0,)
            if message["kind"] == "leading":  # lost for what it said, not for a timeout
                assert "it said it leads a group in step 0; it does not" in str(outcome.cause)
        else:
            params_got, report = outcome
            want = update(np.zeros(SHAPE, np.float32), grouped_sum(grads(0, [1]), [1]), 1)
            assert params_got.tobytes() == want.tobytes()
            assert report == gsray.StepReport(step=0, count=1, missing=(0,))
    finally:
        ray.kill(honest)
        ray.kill(ps)


def test_a_join_with_a_false_node_or_socket_is_refused(cluster: str) -> None:
    import asyncio

    from gradstream.ray import _control

    ps = start(np.zeros(4, np.float32), 1)
    address, settings = ray.get(ps.contact.remote())

    async def join(**fields: Any) -> dict[str, Any]:
        conn = await gs.connect(tuple(address), authkey=settings.authkey)
        async with conn:
            await conn.send_tensors(_control.message("join", rank=0, **fields))
            got: dict[str, Any] = await conn.recv_tensors()
            return got

    try:
        for fields in ({"node": "n" * 129}, {"node": 7}, {"local": "/tmp/x.sock"}):
            assert asyncio.run(join(**fields)) == {}, fields  # closed without an answer
        assert ray.get(ps.placement_of.remote(0)) == (None, None)
        answer = asyncio.run(join(node="B", local="unix:/tmp/x.sock"))
        body, _ = _control.split(answer, tuple(address), "an answer")
        assert body == {"kind": "joined", "rank": 0, "skip": False}
        # The server records the join after answering it: wait for it to, a while.
        deadline = time.monotonic() + 10
        while (placed := ray.get(ps.placement_of.remote(0))) == (None, None):
            assert time.monotonic() < deadline, "the join was never recorded"
            time.sleep(0.01)
        assert placed == ("B", "unix:/tmp/x.sock")
    finally:
        ray.kill(ps)


def test_a_group_of_tensor_sets_sums_each_tensor_in_the_groups_order(cluster: str) -> None:
    shapes = {"w": (40, 50), "b": (50,)}
    rng = np.random.default_rng(4)
    params = {n: rng.standard_normal(s, dtype=np.float32) for n, s in shapes.items()}
    ps = start(params, 3)
    workers = [Worker.remote(ps, 0, SEED), *(NodeWorker.remote(ps, r, SEED, "B") for r in (1, 2))]
    try:
        want = params
        for step in range(3):
            got = ray.get([w.step.remote(step, shapes) for w in workers])
            g = {rank: gradient(SEED, step, rank, shapes) for rank in range(3)}
            summed = grouped_sum(g, [0, 1, 2] if step == 0 else [0, [1, 2]])
            want = update(want, summed, 3)
            for params_got, _ in got:
                assert {n: a.tobytes() for n, a in params_got.items()} == {
                    n: a.tobytes() for n, a in want.items()
                }
        assert ray.get(workers[1].role.remote()) == ([2], False)
    finally:
        for actor in [*workers, ps]:
            ray.kill(actor)


@pytest.mark.parametrize("mode", ["raise", "skip"])
def test_a_follower_too_late_for_its_leader_sends_to_the_server_counted_once(
    cluster: str, mode: str
) -> None:
    """Rank 3 pushes after its leader gave up on it (half of the server's 8 s timeout):
    its leader's sum holds 1 and 2, and 3's gradient is added on its own at its rank."""
    ps, workers, before = _group_of_three(mode)
    try:
        early = [workers[r].step.remote(2, SHAPE) for r in (0, 1, 2)]
        time.sleep(5)
        late = workers[3].step.remote(2, SHAPE)
        want = update(before, grouped_sum(grads(2, [0, 1, 2, 3]), [0, [1, 2], 3]), 4)
        for params_got, report in outcomes([*early, late]):
            assert params_got.tobytes() == want.tobytes()
            assert report == gsray.StepReport(step=2, count=4, missing=())
    finally:
        for actor in [*workers, ps]:
            ray.kill(actor)
