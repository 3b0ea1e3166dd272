"""Fixtures shared by every test folder: every semantic test runs against both
implementations. The helpers the tests share are the package tests/support/ (imported as
``from support.frames import ...``)."""

from __future__ import annotations

from types import ModuleType

import pytest

from support.certs import Certificates, make_certificates
from support.impls import IMPL_NAMES, load_impl


@pytest.fixture(params=IMPL_NAMES)
def impl(request: pytest.FixtureRequest) -> ModuleType:
    """The module whose GradientStreamSession / GradientChunk are under test."""
    return load_impl(request.param)


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    """Certificates for the TLS tests, made once per run (support.certs)."""
    return make_certificates(tmp_path_factory.mktemp("certs"))
