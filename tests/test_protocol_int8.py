"""The int8 wire codec (protocol/tensors.py, torch_tensors.py): a float32 scale per row, then the rows
in [-127, 127]. Round trips within half a step, over a real framed stream; hostile frames (non-finite,
negative or huge scales, -128, wrong ranks and widths, truncated) are refused; the local trainer's
model of an int8 hop is the receiver's rebuild exactly.

Run: .venv/bin/python -m pytest tests/test_protocol_int8.py -q
"""

from __future__ import annotations

import asyncio
import socket

import pytest
import torch

from shoal.model.stages import over_the_wire
from shoal.p2p.streams import FramedStream
from shoal.protocol import BadTensor, ProtocolError
from shoal.protocol.tensors import TensorSpec, wire_nbytes
from shoal.protocol.torch_tensors import dequantize_rows, quantize_rows, round_trip_rows
from tests.helpers.raw_frames import unchecked_frames

SPEC = TensorSpec("int8", (None, None, 16), max_abs=65504.0)


def _pair():
    async def make():
        left, right = socket.socketpair()
        reader, left_writer = await asyncio.open_connection(sock=left)
        _, writer = await asyncio.open_connection(sock=right)
        return FramedStream(None, writer, timeout_s=5), FramedStream(reader, None, timeout_s=5), left_writer  # type: ignore[arg-type]

    return make()


async def _through_stream(send, spec: TensorSpec = SPEC) -> torch.Tensor:
    sender, receiver, keep = await _pair()
    try:
        reading = asyncio.ensure_future(receiver.read_tensor(spec, max_bytes=1 << 20))
        await send(sender)
        return await reading
    finally:
        sender.writer.close()
        keep.close()


def test_rows_round_trip_within_half_a_step_over_a_real_stream():
    x = torch.randn(3, 5, 16) * torch.logspace(-3, 3, 5).view(1, 5, 1)  # rows of very different sizes
    x[0, 0] = 0.0  # a zero row: scale 0, values 0

    async def send(stream):
        return await stream.write_tensor(x, "int8")

    back = asyncio.run(_through_stream(send))
    step = x.abs().amax(-1, keepdim=True) / 127
    assert back.dtype == torch.float32 and back.shape == x.shape
    assert bool(((back - x).abs() <= step / 2 + 1e-6 * step).all()) and torch.equal(back[0, 0], torch.zeros(16))
    assert torch.equal(back, round_trip_rows(x))  # what the local trainer models is what arrives
    assert wire_nbytes((3, 5, 16), "int8") == 3 * 5 * 16 + 3 * 5 * 4  # vs 4 bytes a value in float32


def test_hostile_int8_frames_are_refused():
    good_scales, good_values = quantize_rows(torch.randn(2, 3, 16))

    def sending(scales: torch.Tensor, values: torch.Tensor, scale_dtype: str = "float32"):
        async def send(stream):  # unchecked: the sender's own check would refuse a NaN before the receiver
            await stream.write_frames(unchecked_frames(scales, scale_dtype))
            await stream.write_frames(unchecked_frames(values, "int8"), False)

        return send

    nan = good_scales.clone()
    nan[0, 0] = float("nan")
    negative = good_scales.clone()
    negative[1, 2] = -1.0
    huge = good_scales.clone()
    huge[0, 1] = 1e30
    low = good_values.clone()
    low[0, 0, 0] = -128
    cases = {
        "non-finite scale": sending(nan, good_values),
        "negative scale": sending(negative, good_values),
        "scale beyond the bound": sending(huge, good_values),
        "-128": sending(good_scales, low),
        "values of another width": sending(good_scales, good_values[..., :8].contiguous()),
        "values for other rows": sending(good_scales, good_values[:1].contiguous()),
        "scales of another rank": sending(good_scales[0].contiguous(), good_values),
        "scales not float32": sending(good_scales.to(torch.bfloat16), good_values, "bfloat16"),
    }
    for what, send in cases.items():
        with pytest.raises((BadTensor, ProtocolError)):
            asyncio.run(_through_stream(send))
            pytest.fail(what)


def test_an_int8_hop_in_the_local_trainer_quantizes_both_ways():
    x = torch.randn(2, 4, 16, requires_grad=True)
    y = over_the_wire(x, torch.int8)
    assert torch.equal(y, round_trip_rows(x.detach()))
    grad = torch.randn(2, 4, 16)
    y.backward(grad)
    assert torch.equal(x.grad, round_trip_rows(grad))
    scales, values = quantize_rows(grad)
    assert values.dtype == torch.int8 and int(values.abs().max()) == 127
    assert torch.equal(dequantize_rows(scales, values), round_trip_rows(grad))
