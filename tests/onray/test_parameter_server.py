"""gradstream.ray.ParameterServer: workers' gradients summed in rank order as they stream
in, bit-equal to numpy summing in that order; ``update``'s result back to every worker;
a worker killed mid-step under "raise" and "skip"; bad workers and bad settings."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest
import ray
from ray.exceptions import RayActorError, RayError

import gradstream as gs
import gradstream.ray as gsray
from support.rayactors import (
    AsyncWorker,
    Worker,
    expected_steps,
    gradient,
    in_place,
    outcomes,
    update,
)

SEED = 11


def bits(value: Any) -> Any:
    if isinstance(value, dict):
        return {name: bits(array) for name, array in value.items()}
    return (value.dtype.name, value.shape, value.tobytes())


def start(params: Any, workers: int, mode: str = "raise", **keywords: Any) -> Any:
    return gsray.ParameterServer.options(num_cpus=0).remote(
        params, update, workers=workers, on_worker_failure=mode, **keywords
    )


@pytest.mark.parametrize(
    "shape, worker_class",
    [
        ((257, 1031), Worker),  # one array: summed into one accumulator as chunks arrive
        ({"fc.weight": (64, 300), "fc.bias": (300,), "scale": ()}, AsyncWorker),  # a set
    ],
    ids=["array-sync-actors", "tensor-set-async-actors"],
)
def test_three_workers_five_steps_bit_equal_to_numpy_in_rank_order(
    cluster: str, shape: Any, worker_class: Any
) -> None:
    rng = np.random.default_rng(3)
    if isinstance(shape, dict):
        params = {n: rng.standard_normal(s, dtype=np.float32) for n, s in shape.items()}
    else:
        params = rng.standard_normal(shape, dtype=np.float32)
    ps = start(params, 3)
    workers = [worker_class.remote(ps, rank, SEED) for rank in range(3)]
    try:
        want = expected_steps(params, SEED, [[0, 1, 2]] * 5, shape)
        for step in range(5):
            # Reverse submission order: the sum's order is the ranks', not the arrival's.
            results = ray.get([w.step.remote(step, shape) for w in reversed(workers)])
            for got, report in results:
                assert bits(got) == bits(want[step])
                assert report == gsray.StepReport(step=step, count=3, missing=())
        assert bits(ray.get(ps.params.remote())) == bits(want[-1])
        assert [r.step for r in ray.get(ps.reports.remote())] == list(range(5))
    finally:
        for actor in [*workers, ps]:
            ray.kill(actor)


def test_the_sum_adds_float32_whatever_each_worker_sends(cluster: str) -> None:
    """A float16 and a float64 gradient are converted to float32, then added."""
    params = np.zeros(1000, np.float32)
    ps = start(params, 2)
    workers = [Worker.remote(ps, rank, SEED) for rank in range(2)]
    try:
        g16 = (gradient(SEED, 0, 0, (1000,)) % 100).astype(np.float16)  # in float16's range
        g64 = gradient(SEED, 0, 1, (1000,)).astype(np.float64) * 1.000001
        got = ray.get([workers[0].push.remote(g16), workers[1].push.remote(g64)])
        summed = np.zeros(1000, np.float32)
        summed += g16.astype(np.float32)
        summed += g64.astype(np.float32)
        want = update(params, summed, 2)
        assert all(g.tobytes() == want.tobytes() for g in got)
    finally:
        for actor in [*workers, ps]:
            ray.kill(actor)


def _kill_mid_step(mode: str) -> tuple[list[Any], float, Any, Any]:
    """Three workers; after two clean steps, worker 2 is killed once the others have
    pushed step 2's gradients. The results (or errors) of the others' step 2, the
    seconds they took after the kill, and the server."""
    shape = (100_000,)
    params = np.random.default_rng(5).standard_normal(shape, dtype=np.float32)
    ps = start(params, 3, mode, timeout=20)
    workers = [Worker.remote(ps, rank, SEED) for rank in range(3)]
    for step in range(2):
        ray.get([w.step.remote(step, shape) for w in workers])
    pending = [w.step.remote(2, shape) for w in workers[:2]]
    time.sleep(0.5)  # both are in push(): the server holds worker 0's gradient
    ray.kill(workers[2])
    started = time.monotonic()
    return outcomes(pending), time.monotonic() - started, ps, (workers, params, shape)


def test_skip_finishes_the_step_with_the_survivors_and_names_who_was_missing(
    cluster: str,
) -> None:
    results, seconds, ps, (workers, params, shape) = _kill_mid_step("skip")
    try:
        assert seconds < 20  # a closed connection is seen at once, not after a timeout
        want = expected_steps(params, SEED, [[0, 1, 2], [0, 1, 2], [0, 1]], shape)[-1]
        for got, report in results:
            assert got.tobytes() == want.tobytes()
            assert report == gsray.StepReport(step=2, count=2, missing=(2,))
        # The next step goes on without it, and says so.
        step3 = ray.get([w.step.remote(3, shape) for w in workers[:2]])
        assert all(r == gsray.StepReport(step=3, count=2, missing=(2,)) for _, r in step3)
        assert ray.get(ps.failure.remote()) is None
        # A restarted worker of rank 2 connects again, and takes part from then on.
        workers[2] = Worker.remote(ps, 2, SEED)
        ray.get(workers[2].__ray_ready__.remote())  # joined: its constructor connected
        step4 = ray.get([w.step.remote(4, shape) for w in workers])
        assert all(r == gsray.StepReport(step=4, count=3, missing=()) for _, r in step4)
    finally:
        for actor in [*workers, ps]:
            ray.kill(actor)


def test_a_worker_that_never_connects_is_lost_after_timeout(cluster: str) -> None:
    # 4 s: long enough that a next step taking as long would be waiting for rank 1
    # again, not a loaded machine's Ray calls.
    ps = start(np.zeros(10, np.float32), 2, "skip", timeout=4)
    worker = Worker.remote(ps, 0, SEED)
    try:
        started = time.monotonic()
        ray.get(worker.push.remote(np.ones(10, np.float32)), timeout=60)
        assert time.monotonic() - started >= 4  # it waited for rank 1 that long
        (report,) = ray.get(ps.reports.remote())
        assert report == gsray.StepReport(step=0, count=1, missing=(1,))
        # Lost, under "skip": the next step does not wait for it again.
        started = time.monotonic()
        ray.get(worker.push.remote(np.ones(10, np.float32)), timeout=60)
        assert time.monotonic() - started < 4
        assert ray.get(ps.reports.remote())[1] == gsray.StepReport(1, 1, (1,))
    finally:
        ray.kill(worker)
        ray.kill(ps)


def test_the_first_steps_clock_starts_with_the_first_join(cluster: str) -> None:
    """Ray may place the workers long after the server: under "raise" with a 3 s
    timeout, workers that join 4 s after the server was made still take part (3 s: the
    worker's push, a Ray call after its join, may come late on a loaded machine)."""
    ps = start(np.zeros(6, np.float32), 1, "raise", timeout=3)
    try:
        ray.get(ps.contact.remote())
        time.sleep(4)
        worker = Worker.remote(ps, 0, SEED)
        got = ray.get(worker.push.remote(np.ones(6, np.float32)), timeout=60)
        assert got.tobytes() == update(np.zeros(6, np.float32), np.ones(6, np.float32), 1).tobytes()
        ray.kill(worker)
    finally:
        ray.kill(ps)


def test_an_update_that_changes_the_parameters_shape_stops_the_server(cluster: str) -> None:
    ps = gsray.ParameterServer.options(num_cpus=0).remote(
        np.zeros(5, np.float32), lambda p, s, c: np.zeros(p.size + 1, np.float32), workers=1
    )
    worker = Worker.remote(ps, 0, SEED)
    try:
        with pytest.raises(TypeError, match=r"update returned parameters of \(\(6,\), 'float32'\)"):
            ray.get(worker.push.remote(np.ones(5, np.float32)), timeout=60)
        assert isinstance(ray.get(ps.failure.remote()), TypeError)
    finally:
        ray.kill(worker)
        ray.kill(ps)


def test_parameters_of_another_dtype_are_refused(cluster: str) -> None:
    ps = gsray.ParameterServer.options(num_cpus=0).remote(np.arange(3), update, workers=1)
    with pytest.raises(RayActorError, match="params must be float32, float16, bfloat16 or float64"):
        ray.get(ps.contact.remote(), timeout=60)


def test_a_tensor_set_with_other_names_loses_its_worker(cluster: str) -> None:
    params = {"a": np.zeros(3, np.float32), "b": np.zeros(2, np.float32)}
    ps = start(params, 2, "raise")
    workers = [Worker.remote(ps, rank, SEED) for rank in range(2)]
    try:
        good = workers[0].push.remote({"a": np.ones(3, np.float32), "b": np.ones(2, np.float32)})
        bad = workers[1].push.remote({"a": np.ones(3, np.float32), "c": np.ones(2, np.float32)})
        for ref in (good, bad):
            with pytest.raises(gs.WorkerLostError, match=r"worker 1: .*it sent tensors"):
                ray.get(ref, timeout=60)
    finally:
        for actor in [*workers, ps]:
            ray.kill(actor)


def test_raise_fails_the_step_for_every_worker_with_worker_lost_error(cluster: str) -> None:
    results, seconds, ps, (workers, _, shape) = _kill_mid_step("raise")
    try:
        assert seconds < 20
        for outcome in results:
            assert isinstance(outcome, gs.WorkerLostError)
            assert (outcome.step, outcome.missing) == (2, (2,))
            assert "the worker died or left" in outcome.detail
        failure = ray.get(ps.failure.remote())
        assert isinstance(failure, gs.WorkerLostError) and failure.step == 2
        assert [r.step for r in ray.get(ps.reports.remote())] == [0, 1]
        # The server stays failed: a later push says why at once.
        with pytest.raises(gs.WorkerLostError, match="step 2 failed: no gradient from worker 2"):
            ray.get(workers[0].step.remote(3, shape), timeout=60)
    finally:
        for actor in [*workers, ps]:
            ray.kill(actor)


def test_a_gradient_of_the_wrong_size_loses_its_worker(cluster: str) -> None:
    ps = start(np.zeros(50, np.float32), 2, "skip")
    workers = [Worker.remote(ps, rank, SEED) for rank in range(2)]
    try:
        bad = workers[1].push.remote(np.ones(49, np.float32))
        good = ray.get(workers[0].push.remote(np.ones(50, np.float32)), timeout=60)
        assert (
            good.tobytes() == update(np.zeros(50, np.float32), np.ones(50, np.float32), 1).tobytes()
        )
        with pytest.raises(RayError):
            ray.get(bad, timeout=60)
        (report,) = ray.get(ps.reports.remote())
        assert report == gsray.StepReport(step=0, count=1, missing=(1,))
    finally:
        for actor in [*workers, ps]:
            ray.kill(actor)


def test_an_update_in_place_writes_the_servers_own_copy_of_the_parameters(
    cluster: str,
) -> None:
    """Ray hands the constructor a read-only view of its object store; the server keeps
    a writeable copy, so an update in place works and the caller's array is untouched."""
    params = np.arange(20, dtype=np.float32)
    ps = gsray.ParameterServer.options(num_cpus=0).remote(params, in_place, workers=1)
    worker = Worker.remote(ps, 0, SEED)
    try:
        for _ in range(2):
            got = ray.get(worker.push.remote(np.ones(20, np.float32)), timeout=60)
        assert got.tobytes() == (np.arange(20, dtype=np.float32) - np.float32(1.0)).tobytes()
        assert params.tobytes() == np.arange(20, dtype=np.float32).tobytes()
    finally:
        ray.kill(worker)
        ray.kill(ps)


def test_an_update_that_raises_stops_the_server_and_every_push_raises_it(cluster: str) -> None:
    def broken(params: Any, summed: Any, count: int) -> Any:
        raise ZeroDivisionError("the user's rule failed")

    ps = gsray.ParameterServer.options(num_cpus=0).remote(
        np.zeros(8, np.float32), broken, workers=1
    )
    (worker,) = [Worker.remote(ps, 0, SEED)]
    try:
        with pytest.raises(ZeroDivisionError, match="the user's rule failed"):
            ray.get(worker.push.remote(np.ones(8, np.float32)), timeout=60)
    finally:
        ray.kill(worker)
        ray.kill(ps)


def test_a_stranger_cannot_join_without_the_key_nor_with_a_rank_out_of_range(
    cluster: str,
) -> None:
    """The server made its own authkey (none was given): a peer without it is refused
    at the handshake; one with it that says rank 5 of 1 is refused by name; the worker
    goes on."""
    from gradstream.ray import _control

    ps = start(np.zeros(4, np.float32), 1)
    worker = Worker.remote(ps, 0, SEED)
    try:
        address, settings = ray.get(ps.contact.remote())
        assert settings.authkey is not None and len(settings.authkey) == 32

        async def stranger() -> dict[str, Any]:
            with pytest.raises(gs.AuthenticationError):
                await gs.connect(tuple(address))
            conn = await gs.connect(tuple(address), authkey=settings.authkey)
            async with conn:
                await conn.send_tensors(_control.message("join", rank=5))
                answer = await conn.recv_tensors()
                assert await conn.recv_tensors() == {}  # then closed
                return answer

        body, _ = _control.split(asyncio.run(stranger()), tuple(address), "a refusal")
        assert body == {
            "kind": "refused",
            "rank": 5,
            "detail": "this server has 1 workers, ranks 0 to 0",
        }
        got = ray.get(worker.push.remote(np.ones(4, np.float32)), timeout=60)
        assert got.tobytes() == update(np.zeros(4, np.float32), np.ones(4, np.float32), 1).tobytes()
        with pytest.raises(gs.SettingError, match="refused rank 3: this server has 1 workers"):
            gsray.ParameterClient(ps, 3)
    finally:
        ray.kill(worker)
        ray.kill(ps)


@pytest.mark.parametrize(
    "keywords, match",
    [
        ({"workers": 0}, "workers must be an int of at least 1"),
        (
            {"workers": 2, "on_worker_failure": "drop"},
            "on_worker_failure must be 'raise' or 'skip'",
        ),
        ({"workers": 2, "timeout": -1}, "timeout must be a positive number"),
    ],
)
def test_bad_settings_fail_the_server_with_the_setting_named(
    cluster: str, keywords: dict[str, Any], match: str
) -> None:
    ps = gsray.ParameterServer.options(num_cpus=0).remote(
        np.zeros(3, np.float32), update, **keywords
    )
    with pytest.raises(RayActorError, match=match):
        ray.get(ps.contact.remote(), timeout=60)


def test_a_client_rank_must_be_a_count(cluster: str) -> None:
    with pytest.raises(gs.SettingError, match="rank must be an int of at least 0"):
        gsray.ParameterClient(None, -1)


def _routes(ps: Any) -> list[str]:
    """The server's members' peer addresses, as it sees them."""
    return list(
        ray.get(
            ps.__ray_call__.remote(
                lambda self: [str(c.peer.address) for c in self._steps.members.values()]
            )
        )
    )


@pytest.mark.parametrize("same_node", ["unix", "tcp"])
def test_workers_of_the_servers_node_connect_through_its_unix_socket(
    cluster: str, same_node: str
) -> None:
    params = np.random.default_rng(5).standard_normal(5000, dtype=np.float32)
    ps = start(params, 2, same_node=same_node)
    workers = [Worker.remote(ps, rank, SEED) for rank in range(2)]
    try:
        want = expected_steps(params, SEED, [[0, 1]] * 2, (5000,))
        for step in range(2):
            for got, _ in ray.get([w.step.remote(step, (5000,)) for w in workers]):
                assert bits(got) == bits(want[step])
        routes = _routes(ps)
        assert len(routes) == 2
        assert all(r.startswith("unix:") == (same_node == "unix") for r in routes), routes
        where = ray.get(ps.same_node.remote())
        assert (where is None) == (same_node == "tcp")
    finally:
        for actor in [*workers, ps]:
            ray.kill(actor)


def test_silent_ranks_before_a_worker_do_not_run_out_its_sends_deadline(cluster: str) -> None:
    """Under "skip", ranks 0 to 3 never join: the server waits `timeout` (1 s) for each
    before it reaches rank 4, whose push has been waiting 4 s, twice the server's
    `deadline` (2 s). Its send is held to deadline + timeout x workers, and completes."""
    params = np.zeros(1000, np.float32)
    ps = start(params, 5, "skip", timeout=1, deadline=2)
    worker = Worker.remote(ps, 4, SEED)
    try:
        got, report = ray.get(worker.step.remote(0, (1000,)), timeout=60)
        assert report == gsray.StepReport(step=0, count=1, missing=(0, 1, 2, 3))
        want = update(params, gradient(SEED, 0, 4, (1000,)), 1)
        assert got.tobytes() == want.tobytes()
    finally:
        ray.kill(worker)
        ray.kill(ps)
