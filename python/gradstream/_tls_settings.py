"""``TLS``, the TLS settings of one side of a connection (docs/guides/connections.md):
PEM file paths, checked to exist and be readable where the user gives them, and what a
listener (its certificate and key) and a client (the CA) each need of them.

Plain Python over ``errors`` only: ``gradstream.ray`` checks its settings with it before
any connection is made, and the files are loaded by the native side.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from .errors import SettingError

__all__ = ["TLS", "check_tls", "client_tls", "listener_tls"]


def _readable_file(value: Any, name: str) -> str | None:
    """``value`` (None, a str or an os.PathLike) as a path to a file this process can read,
    or SettingError naming ``name`` and saying what is wrong with it."""
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(
            f"TLS {name}= must be None, a str or an os.PathLike, not {type(value).__name__}"
        )
    path = os.fspath(value)
    if not isinstance(path, str):
        raise TypeError(f"TLS {name}= must name a file by a str path, not {type(path).__name__}")
    if not os.path.exists(path):
        raise SettingError(name, f"TLS {name}= file {path!r} does not exist")
    if os.path.isdir(path):
        raise SettingError(name, f"TLS {name}= {path!r} is a directory, not a PEM file")
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise SettingError(
            name, f"TLS {name}= file {path!r} cannot be read: {exc.strerror}"
        ) from None
    return path


@dataclass(frozen=True)
class TLS:
    """TLS settings of one side of a connection: PEM files.

    ``TLS(cert=..., key=...)`` on a listener, ``TLS(ca=...)`` on a client (the server's
    certificate must be signed by ``ca`` and name the host ``connect`` was given), all
    three on both sides for mutual TLS (a listener with ``ca`` refuses a client without a
    certificate signed by it). The files are checked to exist and be readable here; they
    are loaded when a listener or connection is made.
    """

    cert: str | None = None
    key: str | None = None
    ca: str | None = None

    def __init__(
        self,
        cert: str | os.PathLike[str] | None = None,
        key: str | os.PathLike[str] | None = None,
        ca: str | os.PathLike[str] | None = None,
    ) -> None:
        # In this order: with several bad arguments, the first one raises.
        checked = {
            "cert": _readable_file(cert, "cert"),
            "key": _readable_file(key, "key"),
            "ca": _readable_file(ca, "ca"),
        }
        if (checked["cert"] is None) != (checked["key"] is None):
            given, missing = ("cert", "key") if checked["key"] is None else ("key", "cert")
            raise SettingError(
                missing, f"TLS {given}= needs {missing}= too: a certificate goes with its key"
            )
        if all(path is None for path in checked.values()):
            raise SettingError(
                "tls",
                "TLS() needs cert= and key= (a listener, or a client under mutual TLS) or ca=",
            )
        for name, path in checked.items():
            object.__setattr__(self, name, path)


def check_tls(tls: Any) -> TLS | None:
    if tls is None or isinstance(tls, TLS):
        return tls
    raise TypeError(f"tls must be None or a gradstream.TLS, not {type(tls).__name__}")


def _needing(tls: Any, part: str, detail: str) -> TLS | None:
    checked = check_tls(tls)
    if checked is not None and getattr(checked, part) is None:
        raise SettingError("tls", detail)
    return checked


def listener_tls(tls: Any) -> TLS | None:
    """A listener's ``tls=``: it needs its own certificate and key (``ca`` makes it mutual
    TLS)."""
    return _needing(
        tls,
        "cert",
        "a listener's TLS needs cert= and key= (its certificate); ca= alone is a client's",
    )


def client_tls(tls: Any) -> TLS | None:
    """A client's ``tls=``: it needs the ``ca`` that signed the server's certificate
    (``cert`` and ``key`` present it for mutual TLS)."""
    return _needing(
        tls, "ca", "a client's TLS needs ca= (the authority that signed the server's certificate)"
    )
