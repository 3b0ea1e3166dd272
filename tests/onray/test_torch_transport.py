"""The GRADSTREAM_TORCH tensor transport (gradstream.ray.torch): torch tensors of the four
float dtypes, a model's parameters among them, arrive bit-equal as torch tensors in
another actor and in the driver."""

from __future__ import annotations

from typing import Any

import pytest
import ray

torch = pytest.importorskip("torch")

from support.rayactors_torch import TorchMaker, TorchTaker, describe  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.float64, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tensors_arrive_as_tensors_in_another_actor_and_the_driver(
    cluster: str, dtype: Any
) -> None:
    maker, taker = TorchMaker.remote(), TorchTaker.remote()
    try:
        t = torch.randn(30, 7).to(dtype)
        value = {"t": t, "view": t.t(), "n": 3}
        ref = maker.make.remote(value)
        want = describe({"t": t, "view": t.t().contiguous(), "n": 3})
        assert ray.get(taker.describe.remote(ref)) == want
        got = ray.get(ref)
        assert isinstance(got["t"], torch.Tensor) and describe(got) == want
    finally:
        ray.kill(maker)
        ray.kill(taker)


def test_a_model_state_travels(cluster: str) -> None:
    maker, taker = TorchMaker.remote(), TorchTaker.remote()
    try:
        model = torch.nn.Linear(5, 3)
        params = dict(model.named_parameters())
        got = ray.get(taker.describe.remote(maker.make.remote(params)))
        assert got == describe({k: v.detach() for k, v in params.items()})
    finally:
        ray.kill(maker)
        ray.kill(taker)


def test_what_the_transport_cannot_move_is_refused_by_it(cluster: str) -> None:
    """The refusal is this transport's own (its extract ran on the maker's result)."""
    maker = TorchMaker.remote()
    try:
        with pytest.raises(ray.exceptions.RayError, match=r"torch\.int64.*tensor\.float\(\)"):
            ray.get(maker.make.remote({"steps": torch.arange(3)}))
    finally:
        ray.kill(maker)
