"""Turn whatever a caller hands us into a flat, C-contiguous float32 numpy vector, and
check the output buffers callers lend (``out=``).

Shared by the native session (which only comes here when its own fast path, a
native-endian C-contiguous float32 ndarray, does not apply) and by the reference.
The rule is: float32 in any container is accepted, with no copy where the memory
allows; any other dtype is a TypeError that names it, never a silent cast.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._torch import is_tensor, values_of
from .errors import SettingError

__all__ = [
    "as_float32_array",
    "as_float32_vector",
    "byte_view",
    "check_bool",
    "check_op",
    "dtype_name",
    "frame_buffer",
    "reduction",
    "to_ndarray",
    "value_buffer",
]

_HOW = (
    "a session without keep_dtype (bare frames' and protocol='seed' default) sends float32 "
    "values only, as the ipfrs-transport wire format does; send float16, bfloat16 or "
    "float64 as they are with GradientStreamSession(..., keep_dtype=True) (a gradstream "
    "connection's default), cast them with wire_dtype=..., or convert explicitly if the "
    "rounding is acceptable, e.g. numpy.asarray(g, dtype=numpy.float32) or tensor.float()"
)
# The advice when keep_dtype or wire_dtype is set already: what the session does take.
_ANY_FLOAT = (
    "this session takes float16, bfloat16, float32 and float64 values: a numpy array, a "
    "CPU tensor, a pyarrow array, or a buffer of format 'e', 'f' or 'd'"
)


def _reject(what: str, any_float: bool = False) -> TypeError:
    return TypeError(f"gradient has {what}; {_ANY_FLOAT if any_float else _HOW}")


def _from_arrow(obj: Any) -> np.ndarray:
    import pyarrow as pa

    if isinstance(obj, pa.ChunkedArray):
        obj = obj.combine_chunks()
    if not pa.types.is_float32(obj.type):
        raise _reject(f"Arrow type {obj.type}")
    if obj.null_count:
        raise ValueError(
            f"gradient Arrow array has {obj.null_count} null value(s); "
            "a gradient must be dense (fill them first, e.g. pyarrow.compute.fill_null)"
        )
    values: np.ndarray = obj.to_numpy(zero_copy_only=True)
    return values


def _is_arrow(obj: Any) -> bool:
    mod = type(obj).__module__ or ""
    if not mod.startswith("pyarrow"):
        return False
    import pyarrow as pa

    return isinstance(obj, (pa.Array, pa.ChunkedArray))


def to_ndarray(obj: Any, *, any_float: bool = False) -> np.ndarray:
    """``obj`` as a numpy array, without a copy where the memory allows. The dtype is
    checked by the caller; buffers other than format 'f' are refused here unless
    ``any_float`` (then 'e' and 'd' are taken too)."""
    if isinstance(obj, np.ndarray):
        return obj
    if _is_arrow(obj):
        return _from_arrow(obj)
    if is_tensor(obj):
        values, name = values_of(obj)
        if name == "bfloat16" and not any_float:
            raise _reject("dtype torch.bfloat16")
        return values
    if isinstance(obj, (list, tuple)):
        try:
            return np.asarray(obj, dtype=np.float32)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"gradient list must hold numbers only: {exc}") from None
    if isinstance(obj, (bytes, bytearray, str)):
        raise _reject(f"type {type(obj).__name__} (raw bytes are not a gradient)", any_float)
    try:
        view = memoryview(obj)
    except TypeError:
        view = None
    if view is not None:
        formats = {"e": 2, "f": 4, "d": 8} if any_float else {"f": 4}
        if formats.get(view.format.lstrip("@=<")) != view.itemsize:
            kinds = "float16 is 'e', float32 'f', float64 'd'" if any_float else "float32 is 'f'"
            raise _reject(f"buffer format {view.format!r} ({kinds})", any_float)
        return np.asarray(view)
    if hasattr(obj, "__dlpack__"):
        try:
            return np.from_dlpack(obj)
        except (TypeError, BufferError, RuntimeError, ValueError) as exc:
            dtype = getattr(obj, "dtype", None)
            of_dtype = "" if dtype is None else f" of dtype {dtype}"
            raise TypeError(
                f"gradient {type(obj).__name__}{of_dtype} could not be read through "
                f"__dlpack__ ({exc}); {_ANY_FLOAT if any_float else _HOW}"
            ) from None
    if hasattr(obj, "__array__"):
        return np.asarray(obj)
    raise TypeError(
        f"gradient must be a float32 array-like (numpy array, buffer of format 'f', "
        f"pyarrow Float32Array, CPU tensor or list of floats), not {type(obj).__name__}"
    )


def as_float32_vector(obj: Any) -> np.ndarray:
    """Return ``obj`` as a 1-D C-contiguous native-endian float32 ndarray.

    C-contiguous aligned float32 input is returned as a view (no copy); other layouts are
    copied once, flattened in C order. Non-native byte order is swapped (lossless).
    """
    return as_float32_array(obj).reshape(-1)


def as_float32_array(obj: Any) -> np.ndarray:
    """``as_float32_vector`` before flattening: C-contiguous, in ``obj``'s own shape (the
    shape ``keep_shape`` sends)."""
    arr = to_ndarray(obj)
    dtype = arr.dtype
    if dtype.kind != "f" or dtype.itemsize != 4:
        raise _reject(f"dtype {dtype}")
    if not dtype.isnative:
        arr = arr.astype(np.float32)
    # No-op for C-contiguous aligned input, one copy otherwise (a float32 view at an odd
    # byte offset is contiguous but misaligned, and Rust cannot read it as f32 in place).
    return np.require(arr, requirements=["C", "A"])


def dtype_name(dtype: np.dtype) -> str | None:
    """The gradstream name of a numpy dtype (any byte order), or None."""
    if dtype.kind == "f" and dtype.itemsize in (2, 4, 8):
        return f"float{dtype.itemsize * 8}"
    if dtype.kind == "V" and dtype.itemsize == 2 and dtype.name == "bfloat16":
        return "bfloat16"  # ml_dtypes.bfloat16 (kind 'V')
    return None


# out= buffers, checked alike by the native session and the reference.

_DECODE_OUT = (
    "out= must be a writeable C-contiguous numpy array of float16, bfloat16, float32 or float64"
)


def value_buffer(out: Any) -> np.ndarray:
    """Check a decode call's ``out=`` before any data is read: a writeable, C-contiguous,
    aligned, native-endian numpy array of float16, float32, float64 or ml_dtypes'
    bfloat16, of any shape. Returns ``out`` itself; TypeError naming the problem
    otherwise. Its dtype must also be the one the gradient comes back in, which only the
    data can tell (GradientDtypeError then)."""
    name = dtype_name(out.dtype) if isinstance(out, np.ndarray) else None
    if not isinstance(out, np.ndarray):
        problem = type(out).__name__
    elif name is None:
        problem = f"{out.dtype} array"
    else:
        found = _memory_problem(out, name)
        if found is None:
            return out
        problem = found
    raise TypeError(f"{_DECODE_OUT}, got {problem}")


def _memory_problem(array: np.ndarray, name: str) -> str | None:
    """What keeps the native side from writing ``array``'s values in place (docs/guides/buffers.md:
    native
    byte order, C-contiguous, aligned, writeable), in words naming its dtype ``name``; None
    when nothing does. Shared by ``out=`` and ``reduce_into=``."""
    if not array.dtype.isnative:
        return f"{name} array in non-native byte order ({array.dtype.str})"
    if not array.flags.c_contiguous:
        return f"non-contiguous {name} array"
    if not array.flags.aligned:
        return f"misaligned {name} array"
    if not array.flags.writeable:
        return f"read-only {name} array"
    return None


_REDUCE_INTO = (
    "reduce_into= must be a writeable C-contiguous numpy array or CPU torch tensor of "
    "float16, bfloat16, float32 or float64 (the sum is in its dtype whatever the gradient's)"
)


def check_op(out: Any, reduce_into: Any, op: str) -> None:
    """``op`` must be ``"sum"`` (else SettingError); ``out`` and ``reduce_into`` exclude
    each other (ValueError)."""
    if op != "sum":
        raise SettingError("op", f"op must be 'sum' (the one reduction there is), not {op!r}")
    if reduce_into is not None and out is not None:
        raise ValueError("out= and reduce_into= exclude each other: give one")


def reduction(out: Any, reduce_into: Any, op: str) -> np.ndarray | None:
    """Check a receive's ``reduce_into=`` and ``op=`` before any data is read
    (docs/guides/buffers.md "Reducing while receiving"): ``check_op``, and
    ``reduce_into`` is a writeable, C-contiguous, aligned, native array of one of the four
    dtypes (TypeError naming the problem). Returns it, or None when not given."""
    check_op(out, reduce_into, op)
    if reduce_into is None:
        return None
    name = dtype_name(reduce_into.dtype) if isinstance(reduce_into, np.ndarray) else None
    if not isinstance(reduce_into, np.ndarray):
        problem = type(reduce_into).__name__
    elif name is None:
        problem = f"{reduce_into.dtype} array"
    else:
        found = _memory_problem(reduce_into, name)
        if found is None:
            return reduce_into
        problem = found
    raise TypeError(f"{_REDUCE_INTO}, got {problem}")


def frame_buffer(out: Any) -> memoryview:
    """Check an encode call's ``out=`` and return its memory as writeable raw bytes,
    ``memoryview(out).cast("B")``; TypeError naming the problem otherwise."""
    kind = type(out).__name__
    try:
        view = memoryview(out)
    except (TypeError, ValueError, BufferError) as exc:
        # numpy raises ValueError for dtypes it cannot export (datetime64).
        raise TypeError(
            f"out= must be an object exporting a writeable C-contiguous buffer (bytearray, "
            f"memoryview, numpy array), got {kind}"
        ) from exc
    # The caller's view is released on every path (the cast below stands on its own), so
    # that a bytearray is not left locked against resizing, even by a traceback.
    with view:
        if view.readonly:
            raise TypeError(f"out= must be a writeable buffer, got a read-only {kind}")
        if not view.c_contiguous:
            raise TypeError(f"out= must be a C-contiguous buffer, got a non-contiguous {kind}")
        if view.format == "O" or (isinstance(out, np.ndarray) and out.dtype.hasobject):
            # Raw bytes written over Python object pointers would crash the interpreter.
            raise TypeError(f"out= cannot hold Python objects, got an object {kind}")
        if view.nbytes == 0:
            # memoryview.cast refuses shapes containing 0; nothing fits in it anyway.
            return memoryview(bytearray())
        return view.cast("B")


def byte_view(data: Any) -> memoryview:
    """A flat unsigned-byte view of any buffer-protocol object (bytes, bytearray,
    memoryview, pyarrow.Buffer, numpy arrays of any dtype and shape), copying only when
    the memory is not contiguous. TypeError for str, int and other non-buffers."""
    view = memoryview(data)
    if view.nbytes == 0:
        # memoryview.cast refuses shapes containing 0; an empty view is all we need.
        return memoryview(b"")
    if not view.c_contiguous:
        view = memoryview(view.tobytes())  # the one unavoidable copy
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    return view


def check_bool(value: Any, name: str) -> bool:
    """A bool argument, strictly, like a native ``bool`` one: 0/1 or None are more likely
    bugs than intent (TypeError)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be bool, not {type(value).__name__}")
    return bool(value)
