"""PyTorch tensors (docs/guides/torch.md) over real loopback connections: CPU tensors of
every float dtype sent as they are (non-contiguous, requiring grad, a model's
named_parameters()), read in place when contiguous; received as torch tensors
(``like="torch"``), into ``out=`` / ``reduce_into=`` tensors, and into a model's own
tensors (``recv_tensors(out=model)``), a set that does not fit refused before any write;
the refusals (another device, another dtype) naming the fix."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import gradstream as gs  # noqa: E402
from gradstream import _torch  # noqa: E402
from gradstream.errors import TensorSetError  # noqa: E402
from support.connections import LOCAL, run  # noqa: E402

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def session() -> gs.GradientStreamSession:
    return gs.GradientStreamSession("t", 4096, keep_shape=True, keep_dtype=True)


async def pair(body: Any) -> Any:
    """``body(sender, receiver)`` over one loopback connection."""
    async with await gs.listen(LOCAL, session=session()) as listener:
        accepting = asyncio.create_task(listener.accept())
        async with await gs.connect(listener.address, session=session()) as sender:
            async with await accepting as receiver:
                return await body(sender, receiver)


def equal(a: Any, b: Any) -> bool:
    """Same dtype, shape and bits."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return bool(torch.equal(a.contiguous().view(bits), b.contiguous().view(bits)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_float_dtype_comes_back_as_torch(dtype: Any) -> None:
    a = torch.randn(6, 7, dtype=torch.float64).to(dtype).requires_grad_(True)
    sent = [a, a.t(), a[:, ::2], a[0]]  # requiring grad; non-contiguous; a view

    async def body(s: Any, r: Any) -> list[Any]:
        got = []
        for t in sent:
            _, b = await asyncio.gather(s.send(t), r.recv(like="torch"))
            got.append(b)
        return got

    got = run(lambda: pair(body))
    for t, b in zip(sent, got, strict=True):
        assert isinstance(b, torch.Tensor) and not b.requires_grad
        assert equal(b, t.detach()), (t.shape, b.shape)


def test_a_contiguous_tensor_is_read_in_place() -> None:
    for dtype in DTYPES:
        t = torch.randn(100, dtype=torch.float32).to(dtype).requires_grad_(True)
        values, name = _torch.values_of(t)
        assert name == str(dtype).removeprefix("torch.")
        assert values.ctypes.data == t.data_ptr()
        strided = t.detach()[::2]
        copied, _ = _torch.values_of(strided)
        assert copied.ctypes.data != strided.data_ptr() and copied.flags.c_contiguous


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_encode_frames_of_a_tensor_is_that_of_its_values(impl: Any, dtype: Any) -> None:
    t = torch.linspace(-3, 3, 5000, dtype=torch.float64).to(dtype).reshape(50, 100)
    s = impl.GradientStreamSession("e", 4096, keep_shape=True, keep_dtype=True)
    if dtype == torch.bfloat16:
        ml_dtypes = pytest.importorskip("ml_dtypes")
        values = t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    else:
        values = t.numpy()
    frames = s.encode_frames(t.t())
    assert frames == s.encode_frames(np.ascontiguousarray(values.T))
    back = s.decode_frames(frames)
    assert equal(
        torch.from_numpy(back.view(f"i{back.itemsize}")),
        t.t().contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]),
    )


def test_a_default_session_refuses_bfloat16_naming_keep_dtype() -> None:
    s = gs.GradientStreamSession()
    with pytest.raises(TypeError, match=r"torch.bfloat16.*keep_dtype=True"):
        s.encode_frames(torch.zeros(4, dtype=torch.bfloat16))
    assert s.encode_frames(torch.zeros(4)) == s.encode_frames(np.zeros(4, np.float32))


def test_a_tensor_not_on_the_cpu_names_cpu() -> None:
    with pytest.raises(
        TypeError, match=r"tensor is on meta; move it to the CPU first, tensor\.cpu\(\)"
    ):
        session().encode_frames(torch.zeros(4, device="meta"))
    with pytest.raises(
        TypeError, match=r"tensor is on meta; move it to the CPU first, tensor\.cpu\(\)"
    ):
        session().decode_frames(b"", out=torch.zeros(4, device="meta"))


def test_a_tensor_of_another_dtype_is_refused_naming_it() -> None:
    with pytest.raises(TypeError, match=r"torch.int32"):
        session().encode_frames(torch.zeros(4, dtype=torch.int32))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_out_a_tensor_is_written_in_place(dtype: Any) -> None:
    a = torch.randn(4, 5).to(dtype)
    out = torch.full((4, 5), 7.0, dtype=dtype)
    where = out.data_ptr()

    async def body(s: Any, r: Any) -> Any:
        _, got = await asyncio.gather(s.send(a), r.recv(out=out))
        return got

    got = run(lambda: pair(body))
    assert got is out and out.data_ptr() == where and equal(out, a)


def test_reduce_into_a_float32_tensor_adds_in_place() -> None:
    acc = torch.ones(1000)
    sent = [torch.arange(1000.0), torch.full((1000,), 0.5)]

    async def body(s: Any, r: Any) -> None:
        for t in sent:
            _, got = await asyncio.gather(s.send(t), r.recv(reduce_into=acc))
            assert got is acc

    run(lambda: pair(body))
    assert torch.equal(acc, 1 + torch.arange(1000.0) + 0.5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reduce_into_a_tensor_of_any_float_dtype_adds_as_torch_does(dtype: Any) -> None:
    """A bucket in the parameters' dtype (bfloat16 included): the sum torch's own add
    gives on the CPU (float16/bfloat16 added in float32, rounded back)."""
    acc = torch.randn(5000).to(dtype)
    sent = [torch.randn(5000).to(dtype) for _ in range(2)]
    want = acc.clone()
    for t in sent:
        want += t

    async def body(s: Any, r: Any) -> None:
        for t in sent:
            _, got = await asyncio.gather(s.send(t), r.recv(reduce_into=acc))
            assert got is acc

    run(lambda: pair(body))
    assert equal(acc, want)


def test_lent_tensors_that_cannot_be_written_in_place_are_refused() -> None:
    s = session()
    frames = s.encode_frames(np.zeros(4, np.float32))
    with pytest.raises(TypeError, match=r"reduce_into= must be a torch tensor of .*torch.int32"):
        s.decode_frames(frames, reduce_into=torch.zeros(4, dtype=torch.int32))
    with pytest.raises(TypeError, match="non-contiguous"):
        s.decode_frames(frames, out=torch.zeros(4, 2)[:, 0])
    with pytest.raises(ValueError, match="exclude each other"):
        s.decode_frames(frames, out=torch.zeros(4), reduce_into=torch.zeros(4))
    out = torch.zeros(4)
    assert s.decode_frames(frames, out=out) is out


def test_like_is_checked() -> None:
    async def body(s: Any, r: Any) -> None:
        with pytest.raises(ValueError, match='like= must be "numpy" or "torch"'):
            await r.recv(like="jax")
        with pytest.raises(ValueError, match="exclude each other"):
            await r.recv_tensors(out={}, like="torch")

    run(lambda: pair(body))


def model(seed: int) -> Any:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 3)
    )
    return m


def test_a_model_is_sent_by_its_parameters_and_filled_in_place() -> None:
    source, target = model(1), model(2)
    source[1].running_mean.add_(3.0)  # a buffer: in state_dict, not in named_parameters
    where = {name: t.data_ptr() for name, t in target.state_dict().items()}

    async def body(s: Any, r: Any) -> tuple[Any, Any]:
        # A set carries float values: BatchNorm's integer num_batches_tracked stays home
        # (and recv_tensors(out=module) leaves it out too).
        floats = {k: v for k, v in source.state_dict().items() if v.is_floating_point()}
        _, a = await asyncio.gather(s.send_tensors(floats), r.recv_tensors(out=target))
        params = dict(target.named_parameters())
        _, b = await asyncio.gather(
            s.send_tensors(source.named_parameters()), r.recv_tensors(out=params)
        )
        return a, b

    a, b = run(lambda: pair(body))
    assert a is target and isinstance(b, dict)
    for (name, x), y in zip(source.state_dict().items(), target.state_dict().values(), strict=True):
        assert equal(x, y) or name.endswith("num_batches_tracked"), name
        assert y.data_ptr() == where[name]
    assert all(p.requires_grad for p in target.parameters())


def test_recv_tensors_like_torch_and_a_bfloat16_model() -> None:
    source = model(3).to(torch.bfloat16)
    target = model(4).to(torch.bfloat16)

    async def body(s: Any, r: Any) -> Any:
        _, got = await asyncio.gather(
            s.send_tensors(source.named_parameters()), r.recv_tensors(like="torch")
        )
        await asyncio.gather(
            s.send_tensors(got), r.recv_tensors(out=dict(target.named_parameters()))
        )
        return got

    got = run(lambda: pair(body))
    params = dict(source.named_parameters())
    assert list(got) == list(params)
    for name, t in got.items():
        assert equal(t, params[name].detach())
        assert equal(dict(target.named_parameters())[name].detach(), t)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.pop("2.bias"), r"out= has '2\.bias' which the set has not"),
        (lambda d: d.update(extra=torch.zeros(2)), r"the set has 'extra' which out= has not"),
        (
            lambda d: d.update({"0.weight": torch.zeros(8, 16)}),
            r"'0\.weight' is of shape \[8, 16\]; out= has \[16, 8\]",
        ),
        (
            lambda d: d.update({"2.bias": d["2.bias"].double()}),
            r"'2\.bias' is float64; out= has float32",
        ),
    ],
    ids=["missing", "extra", "shape", "dtype"],
)
def test_a_set_that_does_not_fit_is_refused_before_any_write(change: Any, message: str) -> None:
    source, target = model(5), model(6)
    sent = {n: t.detach().clone() for n, t in source.state_dict().items() if t.is_floating_point()}
    change(sent)
    before = {name: t.clone() for name, t in target.state_dict().items()}

    async def body(s: Any, r: Any) -> Any:
        sending = asyncio.create_task(s.send_tensors(sent, deadline=5))
        with pytest.raises(TensorSetError, match=message):
            await r.recv_tensors(out=target)
        with pytest.raises(gs.errors.DeliveryError, match="receiver"):
            await asyncio.wait_for(sending, 2)
        # Refused as a cancelled receive's transfer is (connections.md "Delivery"): the
        # sender told at once, the connection closed.
        assert r.closed

    run(lambda: pair(body))
    for name, t in target.state_dict().items():
        assert equal(t, before[name]), name


def test_stream_to_and_encode_tensors_take_tensors(impl: Any) -> None:
    import socket

    t = torch.randn(40, 30).to(torch.bfloat16).requires_grad_(True)
    s = impl.GradientStreamSession("st", 256, keep_shape=True, keep_dtype=True)

    async def main() -> Any:
        a, b = socket.socketpair()
        with a, b:
            _, got = await asyncio.gather(s.stream_to(t.t(), a), s.receive_from(b))
        return got

    got = run(main)
    assert equal(_torch.from_values(got, "bfloat16", got.shape), t.detach().t().contiguous())
    sent = {"w": t, "b": torch.ones(3, dtype=torch.float64)}
    back = s.decode_tensors(s.encode_tensors(sent))
    assert list(back) == ["w", "b"] and back["b"].dtype == np.float64
    assert equal(_torch.from_values(back["w"], "bfloat16", back["w"].shape), t.detach())
