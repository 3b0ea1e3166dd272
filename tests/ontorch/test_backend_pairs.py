"""Send/recv between any two ranks of the gradstream backend (tags kept apart, calls on
one channel in order, both directions at once), the collectives made of pairs (gather,
scatter, all-to-all) and the coalesced ones, on 2 and 3 processes, each equal to a
torch reference for float32, float64, float16 and bfloat16; a group of two of three
ranks; a send and a recv of other sizes fail both ends with our error."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backend_launch import SIZES_AND_PATHS, arrays, launch, went_as_asked  # noqa: E402
from backend_ranks import DTYPES, bits, values  # noqa: E402
from test_backend_collectives import ring_reduce  # noqa: E402


def text(seen: dict, key: str) -> str:  # type: ignore[type-arg]
    return bytes(seen[key]).decode()


@SIZES_AND_PATHS
def test_pairs_equal_the_reference(
    tmp_path: pathlib.Path, size: int, same_host: str | None
) -> None:
    assert launch("pairs", size, tmp_path, same_host=same_host) == [0] * size
    seen = [arrays(tmp_path, rank) for rank in range(size)]
    assert went_as_asked(seen, same_host)
    for rank in range(size):
        got = seen[rank]
        for k in range(size):
            for name, dtype in DTYPES.items():
                if k != rank:  # what rank k sent to this one with the tag of dtype
                    expected = bits(values(10 * k + rank, 6, dtype))
                    assert np.array_equal(got[f"p2p/{k}/{name}"], expected), (rank, k, name)
        before, after = (rank - 1) % size, (rank + 1) % size
        expected = torch.cat(
            [values(before, 3, torch.bfloat16), values(after + 50, 3, torch.bfloat16)]
        )
        assert np.array_equal(got["batch"], bits(expected)), rank
        assert "SettingError" in text(got, "anysource") and "pass src=" in text(got, "anysource")
        for name, dtype in DTYPES.items():
            # scatter from rank 0: its part `rank`, values(rank, 6).
            assert np.array_equal(got[f"scatter/{name}"], bits(values(rank, 6, dtype)))
            # all_to_all_single: part `rank` (2 values) of every rank's input, in rank order.
            expected = torch.cat(
                [values(k, 2 * size, dtype)[2 * rank : 2 * rank + 2] for k in range(size)]
            )
            assert np.array_equal(got[f"alltoall_single/{name}"], bits(expected)), (rank, name)
            rows = []
            for k in range(size):
                sends = [j + k + 1 for j in range(size)]
                start = sum(sends[:rank])
                rows.append(
                    values(k, 2 * sum(sends), dtype).view(-1, 2)[start : start + sends[rank]]
                )
            assert np.array_equal(got[f"alltoall_uneven/{name}"], bits(torch.cat(rows))), (
                rank,
                name,
            )
            expected = torch.cat([values(10 * k + rank, k + 1, dtype) for k in range(size)])
            assert np.array_equal(got[f"alltoall/{name}"], bits(expected)), (rank, name)
            # all_gather_coalesced: rank k's two inputs, for each k in turn.
            expected = torch.cat(
                [torch.cat([values(k, 2, dtype), values(k + 5, 3, dtype)]) for k in range(size)]
            )
            assert np.array_equal(got[f"all_gather_coalesced/{name}"], bits(expected))
            lengths = (3 * size, 7 * size)
            gathered = torch.cat(
                [torch.cat([values(k, n, dtype) for k in range(size)]) for n in lengths]
            )
            assert np.array_equal(got[f"allgather_coalesced/{name}"], bits(gathered)), (rank, name)
            mine = [
                ring_reduce([values(k + 3, n, dtype) for k in range(size)], "sum", start=1)[
                    rank * n // size : (rank + 1) * n // size
                ]
                for n in lengths
            ]
            assert np.array_equal(got[f"reduce_scatter_coalesced/{name}"], bits(torch.cat(mine)))
            summed = [
                ring_reduce([values(k + 7, n, dtype) for k in range(size)], "sum") for n in lengths
            ]
            assert np.array_equal(got[f"allreduce_coalesced/{name}"], bits(torch.cat(summed)))
            if name == "float32":  # and torch's own sum, within float error
                reference = sum(values(k + 7, lengths[0], dtype).double() for k in range(size))
                torch.testing.assert_close(
                    torch.from_numpy(got[f"allreduce_coalesced/{name}"].view(np.float32))[
                        : lengths[0]
                    ],
                    reference.float(),
                )
    if size == 3:  # new_group([0, 2], backend="gradstream")
        summed = bits(ring_reduce([values(k, 5, torch.float32) for k in (0, 2)], "sum"))
        for rank in (0, 2):
            assert np.array_equal(seen[rank]["subgroup/allreduce"], summed), rank
        assert "subgroup/allreduce" not in seen[1]
        assert np.array_equal(seen[2]["subgroup/recv"], bits(values(30, 3, torch.float32)))
    # A peer without the group's authkey is refused by a listener; the group goes on.
    assert text(seen[0], "stranger") == "AuthenticationError"
    last = seen[size - 1]
    for name, dtype in DTYPES.items():
        expected = torch.cat([values(k, 5, dtype) for k in range(size)])
        assert np.array_equal(last[f"gather/{name}"], bits(expected)), name
        maximum = torch.stack([values(k + 9, 5, dtype) for k in range(size)]).amax(0)
        assert np.array_equal(last[f"reduce/{name}"], bits(maximum)), name
    # Three sends on one channel, received in order (the second not contiguous on both
    # ends, the third int64).
    inorder = [
        values(1, 4, torch.float64),
        values(2, 12, torch.float32).view(3, 4)[:, ::2],
        torch.arange(5, dtype=torch.int64) - 2,
    ]
    assert np.array_equal(last["inorder"], np.concatenate([bits(t) for t in inorder]))
    # Last, 5 values sent to a recv of 4: both ends fail, each naming the other.
    sender, receiver = (text(seen[rank], "mismatch") for rank in (0, 1))
    assert sender.startswith(
        "DeliveryError: gradstream backend: rank 1 refused rank 0's send (tag 9)"
    ), sender
    assert receiver.startswith(
        "GradientSizeError: gradstream backend: rank 1's recv from rank 0 (tag 9)"
    ), receiver
    assert "a send and its recv take tensors of one size and dtype" in receiver
