"""shoal's wire protocol: versioned typed messages, size limits, and tensor frames.

Depends only on the standard library and msgpack, so anything (a status tool, a test, the
simulator) can speak the protocol without importing torch or hivemind. The torch conversion lives
apart in ``shoal.protocol.torch_tensors``, which nothing here imports.

    data = encode(Ping(sent_at=now(), nonce=7))
    reply = decode(data, expected=(Pong, ErrorReply))   # raises only ProtocolError subclasses
"""

from __future__ import annotations

from .codec import decode, encode
from .errors import (
    BadTensor,
    MalformedMessage,
    MessageTooLarge,
    ProtocolError,
    UnexpectedMessage,
    UnknownMessageType,
    UnsupportedVersion,
    error_for_code,
)
from .limits import (
    CHUNK_BYTES,
    MAX_MESSAGE_BYTES,
    MAX_SEQUENCE_LEN,
    MAX_STR_LEN,
    MAX_TENSOR_BYTES,
    MAX_TENSOR_DIM,
    MAX_TENSOR_RANK,
)
from .messages import ErrorReply, Ping, Pong
from .pipeline import AbandonNotice, Ack, BackwardRequest, ForwardRequest, Hop
from .registry import message, registered_messages, tag_of
from .schema import wire_field
from .tensors import (
    DTYPE_SIZES,
    FLOAT_DTYPES,
    QUANTIZED_DTYPES,
    TensorAssembler,
    TensorHeader,
    TensorMeta,
    TensorSpec,
    assemble,
    chunk_count,
    frame_payload,
    split_payload,
    wire_nbytes,
)
from .version import PROTOCOL_VERSION, is_compatible

__all__ = [
    "AbandonNotice",
    "Ack",
    "BackwardRequest",
    "BadTensor",
    "CHUNK_BYTES",
    "DTYPE_SIZES",
    "ErrorReply",
    "FLOAT_DTYPES",
    "QUANTIZED_DTYPES",
    "ForwardRequest",
    "Hop",
    "MAX_MESSAGE_BYTES",
    "MAX_SEQUENCE_LEN",
    "MAX_STR_LEN",
    "MAX_TENSOR_BYTES",
    "MAX_TENSOR_DIM",
    "MAX_TENSOR_RANK",
    "MalformedMessage",
    "MessageTooLarge",
    "PROTOCOL_VERSION",
    "Ping",
    "Pong",
    "ProtocolError",
    "TensorAssembler",
    "TensorHeader",
    "TensorMeta",
    "TensorSpec",
    "UnexpectedMessage",
    "UnknownMessageType",
    "UnsupportedVersion",
    "assemble",
    "chunk_count",
    "decode",
    "encode",
    "error_for_code",
    "frame_payload",
    "is_compatible",
    "message",
    "registered_messages",
    "split_payload",
    "wire_nbytes",
    "tag_of",
    "wire_field",
]
