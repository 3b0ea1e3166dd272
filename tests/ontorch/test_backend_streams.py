"""configure(streams=3) on 3 ranks meeting over TCP: each connection between ranks runs
over three streams and resumes (docs/guides/across-the-internet.md "Resume"), and the
collectives give the bits one stream gives (the documented
ring order); configure refuses a count outside 1 to 255."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backend_launch import arrays, launch  # noqa: E402
from backend_ranks import STREAMED_LENGTH, bits, values  # noqa: E402
from test_backend_collectives import ring_reduce  # noqa: E402

import gradstream.torch as gst  # noqa: E402
from gradstream.errors import SettingError  # noqa: E402

SIZE = 3


def test_collectives_over_three_streams_a_connection(tmp_path: pathlib.Path) -> None:
    assert launch("streams", SIZE, tmp_path) == [0] * SIZE
    xs = [values(rank, STREAMED_LENGTH, torch.float32) for rank in range(SIZE)]
    for rank in range(SIZE):
        seen = arrays(tmp_path, rank)
        assert seen["streams"].tolist() == [3, 3], rank
        assert seen["resumes"].tolist() == [True, True], rank  # a reset is mended
        assert np.array_equal(seen["allreduce"], bits(ring_reduce(xs, "sum"))), rank
        assert np.array_equal(seen["broadcast"], bits(values(SIZE - 1, 5000, torch.float32)))


@pytest.mark.parametrize("value", [0, 256])
def test_configure_takes_1_to_255_streams(value: int) -> None:
    before = gst.configure()
    try:
        with pytest.raises(SettingError, match="streams"):
            gst.configure(streams=value)
        assert gst.configure(streams=4).streams == 4
    finally:
        gst.configure(streams=before.streams)
