"""FSDP trains over the gradstream backend on the CPU: three steps of FSDP2
(``fully_shard``, each Linear a unit of its own) and of FSDP1 (FullyShardedDataParallel
with ``device_id=cpu``), on 3 processes (uneven shards), give full parameters identical
on every rank and equal, within float tolerance, to the same training over gloo."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backend_launch import arrays, launch  # noqa: E402
from backend_ranks import MLP  # noqa: E402


def test_fsdp_matches_gloo(tmp_path: pathlib.Path) -> None:
    size = 3
    assert launch("fsdp", size, tmp_path) == [0] * size
    seen = [arrays(tmp_path, rank) for rank in range(size)]
    torch.manual_seed(0)
    start = {k: v.detach().numpy() for k, v in MLP().named_parameters()}
    for version in (2, 1):
        names = [k for k in seen[0] if k.startswith(f"fsdp{version}/gradstream/")]
        assert len(names) == len(start), names
        for name in names:
            for rank in range(1, size):
                assert np.array_equal(seen[rank][name], seen[0][name]), (name, rank)
            gloo = seen[0][name.replace("/gradstream/", "/gloo/")]
            np.testing.assert_allclose(seen[0][name], gloo, rtol=1e-5, atol=1e-6)
            # Trained: the parameters moved from where they started.
            original = start[name.split("/")[-1].removeprefix("_fsdp_wrapped_module.")]
            assert seen[0][name].shape == original.shape, name
            assert not np.allclose(seen[0][name], original), name
