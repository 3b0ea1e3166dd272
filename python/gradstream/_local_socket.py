"""A Unix socket of this process's own, for peers of its host (the Ray transport's
makers, the parameter server, the torch backend's ranks: docs/guides/same-host.md), and
the identity that tells whether two processes share a host closely enough to use it."""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import shutil
import sys
import tempfile
import threading
import time

from ._address import UNIX_PATH_MOST

# A directory left by a process that was killed (no exit handler ran) is removed by the
# next process that makes one of the same kind, once it is older than this and nobody
# holds its socket's lock: a directory made a moment ago may still await its listener.
_STALE_AFTER = 60.0

_made_lock = threading.Lock()
# The directories this process made and has not removed yet, by the process that made
# them (a forked child removes none of its parent's).
_made: dict[str, int] = {}


class SocketDirectory:
    """A directory of mode 0700 holding one socket path (``address``, as
    ``"unix:PATH"``), removed by ``remove`` or when the process that made it exits;
    stale ones of the same ``prefix`` (their listener gone) are swept first."""

    def __init__(self, prefix: str) -> None:
        _sweep(prefix)
        self._directory = tempfile.mkdtemp(prefix=prefix)
        path = os.path.join(self._directory, "s.sock")
        if len(os.fsencode(path)) > UNIX_PATH_MOST:
            shutil.rmtree(self._directory, ignore_errors=True)
            raise ValueError(
                f"{path} is longer than the {UNIX_PATH_MOST} bytes a Unix socket path may have "
                "(set TMPDIR to a shorter directory)"
            )
        self.address = f"unix:{path}"
        with _made_lock:
            _made[self._directory] = os.getpid()

    def remove(self) -> None:
        with _made_lock:
            _made.pop(self._directory, None)
        shutil.rmtree(self._directory, ignore_errors=True)


@atexit.register
def _remove_made() -> None:
    with _made_lock:
        own = [d for d, maker in _made.items() if maker == os.getpid()]
        _made.clear()
    for directory in own:
        shutil.rmtree(directory, ignore_errors=True)


def _sweep(prefix: str) -> None:
    """Remove directories of ``prefix`` in the temporary directory that this user owns,
    that are older than ``_STALE_AFTER`` and whose socket's lock (held by its listener
    for its whole life) nobody holds: what a killed process left."""
    root = tempfile.gettempdir()
    with contextlib.suppress(OSError):
        for entry in os.scandir(root):
            if not entry.name.startswith(prefix):
                continue
            with contextlib.suppress(OSError):
                info = entry.stat(follow_symlinks=False)
                if (
                    not entry.is_dir(follow_symlinks=False)
                    or info.st_uid != os.getuid()
                    or time.time() - info.st_mtime < _STALE_AFTER
                    or _held(os.path.join(entry.path, "s.sock.lock"))
                ):
                    continue
                shutil.rmtree(entry.path, ignore_errors=True)


def _held(lock_path: str) -> bool:
    """Whether a listener holds the lock at ``lock_path`` (a missing lock file: none)."""
    try:
        fd = os.open(lock_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def host_identity() -> str | None:
    """What two processes must share to reach each other's Unix sockets and shared
    memory as the same-host transport expects: one running kernel (its boot id), one
    mount and one network namespace (a rank in a namespace of its own stands for another
    machine), one user. None where this cannot be told (not Linux)."""
    if sys.platform != "linux":
        return None
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            boot_id = boot.read().strip()
        mounts = os.stat("/proc/self/ns/mnt").st_ino
        network = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return None
    return f"{boot_id}/{mounts}/{network}/{os.getuid()}"
