"""Who is on each side of the connection tests' connections: the product (the native
``gradstream``) on one side at least, and the test peer (``support.peer``, an
independent implementation of docs/spec/protocol.md) on the other where a test needs an
independent other side.

``pair`` is (the listener's side, the dialler's side): native with native, the native
listener with the test peer dialling, and the test peer listening for the native dialler.
``dialler`` is the side that dials a native listener, and ``acceptor`` the side that
listens for a native dialler: native or the test peer, each.
"""

from __future__ import annotations

from types import ModuleType

import pytest

import gradstream
from support import peer

SIDES = {"native": gradstream, "peer": peer}
PAIRS = [("native", "native"), ("native", "peer"), ("peer", "native")]


@pytest.fixture(
    params=PAIRS, ids=[f"{server}-listener-{client}-dialler" for server, client in PAIRS]
)
def pair(request: pytest.FixtureRequest) -> tuple[ModuleType, ModuleType]:
    """(the listener's side, the dialler's)."""
    server, client = request.param
    return SIDES[server], SIDES[client]


@pytest.fixture(params=list(SIDES))
def dialler(request: pytest.FixtureRequest) -> ModuleType:
    """What dials the native listener of a test."""
    return SIDES[request.param]


@pytest.fixture(params=list(SIDES))
def acceptor(request: pytest.FixtureRequest) -> ModuleType:
    """What listens for the native dialler of a test."""
    return SIDES[request.param]
