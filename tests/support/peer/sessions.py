"""Whole plaintext sessions of the connection protocol (docs/spec/protocol.md, the session
vectors), recorded between two test-peer machines with fixed nonces: every message each
side writes, in order, from the first hello to the last ack.

A session sends one way: the sender's gradient (three frames), then its tensor set (a
manifest and two tensors), each sealed as its transfer, each answered by the receiver's
ack; then the dialler closes. "to the listener" sessions are replayed against the native
listener (the test writes the dialler's messages and reads the listener's), "to the
dialler" ones against the native dialler (the test writes the listener's): the native
side's own bytes (its hello and SPAKE2 element, its tag, its acks) must be the recorded
ones, byte for byte: the native side's scalar, like the peer's here, is fixed by its
fixed nonce (``messages.fixed_seed``).
The frames are the reference encoder's; what a receiver answers does not depend on how
the sender encoded them.

The vectors live in tests/connection/vectors/sessions.json; test_protocol_sessions.py
checks that they are what ``record_all`` gives. To write them again (after a deliberate
change of the protocol or the reference encoder), from tests/, with the message vectors:

    ../.venv/bin/python -m support.peer.vectors
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import numpy as np

from gradstream.reference import GradientStreamSession

from . import messages as m
from .machine import Machine

VECTORS = Path(__file__).resolve().parents[2] / "connection" / "vectors" / "sessions.json"

CLIENT_NONCE = bytes(range(32))
SERVER_NONCE = bytes(range(32, 64))
AUTHKEY = b"correct horse battery staple"
CHUNK_SIZE = 4  # values per chunk: the gradient's 10 values take 3 frames
GRADIENT = np.arange(10, dtype=np.float32) * np.float32(0.5) - np.float32(1.0)
TENSORS = {
    "w": np.arange(6, dtype=np.float32).reshape(2, 3),
    "b": np.array([1.5, -2.0], dtype=np.float64),
}

Side = Literal["dialler", "listener"]
# Session name: (authkey, the side that receives).
SESSIONS: dict[str, tuple[bytes | None, Side]] = {
    "plain, to the listener": (None, "listener"),
    "plain, to the dialler": (None, "dialler"),
    "authkey, to the listener": (AUTHKEY, "listener"),
    "authkey, to the dialler": (AUTHKEY, "dialler"),
}


def session() -> GradientStreamSession:
    """The settings of both sides: the defaults (their limits are in the hellos), with
    CHUNK_SIZE."""
    return GradientStreamSession("session vectors", CHUNK_SIZE)


def record(authkey: bytes | None, to: Side) -> list[dict[str, str]]:
    """One session's messages in order: ``{"from": side, "what": ..., "hex": ...}``."""
    sides: dict[Side, Machine] = {
        "dialler": Machine(m.ROLE_CLIENT, session(), authkey=authkey, nonce=CLIENT_NONCE),
        "listener": Machine(m.ROLE_SERVER, session(), authkey=authkey, nonce=SERVER_NONCE),
    }
    steps: list[dict[str, str]] = []

    def move(side: Side, what: str) -> None:
        data = sides[side].take_outgoing()
        assert data, what
        other: Side = "listener" if side == "dialler" else "dialler"
        sides[other].feed(data)
        steps.append({"from": side, "what": what, "hex": data.hex()})

    first = "hello" if authkey is None else "hello and key exchange"
    move("dialler", first)
    move("listener", first)
    for side in sides.values():
        side.handshake()
    if authkey is not None:
        move("dialler", "authentication")  # the client's tag first
        sides["listener"].handshake()  # the listener answers the tag it verified
        move("listener", "authentication")
    assert all(side.handshake() is not None for side in sides.values())

    sender: Side = "dialler" if to == "listener" else "listener"
    frames = sides[sender].send(GRADIENT)
    move(sender, f"transfer 0: a gradient, {frames} frames")
    assert np.array_equal(sides[to].receive("gradient"), GRADIENT)
    move(to, "ack of transfer 0")
    assert sides[sender].ack() == 0
    frames = sides[sender].send_tensors(TENSORS)
    move(sender, f"transfer 1: a tensor set, {frames} frames")
    got = sides[to].receive("tensors")
    assert list(got) == list(TENSORS)
    move(to, "ack of transfer 1")
    assert sides[sender].ack() == 1
    return steps


def record_all() -> dict[str, Any]:
    """Every session, with what they are made of."""
    return {
        "about": (
            f"Whole plaintext sessions of the gradstream connection protocol, version {m.VERSION} "
            "(docs/spec/protocol.md), recorded by tests/support/peer/sessions.py. Each "
            "step is one message a side writes, in order; the frames are the pure-Python "
            "reference encoder's, seed layout."
        ),
        "client_nonce": CLIENT_NONCE.hex(),
        "server_nonce": SERVER_NONCE.hex(),
        "authkey": AUTHKEY.hex(),
        "max_gradient_len": session().max_gradient_len,
        "max_payload_len": session().max_payload_len,
        "chunk_size": CHUNK_SIZE,
        "gradient": {"dtype": "float32", "values": GRADIENT.tolist()},
        "tensors": {
            name: {"dtype": str(v.dtype), "shape": list(v.shape), "values": v.ravel().tolist()}
            for name, v in TENSORS.items()
        },
        "sessions": {
            name: {
                "authkey": authkey is not None,
                "receiver": to,
                "steps": record(authkey, to),
            }
            for name, (authkey, to) in SESSIONS.items()
        },
    }


def text(vectors: dict[str, Any]) -> str:
    """The vectors as the file holds them."""
    return json.dumps(vectors, indent=1) + "\n"


def load() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(VECTORS.read_text())
    return loaded
