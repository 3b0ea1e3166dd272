"""Writing a received tensor set into a model's tensors (or a mapping's arrays) in
place: ``recv_tensors(out=module_or_state_dict)``, docs/guides/torch.md "Filling a model
in place". Every name, shape and dtype is checked before anything is written."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ._convert import dtype_name, value_buffer
from ._torch import dtype_of, is_tensor, lent_view
from .errors import TensorSetError


def _targets(out: Any) -> dict[str, Any]:
    """The named tensors of ``recv_tensors(out=...)``: a module's floating-point state
    (its parameters and float buffers, sharing their memory: a set carries float values,
    so an integer buffer such as BatchNorm's ``num_batches_tracked`` is left out) or a
    mapping of name to tensor/array (its integer torch tensors left out alike)."""
    if hasattr(out, "state_dict") and callable(out.state_dict) and not isinstance(out, Mapping):
        state: Mapping[str, Any] = out.state_dict(keep_vars=True)
        return {name: t for name, t in state.items() if dtype_of(t) is not None}
    if isinstance(out, Mapping):
        # A state_dict given as it is: its integer tensors left out as a module's are.
        return {name: t for name, t in out.items() if not is_tensor(t) or dtype_of(t) is not None}
    raise TypeError(
        "out= of recv_tensors must be a torch module or a mapping of name to tensor "
        f"(a state_dict, or a dict of numpy arrays), not {type(out).__name__}"
    )


def _shape(target: Any) -> tuple[int, ...]:
    return tuple(int(n) for n in target.shape)


def _target_dtype(target: Any) -> str | None:
    if is_tensor(target):
        return dtype_of(target)
    if isinstance(target, np.ndarray):
        return dtype_name(target.dtype)
    return None


def fill_model(out: Any, received: list[tuple[str, tuple[np.ndarray, str, Any]]]) -> Any:
    """Write a received set into ``out``'s tensors in place, after checking every name,
    shape and dtype (TensorSetError naming the first difference, nothing written then).
    Returns ``out``."""
    targets = _targets(out)
    got = {name: values for name, values in received}
    missing = [name for name in targets if name not in got]
    extra = [name for name in got if name not in targets]
    if missing or extra:
        parts = []
        if extra:
            parts.append(f"the set has {', '.join(map(repr, extra))} which out= has not")
        if missing:
            parts.append(f"out= has {', '.join(map(repr, missing))} which the set has not")
        raise TensorSetError(
            "the tensor set does not match out=: " + "; ".join(parts),
            (extra or missing)[0],
        )
    views: list[tuple[np.ndarray, np.ndarray]] = []
    for name, target in targets.items():
        flat, dtype, shape = got[name]
        sent = tuple(shape) if shape is not None else (flat.size,)
        want = _target_dtype(target)
        if want is None:
            raise TypeError(
                f"out= tensor {name!r} is a {type(target).__name__}, not a torch tensor or "
                "numpy array of float16, bfloat16, float32 or float64"
            )
        if sent != _shape(target):
            raise TensorSetError(
                f"tensor {name!r} is of shape {list(sent)}; out= has {list(_shape(target))}",
                name,
            )
        if dtype != want:
            raise TensorSetError(f"tensor {name!r} is {dtype}; out= has {want}", name)
        if is_tensor(target):
            view, _ = lent_view(target, f"out= tensor {name!r}")
        else:
            view = value_buffer(target)
            if want == "bfloat16":
                view = view.view(np.uint16)
        views.append((view.reshape(-1), flat.reshape(-1).view(view.dtype)))
    for view, flat in views:
        view[...] = flat
    return out
