"""Pure-Python reference implementation of gradstream: see ``_session``."""

from __future__ import annotations

from .. import _convert
from ._session import COMPACT_SCHEMA as COMPACT_SCHEMA
from ._session import PAYLOAD_SCHEMA as PAYLOAD_SCHEMA
from ._session import GradientChunk, GradientStreamSession, TransferProgress
from ._session import _footer_blocks as _footer_blocks
from ._session import decode_payload as decode_payload
from ._session import encode_payload as encode_payload

__all__ = ["GradientChunk", "GradientStreamSession", "TransferProgress"]

# The tests compare the shape metadata with what the session writes, which is this.
_shape_text = _convert.shape_text
