"""A client that dialled something other than a gradstream receiver is told so (issue 23,
"Errors a user met"): an HTTP server or proxy that answers at once is named from its
answer, quoted as text rather than hex, on both the native side and the test peer."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import ModuleType

import pytest

import gradstream as gs
from support.connections import run

ANSWER = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
SEEN = (
    "expected a gradstream hello, got an HTTP answer ('HTTP/1.1 400 Bad'...): the peer is an "
    "HTTP server or proxy, not a gradstream peer"
)


@asynccontextmanager
async def http_answering(answer_with: bytes = ANSWER) -> AsyncIterator[tuple[str, int]]:
    """A server that answers every connection with ``answer_with`` at once (by default as
    an HTTP proxy refusing it does)."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(answer_with)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    async with server:
        yield server.sockets[0].getsockname()[:2]


def test_an_http_answer_is_named_at_once(dialler: ModuleType) -> None:
    async def main() -> tuple[BaseException, float]:
        async with http_answering() as address:
            start = time.monotonic()
            with pytest.raises(gs.ProtocolError) as info:
                await dialler.connect(address)
            return info.value, time.monotonic() - start

    error, seconds = run(main)
    assert SEEN in str(error), str(error)
    assert seconds < 2.0


PAGE = b'<!DOCTYPE HTML>\n<html lang="en">\n<head><title>Error response</title></head>\n'


def test_an_error_page_without_a_status_line_is_named_at_once(dialler: ModuleType) -> None:
    # What http.server sends for a request line it reads as HTTP/0.9: a hello's random
    # bytes may hold the newline that ends one.
    async def main() -> BaseException:
        async with http_answering(PAGE) as address:
            with pytest.raises(gs.ProtocolError) as info:
                await dialler.connect(address)
        return info.value

    error = run(main)
    seen = "an HTML page (an HTTP/0.9 answer): the peer is an HTTP server, not a gradstream peer"
    assert seen in str(error), str(error)
