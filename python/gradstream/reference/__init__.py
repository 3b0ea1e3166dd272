"""Pure-Python reference implementation of gradstream (numpy + pyarrow + zlib + struct).

An independent second implementation of the native module's API, written from the
README's "Wire format" and "Decoding rules" step by step rather than from the Rust code,
so that the differential tests, which hold the two against each other, catch a mistake on
either side: for any input both must raise the same exception class with the same
fields. It is the executable form of the spec: keep it obvious rather than fast.

Two things hold throughout:

* values are moved as raw words (numpy views, Arrow buffers, memcpy-style
  concatenation) and never pass through another dtype unless the dtypes rules cast them
  (``_dtypes.cast``, README "The cast rule"), so NaN payloads, -0.0 and subnormals survive
  bit for bit;
* this package imports only ``gradstream.errors``, ``._convert``, ``._dtypes``,
  ``._io`` and ``._peers`` from gradstream, never the native extension nor the native
  side's tensor-set layer (``gradstream._tensors``), so it can judge them without
  depending on them.

One job a module; the imports run one way, from the session down:

* ``_listener``: ``listen`` and ``serve`` (README "Connections"): the listening socket,
  its caps, the handshakes under their timeout, the refusals logged;
* ``_connection``: ``connect``, ``Connection`` (one transfer at a time) and what both
  sides bring to a connection;
* ``_transfers``: a connection's transfers over the session, with the ack around them
  (``"gradstream"``) or without (``"seed"``);
* ``_handshake``: the hellos and the authkey's tags exchanged;
* ``_streams``: the connection's asyncio streams, TLS or not, tapped for the ack digest;
* ``_tls``: the ``ssl`` contexts and what ``ssl`` errors mean;
* ``_protocol``: the protocol's messages (hello, auth, ack), transfer ids and digests,
  sans-I/O;
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
* ``_wire``: the wire format's fixed facts (frame header, schemas, metadata keys, value
  types), shared by the writer and the reader.

This module only re-exports the API and the names the tests reach into, and gives the
classes this package as their home.
"""

from __future__ import annotations

from .._peers import TLS, Peer, Server
from . import _wire
from ._channels import TransferProgress
from ._chunk import GradientChunk
from ._connection import Connection, connect
from ._guard import _footer_blocks as _footer_blocks
from ._listener import Listener, listen, serve
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

__all__ = [
    "TLS",
    "Connection",
    "GradientChunk",
    "GradientStreamSession",
    "Listener",
    "Peer",
    "Server",
    "TransferProgress",
    "connect",
    "listen",
    "serve",
]

# The tests compare the shape metadata with what the session writes, which is this.
_shape_text = _wire.shape_text

# The classes are defined in the submodules, but their public home is this package: so
# reprs of the classes and pickles of their instances name gradstream.reference, as they
# did before the split, and not a private module that may move again.
for _cls in (Connection, GradientChunk, GradientStreamSession, Listener, TransferProgress):
    _cls.__module__ = __name__
del _cls
