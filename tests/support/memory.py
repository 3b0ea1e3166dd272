"""Memory figures of this process, from /proc."""

from __future__ import annotations


def proc_status(key: str) -> int:
    """A size from /proc/self/status (VmRSS, VmHWM...), in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {key} in /proc/self/status")
