"""The fixture of the command's tests: children started through ``spawn`` are killed
when the test ends, pass or fail (support.cli)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from support.cli import Child


@pytest.fixture
def spawn() -> Iterator[list[Child]]:
    children: list[Child] = []
    yield children
    for child in children:
        child.kill()
