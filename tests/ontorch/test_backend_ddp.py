"""DDP trains unchanged over the gradstream backend: after a few steps on 2 and 3
processes the parameters are identical on every rank and equal, within float
tolerance, to the same training over gloo (in the same processes)."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

pytest.importorskip("torch")

from backend_launch import arrays, launch


@pytest.mark.parametrize("size", [2, 3])
def test_ddp_matches_gloo(tmp_path: pathlib.Path, size: int) -> None:
    assert launch("ddp", size, tmp_path) == [0] * size
    seen = [arrays(tmp_path, rank) for rank in range(size)]
    names = [k for k in seen[0] if k.startswith("gradstream/")]
    assert len(names) == 4
    for name in names:
        for rank in range(1, size):
            assert np.array_equal(seen[rank][name], seen[0][name]), (name, rank)
        gloo = seen[0]["gloo/" + name.split("/", 1)[1]]
        np.testing.assert_allclose(seen[0][name], gloo, rtol=1e-5, atol=1e-6)
        assert not np.array_equal(seen[0][name], np.zeros_like(gloo))
