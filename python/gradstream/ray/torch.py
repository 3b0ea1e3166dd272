"""The ``GRADSTREAM_TORCH`` tensor transport: the ``GRADSTREAM`` transport for torch
tensors (docs/guides/ray.md, "Torch tensors"). Ray takes one data type per transport, so
torch tensors have a transport name of their own:
``@ray.method(tensor_transport="gradstream_torch")``.

``import gradstream.ray.torch`` (in every module that declares such a method: Ray checks
the name there) registers it; it imports torch, which ``gradstream.ray`` alone does not.
The settings, the endpoint and the connections are the ``GRADSTREAM`` transport's
(``gradstream.ray.register``); what differs is the type at each end: CPU tensors of the
four float dtypes go out (read in place when contiguous, detached), tensors come back in
the dtype and shape sent. bfloat16 needs ml_dtypes on both ends (the transport's arrays
are numpy's in between).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
from ray.experimental.rdt import (
    CommunicatorMetadata,
    TensorTransportMetadata,
    register_tensor_transport,
)
from ray.experimental.rdt.util import transport_manager_info

from .. import _dtypes, _torch
from . import _rdt

__all__ = ["TORCH_TRANSPORT", "GradstreamTorchTransport"]

TORCH_TRANSPORT = "GRADSTREAM_TORCH"


def _array(tensor: Any, index: int) -> np.ndarray:
    """A tensor of a result as the endpoint serves it: a numpy view of its values."""
    if not _torch.is_tensor(tensor):
        raise TypeError(
            "the GRADSTREAM_TORCH tensor transport moves torch tensors; value "
            f"{index} of this result is of type {type(tensor).__name__}"
        )
    values, name = _torch.values_of(tensor)
    if name == "bfloat16":
        bfloat16 = _dtypes.bfloat16_dtype()
        if bfloat16 is None:
            raise TypeError(
                "the GRADSTREAM_TORCH transport moves bfloat16 tensors as numpy arrays in "
                "between: pip install 'gradstream[bfloat16]' (ml_dtypes)"
            )
        return values.view(bfloat16)
    return values


def _numpy_dtype(dtype: Any) -> np.dtype[Any]:
    name = _torch.dtype_of(torch.empty(0, dtype=dtype))
    if name is None:  # not one we offer: the check against Ray's record refuses it
        return np.dtype(np.uint8)
    return _dtypes.numpy_dtype(name)


class GradstreamTorchTransport(_rdt.GradstreamTransport):
    """The transport of torch tensors, over the GRADSTREAM transport's endpoint."""

    def tensor_transport_backend(self) -> str:
        return TORCH_TRANSPORT

    def extract_tensor_transport_metadata(
        self, obj_id: str, rdt_object: list[Any]
    ) -> _rdt.GradstreamMetadata:
        arrays = [_array(tensor, k) for k, tensor in enumerate(rdt_object)]
        return self.offer(obj_id, arrays, [(tuple(t.shape), t.dtype) for t in rdt_object])

    def recv_multiple_tensors(
        self,
        obj_id: str,
        tensor_transport_metadata: TensorTransportMetadata,
        communicator_metadata: CommunicatorMetadata,
        target_buffers: list[Any] | None = None,
    ) -> list[Any]:
        recorded = list(tensor_transport_metadata.tensor_meta)
        as_numpy = dataclasses.replace(
            tensor_transport_metadata,
            tensor_meta=[(shape, _numpy_dtype(dtype)) for shape, dtype in recorded],
        )
        arrays = super().recv_multiple_tensors(obj_id, as_numpy, communicator_metadata)
        tensors = [
            _torch.from_values(a.reshape(-1), str(dtype).removeprefix("torch."), a.shape)
            for a, (_, dtype) in zip(arrays, recorded, strict=True)
        ]
        if target_buffers is None:
            return tensors
        for target, tensor in zip(target_buffers, tensors, strict=True):
            target.copy_(tensor)
        return list(target_buffers)


if TORCH_TRANSPORT not in transport_manager_info:
    register_tensor_transport(TORCH_TRANSPORT, ["cpu"], GradstreamTorchTransport, torch.Tensor)
