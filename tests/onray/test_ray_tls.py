"""gradstream.ray under TLS and an authkey (``register(tls=, authkey=)``, and the
parameter server's own): arrays and parameters arrive, and a peer without the
certificate or the key gets no further than the handshake. A job of its own (a second
driver, tests/support/ray_tls_driver.py), since a driver's settings are set once."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from typing import Any

DRIVER = pathlib.Path(__file__).resolve().parent.parent / "support" / "ray_tls_driver.py"


def test_tls_and_authkey_protect_the_transport_and_the_parameter_server(
    cluster: str, certs: Any
) -> None:
    run = subprocess.run(
        [sys.executable, str(DRIVER), cluster, str(certs.folder)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["actor_to_actor"] is True
    assert report["to_driver"] is True
    assert report["parameter_server"] is True
    # Over TLS, not through a Unix socket (same_node="tcp" in the driver).
    assert report["taker_unix"] == 0
    assert len(report["server_routes"]) == 1
    assert not report["server_routes"][0].startswith("unix:")
    refused = {
        "plaintext": "ProtocolError",  # the TLS side's answer is no hello
        "tls-without-key": "AuthenticationError",
        "tls-wrong-key": "AuthenticationError",
    }
    assert report["endpoint_strangers"] == refused
    assert report["server_strangers"] == refused
