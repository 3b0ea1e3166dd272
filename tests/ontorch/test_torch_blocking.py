"""Torch tensors through the blocking face (gradstream.sync): the same keywords as the
asyncio one, like= and recv_tensors(out=) with its refusal, over one core
(``ConnectionCore._taken_set``)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import gradstream.sync as gsync  # noqa: E402
from gradstream.errors import DeliveryError, TensorSetError  # noqa: E402
from support.connections import LOCAL  # noqa: E402


@contextmanager
def pair(
    send: Callable[[gsync.Connection], Any],
) -> Iterator[tuple[gsync.Connection, dict[str, Any]]]:
    """A blocking listener's connection, whose peer runs ``send`` on a thread; what the
    peer raised, under "error", once the block ends."""
    seen: dict[str, Any] = {}
    with gsync.listen(LOCAL) as listener:

        def peer() -> None:
            with gsync.connect(listener.address) as conn:
                try:
                    send(conn)
                except BaseException as exc:
                    seen["error"] = exc

        thread = threading.Thread(target=peer, daemon=True)
        thread.start()
        with listener.accept(timeout=10) as conn:
            yield conn, seen
        thread.join(10)
        assert not thread.is_alive()


def test_recv_like_torch_gives_the_tensor_sent() -> None:
    sent = torch.linspace(-1, 1, 600, dtype=torch.bfloat16).reshape(20, 30)
    with pair(lambda c: c.send(sent)) as (conn, seen):
        got = conn.recv(like="torch")
    assert "error" not in seen
    assert isinstance(got, torch.Tensor) and got.dtype == torch.bfloat16
    assert torch.equal(got.view(torch.int16), sent.view(torch.int16))


def test_a_set_that_does_not_fit_out_is_refused_to_the_sender_at_once() -> None:
    target = {"w": torch.zeros(4, 3), "b": torch.zeros(3)}
    sent = {"w": torch.ones(4, 3), "b": torch.ones(2)}
    with pair(lambda c: c.send_tensors(sent, deadline=5)) as (conn, seen):
        with pytest.raises(TensorSetError, match=r"'b' is of shape \[2\]; out= has \[3\]"):
            conn.recv_tensors(out=target)
        assert conn.closed
    assert isinstance(seen.get("error"), DeliveryError), seen
    assert not target["w"].any() and not target["b"].any()  # nothing written


def test_out_and_like_together_are_refused_before_the_transfer() -> None:
    sent = {"w": torch.ones(3)}
    with pair(lambda c: c.send_tensors(sent, deadline=5)) as (conn, seen):
        with pytest.raises(ValueError, match="out= and like= exclude each other"):
            conn.recv_tensors(out={"w": torch.zeros(3)}, like="torch")
        got = conn.recv_tensors(like="torch")  # the connection is still in step
    assert "error" not in seen
    assert torch.equal(got["w"], sent["w"])
