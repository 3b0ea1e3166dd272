"""A Unix socket of this process's own, for peers of its host (the Ray transport's
makers, the torch backend's ranks: docs/guides/same-host.md), and the identity that
tells whether two processes share a host closely enough to use it."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile

# The longest Unix socket path the kernel takes (sun_path less its NUL).
MAX_PATH = 107


class SocketDirectory:
    """A directory of mode 0700 holding one socket path (``address``, as
    ``"unix:PATH"``), removed by ``remove`` or when the process that made it exits (not
    a child forked after)."""

    def __init__(self, prefix: str) -> None:
        self._directory = tempfile.mkdtemp(prefix=prefix)
        path = os.path.join(self._directory, "s.sock")
        if len(os.fsencode(path)) > MAX_PATH:
            self.remove()
            raise ValueError(
                f"{path} is longer than the {MAX_PATH} bytes a Unix socket path may have "
                "(set TMPDIR to a shorter directory)"
            )
        self.address = f"unix:{path}"
        atexit.register(_remove_own, self._directory, os.getpid())

    def remove(self) -> None:
        shutil.rmtree(self._directory, ignore_errors=True)


def _remove_own(directory: str, maker: int) -> None:
    if os.getpid() == maker:
        shutil.rmtree(directory, ignore_errors=True)


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
