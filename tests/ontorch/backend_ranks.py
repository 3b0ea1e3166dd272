"""One rank of the gradstream backend's tests (tests/ontorch/test_backend_*.py), run as
``python backend_ranks.py SCENARIO RANK SIZE FOLDER``: the ranks meet through a
FileStore in FOLDER and each writes what it saw to FOLDER/<rank>.npz (or .json)."""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from typing import NoReturn

import numpy as np
import torch
import torch.distributed as dist

import gradstream.torch as gst

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
}
LENGTHS = (1001, 2)


def values(rank: int, length: int, dtype: torch.dtype) -> torch.Tensor:
    rng = np.random.default_rng(1000 * rank + length)
    return torch.from_numpy(rng.standard_normal(length).astype(np.float32)).to(dtype)


def bits(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().view(-1).view(torch.uint8).numpy().copy()


def init(
    rank: int, size: int, folder: str, seconds: float = 20.0, backend: str = "gradstream"
) -> None:
    same_host = os.environ.get("GRADSTREAM_TEST_SAME_HOST")  # backend_launch.launch's
    if same_host is not None:
        gst.configure(same_host=same_host)  # type: ignore[arg-type]
    dist.init_process_group(
        backend,
        init_method=f"file://{folder}/store",
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=seconds),
    )


def route() -> np.ndarray:
    """Where this rank's ring connection to the next rank goes (its peer's address, as
    text bytes): a "unix:" path or a TCP address."""
    group = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    return np.frombuffer(str(group._next.peer.address).encode(), np.uint8)


def collectives(rank: int, size: int, folder: str) -> None:
    init(rank, size, folder)
    seen: dict[str, np.ndarray] = {"route": route()}
    for name, dtype in DTYPES.items():
        for length in LENGTHS:
            for op_name, op in OPS.items():
                t = values(rank, length, dtype)
                dist.all_reduce(t, op=op)
                seen[f"allreduce/{name}/{length}/{op_name}"] = bits(t)
    # A tensor that is not contiguous (every other column), and an async Work.
    t = values(rank, 24, torch.float32).view(4, 6)[:, ::2]
    dist.all_reduce(t, async_op=True).wait()
    seen["allreduce/strided"] = bits(t)
    b = values(rank, 7, torch.float64)
    dist.broadcast(b, src=size - 1)
    seen["broadcast"] = bits(b)
    n = torch.arange(5, dtype=torch.int64) * (rank + 1)
    dist.broadcast(n, src=0)
    seen["broadcast/int64"] = bits(n)
    outs = [torch.zeros(3, dtype=torch.bfloat16) for _ in range(size)]
    dist.all_gather(outs, values(rank, 3, torch.bfloat16))
    seen["allgather"] = bits(torch.cat(outs))
    whole = torch.zeros(size * 4)
    dist.all_gather_into_tensor(whole, values(rank, 4, torch.float32))
    seen["allgather_base"] = bits(whole)
    for name in ("float32", "bfloat16"):
        part = torch.zeros(5, dtype=DTYPES[name])
        dist.reduce_scatter_tensor(part, values(rank, 5 * size, DTYPES[name]))
        seen[f"reduce_scatter/{name}"] = bits(part)
    part = torch.zeros(2)
    dist.reduce_scatter(
        part, list(values(rank, 2 * size, torch.float32).chunk(size)), op=dist.ReduceOp.AVG
    )
    seen["reduce_scatter/list"] = bits(part)
    dist.barrier()
    seen["backend"] = np.frombuffer(dist.get_backend().encode(), np.uint8)
    # Queued without waiting, then the group destroyed: the all-reduce still completes
    # (shutdown closes the connections after the collectives queued before it).
    last = torch.ones(1000)
    work = dist.all_reduce(last, async_op=True)
    # So does a send/recv queued before (between the first and the last rank).
    point = torch.full((3,), float(rank))
    pending = []
    if rank == 0:
        pending.append(dist.isend(point, dst=size - 1, tag=4))
    elif rank == size - 1:
        pending.append(dist.irecv(point, src=0, tag=4))
    group = dist.group.WORLD
    dist.destroy_process_group()
    work.wait()
    for queued in pending:
        queued.wait()
    seen["before_shutdown"] = bits(last)
    seen["p2p_before_shutdown"] = bits(point)
    np.savez(f"{folder}/{rank}.npz", **seen)
    del group


INT8_LENGTH = 300_001  # several chunks a segment on 3 ranks, an uneven end


def int8(rank: int, size: int, folder: str) -> None:
    """configure(reduce_wire_dtype="int8"): float32 sums and averages on the int8 wire,
    everything else as it is."""
    gst.configure(reduce_wire_dtype="int8")
    try:
        init(rank, size, folder)
    finally:
        gst.configure(reduce_wire_dtype="none")
    seen: dict[str, np.ndarray] = {}
    for op_name in ("sum", "avg"):
        t = values(rank, INT8_LENGTH, torch.float32)
        dist.all_reduce(t, op=OPS[op_name])
        seen[f"allreduce/{op_name}"] = bits(t)
    # Blocks a few steps of the smallest subnormal large, whose scale rounded to nearest
    # would leave the largest value on step 126 (and re-quantize differently).
    tiny = np.array([2.0**-136, 0.3 * 2.0**-136, -0.61 * 2.0**-136], np.float32)
    t = torch.from_numpy(np.tile(tiny, 1000) if rank == 0 else np.zeros(3000, np.float32))
    dist.all_reduce(t)
    seen["allreduce/subnormal"] = bits(t)
    t = values(rank, 1001, torch.float64)  # not float32: exact
    dist.all_reduce(t)
    seen["allreduce/float64"] = bits(t)
    b = values(rank, 5000, torch.float32)
    dist.broadcast(b, src=size - 1)
    seen["broadcast"] = bits(b)
    part = torch.zeros(INT8_LENGTH // size)
    dist.reduce_scatter_tensor(part, values(rank, part.numel() * size, torch.float32))
    seen["reduce_scatter"] = bits(part)
    dist.destroy_process_group()
    np.savez(f"{folder}/{rank}.npz", **seen)


STREAMED_LENGTH = 200_003


def streamed(rank: int, size: int, folder: str) -> None:
    """configure(streams=3) between ranks meeting over TCP: each ring connection runs
    over 3 streams; the collectives' bits are what one stream gives."""
    gst.configure(streams=3, same_host="tcp")
    try:
        init(rank, size, folder)
    finally:
        gst.configure(streams=1, same_host="unix")
    group = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    seen: dict[str, np.ndarray] = {
        "streams": np.array([group._next.streams, group._prev.streams]),
        "resumes": np.array([group._next.resumes, group._prev.resumes]),
    }
    t = values(rank, STREAMED_LENGTH, torch.float32)
    dist.all_reduce(t)
    seen["allreduce"] = bits(t)
    b = values(rank, 5000, torch.float32)
    dist.broadcast(b, src=size - 1)
    seen["broadcast"] = bits(b)
    dist.destroy_process_group()
    np.savez(f"{folder}/{rank}.npz", **seen)


def record(folder: str, rank: int, outcome: dict[str, object]) -> NoReturn:
    """Write a rank's outcome where ``backend_launch.outcome`` reads it, and end the rank
    at once (a failed group has no clean teardown)."""
    with open(f"{folder}/{rank}.json", "w") as out:
        json.dump(outcome, out)
    os._exit(0)


def int8_mismatch(rank: int, size: int, folder: str) -> None:
    """Rank 0 sets reduce_wire_dtype="int8", the others do not: every rank refuses the
    group at init_process_group."""
    if rank == 0:
        gst.configure(reduce_wire_dtype="int8")
    outcome: dict[str, object] = {}
    started = time.monotonic()
    try:
        init(rank, size, folder, seconds=5.0)
        outcome["joined"] = True
    except Exception as exc:
        outcome["error"] = type(exc).__name__
        outcome["message"] = str(exc)
    outcome["seconds"] = time.monotonic() - started
    record(folder, rank, outcome)


def pairs(rank: int, size: int, folder: str) -> None:
    """Send/recv between every two ranks, tags, the collectives made of pairs and the
    coalesced ones; last, a receive of the wrong size (which fails the group)."""
    init(rank, size, folder)
    seen: dict[str, np.ndarray] = {"route": route()}
    others = [k for k in range(size) if k != rank]
    if rank == 0:  # rank 1's listener, open for the group's life, refuses a stranger
        import gradstream.sync

        address = dist.group.WORLD._links._addresses[1]  # type: ignore[union-attr]
        try:
            gradstream.sync.connect(address, authkey=b"not the group's key", timeout=5).close()
        except Exception as exc:
            seen["stranger"] = np.frombuffer(type(exc).__name__.encode(), np.uint8)
    # Every rank to every other at once, a tag per dtype; received in reverse tag order.
    works, got = [], {}
    for tag, dtype in enumerate(DTYPES.values()):
        for k in others:
            works.append(dist.isend(values(10 * rank + k, 6, dtype), dst=k, tag=tag))
    for tag, (name, dtype) in reversed(list(enumerate(DTYPES.items()))):
        for k in others:
            got[f"p2p/{k}/{name}"] = torch.zeros(6, dtype=dtype)
            works.append(dist.irecv(got[f"p2p/{k}/{name}"], src=k, tag=tag))
    for work in works:
        work.wait()
    seen.update({key: bits(t) for key, t in got.items()})
    # Blocking, in order on one channel, between the first and the last rank; a
    # tensor that is not contiguous on both ends.
    if rank in (0, size - 1):
        peer = size - 1 - rank
        if rank == 0:
            dist.send(values(1, 4, torch.float64), dst=peer)
            dist.send(values(2, 12, torch.float32).view(3, 4)[:, ::2], dst=peer)
            dist.send(torch.arange(5, dtype=torch.int64) - 2, dst=peer)  # as its bytes
        else:
            first, second = torch.zeros(4, dtype=torch.float64), torch.zeros(3, 4)[:, 1::2]
            third = torch.zeros(5, dtype=torch.int64)
            dist.recv(first, src=peer)
            dist.recv(second, src=peer)
            dist.recv(third, src=peer)
            seen["inorder"] = np.concatenate([bits(first), bits(second), bits(third)])
    # Around the ring, both ways at once (batch_isend_irecv).
    left, right = torch.zeros(3, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.bfloat16)
    ops = [
        dist.P2POp(dist.isend, values(rank, 3, torch.bfloat16), (rank + 1) % size),
        dist.P2POp(dist.isend, values(rank + 50, 3, torch.bfloat16), (rank - 1) % size),
        dist.P2POp(dist.irecv, left, (rank - 1) % size),
        dist.P2POp(dist.irecv, right, (rank + 1) % size),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    seen["batch"] = np.concatenate([bits(left), bits(right)])
    try:
        dist.recv(torch.zeros(1), tag=5)
    except Exception as exc:
        seen["anysource"] = np.frombuffer(f"{type(exc).__name__}: {exc}".encode(), np.uint8)
    for name, dtype in DTYPES.items():
        mine = values(rank, 5, dtype)
        into = [torch.zeros(5, dtype=dtype) for _ in range(size)]
        dist.gather(mine, into if rank == size - 1 else None, dst=size - 1)
        if rank == size - 1:
            seen[f"gather/{name}"] = bits(torch.cat(into))
        part = torch.zeros(2, 3, dtype=dtype)
        parts = [values(k, 6, dtype).view(2, 3) for k in range(size)]
        dist.scatter(part, parts if rank == 0 else None, src=0)
        seen[f"scatter/{name}"] = bits(part)
        out = torch.zeros(2 * size, dtype=dtype)
        dist.all_to_all_single(out, values(rank, 2 * size, dtype))
        seen[f"alltoall_single/{name}"] = bits(out)
        # Uneven: rank r sends k + r + 1 rows of 2 to rank k (an empty part for none).
        sends = [k + rank + 1 for k in range(size)]
        takes = [rank + k + 1 for k in range(size)]
        out = torch.zeros(sum(takes), 2, dtype=dtype)
        dist.all_to_all_single(out, values(rank, 2 * sum(sends), dtype).view(-1, 2), takes, sends)
        seen[f"alltoall_uneven/{name}"] = bits(out)
        outs = [torch.zeros(k + 1, dtype=dtype) for k in range(size)]
        dist.all_to_all(outs, [values(10 * rank + k, rank + 1, dtype) for k in range(size)])
        seen[f"alltoall/{name}"] = bits(torch.cat(outs))
        # Coalesced, as FSDP and the bucketed paths call them (one Work for all).
        lengths = (3 * size, 7 * size)
        wholes = [torch.zeros(size * n, dtype=dtype) for n in lengths]
        reduced = [torch.zeros(n // size, dtype=dtype) for n in lengths]
        summed = [values(rank + 7, n, dtype) for n in lengths]
        with dist._coalescing_manager(async_ops=True) as cm:
            for whole, n in zip(wholes, lengths, strict=True):
                dist.all_gather_into_tensor(whole, values(rank, n, dtype))
        cm.wait()
        with dist._coalescing_manager(async_ops=True) as cm:
            for part, n in zip(reduced, lengths, strict=True):
                dist.reduce_scatter_tensor(part, values(rank + 3, n, dtype))
        cm.wait()
        with dist._coalescing_manager(async_ops=True) as cm:
            for t in summed:
                dist.all_reduce(t)
        cm.wait()
        reduced_at = values(rank + 9, 5, dtype)
        dist.reduce(reduced_at, dst=size - 1, op=dist.ReduceOp.MAX)
        if rank == size - 1:
            seen[f"reduce/{name}"] = bits(reduced_at)
        lists = [[torch.zeros(2, dtype=dtype), torch.zeros(3, dtype=dtype)] for _ in range(size)]
        dist.all_gather_coalesced(lists, [values(rank, 2, dtype), values(rank + 5, 3, dtype)])
        seen[f"all_gather_coalesced/{name}"] = bits(torch.cat([t for ts in lists for t in ts]))
        seen[f"allgather_coalesced/{name}"] = bits(torch.cat(wholes))
        seen[f"reduce_scatter_coalesced/{name}"] = bits(torch.cat(reduced))
        seen[f"allreduce_coalesced/{name}"] = bits(torch.cat(summed))
    if size == 3:  # a group of the first and the last rank: its ranks 0 and 1
        sub = dist.new_group([0, 2], backend="gradstream")
        if rank != 1:
            t = values(rank, 5, torch.float32)
            dist.all_reduce(t, group=sub)
            seen["subgroup/allreduce"] = bits(t)
            if rank == 0:
                dist.send(values(30, 3, torch.float32), dst=2, group=sub)
            else:
                got_sub = torch.zeros(3)
                dist.recv(got_sub, src=0, group=sub)
                seen["subgroup/recv"] = bits(got_sub)
    # Last: 5 values sent where 4 are expected; both ends fail, with our error.
    if rank in (0, 1):
        try:
            if rank == 0:
                dist.send(torch.ones(5), dst=1, tag=9)
            else:
                dist.recv(torch.zeros(4), src=0, tag=9)
        except Exception as exc:
            seen["mismatch"] = np.frombuffer(f"{type(exc).__name__}: {exc}".encode(), np.uint8)
    np.savez(f"{folder}/{rank}.npz", **seen)
    os._exit(0)  # the group failed (the mismatch): no clean teardown


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def train(rank: int, group: object) -> dict[str, np.ndarray]:
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(MLP(), process_group=group)
    steps(model, rank, 4)
    return {k: v.detach().numpy().copy() for k, v in model.module.state_dict().items()}


def steps(model: torch.nn.Module, rank: int, count: int) -> None:
    """``count`` SGD steps on this rank's own batches (seeded by the rank)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(100 + rank)
    for _ in range(count):
        x = torch.randn(8, 16, generator=data)
        y = torch.randn(8, 4, generator=data)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def ddp(rank: int, size: int, folder: str) -> None:
    init(rank, size, folder)
    ours = train(rank, dist.group.WORLD)
    gloo = train(rank, dist.new_group(backend="gloo"))
    np.savez(
        f"{folder}/{rank}.npz",
        **{f"gradstream/{k}": v for k, v in ours.items()},
        **{f"gloo/{k}": v for k, v in gloo.items()},
    )
    dist.destroy_process_group()


def sharded(rank: int, group: object, version: int) -> dict[str, np.ndarray]:
    """A few steps of FSDP (``version`` 2: ``fully_shard``; 1: FullyShardedDataParallel
    on the CPU) over ``group``; the full parameters after them."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

    torch.manual_seed(0)
    model: torch.nn.Module = MLP()
    if version == 2:
        mesh = DeviceMesh.from_group(group, "cpu")  # type: ignore[arg-type]
        for layer in model.layers:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        model = FullyShardedDataParallel(model, process_group=group, device_id=torch.device("cpu"))
    steps(model, rank, 3)
    if version == 2:
        return {k: v.full_tensor().detach().numpy().copy() for k, v in model.named_parameters()}
    with FullyShardedDataParallel.summon_full_params(model):
        # clone() first: .numpy() would pin the storage FSDP frees by resizing it.
        return {k: v.detach().clone().numpy() for k, v in model.named_parameters()}


def fsdp(rank: int, size: int, folder: str) -> None:
    init(rank, size, folder)
    gloo = dist.new_group(backend="gloo")
    seen = {}
    for version in (2, 1):
        for name, group in (("gradstream", dist.group.WORLD), ("gloo", gloo)):
            got = sharded(rank, group, version)
            seen.update({f"fsdp{version}/{name}/{k}": v for k, v in got.items()})
    np.savez(f"{folder}/{rank}.npz", **seen)
    dist.destroy_process_group()


def failure(rank: int, size: int, folder: str, how: str) -> None:
    """The last rank dies (or stalls) after one all-reduce; the others time the next."""
    init(rank, size, folder, seconds=4.0)
    t = torch.ones(1 << 16)
    dist.all_reduce(t)
    if rank == size - 1:
        if how == "die":
            os._exit(3)
        time.sleep(7)
        os._exit(3)
    started = time.monotonic()
    try:
        dist.all_reduce(t)
        outcome = {"error": None}
    except Exception as exc:
        outcome = {"error": type(exc).__name__, "message": str(exc)}
    outcome["seconds"] = time.monotonic() - started
    try:  # a later collective fails at once with the same error
        started = time.monotonic()
        dist.barrier()
    except Exception as exc:
        outcome["later"] = type(exc).__name__
        outcome["later_seconds"] = time.monotonic() - started
    record(folder, rank, outcome)  # the group cannot be torn down cleanly without its last rank


def lost_peer(rank: int, size: int, folder: str) -> None:
    """Send/recv with a rank that dies: the last rank takes one message from rank 0 and
    dies as rank 0 sends the next (16 MiB, more than the sockets hold); rank 1 waits
    for a message the last rank never sends."""
    init(rank, size, folder, seconds=4.0)
    last = size - 1
    if rank == last:
        dist.recv(torch.zeros(1000), src=0)
        time.sleep(0.3)  # rank 0's next send is under way
        os._exit(3)
    started = time.monotonic()
    outcome: dict[str, object] = {}
    try:
        if rank == 0:
            dist.send(torch.ones(1000), dst=last)
            started = time.monotonic()
            dist.send(torch.ones(1 << 22), dst=last)
        else:
            dist.recv(torch.zeros(10), src=last)
        outcome["error"] = None
    except Exception as exc:
        outcome = {"error": type(exc).__name__, "message": str(exc)}
    outcome["seconds"] = time.monotonic() - started
    record(folder, rank, outcome)


def secured(rank: int, size: int, folder: str, key: str, same_host: str) -> None:
    """TLS (mutual) and a configured authkey; ``key`` "mismatch": the last rank's differs.
    ``same_host`` as ``configure`` takes it: "tcp" keeps TLS between these ranks of one
    host, "unix" meets on Unix sockets under the authkey alone. Records where the ring's
    connections go (``routes``: the next rank's, the previous one's peer address)."""
    from support.certs import Certificates

    certs = Certificates(__import__("pathlib").Path(folder) / "certs")
    authkey = b"k" * 32 if key == "same" or rank != size - 1 else b"x" * 32
    gst.configure(
        listen_tls=certs.mutual_server,
        connect_tls=certs.mutual_client,
        authkey=authkey,
        same_host=same_host,  # type: ignore[arg-type]
    )
    outcome: dict[str, object] = {}
    started = time.monotonic()
    try:
        init(rank, size, folder, seconds=5.0)
        t = values(rank, 1000, torch.float32)
        dist.all_reduce(t)
        outcome["sum"] = bits(t).tolist()
        group = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        outcome["routes"] = [str(group._next.peer.address), str(group._prev.peer.address)]
        outcome["tls"] = [group._next.peer.tls_subject, group._prev.peer.tls_subject]
        own = group._socket_dir
        dist.destroy_process_group()
        # Its socket's directory goes with the group (None: it had none); the socket
        # file alone would go with its listener anyway.
        outcome["socket_left"] = (
            None
            if own is None
            else os.path.exists(os.path.dirname(own.address.removeprefix("unix:")))
        )
    except Exception as exc:
        outcome["error"] = type(exc).__name__
        outcome["message"] = str(exc)
    outcome["seconds"] = time.monotonic() - started
    record(folder, rank, outcome)


if __name__ == "__main__":
    scenario, rank_text, size_text, where = sys.argv[1:5]
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    args = (int(rank_text), int(size_text), where)
    if scenario == "collectives":
        collectives(*args)
    elif scenario == "pairs":
        pairs(*args)
    elif scenario == "lost-peer":
        lost_peer(*args)
    elif scenario == "fsdp":
        fsdp(*args)
    elif scenario == "ddp":
        ddp(*args)
    elif scenario == "int8":
        int8(*args)
    elif scenario == "int8-mismatch":
        int8_mismatch(*args)
    elif scenario == "streams":
        streamed(*args)
    elif scenario in ("die", "stall"):
        failure(*args, scenario)
    else:  # secured-KEY-SAME_HOST
        _, key, same_host = scenario.split("-")
        secured(*args, key, same_host)
