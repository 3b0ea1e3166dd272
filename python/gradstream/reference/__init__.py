"""Pure-Python reference implementation of gradstream's codec and session (numpy +
pyarrow + zlib + struct).

An independent second implementation of the native session's API, written from
docs/spec/wire-format.md and docs/spec/decoding-rules.md step by step rather than from the
Rust code, so that the differential tests, which hold the two against each other, catch a
mistake on either side: for any input both must raise the same exception class with the
same fields. It is the executable form of the spec: keep it obvious rather than fast. Its
``stream_to`` / ``receive_from`` move frames over sockets and asyncio streams; it has no
connections (``listen`` / ``connect`` are the native package's; the tests' protocol peer
is tests/support/peer/).

Two things hold throughout:

* values are moved as raw words (numpy views, Arrow buffers, memcpy-style
  concatenation) and never pass through another dtype unless the dtypes rules cast them
  (``_dtypes.cast``, docs/guides/dtypes-and-shapes.md), so NaN payloads, -0.0 and
  subnormals survive bit for bit;
* this package imports only ``gradstream.errors``, ``._checks``, ``._convert``,
  ``._dtypes`` and ``._io`` from gradstream, never the native extension nor the native
  side's tensor-set layer (``gradstream._tensors``), so it can judge them without
  depending on them.

One job a module; the imports run one way, from the session down:

* ``_session``: ``GradientStreamSession``, the settings and the API on them, wiring the
  modules below together;
* ``_tensors``: tensor sets (encode_tensors, decode_tensors, stream_tensors,
  receive_tensors) over the receiver, the writer and the channels;
* ``_manifest``: a tensor set's manifest JSON, written and strictly read, and the name
  checks;
* ``_chunk``: ``GradientChunk``, the chunk value object;
* ``_settings``: the checks of the constructor's settings and other arguments;
* ``_channels``: the I/O, over sockets and asyncio streams, and ``TransferProgress``;
* ``_receiver``: ``_FrameReceiver``, decode_frames' rules as a sans-I/O state machine,
  and the in-memory frame stream decode;
* ``_rules``: what a gradient's chunks are held to together (error texts, shape and
  dtype trackers, CRC), and decode_chunks;
* ``_reader``: one payload opened, its schema checked and its value column read;
* ``_guard``: the hand-written flatbuffer checks on hostile payload bytes (footer,
  compressed batches), run before pyarrow reads them;
* ``_writer``: the payload encoder (layouts, dtypes, metadata, compression) and
  ``payload_len``;
* ``_seal``: the ``gradstream_seal`` metadata, written and held to what is expected;
* ``_wire``: the wire format's fixed facts (frame header, schemas, metadata keys, value
  types), shared by the writer and the reader.

This module only re-exports the API and the names the tests reach into, and gives the
classes this package as their home.
"""

from __future__ import annotations

from . import _wire
from ._channels import TransferProgress
from ._chunk import GradientChunk
from ._guard import _footer_blocks as _footer_blocks
from ._reader import decode_payload as decode_payload
from ._session import GradientStreamSession
from ._settings import DEFAULT_CHUNK_SIZE as DEFAULT_CHUNK_SIZE
from ._settings import DEFAULT_MAX_GRADIENT_LEN as DEFAULT_MAX_GRADIENT_LEN
from ._settings import DEFAULT_MAX_PAYLOAD_LEN as DEFAULT_MAX_PAYLOAD_LEN
from ._wire import COMPACT_SCHEMA as COMPACT_SCHEMA
from ._wire import HEADER as HEADER
from ._wire import HEADER_LEN as HEADER_LEN
from ._wire import PAYLOAD_SCHEMA as PAYLOAD_SCHEMA
from ._writer import encode_payload as encode_payload
from ._writer import payload_len as payload_len

__all__ = ["GradientChunk", "GradientStreamSession", "TransferProgress"]

# The tests compare the shape metadata with what the session writes, which is this.
_shape_text = _wire.shape_text

# The classes are defined in the submodules, but their public home is this package: so
# reprs of the classes and pickles of their instances name gradstream.reference, as they
# did before the split, and not a private module that may move again.
for _cls in (GradientChunk, GradientStreamSession, TransferProgress):
    _cls.__module__ = __name__
del _cls
