"""Section 5: peak RSS over baseline of the native socket path, sending and receiving."""

from __future__ import annotations

import asyncio
import resource
import socket
import statistics
import zlib
from typing import Any

from .children import ChildError, Contestant, recv_go, run_rounds, turns
from .config import GO, MIB, Config, SessionSpec, make_gradient, size_text
from .results import Results, Row


def _rss_now() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise ChildError("no VmRSS in /proc/self/status")


def _rss_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _rss_sender(out: Any, _: Any, sock: socket.socket, n: int, timeout: float) -> None:
    session = SessionSpec("native", timeout=timeout).make()
    grad = make_gradient(n)
    crc = zlib.crc32(grad.data)
    base = _rss_now()  # the gradient itself is in the baseline

    async def run() -> None:
        if recv_go(sock):
            await session.stream_to(grad, sock)

    asyncio.run(run())
    out.put(("send", _rss_peak() - base, crc))


def _rss_receiver(out: Any, ctl: Any, sock: socket.socket, n: int, timeout: float) -> None:
    session = SessionSpec("native", timeout=timeout).make()
    base = _rss_now()

    async def run() -> Any:
        sock.sendall(GO)
        return await session.receive_from(sock)

    for _ in turns(ctl):  # one turn: ru_maxrss only grows, so each repeat is a new process
        got = asyncio.run(run())
        peak = _rss_peak() - base  # before anything else allocates
        out.put(("recv", peak, zlib.crc32(got) if got.size == n else None))
        del got


def bench_rss(cfg: Config, res: Results) -> None:
    n = cfg.rss_elements
    label = size_text(n * 4)
    send_name = f"send {label}: peak RSS over baseline (gradient in baseline)"
    recv_name = f"receive {label}: peak RSS over baseline"
    sends: list[int] = []
    recvs: list[int] = []
    try:
        for _ in range(cfg.repeats):
            c = Contestant(
                "rss",
                ("recv", _rss_receiver, (n, cfg.stall_timeout)),
                ("send", _rss_sender, (n, cfg.stall_timeout)),
                per_turn=2,
            )
            run_rounds([c], 1, cfg.deadline)
            if c.error is not None:
                raise ChildError(c.error)
            by_side = {m[0]: m for m in c.messages}
            if by_side["recv"][2] != by_side["send"][2]:
                raise ChildError("the received gradient differs from the sent one")
            sends.append(by_side["send"][1])
            recvs.append(by_side["recv"][1])
    except ChildError as exc:
        res.add(Row("rss_send", "rss", send_name, "failed", str(exc)))
        res.add(Row("rss_recv", "rss", recv_name, "failed", str(exc)))
        return
    for key, name, values in (("rss_send", send_name, sends), ("rss_recv", recv_name, recvs)):
        row = Row(key, "rss", name, elements=n, gradient_bytes=n * 4)
        row.peak_over_baseline_mib = statistics.median(values) / MIB
        row.note = f"{row.peak_over_baseline_mib * MIB / (n * 4):.2f} x the gradient"
        res.add(row)
