"""A second Ray driver for tests/onray/test_ray_tls.py: joins the tests' cluster as a job of its
own, sets TLS and an authkey for it (``gradstream.ray.register``), moves arrays through
the GRADSTREAM transport and a parameter server, and probes the endpoints with peers
that lack the certificate or the key. Prints one JSON object of what it saw.

    python ray_tls_driver.py GCS_ADDRESS CERT_FOLDER
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import sys
from typing import Any

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
TESTS = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TESTS))

import numpy as np  # noqa: E402
import ray  # noqa: E402

import gradstream as gs  # noqa: E402
import gradstream.ray as gsray  # noqa: E402

KEY = b"a shared secret of 32 bytes....."


async def probe(address: tuple[str, int], tls: gs.TLS) -> dict[str, str]:
    """How each kind of stranger fares at ``address``: the error class it gets."""
    strangers: dict[str, dict[str, Any]] = {
        "plaintext": {},
        "tls-without-key": {"tls": tls},
        "tls-wrong-key": {"tls": tls, "authkey": b"not the secret, 32 bytes long..."},
    }
    seen = {}
    for name, keywords in strangers.items():
        try:
            conn = await gs.connect(address, handshake_timeout=5, **keywords)
        except gs.GradientStreamError as exc:
            seen[name] = type(exc).__name__
        else:
            await conn.close()
            seen[name] = "admitted"
    return seen


def main() -> None:
    gcs, folder = sys.argv[1], pathlib.Path(sys.argv[2])
    ray.init(
        address=gcs,
        runtime_env={"env_vars": {"PYTHONPATH": str(TESTS)}},
        log_to_driver=False,
        configure_logging=False,
    )
    tls = gs.TLS(cert=folder / "server.pem", key=folder / "server.key", ca=folder / "ca.pem")
    # The test's certificate names 127.0.0.1 and localhost: listen there, whatever
    # address Ray gives this node (the machine's own one, in some runs).
    # same_node="tcp": these processes share a node, and TLS is what is tested here (a
    # Unix socket would carry them without it, under the authkey).
    gsray.register(tls=tls, authkey=KEY, timeout=15, host="127.0.0.1", same_node="tcp")
    from support.rayactors import Maker, Taker, Worker, describe, update

    maker, taker = Maker.remote(), Taker.remote()
    array = np.random.default_rng(1).standard_normal((300, 301), dtype=np.float32)
    report: dict[str, Any] = {
        "actor_to_actor": ray.get(taker.describe.remote(maker.make.remote(array)))
        == describe(array),
        "to_driver": ray.get(maker.make.remote(array)).tobytes() == array.tobytes(),
    }
    report["taker_unix"] = ray.get(taker.opened_unix.remote())
    endpoint = tuple(ray.get(maker.advertise.remote(None)))
    report["endpoint_strangers"] = asyncio.run(probe(endpoint, tls))

    params = np.zeros(1000, np.float32)
    ps = gsray.ParameterServer.options(num_cpus=0).remote(
        params, update, workers=1, tls=tls, authkey=KEY, host="127.0.0.1", same_node="tcp"
    )
    worker = Worker.remote(ps, 0, 3)
    got = ray.get(worker.push.remote(np.ones(1000, np.float32)), timeout=60)
    report["parameter_server"] = (
        got.tobytes() == update(params, np.ones(1000, np.float32), 1).tobytes()
    )
    report["server_routes"] = ray.get(
        ps.__ray_call__.remote(
            lambda self: [str(c.peer.address) for c in self._steps.members.values()]
        )
    )
    address, _ = ray.get(ps.contact.remote())
    report["server_strangers"] = asyncio.run(probe(tuple(address), tls))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
