"""The four value dtypes, their numpy forms, and the cast rule
(docs/guides/dtypes-and-shapes.md).

Shared by the native session and the reference: input conversion (``prepare``), the
``out=`` dtype names, and handing bfloat16 back. The casts are each implementation's own:
``cast`` here (numpy) for the reference, on both the sending and the receiving side;
Rust ``crates/gradstream-core/src/dtype.rs`` for the native core, chunk by chunk. The
differential tests compare them.

bfloat16 has no numpy or Arrow type of its own. Arrays of it are handled here as uint16
arrays of the raw bits; on the wire it is the Arrow extension type ``gradstream.bfloat16``
over uint16 (``_arrow.BFloat16Type``); ``ml_dtypes.bfloat16`` arrays are taken, and
handed back when ml_dtypes is installed.

Neither pyarrow nor ml_dtypes is imported with this module (``import gradstream`` would
cost twice as long): ml_dtypes when a bfloat16 array is first handed back, ``_arrow``
when a gradient is given as an Arrow array.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any, NamedTuple

import numpy as np

from ._convert import as_float32_array, dtype_name, to_ndarray
from ._torch import is_tensor, values_of

__all__ = [
    "DTYPES",
    "DTYPE_KEY",
    "ML_DTYPES",
    "WIRE_DTYPES",
    "Prepared",
    "bfloat16_dtype",
    "carrier",
    "cast",
    "dtype_name",
    "hand_back",
    "numpy_dtype",
    "prepare",
    "width",
]

DTYPES = ("float16", "bfloat16", "float32", "float64")
# What wire_dtype= takes: a dtype, or the int8 wire, which carries float32 values
# quantized by blocks (docs/spec/wire-format.md, "The int8 wire").
WIRE_DTYPES = (*DTYPES, "int8")


def carrier(wire: str) -> str:
    """The dtype values are cast to before they are written as ``wire``, which is also
    the one a receiver reads them back in: float32 for the int8 wire."""
    return "float32" if wire == "int8" else wire


DTYPE_KEY = "gradient_dtype"

_BITS = {"float16": np.uint16, "bfloat16": np.uint16, "float32": np.uint32, "float64": np.uint64}
# Canonical quiet NaN of each dtype (sign bit clear); docs/guides/dtypes-and-shapes.md.
_CANONICAL_NAN = {
    "float16": 0x7E00,
    "bfloat16": 0x7FC0,
    "float32": 0x7FC0_0000,
    "float64": 0x7FF8 << 48,
}


# Whether ml_dtypes is installed, found without importing it (its extension module alone
# takes longer to import than the rest of gradstream); tests set it to False to see the
# fallback. A native session reads it once, when the session is made.
ML_DTYPES: bool = importlib.util.find_spec("ml_dtypes") is not None
_BFLOAT16: list[np.dtype] = []  # ml_dtypes' bfloat16, once imported


def bfloat16_dtype() -> np.dtype | None:
    """numpy's dtype for bfloat16 (ml_dtypes, imported on the first call), or None: then
    bfloat16 is handed back as float32."""
    if not ML_DTYPES:
        return None
    if not _BFLOAT16:
        import ml_dtypes

        _BFLOAT16.append(np.dtype(ml_dtypes.bfloat16))
    return _BFLOAT16[0]


def width(name: str) -> int:
    """Bytes a value of dtype ``name`` takes (without importing ml_dtypes for bfloat16)."""
    return np.dtype(_BITS[name]).itemsize


def hand_back(name: str) -> str:
    """The dtype name a gradient of dtype ``name`` comes back in (bfloat16 without
    ml_dtypes comes back as float32)."""
    return "float32" if name == "bfloat16" and not ML_DTYPES else name


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype a gradient of dtype ``name`` is handed back in."""
    back = hand_back(name)
    bfloat16 = bfloat16_dtype() if back == "bfloat16" else None
    return np.dtype(back) if bfloat16 is None else bfloat16


def _bits(values: np.ndarray, name: str) -> np.ndarray:
    return values.view(_BITS[name])


def _nan_mask(values: np.ndarray, name: str) -> np.ndarray:
    """NaN positions of an array of ``name`` (bfloat16 as its uint16 bits)."""
    if name == "bfloat16":
        mask: np.ndarray = (values.view(np.uint16) & np.uint16(0x7FFF)) > np.uint16(0x7F80)
        return mask
    return np.asarray(np.isnan(values))


def _sign_bits(values: np.ndarray, name: str) -> np.ndarray:
    """The sign bit (0 or 1, as uint64) of each value of ``name``."""
    bits = _bits(values, name)
    sign: np.ndarray = (bits >> bits.dtype.type(8 * bits.dtype.itemsize - 1)).astype(np.uint64)
    return sign


def _to_float32(values: np.ndarray, name: str) -> np.ndarray:
    if name == "bfloat16":
        return (values.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        return values.astype(np.float32)


def _float32_to_bfloat16(values: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 bits, to nearest, ties to even (NaNs fixed by the caller).

    In uint32: the sum only wraps for NaN bit patterns (above 0xffff8000), and the caller
    replaces every NaN anyway."""
    bits = values.view(np.uint32)
    rounded = bits + np.uint32(0x7FFF)
    rounded += (bits >> np.uint32(16)) & np.uint32(1)
    rounded >>= np.uint32(16)
    return rounded.astype(np.uint16)


def cast(values: np.ndarray, source: str, target: str) -> np.ndarray:
    """``values`` (C-contiguous, of dtype ``source``; bfloat16 as uint16 bits) cast to
    ``target`` by the cast rule, in the same shape (bfloat16 as uint16 bits). The same
    dtype is returned as it is."""
    if source == target:
        return values
    if target == "float64":
        wide = _to_float32(values, source) if source == "bfloat16" else values
        # A signalling NaN raises numpy's "invalid value" warning; its bits are fixed below.
        with np.errstate(invalid="ignore"):
            out = wide.astype(np.float64)
    else:
        narrow = _to_float32(values, source)
        if target == "float32":
            out = narrow.copy() if narrow is values else narrow
        elif target == "float16":
            with np.errstate(over="ignore", invalid="ignore"):
                out = narrow.astype(np.float16)
        else:
            out = _float32_to_bfloat16(narrow)
    # numpy hands a 0-d array's arithmetic back as a scalar: make it an array again.
    out = np.asarray(out)
    nan = _nan_mask(values, source)
    if nan.any():
        width = 8 * np.dtype(_BITS[target]).itemsize
        sign = _sign_bits(values[nan], source)
        canonical = np.uint64(_CANONICAL_NAN[target]) | (sign << np.uint64(width - 1))
        _bits(out, target)[nan] = canonical.astype(_BITS[target])
    # np.require, not np.ascontiguousarray: the latter makes a 0-d array 1-d.
    return np.require(out, requirements=["C"])


class Prepared(NamedTuple):
    """A gradient ready for the codec: C-contiguous, aligned, native-endian, in its own
    shape, in dtype ``source`` (bfloat16 as uint16 bits): the wire dtype (float32 for the
    int8 wire, quantized by the writer), unless the caller asked ``prepare`` to leave the
    cast to it (the native core casts chunk by chunk)."""

    values: np.ndarray
    wire: str  # one of WIRE_DTYPES
    # The dtype the receiver hands back: written as gradient_dtype when it is not
    # carrier(wire).
    result: str
    # The dtype of `values`.
    source: str


_HOW = (
    "gradstream sends float32 by default, as the ipfrs-transport wire format does; pass "
    "keep_dtype=True to send float16, bfloat16 or float64 as they are, or wire_dtype= to cast"
)


def _typed(obj: Any) -> tuple[np.ndarray, str] | None:
    """torch tensors (every float dtype, bfloat16 as its bits) and Arrow
    bfloat16/float16/float64 arrays, which the float32 conversion does not read; None for
    anything else."""
    mod = type(obj).__module__ or ""
    if is_tensor(obj):
        return values_of(obj)
    if mod.startswith("pyarrow"):
        # pyarrow is imported already: the caller made the array with it.
        from ._arrow import arrow_values

        return arrow_values(obj)
    return None


def _any_dtype_array(obj: Any) -> tuple[np.ndarray, str]:

    typed = _typed(obj)
    if typed is not None:
        arr, name = typed
    else:
        arr = to_ndarray(obj, any_float=True)
        found = dtype_name(arr.dtype)
        if found is None:
            raise TypeError(
                f"gradient has dtype {arr.dtype}; gradstream sends float16, bfloat16, "
                "float32 and float64 values"
            )
        name = found
        if name == "bfloat16":
            arr = arr.view(np.uint16)
        elif not arr.dtype.isnative:
            arr = arr.astype(arr.dtype.newbyteorder("="))
    return np.require(arr, requirements=["C", "A"]), name


def prepare(
    obj: Any, *, keep_dtype: bool, wire_dtype: str | None, cast_here: bool = True
) -> Prepared:
    """Take a gradient as a session with these settings does (docs/guides/dtypes-and-shapes.md). The
    values come back cast to the wire dtype, or, with ``cast_here=False``, in their own
    dtype for the caller to cast."""
    if not keep_dtype and wire_dtype is None:
        return Prepared(as_float32_array(obj), "float32", "float32", "float32")
    values, source = _any_dtype_array(obj)
    result = source if keep_dtype else "float32"
    wire = wire_dtype or source
    if not cast_here:
        return Prepared(values, wire, result, source)
    return Prepared(cast(values, source, carrier(wire)), wire, result, carrier(wire))


def as_hand_back(values: np.ndarray, name: str) -> np.ndarray:
    """Received values of dtype ``name`` (bfloat16 as uint16 bits) as the array handed
    back: bfloat16 viewed as ml_dtypes.bfloat16, or widened to float32 without it."""
    if name != "bfloat16":
        return values
    bfloat16 = bfloat16_dtype()
    if bfloat16 is not None:
        return values.view(bfloat16)
    return cast(values, "bfloat16", "float32")
