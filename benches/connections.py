"""Connections against the bare socket path (docs/performance.md): one gradient moved
between two processes over loopback TCP, by

* `raw`: the gradient's bytes as one `sendall` / `recv_into` the same `out=` array in
  slices, on the same socket as `bare` (no frames, no CRC: the issue's fair baseline for
  a receive into `out=`);
* `bare`: `stream_to(grad, sock)` / `receive_from(sock, out=)` on a plain TCP socket;
* `plain`: a `gradstream.connect` / `listen` connection (hello, seal, ack);
* `authkey`: the same with an authkey;
* `tls`: the same over TLS 1.3 (rustls, AES-GCM; certificates made here with trustme).

    python benches/connections.py [--quick] [--elements N] [--layout seed|compact]

Timing: both processes stay connected on all four for every repeat. For each turn the
receiver starts its receive into a pre-faulted `out=` array and says so on a pipe; the
parent then tells the sender to go; the sender reads CLOCK_MONOTONIC (t0) and sends; the
receiver reads it when the array is whole (t1); t1 - t0 spans the first byte to the last
(a connection's sender returns later still, once the ack is back: that wait is not in the
figure, being one round trip). Turns go in rounds (raw bare plain authkey tls, raw bare ...)
so a slow stretch of the shared machine hits all alike; figures are medians, and the
ratios printed are of figures of this one run. Targets (issues 11, 12): bare >= 0.9 x
raw; plain >= 0.95 x bare; TLS >= 0.6 x plain.

Beside each rate: the CPU time each process spent on the transfer (every thread, user
and system; the sender's until its call returned), in seconds per GiB of gradient. On a
machine shared with other work the rates follow what the processes were given; the CPU
costs say what each path asks of a core, whatever the load.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import resource
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

KINDS = ("raw", "bare", "plain", "authkey", "tls")
KEY = b"benchmark authkey, 32 bytes long"
TARGETS = {("bare", "raw"): 0.9, ("plain", "bare"): 0.95, ("tls", "plain"): 0.6}


def _tls_files(folder: Path) -> dict[str, str]:
    import trustme

    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1")
    paths = {name: str(folder / f"{name}.pem") for name in ("ca", "cert", "key")}
    ca.cert_pem.write_to_path(paths["ca"])
    server.private_key_pem.write_to_path(paths["key"])
    server.cert_chain_pems[0].write_to_path(paths["cert"])
    return paths


def _session(gs: Any, layout: str) -> Any:
    return gs.GradientStreamSession("bench", layout=layout, timeout=60)


def _cpu_seconds() -> float:
    """CPU time of this process, every thread (tokio's too), user and system."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _recv_into(sock: socket.socket, out: np.ndarray) -> None:
    """Fill `out` from `sock` in slices, as `recv_into` gives them."""
    view, got = out.data.cast("B"), 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("the sender closed early")
        got += n


def receiver(pipe: Any, elements: int, layout: str, files: dict[str, str]) -> None:
    import gradstream as gs

    async def main() -> None:
        s = _session(gs, layout)
        out = np.ones(elements, np.float32)  # pre-faulted
        bare = socket.create_server(("127.0.0.1", 0))
        listeners = {
            "plain": await gs.listen("127.0.0.1:0", session=s),
            "authkey": await gs.listen("127.0.0.1:0", session=s, authkey=KEY),
            "tls": await gs.listen(
                "127.0.0.1:0", session=s, tls=gs.TLS(cert=files["cert"], key=files["key"])
            ),
        }
        ports = {k: v.address[1] for k, v in listeners.items()}
        ports["bare"] = bare.getsockname()[1]
        pipe.send(ports)
        loop = asyncio.get_running_loop()
        sock, _ = await loop.run_in_executor(None, bare.accept)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conns = {k: await v.accept() for k, v in listeners.items()}
        while True:
            kind = await loop.run_in_executor(None, pipe.recv)
            if kind is None:
                return
            task: asyncio.Future[Any]
            if kind == "raw":
                task = loop.run_in_executor(None, _recv_into, sock, out)
            elif kind == "bare":
                task = asyncio.ensure_future(s.receive_from(sock, out=out))
            else:
                task = asyncio.ensure_future(conns[kind].recv(out))
            await asyncio.sleep(0)
            pipe.send("ready")
            cpu = _cpu_seconds()
            await task
            pipe.send((time.monotonic(), _cpu_seconds() - cpu))

    asyncio.run(main())


def sender(
    pipe: Any, ports: dict[str, int], grad_len: int, layout: str, files: dict[str, str]
) -> None:
    import gradstream as gs

    async def main() -> None:
        s = _session(gs, layout)
        grad = np.arange(grad_len, dtype=np.float32)
        sock = socket.create_connection(("127.0.0.1", ports["bare"]))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conns = {
            "plain": await gs.connect(("127.0.0.1", ports["plain"]), session=s),
            "authkey": await gs.connect(("127.0.0.1", ports["authkey"]), session=s, authkey=KEY),
            "tls": await gs.connect(
                ("127.0.0.1", ports["tls"]), session=s, tls=gs.TLS(ca=files["ca"])
            ),
        }
        loop = asyncio.get_running_loop()
        pipe.send("connected")
        while True:
            kind = await loop.run_in_executor(None, pipe.recv)
            if kind is None:
                return
            t0, cpu = time.monotonic(), _cpu_seconds()
            if kind == "raw":
                await loop.run_in_executor(None, sock.sendall, grad.data.cast("B"))
            elif kind == "bare":
                await s.stream_to(grad, sock)
            else:
                await conns[kind].send(grad)
            pipe.send((t0, _cpu_seconds() - cpu))

    asyncio.run(main())


def measure(elements: int, repeats: int, layout: str) -> dict[str, list[float]]:
    """Seconds of each repeat of each kind, in interleaved rounds (benches/suite calls this
    for its connection rows)."""
    return measure_with_cpu(elements, repeats, layout)[0]


Times = dict[str, list[float]]
CpuTimes = dict[str, list[tuple[float, float]]]


def measure_with_cpu(elements: int, repeats: int, layout: str) -> tuple[Times, CpuTimes]:
    """measure's seconds, and the CPU seconds (receiver, sender) of each repeat."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as folder:
        files = _tls_files(Path(folder))
        r_here, r_there = ctx.Pipe()
        s_here, s_there = ctx.Pipe()
        recv_proc = ctx.Process(target=receiver, args=(r_there, elements, layout, files))
        recv_proc.start()
        ports = r_here.recv()
        send_proc = ctx.Process(target=sender, args=(s_there, ports, elements, layout, files))
        send_proc.start()
        assert s_here.recv() == "connected"
        times: dict[str, list[float]] = {k: [] for k in KINDS}
        cpus: dict[str, list[tuple[float, float]]] = {k: [] for k in KINDS}
        try:
            for _ in range(repeats):
                for kind in KINDS:
                    r_here.send(kind)
                    assert r_here.recv() == "ready"
                    s_here.send(kind)
                    t0, sender_cpu = s_here.recv()
                    t1, receiver_cpu = r_here.recv()
                    times[kind].append(t1 - t0)
                    cpus[kind].append((receiver_cpu, sender_cpu))
        finally:
            r_here.send(None)
            s_here.send(None)
            recv_proc.join(30)
            send_proc.join(30)
    return times, cpus


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 repeats of 256 MiB")
    parser.add_argument("--elements", type=int, help="float32 values (default 2^28: 1 GiB)")
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--layout", default="compact", choices=("seed", "compact"))
    args = parser.parse_args(argv)
    elements = args.elements or (2**26 if args.quick else 2**28)
    repeats = args.repeats or (3 if args.quick else 5)
    times, cpus = measure_with_cpu(elements, repeats, args.layout)
    size = elements * 4
    print(
        f"connections: {elements:,} float32 values ({size / 2**30:.2f} GiB), layout "
        f"{args.layout}, median of {repeats}, GB/s of gradient"
    )
    rate = {k: size / statistics.median(v) / 1e9 for k, v in times.items()}
    gib = size / 2**30
    for kind in KINDS:
        receiver_cpu = statistics.median(r for r, _ in cpus[kind]) / gib
        sender_cpu = statistics.median(s for _, s in cpus[kind]) / gib
        print(
            f"  {kind:8s} {rate[kind]:6.2f} GB/s   CPU s per GiB: receiver {receiver_cpu:.2f}, "
            f"sender {sender_cpu:.2f}"
        )
    ok = True
    for (a, b), target in TARGETS.items():
        ratio = rate[a] / rate[b]
        verdict = "ok" if ratio >= target else "BELOW TARGET"
        ok &= ratio >= target
        print(f"  {a} / {b} = {ratio:.2f} (target >= {target}) {verdict}")
    print(f"  authkey / plain = {rate['authkey'] / rate['plain']:.2f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
