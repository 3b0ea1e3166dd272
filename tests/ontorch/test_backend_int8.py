"""configure(reduce_wire_dtype="int8") on 3 ranks: float32 all-reduces (sum and average)
and reduce-scatters move on the int8 wire, within its error bound of the exact result,
every rank ending an all-reduce with the same bits; a float64 all-reduce and a
broadcast move as they are (exact)."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backend_launch import arrays, launch, outcome  # noqa: E402
from backend_ranks import INT8_LENGTH, bits, values  # noqa: E402
from test_backend_collectives import ring_reduce  # noqa: E402

SIZE = 3


def as_float32(raw: np.ndarray) -> np.ndarray:
    return np.frombuffer(raw.tobytes(), np.float32)


def test_reductions_on_the_int8_wire(tmp_path: pathlib.Path) -> None:
    assert launch("int8", SIZE, tmp_path) == [0] * SIZE
    seen = [arrays(tmp_path, rank) for rank in range(SIZE)]
    xs = [values(rank, INT8_LENGTH, torch.float32) for rank in range(SIZE)]
    exact = np.sum([x.numpy().astype(np.float64) for x in xs], axis=0)
    # Each value crosses at most three quantizations (two partial sums, the finished
    # segment), each within absmax / 254 of its block; a partial sum's absmax is at
    # most the three ranks' largest magnitudes added.
    bound = 3 * (SIZE * max(float(np.abs(x.numpy()).max()) for x in xs)) / 254
    for rank in range(1, SIZE):  # blocks a few subnormal steps large: the same bits too
        assert np.array_equal(seen[rank]["allreduce/subnormal"], seen[0]["allreduce/subnormal"])
    for op, scale in (("sum", 1), ("avg", SIZE)):
        key = f"allreduce/{op}"
        for rank in range(1, SIZE):
            assert np.array_equal(seen[rank][key], seen[0][key]), (key, rank)
        got = as_float32(seen[0][key]).astype(np.float64)
        error = np.abs(got * scale - exact)
        assert error.max() <= bound, (key, error.max(), bound)
        assert (error > 0).mean() > 0.5, key  # lossy: the int8 wire carried it
    for rank in range(SIZE):
        # Not float32: as it is, in the documented ring order.
        doubles = [values(r, 1001, torch.float64) for r in range(SIZE)]
        assert np.array_equal(seen[rank]["allreduce/float64"], bits(ring_reduce(doubles, "sum")))
        # A broadcast is not a reduction: exact.
        assert np.array_equal(seen[rank]["broadcast"], bits(values(SIZE - 1, 5000, torch.float32)))
    part = INT8_LENGTH // SIZE
    inputs = [values(r, part * SIZE, torch.float32).numpy().astype(np.float64) for r in range(SIZE)]
    whole = np.sum(inputs, axis=0)
    for rank in range(SIZE):
        got = as_float32(seen[rank]["reduce_scatter"]).astype(np.float64)
        error = np.abs(got - whole[rank * part : (rank + 1) * part])
        assert error.max() <= bound and (error > 0).mean() > 0.5, rank


def test_ranks_that_set_the_option_differently_refuse_the_group(tmp_path: pathlib.Path) -> None:
    """A rank on the int8 wire and one not would end all-reduces with different bits:
    every rank refuses the group at init_process_group, naming the rank that differs."""
    assert launch("int8-mismatch", 2, tmp_path) == [0, 0]
    got = [outcome(tmp_path, rank) for rank in range(2)]
    assert [g.get("error") for g in got] == ["SettingError", "SettingError"], got
    assert got[0]["message"] == (
        "rank 1 set reduce_wire_dtype='none', rank 0 'int8': every rank must configure "
        "the same before init_process_group"
    )
    assert "rank 0 set reduce_wire_dtype='int8', rank 1 'none'" in str(got[1]["message"])


@pytest.mark.parametrize("value", ["int4", "float16", "", None])
def test_configure_takes_int8_or_none(value: object) -> None:
    """Another value is a SettingError naming the option, and changes nothing; None
    keeps what was set; "none" puts back the exact wire."""
    import gradstream.torch as gst
    from gradstream.errors import SettingError

    before = gst.options()
    if value is None:
        assert gst.configure(reduce_wire_dtype=None) == before
    else:
        with pytest.raises(SettingError) as info:
            gst.configure(reduce_wire_dtype=value)  # type: ignore[arg-type]
        assert info.value.setting == "reduce_wire_dtype"
        assert str(info.value) == f'reduce_wire_dtype must be "int8" or "none", got {value!r}'
        assert gst.options() == before
    try:
        assert gst.configure(reduce_wire_dtype="int8").reduce_wire_dtype == "int8"
        assert gst.configure(reduce_wire_dtype=None).reduce_wire_dtype == "int8"
    finally:
        assert gst.configure(reduce_wire_dtype="none").reduce_wire_dtype is None
