"""Tensors as the backend moves them: a 1-D numpy view of a tensor's memory in a dtype
gradstream carries (``_Flat``), the segments a ring cuts it into, the rows
``all_to_all_single`` splits, and how a received segment is combined into one's own."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..errors import SettingError

_WIRE = {
    torch.float32: (torch.float32, np.float32),
    torch.float64: (torch.float64, np.float64),
    torch.float16: (torch.float16, np.float16),
    # bfloat16 travels as its raw 16-bit values, viewed as float16 (no conversion: the
    # bits are copied; the sum is done by torch in bfloat16).
    torch.bfloat16: (torch.float16, np.float16),
}


class _Flat:
    """A tensor as the ring moves it: a 1-D torch view and a numpy view of the same
    memory in a dtype gradstream carries. A tensor that is not contiguous is copied
    in and written back by ``done``."""

    def __init__(self, tensor: torch.Tensor) -> None:
        if tensor.device.type != "cpu":
            raise TypeError(
                f"the gradstream backend takes CPU tensors, got one on {tensor.device}: "
                "use .cpu(), or the gloo/nccl backend for device tensors"
            )
        self.tensor = tensor
        self.flat = tensor.detach().reshape(-1) if tensor.is_contiguous() else None
        work = self.flat if self.flat is not None else tensor.detach().contiguous().reshape(-1)
        self.torch = work
        if tensor.dtype in _WIRE:
            wire = work.view(_WIRE[tensor.dtype][0])
        elif work.numel() * work.element_size() % 2 == 0:
            # Other dtypes (int64 buffers, ...) only move as bits (broadcast, gather).
            wire = work.view(torch.uint8).view(torch.float16)
        else:
            raise TypeError(
                f"the gradstream backend moves {tensor.dtype} tensors of an even byte "
                f"count only, got {work.numel() * work.element_size()} bytes"
            )
        # Through DLPack, not .numpy(): that marks the tensor's storage unresizable for
        # good, and FSDP frees its unsharded parameters by resizing their storage to 0.
        self.wire: np.ndarray = np.from_dlpack(wire)

    def reducible(self) -> _Flat:
        """Itself, when its values can be added up (one of the four float dtypes)."""
        if self.tensor.dtype not in _WIRE:
            raise TypeError(
                "the gradstream backend reduces float32, float64, float16 and bfloat16 "
                f"tensors, not {self.tensor.dtype}"
            )
        return self

    def done(self) -> None:
        if self.flat is None:
            self.tensor.copy_(self.torch.view(self.tensor.shape))


def _bounds(length: int, parts: int) -> list[tuple[int, int]]:
    return [(i * length // parts, (i + 1) * length // parts) for i in range(parts)]


_REDUCE = {
    dist.ReduceOp.SUM: "sum",
    dist.ReduceOp.AVG: "avg",
    dist.ReduceOp.MIN: "min",
    dist.ReduceOp.MAX: "max",
    dist.ReduceOp.PRODUCT: "product",
}


def _op_name(op: Any) -> str:
    for known, name in _REDUCE.items():
        if op == known:
            return name
    raise SettingError(
        "op", f"the gradstream backend reduces with SUM, AVG, MIN, MAX or PRODUCT, not {op}"
    )


def _others(flats: list[_Flat], rank: int) -> dict[int, _Flat]:
    return {k: f for k, f in enumerate(flats) if k != rank}


def _rows(tensor: torch.Tensor, splits: list[int], parts: int, what: str) -> list[_Flat]:
    """``tensor`` cut along its first dimension into ``splits`` rows each (equal parts
    when ``splits`` is empty), each a ``_Flat`` of its rows."""
    rows = tensor.shape[0] if tensor.dim() else 0
    if not splits:
        if rows % parts:
            raise ValueError(
                f"all_to_all_single: the {what}'s {rows} rows do not split equally among "
                f"{parts} ranks: pass {what}_split_sizes"
            )
        splits = [rows // parts] * parts
    if len(splits) != parts or sum(splits) != rows:
        raise ValueError(
            f"all_to_all_single: {what}_split_sizes {list(splits)} must be {parts} numbers "
            f"adding up to the {what}'s {rows} rows"
        )
    starts = np.cumsum([0, *splits[:-1]])
    return [_Flat(tensor.narrow(0, int(a), int(n))) for a, n in zip(starts, splits, strict=True)]


def _combine(mine: torch.Tensor, got: torch.Tensor, dtype: torch.dtype, op: str) -> None:
    """``mine = mine (op) got``, in ``dtype`` (got holds its bits)."""
    other = got.view(dtype)
    if op in ("sum", "avg"):
        mine.add_(other)
    elif op == "min":
        torch.minimum(mine, other, out=mine)
    elif op == "max":
        torch.maximum(mine, other, out=mine)
    else:
        mine.mul_(other)
