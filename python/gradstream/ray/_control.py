"""The few messages ``gradstream.ray`` peers exchange besides tensors, carried in the
name of an empty tensor that leads a tensor set: ``gradstream.ray:`` and a compact JSON
object. A tensor set is what a gradstream connection moves, sealed and acknowledged; a
name holds at most 1024 UTF-8 bytes, which bounds what a peer can make us parse.

Everything read here comes from the network: ``read`` checks the message's kind and the
type of every field, and says what was wrong as a ``ProtocolError``.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import ProtocolError

PREFIX = "gradstream.ray:"
# Room for a name: the tensor-set limit (1024 UTF-8 bytes) less the prefix.
_ROOM = 1024 - len(PREFIX.encode())

Tensors = dict[str, npt.NDArray[Any]]


def message(kind: str, **fields: Any) -> Tensors:
    """A tensor set of one empty tensor whose name says ``kind`` and ``fields``; a
    ``detail`` text is cut to fit."""
    body = {"kind": kind, **fields}
    text = json.dumps(body, ensure_ascii=True, separators=(",", ":"))
    over = len(text) - _ROOM
    if over > 0 and isinstance(body.get("detail"), str):
        body["detail"] = body["detail"][: max(0, len(body["detail"]) - over - 3)] + "..."
        text = json.dumps(body, ensure_ascii=True, separators=(",", ":"))
    return {PREFIX + text: np.empty(0, np.float32)}


def split(tensors: Tensors, peer: Any, expected: str) -> tuple[dict[str, Any], list[Any]]:
    """The leading message of a received set, and the tensors that follow it."""
    names = list(tensors)
    if not names or not names[0].startswith(PREFIX):
        seen = "nothing (the peer closed)" if not names else "a tensor set without a message"
        raise ProtocolError(expected, seen, peer)
    try:
        body = json.loads(names[0][len(PREFIX) :])
    except (ValueError, RecursionError):  # a name nests up to ~1000 levels deep
        body = None
    if not isinstance(body, dict) or not isinstance(body.get("kind"), str):
        raise ProtocolError(expected, "a message that is not a JSON object with a kind", peer)
    if any(name.startswith(PREFIX) for name in names[1:]):
        raise ProtocolError(expected, "a tensor set with two messages", peer)
    return body, [tensors[name] for name in names[1:]]


def object_id(body: dict[str, Any], peer: Any, expected: str) -> str:
    """``body["id"]``: an object id as Ray writes them (hex), or the few other
    characters a test's id may use; at most 128 of them, so a reply quoting it fits."""
    value: str = field(body, "id", str, peer, expected)
    plain = all(c.isascii() and (c.isalnum() or c in "-_") for c in value)
    if not 0 < len(value) <= 128 or not plain:
        raise ProtocolError(
            expected, f"a {body['kind']!r} message whose id is {value[:80]!r}", peer
        )
    return value


def field(body: dict[str, Any], name: str, kind: type, peer: Any, expected: str) -> Any:
    """``body[name]``, which must be a ``kind`` (an int is never a bool here)."""
    value = body.get(name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ProtocolError(expected, f"a {body['kind']!r} message whose {name} is {value!r}", peer)
    return value
