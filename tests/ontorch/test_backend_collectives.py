"""Each collective of the gradstream backend against a numpy/torch reference, on 2 and 3
processes: the all-reduce in the documented order (segment j summed in ring order from
rank j), so the reference gives the very bits, the same on every rank."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backend_launch import SIZES_AND_PATHS, arrays, launch, went_as_asked  # noqa: E402
from backend_ranks import DTYPES, LENGTHS, OPS, bits, values  # noqa: E402


def ring_reduce(xs: list, op: str, start: int = 0):  # type: ignore[no-untyped-def]
    """The backend's all-reduce, as the docs state it: segment j added up in ring order
    from rank j (from rank j + 1 in a reduce-scatter: ``start`` 1)."""
    size, length = len(xs), xs[0].numel()
    out = xs[0].clone()
    for j in range(size):
        a, b = j * length // size, (j + 1) * length // size
        first = (j + start) % size
        acc = xs[first][a:b].clone()
        for k in range(1, size):
            mine = xs[(first + k) % size][a:b].clone()
            if op in ("sum", "avg"):
                acc = mine.add_(acc)
            elif op == "min":
                acc = torch.minimum(mine, acc)
            else:
                acc = torch.maximum(mine, acc)
        out[a:b] = acc
    if op == "avg":
        out.div_(size)
    return out


@SIZES_AND_PATHS
def test_collectives_equal_the_reference(
    tmp_path: pathlib.Path, size: int, same_host: str | None
) -> None:
    assert launch("collectives", size, tmp_path, same_host=same_host) == [0] * size
    seen = [arrays(tmp_path, rank) for rank in range(size)]
    assert went_as_asked(seen, same_host)
    for name, dtype in DTYPES.items():
        for length in LENGTHS:
            xs = [values(rank, length, dtype) for rank in range(size)]
            for op in OPS:
                key = f"allreduce/{name}/{length}/{op}"
                expected = bits(ring_reduce(xs, op))
                for rank in range(size):
                    assert np.array_equal(seen[rank][key], expected), (key, rank)
                if op == "sum" and name == "float32":  # numpy's sum, within float error
                    got = np.frombuffer(seen[0][key].tobytes(), np.float32)
                    np.testing.assert_allclose(
                        got, np.sum([x.numpy() for x in xs], axis=0), rtol=1e-5, atol=1e-6
                    )
    strided = [values(rank, 24, torch.float32).view(4, 6)[:, ::2] for rank in range(size)]
    total = sum(x.double() for x in strided).float()
    for rank in range(size):
        got = torch.from_numpy(seen[rank]["allreduce/strided"].view(np.float32)).view(4, 3)
        torch.testing.assert_close(got, total)
        assert np.array_equal(seen[rank]["allreduce/strided"], seen[0]["allreduce/strided"])
        assert np.array_equal(seen[rank]["broadcast"], bits(values(size - 1, 7, torch.float64)))
        assert np.array_equal(seen[rank]["broadcast/int64"], bits(torch.arange(5)))
        gathered = torch.cat([values(k, 3, torch.bfloat16) for k in range(size)])
        assert np.array_equal(seen[rank]["allgather"], bits(gathered))
        whole = torch.cat([values(k, 4, torch.float32) for k in range(size)])
        assert np.array_equal(seen[rank]["allgather_base"], bits(whole))
        for name in ("float32", "bfloat16"):
            xs = [values(k, 5 * size, DTYPES[name]) for k in range(size)]
            mine = ring_reduce(xs, "sum", start=1)[5 * rank : 5 * rank + 5]
            assert np.array_equal(seen[rank][f"reduce_scatter/{name}"], bits(mine)), name
        xs = [values(k, 2 * size, torch.float32) for k in range(size)]
        mine = ring_reduce(xs, "avg", start=1)[2 * rank : 2 * rank + 2]
        assert np.array_equal(seen[rank]["reduce_scatter/list"], bits(mine))
        assert seen[rank]["backend"].tobytes() == b"gradstream"
        assert np.array_equal(seen[rank]["before_shutdown"], bits(torch.full((1000,), size * 1.0)))
        # rank 0's isend before the group was destroyed reached the last rank.
        sent = torch.zeros(3) if rank in (0, size - 1) else torch.full((3,), float(rank))
        assert np.array_equal(seen[rank]["p2p_before_shutdown"], bits(sent)), rank
