"""Section 6: gs.Connection (plain, authkey, TLS) against the bare socket path, measured by
benches/connections.py's own `measure` (its four kinds in interleaved rounds, in two
processes of its own), so that one benchmark run prints these ratios too and the script
still runs alone."""

from __future__ import annotations

import contextlib
import importlib.util
import multiprocessing as mp
import signal
import sys
from pathlib import Path
from types import FrameType, ModuleType

from .children import ChildError
from .config import Config, importable, size_text
from .results import Results, Row, timed_row

# The script checks no bits itself: the connection's CRCs and its ack's digest do (and the
# bare receive's CRCs).
NOTE = "by benches/connections.py: its own two processes, no bit-for-bit check"
SCRIPT = Path(__file__).resolve().parent.parent / "connections.py"
LAYOUT = "compact"  # the script's default: TLS moves twice the wire bytes in the seed one
NAMES = {
    "bare": "bare stream_to / receive_from on a TCP socket",
    "plain": "gs.Connection, plain (hello, seal, ack)",
    "authkey": "gs.Connection with an authkey",
    "tls": "gs.Connection over TLS 1.3 (AES-128-GCM)",
}


def _script() -> ModuleType:
    """benches/connections.py as the module `connections`: its children are spawned, and
    find their functions by that name on sys.path (hence its folder is put there)."""
    folder = str(SCRIPT.parent)
    if folder not in sys.path:
        sys.path.append(folder)
    module = sys.modules.get("connections")
    if module is None or Path(getattr(module, "__file__", "")).resolve() != SCRIPT:
        spec = importlib.util.spec_from_file_location("connections", SCRIPT)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["connections"] = module
        spec.loader.exec_module(module)
    return module


def _out_of_time(signum: int, frame: FrameType | None) -> None:
    raise ChildError("benches/connections.py did not finish in time")


def _measure(cfg: Config) -> dict[str, list[float]]:
    """The script's measurement under a deadline: it waits on its pipes without one, so a
    child that dies early would hold this run forever."""
    limit = max(1, round(cfg.deadline * (cfg.repeats + 1)))  # alarm(0) would be none
    previous = signal.signal(signal.SIGALRM, _out_of_time)
    signal.alarm(limit)
    try:
        times: dict[str, list[float]] = _script().measure(cfg.e2e_elements, cfg.repeats, LAYOUT)
        return times
    except BaseException:
        for child in mp.active_children():  # the suite's own are gone by now: these are its
            child.kill()
            with contextlib.suppress(Exception):
                child.join(5)
        raise
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def bench_connections(cfg: Config, res: Results) -> None:
    n = cfg.e2e_elements
    label = f"{LAYOUT}, {size_text(n * 4)}, into out="
    keys = {kind: f"conn_{kind}" for kind in NAMES}
    if not importable("trustme"):  # the script makes its TLS certificates with it
        for kind, key in keys.items():
            name = f"{NAMES[kind]}, {label}"
            res.add(Row(key, "connections", name, "skipped", "trustme is not importable"))
        return
    try:
        times = _measure(cfg)
    except Exception as exc:
        for kind, key in keys.items():
            why = f"{type(exc).__name__}: {exc}"
            res.add(Row(key, "connections", f"{NAMES[kind]}, {label}", "failed", why))
        return
    for kind, key in keys.items():
        samples = times.get(kind, [])
        name = f"{NAMES[kind]}, {label}"
        if len(samples) != cfg.repeats:
            res.add(Row(key, "connections", name, "failed", "missing repeats"))
            continue
        row = timed_row(key, "connections", name, samples, elements=n, gradient_bytes=n * 4)
        row.note = NOTE
        res.add(row)
