"""gradstream on Ray (docs/guides/ray.md): the ``GRADSTREAM`` tensor transport
for ``@ray.method(tensor_transport="gradstream")``, and a parameter server that sums its
workers' gradients as they stream in.

Needs Ray (``pip install gradstream[ray]``); ``import gradstream`` alone does not.
"""

from __future__ import annotations

from typing import Any

try:
    import ray as _ray  # noqa: F401
except ImportError as exc:  # pragma: no cover - the test environment has Ray
    raise ImportError("gradstream.ray needs Ray: pip install 'gradstream[ray]'") from exc

from ..errors import ObjectUnavailableError, WorkerLostError
from . import _rdt
from ._ps import ParameterServer, StepReport
from ._ps_client import ParameterClient
from ._settings import RaySettings

TRANSPORT = _rdt.TRANSPORT
# Ray checks the name where a decorated method is defined: known from the import on.
_rdt.make_known()

__all__ = [
    "TRANSPORT",
    "ObjectUnavailableError",
    "ParameterClient",
    "ParameterServer",
    "RaySettings",
    "StepReport",
    "WorkerLostError",
    "register",
]


_UNSET: Any = object()


def register(
    *,
    tls: Any = _UNSET,
    authkey: Any = _UNSET,
    timeout: Any = _UNSET,
    connect_timeout: Any = _UNSET,
    deadline: Any = _UNSET,
    host: Any = _UNSET,
    layout: Any = _UNSET,
    compression: Any = _UNSET,
    chunk_size: Any = _UNSET,
    same_node: Any = _UNSET,
) -> RaySettings:
    """Set the ``GRADSTREAM`` tensor transport's settings for this job: in the driver,
    before the actors use it (``import gradstream.ray`` already makes the name
    ``"gradstream"`` known to ``@ray.method``). Returns the settings in force.

    ``tls=gradstream.TLS(cert=, key=, ca=)`` (every process both listens and connects:
    mutual TLS; the certificate names each node's address), ``authkey=`` (at least 16
    bytes; default, a random key for the job), ``timeout`` (seconds without progress
    before a transfer fails; default 60), ``deadline`` (seconds one transfer may take;
    default 300), ``connect_timeout`` (TCP, TLS and the hello together; default 10),
    ``host`` (where each process listens; default, the address Ray uses for its node),
    the session's ``layout`` (default ``"compact"``), ``compression`` and
    ``chunk_size``, and ``same_node`` (``"unix"``, the default: a receiver fetches from a
    maker of its own Ray node through the same-host transport, shared memory under the
    job's authkey and without TLS; ``"tcp"``: as from another node).

    The settings reach the job's processes through Ray's KV store, written by this call
    once Ray is up, or else by the driver's first call of a decorated method; without a
    call, the defaults. A call with no keywords keeps what was set; a second call with
    other settings is a ``SettingError``. In Ray's worker processes it changes nothing:
    their settings are always the driver's (a worker that needs them before the driver
    wrote them gets a ``SettingError`` saying so).
    """
    given = {
        name: value
        for name, value in {
            "tls": tls,
            "authkey": authkey,
            "timeout": timeout,
            "connect_timeout": connect_timeout,
            "deadline": deadline,
            "host": host,
            "layout": layout,
            "compression": compression,
            "chunk_size": chunk_size,
            "same_node": same_node,
        }.items()
        if value is not _UNSET
    }
    return _rdt.register(RaySettings.checked(**given) if given else None)
