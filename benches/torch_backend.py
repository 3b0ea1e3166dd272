"""The torch.distributed backend against gloo, in the same run (issue 23, section 4):
all-reduce of float32 across 2 and 3 processes, and DDP steps/s of a ~50M-parameter MLP.
The ranks share this host, so the backend's default ("gradstream") meets on Unix
sockets, its bytes through shared memory (issue 24); "gradstream-tcp" is the same over
loopback TCP (``configure(same_host="tcp")``), as ranks of different hosts meet, and
"gradstream-tls" over mutual TLS (TCP: there is no TLS on a Unix socket) when trustme
imports. Each contestant runs in fresh processes, the rounds interleaved; the figures
are the best of the rounds.

    python benches/torch_backend.py [--mib 256] [--ranks 2 3] [--rounds 3] [--ddp-steps 5]
                                    [--no-tls] [--no-ddp] [--json FILE]

Not part of ``make bench`` yet (the suite's rows and ratios are another change).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Any


def _rank(args: list[str]) -> None:
    """One rank: ``what backend rank size folder mib repeats``."""
    what, backend, rank_s, size_s, folder, mib_s, repeats_s = args
    rank, size, repeats = int(rank_s), int(size_s), int(repeats_s)
    import torch
    import torch.distributed as dist

    if backend.startswith("gradstream"):
        import gradstream.torch as gst

        if backend == "gradstream-tls":
            import gradstream as gs

            certs = pathlib.Path(folder).parent / "certs"
            tls = gs.TLS(cert=certs / "server.pem", key=certs / "server.key", ca=certs / "ca.pem")
            gst.configure(listen_tls=tls, connect_tls=tls, same_host="tcp")
        elif backend == "gradstream-tcp":
            gst.configure(same_host="tcp")
    dist.init_process_group(
        backend.split("-")[0],
        init_method=f"file://{folder}/store",
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=120),
    )
    times: list[float] = []
    if what == "allreduce":
        tensor = torch.ones(int(float(mib_s) * (1 << 20)) // 4)
        dist.all_reduce(tensor)  # warm: connections, pages
        for _ in range(repeats):
            dist.barrier()
            started = time.perf_counter()
            dist.all_reduce(tensor)
            times.append(time.perf_counter() - started)
    else:
        width = 3584  # 4 layers of 3584 x 3584: 51.4M parameters
        torch.manual_seed(0)
        layers: list[torch.nn.Module] = []
        for _ in range(4):
            layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*layers[:-1]))
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
        x = torch.randn(16, width)
        for step in range(repeats + 1):
            dist.barrier()
            started = time.perf_counter()
            optimizer.zero_grad()
            model(x).square().mean().backward()
            optimizer.step()
            if step:  # the first builds DDP's buckets
                times.append(time.perf_counter() - started)
    if rank == 0:
        pathlib.Path(folder, "times.json").write_text(json.dumps(times))
    dist.destroy_process_group()


def _run(what: str, backend: str, size: int, mib: float, repeats: int, root: str) -> list[float]:
    folder = tempfile.mkdtemp(dir=root)
    children = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--rank",
                what,
                backend,
                str(rank),
                str(size),
                folder,
                str(mib),
                str(repeats),
            ],
        )
        for rank in range(size)
    ]
    for child in children:
        if child.wait(timeout=600) != 0:
            raise SystemExit(f"{what} over {backend} on {size} ranks failed")
    times: list[float] = json.loads(pathlib.Path(folder, "times.json").read_text())
    return times


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        _rank(sys.argv[2:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=float, default=256.0)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ddp-steps", type=int, default=5)
    parser.add_argument("--no-tls", action="store_true")
    parser.add_argument("--no-ddp", action="store_true")
    parser.add_argument("--json", help="also write the rows to this file")
    options = parser.parse_args()
    backends = ["gloo", "gradstream", "gradstream-tcp"]
    with tempfile.TemporaryDirectory() as root:
        if not options.no_tls:
            try:
                sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "tests"))
                from support.certs import make_certificates

                os.mkdir(f"{root}/certs")
                make_certificates(pathlib.Path(root, "certs"))
                backends.append("gradstream-tls")
            except ImportError:
                print("trustme not installed: no TLS row")
        best: dict[tuple[str, str, int], float] = {}
        for _ in range(options.rounds):
            for size in options.ranks:
                for backend in backends:
                    seconds = min(
                        _run("allreduce", backend, size, options.mib, options.repeats, root)
                    )
                    key = ("allreduce", backend, size)
                    best[key] = min(best.get(key, seconds), seconds)
                    if not options.no_ddp and backend in ("gloo", "gradstream") and size == 2:
                        steps = _run("ddp", backend, size, 0, options.ddp_steps, root)
                        key = ("ddp", backend, size)
                        best[key] = min(best.get(key, min(steps)), min(steps))
    rows: list[dict[str, Any]] = []
    for (what, backend, size), seconds in sorted(best.items()):
        if what == "allreduce":
            figure = options.mib * (1 << 20) / seconds / 1e9
            unit = "GB/s (tensor bytes / time)"
        else:
            figure, unit = 1.0 / seconds, "steps/s"
        gloo = best[(what, "gloo", size)]
        rows.append(
            {
                "what": what,
                "backend": backend,
                "ranks": size,
                "figure": figure,
                "unit": unit,
                "x_gloo": gloo / seconds,
            }
        )
        print(
            f"{what:9} {backend:15} {size} ranks  {figure:8.3f} {unit}  "
            f"{gloo / seconds:5.2f} x gloo"
        )
    if options.json:
        pathlib.Path(options.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
