"""The Arrow side of the dtypes (docs/guides/dtypes-and-shapes.md): the extension type
``gradstream.bfloat16`` (``BFloat16Type``) and the Arrow arrays a gradient may be given as.

Apart from ``_dtypes`` so that ``import gradstream`` does not import pyarrow (it costs
about as much as the rest of the package): this module is imported when something first
needs it, i.e. by the reference codec, by ``gradstream.BFloat16Type``, by a gradient given
as an Arrow array, and by ``import gradstream`` itself when pyarrow was imported first.
Importing it registers ``BFloat16Type`` with pyarrow, so that pyarrow reads a
``gradstream.bfloat16`` field as that type.

Uses pyarrow only; used by ``_dtypes`` (lazily), the reference and the package.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

__all__ = ["BF16_EXTENSION", "BFloat16Type", "arrow_values", "is_bfloat16_type"]

BF16_EXTENSION = "gradstream.bfloat16"


class BFloat16Type(pa.ExtensionType):  # type: ignore[misc]
    """Arrow extension type ``gradstream.bfloat16``: bfloat16 values stored as the uint16
    of their bits (the top half of the float32 bits). Its serialized metadata is empty.

    ``BFloat16Type()`` is over uint16. A file may put the name on a field of another type;
    pyarrow then reads that field as this type over its own storage type (rather than
    failing to open the file), and gradstream goes by the storage type, as arrow-rs does:
    only a uint16 field with the name holds bfloat16 values."""

    def __init__(self, storage_type: pa.DataType | None = None) -> None:
        super().__init__(pa.uint16() if storage_type is None else storage_type, BF16_EXTENSION)

    def __arrow_ext_serialize__(self) -> bytes:
        return b""

    @classmethod
    def __arrow_ext_deserialize__(
        cls, storage_type: pa.DataType, serialized: bytes
    ) -> BFloat16Type:
        return cls(storage_type)


def is_bfloat16_type(data_type: pa.DataType) -> bool:
    """Whether an Arrow type is bfloat16: ``gradstream.bfloat16`` over uint16."""
    return isinstance(data_type, BFloat16Type) and data_type.storage_type == pa.uint16()


try:
    pa.register_extension_type(BFloat16Type())
except pa.ArrowKeyError:  # registered already (module reloaded)
    pass


def arrow_values(obj: Any) -> tuple[np.ndarray, str] | None:
    """An Arrow bfloat16/float16/float32/float64 array (or chunked array) as its values
    (bfloat16 as uint16 bits) and dtype name; None for any other object."""
    if not isinstance(obj, (pa.Array, pa.ChunkedArray)):
        return None
    if isinstance(obj, pa.ChunkedArray):
        obj = obj.combine_chunks()
    if obj.null_count:
        raise ValueError(
            f"gradient Arrow array has {obj.null_count} null value(s); "
            "a gradient must be dense (fill them first, e.g. pyarrow.compute.fill_null)"
        )
    if isinstance(obj.type, BFloat16Type):
        if is_bfloat16_type(obj.type):
            return obj.storage.to_numpy(zero_copy_only=True), "bfloat16"
        obj = obj.storage  # the name on another type: that type's values
    floats = (("float16", pa.float16()), ("float32", pa.float32()), ("float64", pa.float64()))
    for name, arrow_type in floats:
        if obj.type == arrow_type:
            return obj.to_numpy(zero_copy_only=True), name
    return None
