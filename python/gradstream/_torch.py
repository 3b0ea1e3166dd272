"""PyTorch tensors in and out (docs/guides/torch.md); filling a model in place is `_fill`.

torch is an optional extra (``gradstream[torch]``) and is imported only when a torch
tensor is seen (its class lives in a ``torch`` module, so the caller imported torch
already) or asked for (``like="torch"``): ``import gradstream`` never imports it.

Going out, a CPU tensor of any float dtype is read in place as a numpy array when its
memory is contiguous (one copy otherwise, as for a numpy array); bfloat16 as its raw
16-bit values (no ml_dtypes needed); a tensor that requires grad is read detached (its
values: the send is no part of the autograd graph). Coming back, tensors are made over
the received numpy memory (``torch.from_numpy``, no copy), and ``out=`` / ``reduce_into=``
/ a model's own tensors are written in place through a numpy view of their memory.
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np

__all__ = [
    "LIKES",
    "check_like",
    "from_values",
    "is_tensor",
    "lent_view",
    "values_of",
]

LIKES = ("numpy", "torch")

# torch's dtype name -> gradstream's (the four value dtypes).
_NAMES = {
    "torch.float16": "float16",
    "torch.bfloat16": "bfloat16",
    "torch.float32": "float32",
    "torch.float64": "float64",
}


def _torch() -> Any:
    # torch is not typed here (nor a dependency): reached only once torch is in use.
    return importlib.import_module("torch")


def is_tensor(obj: Any) -> bool:
    """Whether ``obj`` is a torch tensor (a ``torch.Tensor`` or a subclass such as
    ``torch.nn.Parameter``), found without importing torch."""
    for cls in type(obj).__mro__:
        if cls.__name__ == "Tensor" and (cls.__module__ or "") == "torch":
            return True
    return False


def _on_cpu(tensor: Any, what: str) -> None:
    device = tensor.device
    if device.type != "cpu":
        raise TypeError(
            f"{what} tensor is on {device}; move it to the CPU first, tensor.cpu() "
            "(gradstream reads and writes host memory only)"
        )


def dtype_of(tensor: Any) -> str | None:
    """gradstream's name of a tensor's dtype, or None for the others (int, complex, ...)."""
    return _NAMES.get(str(tensor.dtype))


def values_of(tensor: Any) -> tuple[np.ndarray, str]:
    """A CPU tensor's values as a numpy array in its own shape and its dtype name
    (bfloat16 as uint16 bits): a view of the tensor's memory when it is contiguous,
    one copy otherwise. Detached first: a tensor that requires grad is sent as its
    values. TypeError for a tensor on another device or of another dtype."""
    _on_cpu(tensor, "gradient")
    name = dtype_of(tensor)
    if name is None:
        raise TypeError(
            f"gradient tensor has dtype {tensor.dtype}; gradstream sends float16, bfloat16, "
            "float32 and float64 values (convert it, e.g. tensor.float())"
        )
    plain = tensor.detach().contiguous()  # no copy when it is contiguous already
    if name == "bfloat16":
        torch = _torch()
        return plain.view(torch.int16).numpy().view(np.uint16), name
    return plain.numpy(), name


def lent_view(tensor: Any, what: str) -> tuple[np.ndarray, str]:
    """A tensor lent to be written in place (``out=``, ``reduce_into=``, a model's
    tensors): a numpy view of its memory (bfloat16 as uint16 bits) and its dtype name.
    TypeError naming the problem when it cannot be written in place."""
    _on_cpu(tensor, what)
    name = dtype_of(tensor)
    if name is None:
        raise TypeError(
            f"{what} must be a torch tensor of float16, bfloat16, float32 or float64, "
            f"got {tensor.dtype}"
        )
    if not tensor.is_contiguous():
        raise TypeError(
            f"{what} must be a contiguous torch tensor (written in place), got a "
            "non-contiguous one: pass tensor.contiguous() and copy back, or receive a new one"
        )
    plain = tensor.detach()
    if name == "bfloat16":
        torch = _torch()
        return plain.view(torch.int16).numpy().view(np.uint16), name
    return plain.numpy(), name


def check_like(like: Any) -> str:
    """``like=`` checked: "numpy" (the default) or "torch" (ValueError otherwise)."""
    if like is None:
        return "numpy"
    if like not in LIKES:
        raise ValueError(f'like= must be "numpy" or "torch", not {like!r}')
    return str(like)


def from_values(flat: np.ndarray, name: str, shape: Any) -> Any:
    """Received values (flat, bfloat16 as uint16 bits) as a torch tensor over the same
    memory, in ``shape`` when the sender kept it."""
    torch = _torch()
    if name == "bfloat16" and flat.dtype.itemsize == 2:
        # uint16 bits or ml_dtypes' bfloat16: the same 16 bits either way.
        tensor = torch.from_numpy(flat.view(np.int16)).view(torch.bfloat16)
    elif name == "float16" and flat.dtype.itemsize == 2:
        tensor = torch.from_numpy(flat.view(np.float16))
    else:
        tensor = torch.from_numpy(flat)
    return tensor if shape is None else tensor.reshape(tuple(shape))
