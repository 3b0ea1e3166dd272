"""A tensor set's manifest (docs/guides/tensor-sets.md): its entries, the JSON text a sender
writes, the strict reading of that text by a receiver (receiver rule 2), and the checks
of a tensor name, which the sender applies too.

Apart from ``_tensors`` because it is about JSON and names alone: no frames, no I/O, no
session. It is the reference's own reading of the rules, written separately from the
native session's ``gradstream._tensors`` (once shared by both), so that the differential
tests see two readings of every rule; where docs/spec/decoding-rules.md states a message, both give
it.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, NamedTuple, NoReturn

from .. import _dtypes
from ..errors import TensorSetError
from ._wire import numpy_can_make

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
# A quoted value is cut to this many characters: a hostile manifest's values can be huge.
_QUOTE_LIMIT = 80
# The deepest nesting of arrays and objects a manifest may have (the schema needs 3):
# checked on the text before parsing, so that no parser recurses deeper.
MAX_DEPTH = 32
# The most digits of an integer literal (Python 3.11's default int limit), whatever
# this interpreter's setting.
MAX_INT_DIGITS = 4300
_NOT_JSON = "tensor set manifest is not valid JSON"


class Entry(NamedTuple):
    """One tensor of a set as its manifest names it."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        """Its element count: what its gradient may hold (max_gradient_len)."""
        return math.prod(self.shape)


def quoted(value: Any) -> str:
    """``value`` as it stands in a tensor-set message: compact ASCII JSON (a name is
    ``"fc.weight"``), cut to at most 80 characters (the first 77, then ``...``)."""
    text = json.dumps(value, ensure_ascii=True, separators=(",", ":"), allow_nan=True)
    if len(text) > _QUOTE_LIMIT:
        text = text[: _QUOTE_LIMIT - 3] + "..."
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
            f"tensor name {quoted(name)} is not valid Unicode text (a lone surrogate): "
            "it has no UTF-8 form",
            name=name,
        ) from None
    if len(encoded) > MAX_NAME_BYTES:
        raise TensorSetError(
            f"tensor name {quoted(name)} takes {len(encoded)} UTF-8 bytes, above the "
            f"limit of {MAX_NAME_BYTES}",
            name=name,
        )
    if name in taken:
        raise TensorSetError(
            f"tensor name {quoted(name)} appears twice in the tensor set", name=name
        )
    taken.add(name)


def manifest_json(entries: list[Entry]) -> str:
    """The manifest's text: compact JSON, keys in the docs/spec/decoding-rules.md order, names as
    they are
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


def _integer(digits: str) -> int:
    """An integer literal, refused above 4300 digits (whatever this interpreter's own
    limit), as every implementation refuses it."""
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError("an integer literal of more than 4300 digits")
    return int(digits)


# The characters the depth scan looks at: brackets, quotes and backslashes.
_SCANNED = re.compile(r'[\[\]{}"\\]')


def _check_depth(text: str) -> None:
    """The lexical depth scan, before any parsing: outside a string ``[`` and ``{`` go one
    level down and ``]`` and ``}`` one up; ``"`` starts or ends a string; inside one, a
    backslash skips the character after it. Deeper than 32 levels is refused."""
    depth = 0
    in_string = False
    skip_to = 0  # the index after the character a backslash skipped
    for match in _SCANNED.finditer(text):
        at = match.start()
        if at < skip_to:
            continue
        char = match.group()
        if in_string:
            if char == "\\":
                skip_to = at + 2
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                raise TensorSetError(
                    f"tensor set manifest nests arrays or objects deeper than {MAX_DEPTH} levels"
                )
        elif char in "]}":
            depth -= 1


def _has_lone_surrogate(value: Any) -> bool:
    """Whether a string of the parsed document (a key or a value) holds a lone surrogate
    (from a ``\\ud800``-style escape): text with no UTF-8 form."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_lone_surrogate(item) for item in value)
    return False


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
    """Rules 2 and 3 of the docs/spec/decoding-rules.md manifest reading: the depth scan, then a
    strict
    parse (RFC 8259 JSON only, a repeated key refused when its object closes), then no
    lone surrogate anywhere."""
    _check_depth(text)
    try:
        document = json.loads(
            text, object_pairs_hook=_object, parse_constant=_refuse_constant, parse_int=_integer
        )
    except _DuplicateKey as exc:
        raise TensorSetError(
            f"tensor set manifest repeats the key {quoted(exc.args[0])} in one JSON object"
        ) from None
    except ValueError:  # JSONDecodeError is a ValueError; so are _integer's and NaN's
        raise TensorSetError(_NOT_JSON) from None
    if _has_lone_surrogate(document):
        raise TensorSetError(_NOT_JSON)
    return document


def _keys_exactly(obj: dict[str, Any], keys: tuple[str, ...], what: str, name: Any) -> None:
    """Every key of ``keys`` present (the first missing one named), then no other."""
    missing = [key for key in keys if key not in obj]
    if missing:
        raise TensorSetError(f"{what} has no {quoted(missing[0])} key", name=name)
    extra = [key for key in obj if key not in keys]
    if extra:
        raise TensorSetError(
            f"{what} has an unexpected key {quoted(extra[0])} (its keys are {', '.join(keys)})",
            name=name,
        )


def _header_fields(document: Any) -> list[Any]:
    """The top-level object checked (format, version); its ``tensors`` array."""
    if not isinstance(document, dict):
        raise TensorSetError(f"tensor set manifest is a JSON {_kind(document)}, not an object")
    _keys_exactly(document, _TOP_KEYS, "tensor set manifest", None)
    fmt = document["format"]
    if not (isinstance(fmt, str) and fmt == FORMAT):
        raise TensorSetError(f"tensor set manifest format is {quoted(fmt)}, not {quoted(FORMAT)}")
    version = document["version"]
    # True == 1 and 1.0 == 1 in Python; neither is the integer 1 of JSON.
    if type(version) is not int or version != VERSION:
        raise TensorSetError(
            f"tensor set manifest version {quoted(version)} is not supported (this "
            f"gradstream reads version {VERSION})"
        )
    tensors = document["tensors"]
    if not isinstance(tensors, list):
        raise TensorSetError(
            f"tensor set manifest {quoted('tensors')} is a JSON {_kind(tensors)}, not an array"
        )
    return tensors


def _dims(shape: Any, name: str) -> tuple[int, ...]:
    """An entry's shape: an array of at most 32 integers of at most 18 digits, which numpy
    can make an array of (as gradient_shape allows)."""
    if not isinstance(shape, list):
        raise TensorSetError(
            f"tensor {quoted(name)}: its shape is a JSON {_kind(shape)}, not an array of integers",
            name=name,
        )
    if len(shape) > MAX_DIMS:
        raise TensorSetError(
            f"tensor {quoted(name)}: its shape has {len(shape)} dimensions, more than {MAX_DIMS}",
            name=name,
        )
    for dim in shape:
        if type(dim) is not int or dim < 0 or len(str(dim)) > DIM_DIGITS:
            raise TensorSetError(
                f"tensor {quoted(name)}: shape dimension {quoted(dim)} is not an integer of at "
                f"most {DIM_DIGITS} digits",
                name=name,
            )
    dims = tuple(shape)
    if not numpy_can_make(dims):
        raise TensorSetError(
            f"tensor {quoted(name)}: its shape {quoted(shape)} is beyond what numpy can make "
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
            f"tensor {quoted(name)}: dtype {quoted(dtype)} is not {_FOUR_DTYPES}", name=name
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
