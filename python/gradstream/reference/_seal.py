"""Sealed chunks (docs/spec/wire-format.md; the receiver's rule in
docs/spec/decoding-rules.md): the ``gradstream_seal`` schema metadata that puts
a chunk's transfer id, index, total and position under its CRC, written by the sender and
held by the receiver to what it expects.

The value is 59 ASCII characters, lowercase hex fields of fixed width::

    <transfer id: 32 hex>:<chunk_index: 8 hex>:<total_chunks: 8 hex>:<position: 8 hex>

``position`` is ``ffffffff`` for a lone gradient, ``fffffffe`` for a tensor set's
manifest and k for tensor k (from 0) of a set. Every receiver verifies a seal it finds;
what it expects is ``WHEN_PRESENT`` (a receiver without ``seal=True``: the first chunk
taken decides; sealed, every chunk is held to what ``CONSISTENT`` holds it to, unsealed,
every chunk must be unsealed, as the original's frames are), ``CONSISTENT`` (a standalone
``seal=True`` session: every chunk sealed, all with the transfer id of the first chunk
taken), the 16 bytes of one exact transfer id (a connection's receiver) or ``ABSENT``
(no seal: the tensors of a set whose manifest a ``WHEN_PRESENT`` receiver took unsealed).

Apart because it is one rule of its own, used by the writer's callers (the session and
the tensor sets) and by both receiving paths (``_rules``' decode_chunks and
``_receiver``), which call ``_SealTracker`` as they call the shape and dtype trackers.
"""

from __future__ import annotations

import os
import re
from typing import Final, Literal, NamedTuple

from ..errors import FrameError

SEAL_KEY: Final = "gradstream_seal"
LONE: Final = 0xFFFF_FFFF
MANIFEST: Final = 0xFFFF_FFFE
WHEN_PRESENT: Final = "when-present"
CONSISTENT: Final = "consistent"
ABSENT: Final = "absent"

# What a receiver expects of seals (see the module's docstring).
Expect = Literal["when-present", "consistent", "absent"] | bytes

_GRAMMAR = re.compile(r"([0-9a-f]{32}):([0-9a-f]{8}):([0-9a-f]{8}):([0-9a-f]{8})")


class Seal(NamedTuple):
    """What a gradient is sealed with: its transfer's id and its position in it."""

    transfer: bytes  # 16 bytes
    position: int

    def text(self, chunk_index: int, total_chunks: int) -> str:
        """The value of the chunk ``chunk_index`` of ``total_chunks``."""
        return f"{self.transfer.hex()}:{chunk_index:08x}:{total_chunks:08x}:{self.position:08x}"


def new_transfer_id() -> bytes:
    """A fresh random transfer id (a standalone ``seal=True`` sender's, per gradient or
    per set)."""
    return os.urandom(16)


def check_transfer_id(transfer: object) -> bytes:
    """A transfer id given by a caller: 16 bytes, else TypeError or ValueError."""
    if not isinstance(transfer, bytes):
        raise TypeError(f"a transfer id is 16 bytes, not {type(transfer).__name__}")
    if len(transfer) != 16:
        raise ValueError(f"a transfer id is 16 bytes, not {len(transfer)}")
    return transfer


def _described(position: int) -> str:
    if position == LONE:
        return "a lone gradient"
    if position == MANIFEST:
        return "a tensor set's manifest"
    return f"tensor position {position} of a tensor set"


def _mismatch_hint(read: int, expected: int) -> str:
    """The call that receives what the sender sent, when a receiver expected the other
    kind of transfer (as the core's ``Position::mismatch_hint``)."""
    if (read, expected) == (MANIFEST, LONE):
        return ": the peer sent a tensor set (send_tensors); receive it with recv_tensors()"
    if (read, expected) == (LONE, MANIFEST):
        return ": the peer sent a lone gradient (send); receive it with recv()"
    return ""


class _SealTracker:
    """One gradient's seal rule: what is expected, the position the gradient must hold,
    and the first accepted chunk with its transfer id (None: unsealed). ``check`` for a
    chunk whose schema has been read, before the dtype rules; ``accept`` once every rule
    has passed for it."""

    __slots__ = ("_expect", "_first", "_position")

    def __init__(self, expect: Expect = WHEN_PRESENT, position: int = LONE) -> None:
        self._expect = expect
        self._position = position
        self._first: tuple[int, bytes | None] | None = None  # (chunk_index, transfer)

    @property
    def transfer(self) -> bytes | None:
        """The id the chunks taken so far carry (the expected one, for an exact id; None
        before the first, or when they are unsealed)."""
        if isinstance(self._expect, bytes):
            return self._expect
        return None if self._first is None else self._first[1]

    def check(
        self, raw: str | None, chunk_index: int, total_chunks: int, offset: int | None
    ) -> bytes | None:
        """The chunk's transfer id as its seal gives it (None: unsealed), or FrameError
        when the seal is not what is expected."""

        def refused(detail: str) -> FrameError:
            return FrameError(detail, chunk_index, offset)

        first = self._first
        if raw is None:
            if self._expect == CONSISTENT or isinstance(self._expect, bytes):
                raise refused(
                    f"chunk {chunk_index} is not sealed; this receiver expects sealed chunks"
                )
            if first is not None and first[1] is not None:
                raise refused(
                    f"chunk {chunk_index} is not sealed; chunk {first[0]} is sealed for "
                    f"transfer {first[1].hex()}"
                )
            return None
        match = _GRAMMAR.fullmatch(raw)
        if match is None:
            raise refused(
                f"chunk {chunk_index} has a gradstream_seal that is not "
                "<32 hex>:<8 hex>:<8 hex>:<8 hex> in lowercase"
            )
        transfer = bytes.fromhex(match[1])
        index, total, position = (int(match[k], 16) for k in (2, 3, 4))
        if self._expect == ABSENT:
            raise refused(f"chunk {chunk_index} is sealed; the tensor set's manifest is not sealed")
        if self._expect == WHEN_PRESENT and first is not None and first[1] is None:
            raise refused(f"chunk {chunk_index} is sealed; chunk {first[0]} is not sealed")
        if isinstance(self._expect, bytes) and transfer != self._expect:
            raise refused(
                f"chunk {chunk_index} is sealed for transfer {transfer.hex()}, expected "
                f"transfer {self._expect.hex()}"
            )
        if first is not None and first[1] is not None and transfer != first[1]:
            raise refused(
                f"chunk {chunk_index} is sealed for transfer {transfer.hex()}; chunk "
                f"{first[0]} is sealed for transfer {first[1].hex()}"
            )
        if position != self._position:
            raise refused(
                f"chunk {chunk_index} is sealed for {_described(position)}, expected "
                f"{_described(self._position)}{_mismatch_hint(position, self._position)}"
            )
        if (index, total) != (chunk_index, total_chunks):
            raise refused(
                f"chunk {chunk_index} of {total_chunks} is sealed as chunk {index} of {total}"
            )
        return transfer

    def accept(self, chunk_index: int, transfer: bytes | None) -> None:
        """Record the first accepted chunk and its transfer id, None when unsealed (a
        no-op for later ones)."""
        if self._first is None:
            self._first = (chunk_index, transfer)
