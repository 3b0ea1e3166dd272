"""One Ray cluster for every test of gradstream.ray (docs/guides/ray.md): a
local head in Ray's single-node mode on 127.0.0.1 (Ray's own traffic and every
gradstream endpoint stay on loopback), no dashboard, a small object store, and the
GRADSTREAM transport's settings registered once in this driver. Ray's workers get
``tests/`` on their path, so the actors of ``support.rayactors`` load by name."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Iterator

import pytest

# Ray's single-node mode: it then takes 127.0.0.1 for its node instead of the machine's
# own interface, so Ray's traffic and every gradstream endpoint stay on loopback. Read
# when ray is imported; its processes inherit it.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"

import ray

import gradstream.ray as gsray

TESTS = pathlib.Path(__file__).resolve().parent.parent
# Seconds a transfer may stand still before it fails, for this cluster's transport.
TRANSPORT_TIMEOUT = 15.0


@pytest.fixture(scope="session")
def cluster() -> Iterator[str]:
    """The running cluster's address (for a second driver in a subprocess)."""
    path = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
    context = ray.init(
        include_dashboard=False,
        num_cpus=8,
        object_store_memory=300 * 2**20,
        runtime_env={"env_vars": {"PYTHONPATH": path, "RAY_USAGE_STATS_ENABLED": "0"}},
        configure_logging=False,
        log_to_driver=False,
    )
    gsray.register(timeout=TRANSPORT_TIMEOUT)  # published now that Ray is up
    try:
        yield context.address_info["gcs_address"]
    finally:
        ray.shutdown()
