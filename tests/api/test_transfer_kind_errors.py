"""A transfer of the other kind than the receiver waits for names the call that receives
it: a tensor set sent to ``recv()`` says ``recv_tensors()``, a lone gradient sent to
``recv_tensors()`` says ``recv()`` (on both sides: the sender's DeliveryError carries the
receiver's reason)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

import gradstream as gs
from support.connections import LOCAL, run


async def mismatch(sending: str, receiving: str) -> tuple[BaseException, BaseException]:
    async with await gs.listen(LOCAL) as listener:
        accepted = asyncio.create_task(listener.accept())
        async with await gs.connect(listener.address) as c, await accepted as conn:
            what: Any = {"w": np.ones(4, np.float32)} if sending == "send_tensors" else np.ones(4)
            sent = asyncio.create_task(getattr(c, sending)(what))
            with pytest.raises(gs.GradientStreamError) as received:
                await getattr(conn, receiving)()
            with pytest.raises(gs.GradientStreamError) as refused:
                await sent
            return received.value, refused.value


def test_a_tensor_set_sent_to_recv_names_recv_tensors() -> None:
    received, refused = run(lambda: mismatch("send_tensors", "recv"))
    for error in (received, refused):
        assert "sealed for a tensor set's manifest, expected a lone gradient" in str(error)
        assert "the peer sent a tensor set (send_tensors); receive it with recv_tensors()" in str(
            error
        )
    assert isinstance(refused, gs.DeliveryError)


def test_a_gradient_sent_to_recv_tensors_names_recv() -> None:
    received, refused = run(lambda: mismatch("send", "recv_tensors"))
    for error in (received, refused):
        assert "the peer sent a lone gradient (send); receive it with recv()" in str(error)
