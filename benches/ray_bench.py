"""gradstream on Ray against Ray's own object store (issue 13's benchmark rows; docs/performance.md
"Many workers on Ray"), measured side by side in one run:

    python benches/ray_bench.py [--quick] [--json FILE]

1. Across nodes, two Ray nodes on this one machine: the head in the root network
   namespace (10.213.0.1) and a second node in a network namespace this script makes
   (10.213.0.2), joined by a veth pair (``ip netns add``, ``ip link add ... type veth``;
   needs root, else these rows are skipped with a note). Rows:

   * a 256 MiB float32 array from an actor on node A to an actor on node B, through the
     ``GRADSTREAM`` tensor transport (``gradstream.ray.register()``: compact layout, the
     default) and through Ray's object store (a plain method returning the array, its
     reference passed to the other actor); best of N, and object-store time / ours;
   * a parameter-server step of 3 workers x 256 MiB (workers on node B, the server on
     node A): ``gradstream.ray.ParameterServer`` against a plain object-store server
     written here (its ``step`` takes the 3 gradient references, sums them in rank order
     with numpy, applies the same update and returns the parameters, which every worker
     then receives); the median of the steps after the first, and the ratio;
   * Ray's gloo transport (``tensor_transport="gloo"``, ray.util.collective) when
     ``import torch`` works (a note otherwise);
   * the link's limit beside them: the same bytes by one ``sendall`` / ``recv_into`` a
     reused buffer between two actors' plain sockets (no Ray in between, no framing).

2. One node (a head on 127.0.0.1): the same actor-to-actor rows. Ray moves the array
   through shared memory here, which a socket cannot beat: the ratio is reported as is.

Every ratio is reported beside its target (issue 13: >= 1.5 across nodes), never
asserted. Each contestant has actors of its own: Ray installs a numpy serializer of its
own in a process once a tensor-transport method ran there, which changes how that
process returns ordinary numpy arrays. Turns go in rounds (gradstream, object store,
gradstream, ...), so a slow stretch of the shared machine hits both alike.

A transfer's time runs from just before the driver calls the maker's method to the
receiving method's first line (the clock is the machine's CLOCK_MONOTONIC, the same in
every process and namespace): scheduling both tasks, the maker's return, the move and
whatever the receiver does before its code runs (Ray pulls the object into the receiving
node's store; the transport fetches the arrays). The receiver then checks the array
against its own copy, outside the time. A parameter-server step runs from the driver's
call to the last worker's return of the new parameters; its note gives, as medians, when
each worker had them (and for the object-store server, when the gradients were all on its
node and when its update was done), and both servers' parameters are compared bit for
bit at the end (the same gradients, the same sum order, the same update).

The two nodes, their namespace and their teardown: ``ray_nodes``; the machine's facts,
the ratios and the printed report: ``ray_report``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from ray_nodes import HEAD_IP, NODE_IP, Clusters, namespaces_unavailable
from ray_report import machine, print_result, ratios

MIB = 1 << 20
GRADIENT_BYTES = 256 * MIB
ELEMENTS = GRADIENT_BYTES // 4
WORKERS = 3
LR = 0.01
# The row names say the layout of the settings measured: register()'s default.
GS = "GRADSTREAM transport (compact layout, the default)"
GS_PS = "gradstream.ray.ParameterServer (compact layout, the default)"
OS = "Ray object store"
OS_PS = "a Ray object-store server (numpy sum in gradstream's order)"
DRIVER_TIMEOUT = 480


# --- what the actors run (pickled by value into the Ray workers) ----------------------


def make_array(elements: int, seed: int) -> np.ndarray:
    """A gradient: float32 normals, the same for the same seed in every process."""
    return np.random.default_rng(seed).standard_normal(elements, dtype=np.float32)


def sgd(params: np.ndarray, summed: np.ndarray, count: int) -> np.ndarray:
    """The update both parameter servers apply: params -= lr * mean gradient, in place
    (on a copy the first time: parameters Ray deserialized are a read-only view of its
    object store)."""
    if not params.flags.writeable:
        params = params.copy()
    np.multiply(summed, np.float32(LR / count), out=summed)
    np.subtract(params, summed, out=params)
    return params


def _define_actors() -> dict[str, Any]:
    import ray

    import gradstream.ray as gsray

    class _Receiver:
        """Takes the array as its argument: the time it arrived, and whether it is the
        array the maker holds (checked after the clock)."""

        def __init__(self, elements: int, seed: int) -> None:
            self.expected = make_array(elements, seed)

        def node(self) -> str:
            return str(ray.util.get_node_ip_address())

        def take(self, array: np.ndarray) -> tuple[float, bool]:
            arrived = time.monotonic()
            ok = array.shape == self.expected.shape and bool(np.array_equal(array, self.expected))
            return arrived, ok

        def copy_new(self) -> float:
            """Seconds numpy takes here to copy the array into a new one (its pages
            faulted in as they are written): the least any receiver that hands back a new
            array of its own pays, with no transfer and no Ray call in it."""
            start = time.monotonic()
            fresh = self.expected.copy()
            took = time.monotonic() - start
            del fresh
            return took

    class _Maker:
        def __init__(self, elements: int, seed: int) -> None:
            self.array = make_array(elements, seed)

        def node(self) -> str:
            return str(ray.util.get_node_ip_address())

    @ray.remote(num_cpus=0, enable_tensor_transport=True)
    class GsMaker(_Maker):
        @ray.method(tensor_transport="gradstream")
        def make(self) -> np.ndarray:
            return self.array

    @ray.remote(num_cpus=0, enable_tensor_transport=True)
    class GsReceiver(_Receiver):
        def opened(self) -> tuple[int, int]:
            """Connections this process's transport opened: in all, and to a maker's
            Unix socket (one node only: Ray's node id decides)."""
            from ray.experimental.rdt.util import get_tensor_transport_manager

            endpoint = get_tensor_transport_manager(gsray.TRANSPORT).endpoint
            return endpoint.connections_opened, endpoint.unix_connections_opened

    @ray.remote(num_cpus=0)
    class OsMaker(_Maker):
        def make(self) -> np.ndarray:
            return self.array

    @ray.remote(num_cpus=0)
    class OsReceiver(_Receiver):
        pass

    @ray.remote(num_cpus=0)
    class GsWorker:
        """A worker of gradstream.ray.ParameterServer: pushes its gradient each step."""

        def __init__(self, server: Any, rank: int, elements: int) -> None:
            self.gradient = make_array(elements, 100 + rank)
            self.client = gsray.ParameterClient(server, rank)

        def node(self) -> str:
            return str(ray.util.get_node_ip_address())

        def step(self) -> tuple[float, float]:
            """The new parameters' first value, and when they arrived."""
            params = self.client.push(self.gradient)
            return float(params[0]), time.monotonic()

    @ray.remote(num_cpus=0)
    class OsServer:
        """The object-store parameter server: the gradients come as arguments (Ray pulls
        them to this node), are summed in gradstream's server's order (the workers, all
        of one other node, are one group: ``0 + (((0 + g0) + g1) + g2)``), and the new
        parameters go back through the object store."""

        def __init__(self, params: np.ndarray) -> None:
            self.params = params.copy()
            self.times = (0.0, 0.0)

        def node(self) -> str:
            return str(ray.util.get_node_ip_address())

        def step(self, *gradients: np.ndarray) -> np.ndarray:
            arrived = time.monotonic()  # every gradient is in this node's store
            group = np.zeros(self.params.shape, np.float32)
            for gradient in gradients:
                np.add(group, gradient, out=group)
            acc = np.zeros(self.params.shape, np.float32)
            np.add(acc, group, out=acc)
            del group
            self.params = sgd(self.params, acc, len(gradients))
            self.times = (arrived, time.monotonic())
            return self.params

        def last_times(self) -> tuple[float, float]:
            """When the last step's gradients were all here, and its update done."""
            return self.times

        def get(self) -> np.ndarray:
            return self.params

    @ray.remote(num_cpus=0)
    class OsWorker:
        def __init__(self, rank: int, elements: int) -> None:
            self.gradient = make_array(elements, 100 + rank)

        def node(self) -> str:
            return str(ray.util.get_node_ip_address())

        def grad(self) -> np.ndarray:
            return self.gradient

        def apply(self, params: np.ndarray) -> tuple[float, float]:
            return float(params[0]), time.monotonic()

    @ray.remote(num_cpus=0)
    class RawSender:
        """The link's limit: the array's bytes by one sendall on a plain TCP socket."""

        def __init__(self, elements: int, seed: int) -> None:
            self.array = make_array(elements, seed)
            self.listener = socket.create_server((ray.util.get_node_ip_address(), 0))
            self.conn: socket.socket | None = None

        def node(self) -> str:
            return str(ray.util.get_node_ip_address())

        def address(self) -> tuple[str, int]:
            host, port = self.listener.getsockname()[:2]
            return host, port

        def accept(self) -> bool:
            self.conn, _ = self.listener.accept()
            return True

        def send(self) -> float:
            assert self.conn is not None
            start = time.monotonic()
            self.conn.sendall(memoryview(self.array).cast("B"))
            return start

    @ray.remote(num_cpus=0)
    class RawReceiver(_Receiver):
        def __init__(self, elements: int, seed: int) -> None:
            super().__init__(elements, seed)
            self.buffer = np.ones(elements, np.float32)  # reused, its pages faulted in
            self.sock: socket.socket | None = None

        def connect(self, address: tuple[str, int]) -> bool:
            self.sock = socket.create_connection(tuple(address))
            return True

        def receive(self) -> tuple[float, bool]:
            assert self.sock is not None
            view, got = memoryview(self.buffer).cast("B"), 0
            while got < len(view):
                n = self.sock.recv_into(view[got:])
                if n == 0:
                    raise ConnectionError("the sender closed early")
                got += n
            done = time.monotonic()
            return done, bool(np.array_equal(self.buffer, self.expected))

    return {
        "GsMaker": GsMaker,
        "GsReceiver": GsReceiver,
        "OsMaker": OsMaker,
        "OsReceiver": OsReceiver,
        "GsWorker": GsWorker,
        "OsServer": OsServer,
        "OsWorker": OsWorker,
        "RawSender": RawSender,
        "RawReceiver": RawReceiver,
    }


def _gloo_on_node_interface() -> None:
    """Point gloo at the interface holding this Ray node's address (GLOO_SOCKET_IFNAME,
    read when the actor's group is made): left alone, gloo takes the address its host
    name resolves to, 127.0.0.1 here, and the two namespaces' ranks cannot meet."""
    import ray

    ip = str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]
    shown = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True)
    for line in shown.stdout.splitlines():
        fields = line.split()
        if len(fields) > 3 and fields[3].split("/")[0] == ip:
            os.environ["GLOO_SOCKET_IFNAME"] = fields[1].split("@")[0]
            return


def _gloo_actors() -> tuple[Any, Any]:
    """Ray's gloo transport (torch tensors over ray.util.collective), when torch imports."""
    import ray
    import torch

    @ray.remote(num_cpus=0, enable_tensor_transport=True)
    class GlooMaker:
        def __init__(self, elements: int, seed: int) -> None:
            _gloo_on_node_interface()
            self.tensor = torch.from_numpy(make_array(elements, seed))

        @ray.method(tensor_transport="gloo")
        def make(self) -> Any:
            return self.tensor

    @ray.remote(num_cpus=0, enable_tensor_transport=True)
    class GlooReceiver:
        def __init__(self, elements: int, seed: int) -> None:
            _gloo_on_node_interface()
            self.expected = torch.from_numpy(make_array(elements, seed))

        def take(self, tensor: Any) -> tuple[float, bool]:
            arrived = time.monotonic()
            return arrived, bool(torch.equal(tensor, self.expected))

    return GlooMaker, GlooReceiver


# --- the driver (a child process, one per cluster) -----------------------------------


def _say(text: str) -> None:
    print(f"  [{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def _transfer(maker: Any, receiver: Any) -> float:
    import ray

    if hasattr(maker, "send"):  # the raw TCP pair: from the sender's call to the last byte
        start, (done, ok) = ray.get([maker.send.remote(), receiver.receive.remote()])
        if not ok:
            raise AssertionError("raw TCP: the receiver got other bytes than were sent")
        return float(done - start)
    start = time.monotonic()
    ref = maker.make.remote()
    arrived, ok = ray.get(receiver.take.remote(ref))
    del ref
    if not ok:
        raise AssertionError("the receiver got an array that differs from the maker's")
    return float(arrived - start)


def _placed(node: str | None) -> dict[str, Any]:
    return {} if node is None else {"resources": {node: 0.001}}


def _row(key: str, name: str, samples: list[float], nbytes: int, how: str) -> dict[str, Any]:
    best = min(samples)
    median = statistics.median(samples)
    seconds = best if how == "best" else median
    return {
        "key": key,
        "name": name,
        "status": "ok",
        "how": how,
        "seconds": seconds,
        "best": best,
        "median": median,
        "samples": samples,
        "bytes": nbytes,
        "gbps": nbytes / seconds / 1e9,
        "note": "",
    }


def drive(section: str, address: str, node_ip: str, quick: bool, out: Path) -> int:
    import ray

    import gradstream.ray as gsray

    repeats = 3 if quick else 7
    steps = 3 if quick else 6  # the first is not counted: 5 rounds, each held to the target
    two_nodes = section == "cross"
    a, b = ("nodeA", "nodeB") if two_nodes else (None, None)
    prefix = "across nodes" if two_nodes else "one node"
    result: dict[str, Any] = {"rows": [], "notes": [], "placement": {}}

    def save() -> None:
        out.write_text(json.dumps(result))

    # log_to_driver=False: the minimal Ray has no metrics agent, and its head and
    # raylets say so on every start; an actor's exception still reaches ray.get.
    ray.init(
        address=address, _node_ip_address=node_ip, logging_level="WARNING", log_to_driver=False
    )
    settings = gsray.register()
    result["settings"] = {"layout": settings.layout, "chunk_size": settings.chunk_size}
    actors = _define_actors()

    # 1. one array, actor to actor: each contestant on actors of its own.
    _say(f"{prefix}: making the transfer actors ({GRADIENT_BYTES // MIB} MiB arrays)")
    pairs = {
        "gs": (
            actors["GsMaker"].options(**_placed(a)).remote(ELEMENTS, 1),
            actors["GsReceiver"].options(**_placed(b)).remote(ELEMENTS, 1),
        ),
        "os": (
            actors["OsMaker"].options(**_placed(a)).remote(ELEMENTS, 1),
            actors["OsReceiver"].options(**_placed(b)).remote(ELEMENTS, 1),
        ),
    }
    raw = (
        actors["RawSender"].options(**_placed(a)).remote(ELEMENTS, 1),
        actors["RawReceiver"].options(**_placed(b)).remote(ELEMENTS, 1),
    )
    listening = ray.get(raw[0].address.remote())
    ray.get([raw[0].accept.remote(), raw[1].connect.remote(listening)])
    pairs["raw"] = raw
    for key, (maker, receiver) in pairs.items():
        placed = ray.get([maker.node.remote(), receiver.node.remote()])
        result["placement"][f"transfer {key}"] = placed
        if two_nodes and placed != [HEAD_IP, NODE_IP]:
            raise AssertionError(f"transfer {key}: maker and receiver are on {placed}")
    if two_nodes:
        torch_ok = True
        try:
            import torch  # noqa: F401
        except ImportError:
            torch_ok = False
        if torch_ok:
            try:
                from ray.experimental.collective import create_collective_group

                gloo_maker, gloo_receiver = _gloo_actors()
                pair = (
                    gloo_maker.options(**_placed(a)).remote(ELEMENTS, 1),
                    gloo_receiver.options(**_placed(b)).remote(ELEMENTS, 1),
                )
                create_collective_group(list(pair), backend="torch_gloo")
                pairs["gloo"] = pair
            except Exception as exc:
                result["notes"].append(f"Ray gloo transport: not measured ({exc!r})")
        else:
            result["notes"].append(
                "Ray gloo transport / ray.util.collective: skipped, torch is not installed"
            )
    samples: dict[str, list[float]] = {key: [] for key in pairs}
    copies: list[float] = []  # one node: the receiving actor's copy into a new array
    # Rounds: gradstream, the object store, raw TCP[, gloo], then again.
    for turn in range(repeats + 1):  # turn 0 warms up: connections, listeners, workers
        took = {}
        for key, (maker, receiver) in list(pairs.items()):
            try:
                took[key] = _transfer(maker, receiver)
            except Exception as exc:
                if key != "gloo":  # ours and the object store's must work
                    raise
                result["notes"].append(f"Ray gloo transport: failed ({exc!r})")
                del pairs["gloo"], samples["gloo"]
        if not two_nodes:
            took["copy"] = ray.get(pairs["gs"][1].copy_new.remote())
        if turn:
            for key, seconds in took.items():
                (copies if key == "copy" else samples[key]).append(seconds)
        what = "warm-up" if turn == 0 else f"round {turn}"
        _say(f"{prefix}: transfer {what}: " + ", ".join(f"{k} {v:.3f} s" for k, v in took.items()))
    # Which way GRADSTREAM went: across nodes never a Unix socket (the second node
    # shares this filesystem, so only Ray's node id keeps it off), on one node always.
    opened, unix = ray.get(pairs["gs"][1].opened.remote())
    result["placement"]["transfer gs connections (all, unix)"] = [opened, unix]
    if opened < 1 or (unix != 0 if two_nodes else unix != opened):
        raise AssertionError(
            f"{prefix}: GRADSTREAM opened {opened} connections, {unix} of them Unix sockets"
        )
    link = "the veth" if two_nodes else "loopback"
    names = {
        "gs": GS if two_nodes else f"{GS}, through the maker's Unix socket",
        "os": OS,
        "gloo": "Ray gloo transport (torch tensors)",
        "raw": f"raw TCP over {link}, no Ray (the link's limit)",
    }
    raw_note = (
        "one sendall / recv_into a reused pre-faulted buffer between two actors' plain "
        "sockets: no framing, no CRC, no task in between"
    )
    for key, values in samples.items():
        result["rows"].append(
            _row(
                f"{section}.transfer.{key}",
                f"{prefix}, {GRADIENT_BYTES // MIB} MiB actor to actor, {names[key]}",
                values,
                GRADIENT_BYTES,
                "best",
            )
        )
        if key == "raw":
            result["rows"][-1]["note"] = raw_note
    if copies:
        result["rows"].append(
            _row(
                f"{section}.transfer.copy",
                f"{prefix}, {GRADIENT_BYTES // MIB} MiB: numpy copy into a new array inside "
                "the receiving actor (no transfer, no Ray call: the floor of a receiver "
                "that hands back a new array)",
                copies,
                GRADIENT_BYTES,
                "best",
            )
        )
    save()
    for maker, receiver in pairs.values():
        ray.kill(maker)
        ray.kill(receiver)
    del pairs

    # 2. a parameter-server step, 3 workers x 256 MiB (across nodes only).
    if two_nodes:
        _say(f"{prefix}: making the parameter servers and their {WORKERS} workers each")
        params = make_array(ELEMENTS, 7)
        gs_server = gsray.ParameterServer.options(num_cpus=0, **_placed(a)).remote(
            params, sgd, workers=WORKERS, timeout=120
        )
        gs_workers = [
            actors["GsWorker"].options(**_placed(b)).remote(gs_server, rank, ELEMENTS)
            for rank in range(WORKERS)
        ]
        os_server = actors["OsServer"].options(**_placed(a)).remote(params)
        os_workers = [
            actors["OsWorker"].options(**_placed(b)).remote(rank, ELEMENTS)
            for rank in range(WORKERS)
        ]
        del params
        (server_host, _), _ = ray.get(gs_server.contact.remote())
        placement = {
            "ps gs": [server_host, *ray.get([w.node.remote() for w in gs_workers])],
            "ps os": ray.get([os_server.node.remote()] + [w.node.remote() for w in os_workers]),
        }
        result["placement"].update(placement)
        for key, placed in placement.items():
            if placed != [HEAD_IP] + [NODE_IP] * WORKERS:
                raise AssertionError(f"{key}: the server and the workers are on {placed}")

        def gs_step() -> tuple[float, list[float], list[float]]:
            start = time.monotonic()
            got = ray.get([w.step.remote() for w in gs_workers])
            took = time.monotonic() - start
            # When each worker had the new parameters (they go out in rank order).
            return took, [first for first, _ in got], sorted(t - start for _, t in got)

        def os_step() -> tuple[float, list[float], list[float]]:
            start = time.monotonic()
            grads = [w.grad.remote() for w in os_workers]
            new = os_server.step.remote(*grads)
            got = ray.get([w.apply.remote(new) for w in os_workers])
            took = time.monotonic() - start
            del grads, new
            arrived, updated = ray.get(os_server.last_times.remote())
            phases = [arrived - start, updated - start, *sorted(t - start for _, t in got)]
            return took, [first for first, _ in got], phases

        ps_samples: dict[str, list[float]] = {"gs": [], "os": []}
        phases: dict[str, list[list[float]]] = {"gs": [], "os": []}
        agree = True
        for step in range(steps):
            gs_seconds, gs_firsts, gs_phases = gs_step()
            os_seconds, os_firsts, os_phases = os_step()
            agree = agree and len(set(gs_firsts + os_firsts)) == 1
            if step:
                ps_samples["gs"].append(gs_seconds)
                ps_samples["os"].append(os_seconds)
                phases["gs"].append(gs_phases)
                phases["os"].append(os_phases)
            _say(
                f"{prefix}: parameter-server step {step}: gs {gs_seconds:.3f} s, "
                f"os {os_seconds:.3f} s"
            )
        # Across nodes, the workers reached the server over TCP, never its Unix socket.
        routes = ray.get(
            gs_server.__ray_call__.remote(
                lambda self: [str(c.peer.address) for c in self._steps.members.values()]
            )
        )
        result["placement"]["ps gs routes"] = routes
        if len(routes) != WORKERS or any(r.startswith("unix:") for r in routes):
            raise AssertionError(f"{prefix}: the server's workers came in on {routes}")
        # The workers of node B reduced there, led by rank 0 (from the second step on).
        groups = ray.get(gs_server.__ray_call__.remote(lambda self: dict(self._steps.plan)))
        if groups != dict.fromkeys(range(WORKERS), 0):
            raise AssertionError(f"{prefix}: the server's groups were {groups}")
        gs_params = ray.get(gs_server.params.remote())
        os_params = ray.get(os_server.get.remote())
        same = bool(np.array_equal(gs_params, os_params)) and agree
        del gs_params, os_params
        reports = ray.get(gs_server.reports.remote())
        if any(report.missing for report in reports):
            raise AssertionError(f"gradstream's server missed workers: {reports}")
        check = (
            f"after {steps} steps both servers' parameters are bit-equal"
            if same
            else "the two servers' parameters DIFFER"
        )
        gs_at = [statistics.median(p) for p in zip(*phases["gs"], strict=True)]
        os_at = [statistics.median(p) for p in zip(*phases["os"], strict=True)]
        gs_moved = (
            "3 gradients summed on node B (two through its leader's Unix socket), the sum "
            "in, the parameters out once to the leader, which passes them on: 2 x 256 MiB "
            "across the veth; the workers had the new parameters at +"
            + ", +".join(f"{t:.2f}" for t in gs_at)
            + " s"
        )
        os_moved = (
            "3 gradients in, the parameters out once to node B (its workers share them): "
            f"4 x 256 MiB across the veth; all gradients on node A at +{os_at[0]:.2f} s, "
            f"summed and updated at +{os_at[1]:.2f} s, the workers had the new parameters "
            "at +" + ", +".join(f"{t:.2f}" for t in os_at[2:]) + " s"
        )
        for key, name, moved in (("gs", GS_PS, gs_moved), ("os", OS_PS, os_moved)):
            row = _row(
                f"{section}.ps.{key}",
                f"{prefix}, parameter-server step, {WORKERS} x {GRADIENT_BYTES // MIB} MiB, {name}",
                ps_samples[key],
                WORKERS * GRADIENT_BYTES,
                "median",
            )
            row["note"] = f"{moved} (medians); {check}"
            row["phases"] = gs_at if key == "gs" else os_at
            result["rows"].append(row)
        if not same:
            result["notes"].append("the parameter servers disagree: see the rows' notes")
        save()
        ray.get(gs_server.close.remote())
    save()
    ray.shutdown()
    return 0


def _drive_child(
    clusters: Clusters, section: str, address: str, node_ip: str, quick: bool
) -> dict[str, Any]:
    out = clusters.root / f"{section}.json"
    cmd = [
        sys.executable,
        __file__,
        "--drive",
        section,
        "--address",
        address,
        "--node-ip",
        node_ip,
        "--out",
        str(out),
    ]
    if quick:
        cmd.append("--quick")
    proc = subprocess.run(cmd, env=clusters.env(), timeout=DRIVER_TIMEOUT, check=False)
    result: dict[str, Any] = {"rows": [], "notes": []}
    if out.exists():
        result = json.loads(out.read_text())
    if proc.returncode != 0:
        result["failed"] = True
        result["notes"].append(
            f"{section}: the driver failed (exit {proc.returncode}; its error is above)"
        )
    return result


def _merge(result: dict[str, Any], part: dict[str, Any], section: str) -> bool:
    result["rows"] += part["rows"]
    result["notes"] += part["notes"]
    result[f"{section}_placement"] = part.get("placement")
    return bool(part.get("failed", False))


def _across_nodes(result: dict[str, Any], quick: bool) -> bool:
    """The rows of two Ray nodes joined by a veth pair; True if they failed."""
    why = namespaces_unavailable()
    if why is not None:
        result["notes"].append(f"across-nodes rows skipped: network namespaces unavailable ({why})")
        return False
    print(
        f"across nodes: a namespace, veth {HEAD_IP} <-> {NODE_IP}, two Ray nodes", file=sys.stderr
    )
    clusters = Clusters()
    try:
        try:
            clusters.make_namespace()
        except subprocess.CalledProcessError as exc:
            why = f"`{' '.join(exc.cmd)}`: {exc.stderr.strip()}"
            result["notes"].append(f"across-nodes rows skipped: cannot make the namespace ({why})")
            return False
        try:
            address = clusters.start_head(HEAD_IP, "nodeA", "head")
            clusters.join(address, NODE_IP, "nodeB", "nodeB")
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            result["notes"].append(f"across nodes: the Ray nodes did not start: {exc}")
            return True
        return _merge(result, _drive_child(clusters, "cross", address, HEAD_IP, quick), "cross")
    finally:
        clusters.teardown()


def _one_node(result: dict[str, Any], quick: bool) -> bool:
    """The rows of one Ray node on 127.0.0.1; True if they failed."""
    print("one node: a Ray head on 127.0.0.1", file=sys.stderr)
    clusters = Clusters()
    try:
        try:
            address = clusters.start_head("127.0.0.1", None, "one")
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            result["notes"].append(f"one node: the Ray head did not start: {exc}")
            return True
        return _merge(result, _drive_child(clusters, "one", address, "127.0.0.1", quick), "one")
    finally:
        clusters.teardown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats and steps")
    parser.add_argument("--json", type=Path, help="write every row and ratio here")
    parser.add_argument("--drive", choices=("cross", "one"), help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--node-ip", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.drive:
        return drive(args.drive, args.address, args.node_ip, args.quick, args.out)

    try:
        import ray  # noqa: F401
    except ImportError:
        print("benches/ray_bench.py: skipped, Ray is not installed (pip install 'gradstream[ray]')")
        return 0
    began = time.monotonic()
    # SIGTERM (a killed `make bench`) runs the teardown as Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    result: dict[str, Any] = {"machine": machine(), "rows": [], "notes": []}
    failed = _across_nodes(result, args.quick)
    failed = _one_node(result, args.quick) or failed
    result["machine"]["loadavg_end"] = os.getloadavg()
    result["ratios"] = ratios({row["key"]: row for row in result["rows"]})
    elapsed = time.monotonic() - began
    result["seconds"] = elapsed
    per_step = f"its {WORKERS} x {GRADIENT_BYTES // MIB} MiB of gradients"
    print_result(result, elapsed, args.quick, per_step)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
