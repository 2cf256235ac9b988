"""How an activation or gradient travels between stages: one codec per `pipeline.wire_dtype`.

A codec writes a tensor to a stream as one or more pieces (a tensor header frame, then its raw chunk
frames: streams.py) and reads it back, checked against the receiver's `TensorSpec`. The run config
names a codec (`WIRE_DTYPES`, shoal/config.py); a test holds that list and this table equal, so a new
codec is one class here and one name there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from shoal.protocol.tensors import TensorSpec


class PieceStream(Protocol):
    """What a codec needs of a stream (streams.FramedStream)."""

    async def write_piece(
        self, tensor: Any, wire_dtype: str, leading: Sequence[object], starts_message: bool, kind: str
    ) -> int: ...

    async def read_piece(self, spec: TensorSpec, compute_dtype: Any, max_bytes: int | None, device: Any) -> Any: ...


class WireCodec(Protocol):
    name: str

    async def write(self, stream: PieceStream, tensor: Any, leading: Sequence[object], kind: str) -> int:
        """Send `tensor` after the `leading` messages (in the same write as its first chunk); its bytes."""
        ...

    async def read(
        self, stream: PieceStream, spec: TensorSpec, compute_dtype: Any, max_bytes: int | None, device: Any
    ) -> Any:
        """Receive one tensor of `spec`, in `compute_dtype` (None: float32), onto `device`."""
        ...


class PlainCodec:
    """The tensor in a float dtype, cast on its own device first (fewer bytes to copy to the host)."""

    def __init__(self, name: str):
        self.name = name

    async def write(self, stream: PieceStream, tensor: Any, leading: Sequence[object], kind: str) -> int:
        from shoal.device import to_host
        from shoal.protocol.torch_tensors import TORCH_DTYPES

        if tensor.device.type != "cpu":
            tensor = to_host(tensor.detach().to(TORCH_DTYPES[self.name]))
        return await stream.write_piece(tensor, self.name, leading, True, kind)

    async def read(
        self, stream: PieceStream, spec: TensorSpec, compute_dtype: Any, max_bytes: int | None, device: Any
    ) -> Any:
        import torch

        return await stream.read_piece(spec, compute_dtype or torch.float32, max_bytes, device)


class RowsInt8Codec:
    """int8 rows: a float32 scale per row of the last dimension, then the rows as int8 (torch_tensors.py)."""

    name = "int8"

    async def write(self, stream: PieceStream, tensor: Any, leading: Sequence[object], kind: str) -> int:
        from shoal.device import to_host
        from shoal.protocol.torch_tensors import quantize_rows

        scales, values = quantize_rows(tensor)
        sent = await stream.write_piece(to_host(scales), "float32", leading, True, kind)
        return sent + await stream.write_piece(to_host(values), self.name, (), False, kind)

    async def read(
        self, stream: PieceStream, spec: TensorSpec, compute_dtype: Any, max_bytes: int | None, device: Any
    ) -> Any:
        import torch

        from shoal.protocol.torch_tensors import rows_scale_spec, rows_to_tensor, rows_values_spec

        scales = await stream.read_piece(rows_scale_spec(spec), None, max_bytes, None)
        values = await stream.read_piece(rows_values_spec(spec, scales), torch.int8, max_bytes, None)
        return rows_to_tensor(scales, values, compute_dtype or torch.float32, device)


WIRE_CODECS: dict[str, WireCodec] = {
    codec.name: codec
    for codec in (PlainCodec("float32"), PlainCodec("bfloat16"), PlainCodec("float16"), RowsInt8Codec())
}
