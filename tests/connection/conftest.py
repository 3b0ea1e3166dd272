"""The implementations the connection tests run against (README "Connections": both have
the same API and speak the same bytes): ``gs`` is one of them, for a test of one side
(the other side a hostile peer by hand, or the same implementation); ``pair`` is a
listener's implementation and a client's, every combination, native and reference
crossed both ways."""

from __future__ import annotations

from types import ModuleType

import pytest

from support.impls import IMPL_NAMES, load_impl

PAIRS = [(server, client) for server in IMPL_NAMES for client in IMPL_NAMES]


@pytest.fixture(params=IMPL_NAMES)
def gs(request: pytest.FixtureRequest) -> ModuleType:
    """``gradstream.reference`` or ``gradstream`` (the native one)."""
    return load_impl(request.param)


@pytest.fixture(
    params=PAIRS, ids=[f"{client}-client-{server}-listener" for server, client in PAIRS]
)
def pair(request: pytest.FixtureRequest) -> tuple[ModuleType, ModuleType]:
    """(the listener's implementation, the client's)."""
    server, client = request.param
    return load_impl(server), load_impl(client)
