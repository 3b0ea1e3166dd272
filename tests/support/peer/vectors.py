"""The connection protocol's test vectors (docs/spec/protocol.md, test vectors), made by
the test peer alone: every message of the spec's fixed handshake (nonces ``00..1f`` and
``20..3f``, the default limits, the authkey ``correct horse battery staple``, each side's
SPAKE2 scalar fixed by its nonce), the transfer ids and acks, protocol version 1's
messages (what an older peer sends), and the whole sessions of ``sessions``. The golden
tests (connection/test_protocol_golden.py) hold both implementations to
``vectors/messages.json``, the replays (connection/test_protocol_sessions.py) the native
side to ``vectors/sessions.json``; both check that the files are what this script gives.
To write them again (after a deliberate change of the protocol), from tests/:

    ../.venv/bin/python -m support.peer.vectors
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from . import messages as m
from . import sessions

FOLDER = Path(__file__).resolve().parents[2] / "connection" / "vectors"
MESSAGES = FOLDER / "messages.json"

CLIENT_NONCE = sessions.CLIENT_NONCE
SERVER_NONCE = sessions.SERVER_NONCE
AUTHKEY = sessions.AUTHKEY
MAX_GRADIENT_LEN = 1 << 30  # the session defaults
MAX_PAYLOAD_LEN = 1 << 28
HEADERS = [struct.pack("<4I", 0, 2, 10, 0x11111111), struct.pack("<4I", 1, 2, 10, 0x22222222)]
REASON = "chunk 1 failed its CRC check"


def _hellos(version: int) -> tuple[bytes, bytes]:
    def hello(role: int, nonce: bytes) -> bytes:
        fields = m.Hello(role, m.AUTH_KEY, nonce, MAX_GRADIENT_LEN, MAX_PAYLOAD_LEN)
        return m.encode_hello(fields, version)

    return hello(m.ROLE_CLIENT, CLIENT_NONCE), hello(m.ROLE_SERVER, SERVER_NONCE)


def messages() -> dict[str, Any]:
    """The message vectors, as hex."""
    client_hello, server_hello = _hellos(m.VERSION)
    client = m.Exchange(AUTHKEY, m.ROLE_CLIENT, m.fixed_seed(CLIENT_NONCE))
    server = m.Exchange(AUTHKEY, m.ROLE_SERVER, m.fixed_seed(SERVER_NONCE))
    key = client.finish(server.element)
    assert server.finish(client.element) == key, "SPAKE2 gave the sides different keys"
    hellos = (client_hello, server_hello)
    tid = m.transfer_id(CLIENT_NONCE, SERVER_NONCE, m.TO_SERVER, 0)
    digest = m.ack_digest(tid, HEADERS)
    old_client, old_server = _hellos(m.OLD_VERSION)
    return {
        "about": (
            "The message vectors of the gradstream connection protocol, version "
            f"{m.VERSION} (docs/spec/protocol.md), written by tests/support/peer/vectors.py."
        ),
        "client_nonce": CLIENT_NONCE.hex(),
        "server_nonce": SERVER_NONCE.hex(),
        "authkey": AUTHKEY.hex(),
        "max_gradient_len": MAX_GRADIENT_LEN,
        "max_payload_len": MAX_PAYLOAD_LEN,
        "client_seed": m.fixed_seed(CLIENT_NONCE).hex(),
        "server_seed": m.fixed_seed(SERVER_NONCE).hex(),
        "client_hello": client_hello.hex(),
        "server_hello": server_hello.hex(),
        "client_pake": client.message().hex(),
        "server_pake": server.message().hex(),
        "session_key": key.hex(),
        "client_auth": m.encode_auth(m.confirm_tag(key, m.ROLE_CLIENT, *hellos)).hex(),
        "server_auth": m.encode_auth(m.confirm_tag(key, m.ROLE_SERVER, *hellos)).hex(),
        "transfer_ids": {
            f"{direction},{counter}": m.transfer_id(
                CLIENT_NONCE, SERVER_NONCE, direction, counter
            ).hex()
            for direction, counter in [(m.TO_SERVER, 0), (m.TO_CLIENT, 0), (m.TO_SERVER, 1)]
        },
        "headers": [h.hex() for h in HEADERS],
        "ack": m.encode_ack(m.Ack(0, digest, None)).hex(),
        "reason": REASON,
        "refusal": m.encode_ack(m.Ack(0, bytes(32), REASON)).hex(),
        "version_1": {
            "client_hello": old_client.hex(),
            "server_hello": old_server.hex(),
            "client_auth": m.encode_auth(
                m.version1_tag(AUTHKEY, m.ROLE_CLIENT, old_client, old_server)
            ).hex(),
            "server_auth": m.encode_auth(
                m.version1_tag(AUTHKEY, m.ROLE_SERVER, old_client, old_server)
            ).hex(),
        },
    }


def text(vectors: dict[str, Any]) -> str:
    """The vectors as the files hold them."""
    return json.dumps(vectors, indent=1) + "\n"


def load() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(MESSAGES.read_text())
    return loaded


if __name__ == "__main__":
    MESSAGES.write_text(text(messages()))
    sessions.VECTORS.write_text(sessions.text(sessions.record_all()))
    print(f"wrote {MESSAGES} and {sessions.VECTORS}")
