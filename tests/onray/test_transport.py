"""The GRADSTREAM tensor transport (``@ray.method(tensor_transport="gradstream")``): what
a decorated method returns arrives bit-equal in another actor and in the driver, for each
of the four dtypes; connections are reused; freed objects stop being served; a corrupted
chunk is refused; a dead receiver or maker fails in bounded time, and the maker goes on
serving others."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import ray
from ray.exceptions import ActorDiedError, RayError, RayTaskError

import gradstream as gs
import gradstream.ray as gsray
from support.rayactors import Maker, Taker, TamperingProxy, describe, wait_until

DTYPES = [np.float32, np.float16, np.float64, ml_dtypes.bfloat16]


@pytest.fixture(scope="module")
def pair(cluster: str) -> Iterator[tuple[Any, Any]]:
    """A maker and a taker that live for the module (fresh ones where a test kills)."""
    maker, taker = Maker.remote(), Taker.remote()
    yield maker, taker
    ray.kill(maker)
    ray.kill(taker)


def special(dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
    """Random values of ``dtype`` with NaN payloads, both zeros, both infinities and
    subnormals at the front: every bit must arrive."""
    bits = {2: np.uint16, 4: np.uint32, 8: np.uint64}[np.dtype(dtype).itemsize]
    rng = np.random.default_rng(7)
    raw = rng.integers(0, np.iinfo(bits).max, size=shape, dtype=bits, endpoint=True)
    values = raw.view(dtype)
    flat = values.reshape(-1)
    front = np.array([np.nan, -0.0, 0.0, np.inf, -np.inf], np.float32).astype(dtype)
    flat[: min(flat.size, front.size)] = front[: flat.size]
    return values


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(), (0,), (1,), (3, 4, 5), (70_001,)], ids=str)
def test_arrays_arrive_bit_equal_in_another_actor(
    pair: tuple[Any, Any], dtype: Any, shape: tuple[int, ...]
) -> None:
    maker, taker = pair
    array = special(dtype, shape)
    got = ray.get(taker.describe.remote(maker.make.remote(array)))
    assert got == describe(array)


def test_a_structure_of_arrays_keeps_its_order_views_and_other_values(
    pair: tuple[Any, Any],
) -> None:
    maker, taker = pair
    base = special(np.float32, (6, 8))
    value = {
        "w": base,
        "t": base.T,  # not C-contiguous: arrives as its values in C order of the view
        "slices": [base[::2, 1::3], special(np.float64, (5,))],
        "n": 7,
        "s": "text",
        "be": special(np.float32, (9,)).astype(">f4"),  # swapped to native, same values
    }
    got = ray.get(taker.describe.remote(maker.make.remote(value)))
    want = describe({**value, "be": value["be"].astype("<f4")})
    assert got == want


def test_the_driver_gets_the_arrays_too(pair: tuple[Any, Any]) -> None:
    maker, _ = pair
    array = special(ml_dtypes.bfloat16, (300, 7))
    got = ray.get(maker.make.remote({"g": array}))
    assert got["g"].dtype == array.dtype and got["g"].shape == array.shape
    assert got["g"].tobytes() == array.tobytes()


def test_one_connection_serves_every_object_between_two_processes(cluster: str) -> None:
    maker, taker = Maker.remote(), Taker.remote()
    try:
        for seed in range(4):
            ref = maker.big.remote(100_000, seed)
            assert ray.get(taker.slow.remote(ref)) == 100_000
        assert ray.get(taker.opened.remote()) == 1
    finally:
        ray.kill(maker)
        ray.kill(taker)


def test_a_freed_object_is_no_longer_served(pair: tuple[Any, Any]) -> None:
    maker, taker = pair
    before = ray.get(maker.held.remote())
    ref = maker.big.remote(10_000)
    assert ray.get(taker.slow.remote(ref)) == 10_000
    assert ray.get(maker.held.remote()) == before + 1
    del ref
    assert wait_until(lambda: ray.get(maker.held.remote()) == before, 30)


@pytest.mark.parametrize(
    "value, what",
    [
        (np.arange(3), "an array of int64"),
        ({"ok": np.ones(2, np.float32), "bad": np.ones(2, np.complex64)}, "an array of complex64"),
        (np.array([True]), "an array of bool"),
    ],
)
def test_other_dtypes_are_a_type_error_naming_the_dtype(
    pair: tuple[Any, Any], value: Any, what: str
) -> None:
    maker, taker = pair
    with pytest.raises(TypeError, match=f"float64; value [01] of this result is {what}"):
        ray.get(taker.describe.remote(maker.make.remote(value)))


def test_a_corrupted_chunk_is_refused_and_not_delivered(cluster: str) -> None:
    maker, taker = Maker.remote(), Taker.remote()
    real = ray.get(maker.advertise.remote(None))
    # Past the reply's manifest, inside the array's payload.
    proxy = TamperingProxy(tuple(real), flip_at=1_000_000)
    try:
        ray.get(maker.advertise.remote(proxy.address))
        ref = maker.big.remote(1_000_000)
        with pytest.raises(RayError) as caught:
            ray.get(taker.slow.remote(ref), timeout=60)
        assert proxy.flipped == 1
        assert isinstance(caught.value, gs.ChecksumMismatchError | gs.FrameError)
        assert "Checksum mismatch" in str(caught.value) or "seal" in str(caught.value)
        assert ray.get(taker.count.remote()) == 0  # the task never ran on bad data
        # The same object, asked for directly this time, arrives whole.
        ray.get(maker.advertise.remote(None))
        again = maker.make.remote(np.arange(10, dtype=np.float32))
        assert ray.get(taker.slow.remote(again)) == 10
    finally:
        proxy.close()
        ray.kill(maker)
        ray.kill(taker)


def test_a_killed_receiver_fails_in_bounded_time_and_the_maker_goes_on(cluster: str) -> None:
    maker, taker, other = Maker.remote(), Taker.remote(), Taker.remote()
    real = ray.get(maker.advertise.remote(None))
    # The proxy stops forwarding 1 MB into the reply: the transfer is under way when the
    # receiver is killed, however fast this machine moves 128 MiB.
    proxy = TamperingProxy(tuple(real), flip_at=1_000_000, hold=True)
    try:
        ray.get(maker.advertise.remote(proxy.address))
        ref = maker.big.remote(32 * 2**20)
        pending = taker.slow.remote(ref)
        assert proxy.reached.wait(60)
        started = time.monotonic()
        ray.kill(taker)
        with pytest.raises(ActorDiedError):
            ray.get(pending, timeout=60)
        assert time.monotonic() - started < 30
        assert ray.get(other.slow.remote(ref), timeout=60) == 32 * 2**20
    finally:
        proxy.close()
        ray.kill(maker)
        ray.kill(other)


def test_a_dead_maker_is_an_error_in_bounded_time(cluster: str) -> None:
    maker, taker = Maker.remote(), Taker.remote()
    try:
        ref = maker.big.remote(1000)
        ray.get(maker.held.remote())  # the object exists before its maker dies
        ray.kill(maker)
        started = time.monotonic()
        with pytest.raises(gs.ObjectUnavailableError) as caught:
            ray.get(taker.slow.remote(ref), timeout=90)
        assert time.monotonic() - started < 60
        assert isinstance(caught.value, RayTaskError)  # Ray's, carrying ours
        assert caught.value.detail.startswith("cannot connect: ")  # its listener is gone
        assert ray.get(taker.count.remote()) == 0
    finally:
        ray.kill(taker)


def test_a_stranger_asking_an_endpoint_gets_a_refusal_or_nothing(
    pair: tuple[Any, Any],
) -> None:
    """A peer that is no Ray process: without the job's key it gets no further than the
    handshake; with it, a fetch of an unknown id is refused by name, and a malformed
    request ends only that connection."""
    from gradstream.ray import _control

    maker, taker = pair
    address = tuple(ray.get(maker.advertise.remote(None)))

    key = gsray.register().authkey  # the job's, made by register() (none was given)
    assert key is not None and len(key) == 32

    async def stranger() -> None:
        with pytest.raises(gs.AuthenticationError):
            await gs.connect(address)  # without the job's key: no further
        conn = await gs.connect(address, authkey=key)
        async with conn:
            await conn.send_tensors(_control.message("fetch", id="no-such-object"))
            reply = await conn.recv_tensors()
            body, rest = _control.split(reply, address, "a refusal")
            assert body == {
                "kind": "missing",
                "id": "no-such-object",
                "detail": "this process no longer holds it",
            }
            assert rest == []
        rude = await gs.connect(address, authkey=key)
        async with rude:
            await rude.send_tensors({"not-a-message": np.empty(0, np.float32)})
            assert await rude.recv_tensors() == {}  # closed by the endpoint
        heavy = await gs.connect(address, authkey=key)
        async with heavy:  # a request is one empty tensor: values are refused unsent
            with pytest.raises(gs.DeliveryError, match="above max_gradient_len 1"):
                await heavy.send_tensors({"x": np.ones(3, np.float32)})

    asyncio.run(stranger())
    # The endpoint still serves Ray's receivers.
    assert ray.get(taker.slow.remote(maker.big.remote(5))) == 5


def test_register_again_with_the_same_settings_is_quiet_and_other_settings_refused(
    cluster: str,
) -> None:
    given = gsray.register().timeout  # no keywords: what conftest set, as it was
    assert given != gsray.RaySettings().timeout
    assert gsray.register(timeout=given).timeout == given
    with pytest.raises(gs.SettingError, match="already given other settings"):
        gsray.register(timeout=given + 1)
    assert gsray.register(timeout=given, deadline=300.0).deadline == 300.0  # the default
    with pytest.raises(gs.SettingError, match="already given other settings"):
        gsray.register(deadline=5)
    assert gsray.register().timeout == given


@pytest.mark.parametrize(
    "keywords, error, match",
    [
        ({"timeout": 0}, gs.SettingError, "timeout must be a positive number"),
        ({"deadline": float("inf")}, gs.SettingError, "deadline must be a positive number"),
        ({"timeout": None}, gs.SettingError, "timeout must be a number of seconds"),
        ({"connect_timeout": "5"}, gs.SettingError, "connect_timeout must be a number"),
        ({"layout": "dense"}, gs.SettingError, "layout"),
        ({"authkey": b"short"}, gs.SettingError, "at least 16 bytes"),
        ({"authkey": "a str key of enough length"}, TypeError, "authkey must be None or bytes"),
        ({"host": ""}, gs.SettingError, "host must be a non-empty str"),
        ({"tls": "cert.pem"}, TypeError, "tls must be a gradstream.TLS"),
    ],
)
def test_settings_are_checked_where_they_are_given(
    keywords: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        gsray.RaySettings.checked(**keywords)


def test_tls_without_a_ca_is_refused(certs: Any) -> None:
    with pytest.raises(gs.SettingError, match=r"needs TLS\(cert=, key=, ca=\)"):
        gsray.RaySettings.checked(tls=certs.server)


def test_an_abort_stops_a_fetch_under_way_at_once() -> None:
    """What Ray's abort_transport does: a fetch stuck on a peer that never answers ends
    with ObjectUnavailableError when aborted, long before its own timeouts."""
    import socket
    import threading

    from gradstream.ray._endpoint import Endpoint

    silent = socket.create_server(("127.0.0.1", 0))  # accepts, and says nothing
    endpoint = Endpoint(gsray.RaySettings.checked(host="127.0.0.1", connect_timeout=60))
    outcome: list[BaseException] = []

    def fetch() -> None:
        try:
            endpoint.fetch(silent.getsockname()[:2], "obj-1")
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=fetch)
    started = time.monotonic()
    thread.start()
    time.sleep(0.5)
    endpoint.abort("obj-1")
    thread.join(30)
    silent.close()
    assert not thread.is_alive() and time.monotonic() - started < 30
    (error,) = outcome
    assert isinstance(error, gs.ObjectUnavailableError)
    assert (error.object_id, error.detail) == ("obj-1", "the transfer was aborted (by Ray)")


def test_ray_pickles_a_makers_plain_numpy_results_once_it_ran_a_decorated_method(
    cluster: str,
) -> None:
    """docs/guides/ray.md's caveat of Ray 2.60, held to it: Ray's zero-copy path hands the driver a
    read-only array backed by its object store; after the actor ran a decorated method,
    the same plain method's array comes through pickle, a writeable copy."""
    maker = Maker.remote()
    try:
        array = np.ones(1 << 18, np.float32)  # 1 MiB: Ray's object store, not inline
        before = ray.get(maker.plain.remote(array))
        ray.get(maker.make.remote(np.ones(3, np.float32)))
        after = ray.get(maker.plain.remote(array))
        assert (before.flags.writeable, after.flags.writeable) == (False, True)
        assert before.tobytes() == after.tobytes() == array.tobytes()
    finally:
        ray.kill(maker)


def test_a_maker_that_dies_mid_reply_is_object_unavailable_error() -> None:
    """The reply's stream ends halfway (a proxy cuts it, as a maker's death would): the
    fetch is refused as ObjectUnavailableError naming the failed connection, not the
    half of an array."""
    from gradstream.ray._endpoint import Endpoint

    settings = gsray.RaySettings.checked(host="127.0.0.1")
    maker, receiver = Endpoint(settings), Endpoint(settings)
    maker.offer("obj-2", [np.ones(1_000_000, np.float32)])
    proxy = TamperingProxy(maker.address(), flip_at=1_000_000, cut=True)
    try:
        with pytest.raises(gs.ObjectUnavailableError) as caught:
            receiver.fetch(proxy.address, "obj-2")
        assert proxy.flipped == 1
        assert caught.value.object_id == "obj-2"
        assert caught.value.detail.startswith("the connection failed: ")
    finally:
        proxy.close()


# ------------------------------------------------------------ one node: Unix sockets


def test_a_maker_of_the_same_node_is_fetched_through_its_unix_socket(cluster: str) -> None:
    maker, taker = Maker.remote(), Taker.remote()
    try:
        array = special(np.float32, (70_001,))
        for _ in range(2):
            assert ray.get(taker.describe.remote(maker.make.remote(array))) == describe(array)
        # One connection, kept, and it was the maker's Unix socket.
        assert ray.get(taker.opened.remote()) == 1
        assert ray.get(taker.opened_unix.remote()) == 1
    finally:
        ray.kill(maker)
        ray.kill(taker)


def _endpoint(**keywords: Any) -> Any:
    from gradstream.ray._endpoint import Endpoint

    return Endpoint(gsray.RaySettings.checked(host="127.0.0.1", timeout=5, **keywords))


def _closed(endpoint: Any) -> None:
    from gradstream.ray import _loop

    _loop.call(endpoint.close())


@pytest.mark.parametrize("node", ["this", "another"])
def test_the_unix_socket_is_used_only_for_a_maker_ray_places_on_this_node(
    cluster: str, node: str
) -> None:
    """A path that resolves proves nothing (the benchmark's second Ray node shares this
    filesystem): only Ray's node id sends a fetch to the maker's Unix socket."""
    from ray.experimental.rdt import CommunicatorMetadata

    from gradstream.ray._rdt import GradstreamTransport

    served, receiver = _endpoint(), _endpoint()
    try:
        array = special(np.float64, (1000,))
        maker = GradstreamTransport()
        maker._endpoint = served  # not the driver's own endpoint, which nobody closes
        meta = maker.offer("obj-local", [array], [(array.shape, array.dtype)])
        assert meta.local is not None and meta.node == ray.get_runtime_context().get_node_id()
        if node == "another":
            meta.node = "f" * len(meta.node)
        rdt = GradstreamTransport()
        rdt._endpoint = receiver
        (got,) = rdt.recv_multiple_tensors("obj-local", meta, CommunicatorMetadata())
        assert got.tobytes() == array.tobytes()
        assert receiver.connections_opened == 1
        assert receiver.unix_connections_opened == (1 if node == "this" else 0)
    finally:
        _closed(served)
        _closed(receiver)


def test_same_node_tcp_neither_listens_nor_connects_on_a_unix_socket(cluster: str) -> None:
    served, receiver = _endpoint(same_node="tcp"), _endpoint(same_node="tcp")
    unix_maker = _endpoint()
    try:
        array = special(np.float32, (100,))
        tcp, local = served.offer("obj", [array])
        assert local is None
        # Told of a Unix socket anyway: this side's setting keeps it on TCP.
        _, other_local = unix_maker.offer("obj", [array])
        assert other_local is not None
        (got,) = receiver.fetch(tcp, "obj", local=other_local)
        assert got.tobytes() == array.tobytes()
        assert (receiver.connections_opened, receiver.unix_connections_opened) == (1, 0)
    finally:
        for endpoint in (served, receiver, unix_maker):
            _closed(endpoint)


def test_a_unix_socket_that_cannot_be_reached_falls_back_to_tcp(cluster: str) -> None:
    served, receiver = _endpoint(), _endpoint()
    try:
        array = special(np.float32, (100,))
        tcp, local = served.offer("obj", [array])
        assert local is not None
        (got,) = receiver.fetch(tcp, "obj", local="unix:/nonexistent/gradstream.sock")
        assert got.tobytes() == array.tobytes()
        assert (receiver.connections_opened, receiver.unix_connections_opened) == (1, 0)
    finally:
        _closed(served)
        _closed(receiver)


def test_an_endpoint_removes_its_socket_directory_when_closed(cluster: str) -> None:
    import os

    served = _endpoint()
    _, local = served.offer("obj", [np.ones(3, np.float32)])
    assert local is not None
    path = local.removeprefix("unix:")
    assert os.path.exists(path) and oct(os.stat(os.path.dirname(path)).st_mode & 0o777) == "0o700"
    _closed(served)
    assert not os.path.exists(os.path.dirname(path))
