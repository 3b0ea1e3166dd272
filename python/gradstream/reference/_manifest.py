"""A tensor set's manifest (README "Tensor sets"): its entries, the JSON text a sender
writes, the strict reading of that text by a receiver (receiver rule 2), and the checks
of a tensor name, which the sender applies too.

Apart from ``_tensors`` because it is about JSON and names alone: no frames, no I/O, no
session. It is the reference's own reading of the rules, written separately from the
native session's ``gradstream._tensors`` (once shared by both), so that the differential
tests see two readings of every rule; where the README states a message, both give it.
"""

from __future__ import annotations

import json
import math
from typing import Any, NamedTuple, NoReturn

from .. import _dtypes
from ..errors import TensorSetError

FORMAT = "gradstream.tensors"
VERSION = 1
MAX_NAME_BYTES = 1024
MAX_DIMS = 32
# A dimension has at most 18 decimal digits, as in gradient_shape.
DIM_DIGITS = 18
# The manifest frame is read with max_payload_len capped at this (receiver rule 1).
MANIFEST_CAP = 16 * 1024 * 1024

_TOP_KEYS = ("format", "version", "tensors")
_ENTRY_KEYS = ("name", "dtype", "shape")
_FOUR_DTYPES = "float16, bfloat16, float32 or float64"
_REPR_LIMIT = 80


class Entry(NamedTuple):
    """One tensor of a set as its manifest names it."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        """Its element count: what its gradient may hold (max_gradient_len)."""
        return math.prod(self.shape)


def _clipped(value: Any) -> str:
    """``repr(value)``, at most 80 characters: a hostile manifest's values can be huge."""
    text = repr(value)
    if len(text) > _REPR_LIMIT:
        text = text[: _REPR_LIMIT - 3] + "..."
    return text


def check_name(name: str, taken: set[str]) -> None:
    """A name: non-empty, with a UTF-8 form of at most 1024 bytes, not in ``taken`` (to
    which it is then added). TensorSetError carrying the name otherwise."""
    if name == "":
        raise TensorSetError("a tensor name is empty; names are non-empty strings", name=name)
    try:
        encoded = name.encode("utf-8")
    except UnicodeEncodeError:
        raise TensorSetError(
            f"tensor name {_clipped(name)} is not valid Unicode text (a lone surrogate): "
            "it has no UTF-8 form",
            name=name,
        ) from None
    if len(encoded) > MAX_NAME_BYTES:
        raise TensorSetError(
            f"tensor name {_clipped(name)} takes {len(encoded)} UTF-8 bytes, above the "
            f"limit of {MAX_NAME_BYTES}",
            name=name,
        )
    if name in taken:
        raise TensorSetError(f"tensor name {name!r} appears twice in the tensor set", name=name)
    taken.add(name)


def manifest_json(entries: list[Entry]) -> str:
    """The manifest's text: compact JSON, keys in the README's order, names as they are
    (not escaped to ASCII)."""
    tensors = [{"name": e.name, "dtype": e.dtype, "shape": list(e.shape)} for e in entries]
    document = {"format": FORMAT, "version": VERSION, "tensors": tensors}
    return json.dumps(document, ensure_ascii=False, separators=(",", ":"))


# ---------------------------------------------------------------------------- reading


class _DuplicateKey(Exception):
    """A JSON object naming one key twice (json.loads would keep the last silently)."""


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(key)
        result[key] = value
    return result


def _refuse_constant(token: str) -> NoReturn:
    # NaN, Infinity and -Infinity: Python's json takes them, JSON does not.
    raise ValueError(f"{token} is not a JSON value")


_JSON_KINDS: tuple[tuple[type, str], ...] = (
    (bool, "boolean"),  # before int: bool is an int subclass
    (dict, "object"),
    (list, "array"),
    (str, "string"),
    (int, "integer"),
    (float, "number"),
)


def _kind(value: Any) -> str:
    """What a parsed JSON value is, in JSON's words."""
    for cls, word in _JSON_KINDS:
        if isinstance(value, cls):
            return word
    return "null"


def _load(text: str) -> Any:
    try:
        return json.loads(text, object_pairs_hook=_object, parse_constant=_refuse_constant)
    except _DuplicateKey as exc:
        raise TensorSetError(
            f"tensor set manifest repeats the key {_clipped(exc.args[0])} in one JSON object"
        ) from None
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise TensorSetError(f"tensor set manifest is not valid JSON: {exc}") from None


def _keys_exactly(obj: dict[str, Any], keys: tuple[str, ...], what: str, name: Any) -> None:
    """Every key of ``keys`` present (the first missing one named), then no other."""
    missing = [key for key in keys if key not in obj]
    if missing:
        raise TensorSetError(f"{what} has no {missing[0]!r} key", name=name)
    extra = [key for key in obj if key not in keys]
    if extra:
        raise TensorSetError(
            f"{what} has an unexpected key {_clipped(extra[0])} (its keys are {', '.join(keys)})",
            name=name,
        )


def _header_fields(document: Any) -> list[Any]:
    """The top-level object checked (format, version); its ``tensors`` array."""
    if not isinstance(document, dict):
        raise TensorSetError(f"tensor set manifest is a JSON {_kind(document)}, not an object")
    _keys_exactly(document, _TOP_KEYS, "tensor set manifest", None)
    fmt = document["format"]
    if not (isinstance(fmt, str) and fmt == FORMAT):
        raise TensorSetError(f"tensor set manifest format is {_clipped(fmt)}, not {FORMAT!r}")
    version = document["version"]
    # True == 1 and 1.0 == 1 in Python; neither is the integer 1 of JSON.
    if type(version) is not int or version != VERSION:
        raise TensorSetError(
            f"tensor set manifest version {_clipped(version)} is not supported (this "
            f"gradstream reads version {VERSION})"
        )
    tensors = document["tensors"]
    if not isinstance(tensors, list):
        raise TensorSetError(
            f"tensor set manifest 'tensors' is a JSON {_kind(tensors)}, not an array"
        )
    return tensors


def _dims(shape: Any, name: str) -> tuple[int, ...]:
    """An entry's shape: an array of at most 32 integers of at most 18 digits, which numpy
    can make an array of (as gradient_shape allows)."""
    if not isinstance(shape, list):
        raise TensorSetError(
            f"tensor {name!r}: its shape is a JSON {_kind(shape)}, not an array of integers",
            name=name,
        )
    if len(shape) > MAX_DIMS:
        raise TensorSetError(
            f"tensor {name!r}: its shape has {len(shape)} dimensions, more than {MAX_DIMS}",
            name=name,
        )
    for dim in shape:
        if type(dim) is not int or dim < 0 or len(str(dim)) > DIM_DIGITS:
            raise TensorSetError(
                f"tensor {name!r}: shape dimension {_clipped(dim)} is not an integer of at "
                f"most {DIM_DIGITS} digits",
                name=name,
            )
    dims = tuple(shape)
    if not _dtypes.numpy_can_make(dims):
        raise TensorSetError(
            f"tensor {name!r}: its shape {_clipped(shape)} is beyond what numpy can make "
            "(its non-zero dimensions multiply past 2**60)",
            name=name,
        )
    return dims


def _entry(item: Any, where: str, taken: set[str]) -> Entry:
    if not isinstance(item, dict):
        raise TensorSetError(f"{where} is a JSON {_kind(item)}, not an object")
    name = item.get("name")
    # The keys first, so a missing or extra key is named before a bad name.
    _keys_exactly(item, _ENTRY_KEYS, where, name if isinstance(name, str) else None)
    if not isinstance(name, str):
        raise TensorSetError(f"{where}: its name is a JSON {_kind(name)}, not a string")
    check_name(name, taken)
    dtype = item["dtype"]
    if not (isinstance(dtype, str) and dtype in _dtypes.DTYPES):
        raise TensorSetError(
            f"tensor {name!r}: dtype {_clipped(dtype)} is not {_FOUR_DTYPES}", name=name
        )
    return Entry(name, dtype, _dims(item["shape"], name))


def read_manifest(text: str) -> list[Entry]:
    """Receiver rule 2 on a manifest's text: its entries, in order, or the TensorSetError
    of the first problem met (``.name`` the tensor concerned, when one is)."""
    tensors = _header_fields(_load(text))
    taken: set[str] = set()
    count = len(tensors)
    return [
        _entry(item, f"tensor set manifest entry {k} of {count}", taken)
        for k, item in enumerate(tensors, 1)
    ]
