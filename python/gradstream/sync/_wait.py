"""The blocking face's waits: one native ``Completions`` per thread, waited on in Rust
(GIL released, signal handlers run between 50 ms slices; crates/gradstream-py/src/
complete.rs, ``Completions.wait``)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from .._native import Completions

_local = threading.local()


def waiter() -> Completions:
    """This thread's ``Completions`` (made on first use)."""
    found: Completions | None = getattr(_local, "completions", None)
    if found is None:
        found = _local.completions = Completions()
    return found


def wait(completions: Completions, job: int, interrupted: Callable[[], Any] | None = None) -> Any:
    """The result of ``job``, or its exception raised. When a signal handler raises
    (Ctrl-C), the job is stopped and gone first (in Rust), then ``interrupted`` runs
    (the connection's post-cancel rule), then the handler's exception goes on."""
    try:
        ok, value = completions.wait(job)
    except BaseException:
        if interrupted is not None:
            interrupted()
        raise
    if not ok:
        raise value
    return value
