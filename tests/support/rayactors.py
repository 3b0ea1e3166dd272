"""Ray actors and helpers for the tests of gradstream.ray (tests/onray/). They live in an
importable module, not in a test file, so that Ray's workers load them by name (the
cluster's workers get ``tests/`` on their path: ``tests/onray/conftest.py``)."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from typing import Any

import numpy as np
import ray

import gradstream.ray as gsray


def transport() -> Any:
    """This process's GRADSTREAM transport instance (Ray keeps one per process)."""
    from ray.experimental.rdt.util import get_tensor_transport_manager

    return get_tensor_transport_manager(gsray.TRANSPORT)


@ray.remote(num_cpus=0, enable_tensor_transport=True)
class Maker:
    """Makes objects that travel through the GRADSTREAM transport."""

    @ray.method(tensor_transport="gradstream")
    def make(self, value: Any) -> Any:
        return value

    @ray.method(tensor_transport="gradstream")
    def big(self, n: int, seed: int = 0) -> np.ndarray:
        return np.random.default_rng(seed).standard_normal(n, dtype=np.float32)

    def plain(self, value: Any) -> Any:
        """Returned the usual way (no tensor transport)."""
        return value

    def held(self) -> int:
        return int(transport().endpoint.held())

    def advertise(self, address: tuple[str, int] | None) -> tuple[str, int]:
        """Tell receivers to fetch through ``address`` (a proxy); the real address."""
        endpoint = transport().endpoint
        endpoint.advertised = address
        return tuple(endpoint.address())

    def pid(self) -> int:
        return os.getpid()


@ray.remote(num_cpus=0, enable_tensor_transport=True)
class Taker:
    """Receives objects as a task's argument, and reports what it got as plain bytes."""

    def __init__(self) -> None:
        self.calls = 0

    def describe(self, value: Any) -> Any:
        self.calls += 1
        return _describe(value)

    def slow(self, value: Any) -> int:
        self.calls += 1
        return len(value)

    def count(self) -> int:
        return self.calls

    def opened(self) -> int:
        return int(transport().endpoint.connections_opened)

    def opened_unix(self) -> int:
        return int(transport().endpoint.unix_connections_opened)


def _describe(value: Any) -> Any:
    """A value with each array replaced by (dtype name, shape, its bytes in C order)."""
    if isinstance(value, np.ndarray):
        return ("ndarray", value.dtype.name, value.shape, np.ascontiguousarray(value).tobytes())
    if isinstance(value, dict):
        return {key: _describe(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_describe(item) for item in value)
    return value


def describe(value: Any) -> Any:
    return _describe(value)


class _Pushes:
    """A sync worker's calls: its gradient for a step is a pure function of (seed, step,
    rank), so the test computes the same one."""

    rank: int
    seed: int
    client: gsray.ParameterClient

    def step(self, step: int, shape: Any) -> tuple[Any, Any]:
        params = self.client.push(gradient(self.seed, step, self.rank, shape))
        return params, self.client.last_report

    def push(self, value: Any) -> Any:
        return self.client.push(value)


@ray.remote(num_cpus=0)
class Worker(_Pushes):
    """A parameter-server worker (sync methods)."""

    def __init__(self, server: Any, rank: int, seed: int) -> None:
        self.rank = rank
        self.seed = seed
        self.client = gsray.ParameterClient(server, rank)


@ray.remote(num_cpus=0)
class AsyncWorker:
    """The same, as an async actor using ``push_async``."""

    def __init__(self, server: Any, rank: int, seed: int) -> None:
        self.rank = rank
        self.seed = seed
        self.client = gsray.ParameterClient(server, rank)

    async def step(self, step: int, shape: Any) -> tuple[Any, Any]:
        params = await self.client.push_async(gradient(self.seed, step, self.rank, shape))
        return params, self.client.last_report


@ray.remote(num_cpus=0, max_concurrency=4)  # is_stalled answers while step is in push
class NodeWorker(_Pushes):
    """A worker that takes itself for one on Ray node ``node`` (never the server's): this
    one machine then holds several "nodes", whose workers reduce on their node first.
    ``stall`` makes it, as a leader, hang for good at a point of its push ("collect":
    once it holds its followers' gradients; "forward": once it has the server's reply,
    before it passes it on) once ``arm`` was called, for a test to kill it there."""

    def __init__(self, server: Any, rank: int, seed: int, node: str, stall: str = "") -> None:
        import gradstream.ray._ps_group as group
        import gradstream.ray._same_node as same_node

        same_node.node_id = lambda: node  # type: ignore[assignment]
        if stall:
            original = getattr(group.Leader, stall)

            async def stalled(*args: Any, **kwargs: Any) -> Any:
                if stall == "forward" and self.armed:
                    self.stalled = True
                    await asyncio.sleep(3600)
                got = await original(*args, **kwargs)
                if self.armed:
                    self.stalled = True
                    await asyncio.sleep(3600)
                return got

            setattr(group.Leader, stall, stalled)
        self.armed = self.stalled = False
        self.rank = rank
        self.seed = seed
        self.client = gsray.ParameterClient(server, rank)

    def role(self) -> tuple[list[int], bool]:
        """The followers linked to it, and whether it has a link to a leader."""
        leader = self.client._leader
        links = sorted(leader._links) if leader is not None else []
        return links, self.client._follower._link is not None

    def arm(self) -> None:
        self.armed = True

    def is_stalled(self) -> bool:
        return self.stalled


def gradient(seed: int, step: int, rank: int, shape: Any) -> Any:
    """Worker ``rank``'s gradient at ``step``: an array of ``shape``, or a dict of arrays
    when ``shape`` is a dict of shapes; special values included."""
    rng = np.random.default_rng([seed, step, rank])
    if isinstance(shape, dict):
        return {name: _values(rng, s) for name, s in shape.items()}
    return _values(rng, shape)


def _values(rng: np.random.Generator, shape: Any) -> np.ndarray:
    values = rng.standard_normal(shape, dtype=np.float32) * np.float32(1e3)
    flat = values.reshape(-1)
    if flat.size >= 4:
        flat[:4] = [-0.0, 1e-42, 1e30, -1e30]  # a zero's sign, a subnormal, large values
    return values


def update(params: Any, summed: Any, count: int) -> Any:
    """A plain SGD step on the mean, float32 throughout."""
    if isinstance(params, dict):
        return {n: params[n] - np.float32(0.01) * (summed[n] / np.float32(count)) for n in params}
    return params - np.float32(0.01) * (summed / np.float32(count))


def in_place(params: Any, summed: Any, count: int) -> Any:
    """An update that writes the server's parameters in place."""
    params -= np.float32(0.5) * summed
    return params


def grouped_sum(grads: Any, order: list[Any]) -> Any:
    """The server's sum of ``grads`` (rank: gradient array) in ``order``: ranks and
    groups (lists of ranks, a group summed from zeros first), added into zeros in turn."""
    first = next(iter(grads.values()))
    if isinstance(first, dict):
        return {
            name: grouped_sum({rank: g[name] for rank, g in grads.items()}, order) for name in first
        }
    total = np.zeros(first.shape, np.float32)
    for item in order:
        if isinstance(item, list):
            item_sum = np.zeros(total.shape, np.float32)
            for rank in item:
                item_sum += grads[rank]
            total += item_sum
        else:
            total += grads[item]
    return total


def expected_steps(params: Any, seed: int, ranks_per_step: list[list[int]], shape: Any) -> Any:
    """The parameters after each step, summed with numpy in rank order from zeros."""
    out = []
    for step, ranks in enumerate(ranks_per_step):
        grads = [gradient(seed, step, rank, shape) for rank in ranks]
        if isinstance(params, dict):
            summed = {n: np.zeros(a.shape, np.float32) for n, a in params.items()}
            for g in grads:
                for n in summed:
                    summed[n] += g[n]
        else:
            summed = np.zeros(params.shape, np.float32)
            for g in grads:
                summed += g
        params = update(params, summed, len(ranks))
        out.append(params)
    return out


class TamperingProxy:
    """A TCP forwarder on 127.0.0.1 that flips one byte of what the server sends, at
    offset ``flip_at`` of each connection's server-to-client stream; or, with ``cut``,
    closes both sides there instead (a server that died mid-reply); or, with ``hold``,
    forwards nothing past that offset of the first connection until ``close()`` (a
    transfer that is certainly under way, however fast the machine: ``reached`` is set
    when it gets there; later connections pass untouched)."""

    def __init__(
        self, target: tuple[str, int], flip_at: int, cut: bool = False, hold: bool = False
    ) -> None:
        self.target = target
        self.flip_at = flip_at
        self.cut = cut
        self.hold = hold
        self.flipped = 0
        self.reached = threading.Event()
        self._released = threading.Event()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.address = self._sock.getsockname()[:2]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            threading.Thread(target=self._pipe, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, tamper: bool) -> None:
        seen = 0
        try:
            while data := src.recv(1 << 16):
                at = self.flip_at - seen
                if tamper and 0 <= at < len(data):
                    if self.hold:
                        if not self.reached.is_set():  # only the first connection is held
                            dst.sendall(data[:at])
                            self.reached.set()
                            self._released.wait()
                            return
                    elif self.cut:
                        dst.sendall(data[:at])
                        self.flipped += 1
                        return
                    else:
                        buf = bytearray(data)
                        buf[at] ^= 0x01
                        data = bytes(buf)
                        self.flipped += 1
                seen += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._released.set()
        self._sock.close()


def outcomes(refs: list[Any], timeout: float = 60) -> list[Any]:
    """Each ref's value, or the RayError its task raised, in order."""
    from ray.exceptions import RayError

    got: list[Any] = []
    for ref in refs:
        try:
            got.append(ray.get(ref, timeout=timeout))
        except RayError as exc:
            got.append(exc)
    return got


def wait_until(predicate: Any, seconds: float) -> bool:
    """Poll ``predicate`` until it holds or ``seconds`` pass."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.1)
    return bool(predicate())
