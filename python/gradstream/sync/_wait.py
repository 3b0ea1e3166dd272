"""The blocking face's waits: one native ``Completions`` per thread, waited on in Rust
(GIL released, signal handlers run between 50 ms slices; crates/gradstream-py/src/
complete.rs, ``Completions.wait``), and what an interrupted call (Ctrl-C) does first."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

from .._native import Completions

_local = threading.local()


def waiter() -> Completions:
    """This thread's ``Completions`` (made on first use)."""
    found: Completions | None = getattr(_local, "completions", None)
    if found is None:
        found = _local.completions = Completions()
    return found


def wait(completions: Completions, job: int) -> Any:
    """The result of ``job``, or its exception raised."""
    ok, value = completions.wait(job)
    if not ok:
        raise value
    return value


@contextlib.contextmanager
def stopping(
    completions: Completions, abandoned: Callable[[], Any] | None = None
) -> Iterator[None]:
    """Around a native call and its wait: when a signal handler's exception (Ctrl-C's
    KeyboardInterrupt, anything not an ``Exception``) comes out, wherever it was raised
    (in the wait, or just after the native call returned a job not yet waited for), the
    thread's jobs are stopped and gone first, then ``abandoned`` runs (the connection's
    post-cancel rule), then the exception goes on."""
    try:
        yield
    except Exception:
        raise
    except BaseException:
        interrupted(completions, abandoned)
        raise


def interrupted(completions: Completions, abandoned: Callable[[], Any] | None = None) -> None:
    """What ``stopping`` does before a signal handler's exception goes on (for a caller
    that cannot afford a context manager: a small transfer's round trip)."""
    completions.stop_all()
    if abandoned is not None:
        abandoned()
