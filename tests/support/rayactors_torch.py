"""Actors of the GRADSTREAM_TORCH transport (tests/onray/test_torch_transport.py): a maker
of torch tensors and a taker that reports what it got as plain values."""

from __future__ import annotations

from typing import Any

import ray
import torch

import gradstream.ray.torch  # noqa: F401  (the transport's name, where methods use it)


def describe(value: Any) -> Any:
    """Tensors as (type, dtype, shape, bits) in a structure of plain values."""
    if isinstance(value, torch.Tensor):
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[value.element_size()]
        raw = value.detach().contiguous().view(bits).reshape(-1).tolist()
        return ("tensor", str(value.dtype), tuple(value.shape), raw)
    if isinstance(value, dict):
        return {k: describe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [describe(v) for v in value]
    return value


@ray.remote(num_cpus=0, enable_tensor_transport=True)
class TorchMaker:
    @ray.method(tensor_transport="gradstream_torch")
    def make(self, value: Any) -> Any:
        return value


@ray.remote(num_cpus=0, enable_tensor_transport=True)
class TorchTaker:
    def describe(self, value: Any) -> Any:
        return describe(value)
