"""Size limits for everything that crosses the wire.

Every limit is checked *before* the work it protects (a message's size before msgpack parses it, a
tensor's declared size before its buffer is allocated), so a peer cannot make us spend memory or time
beyond these numbers.
"""

from __future__ import annotations

# A control message (ping, headers, error replies). Headers carry metadata only; tensors travel as
# raw chunks, so 64 KiB is generous and keeps a hostile message cheap to refuse.
MAX_MESSAGE_BYTES = 64 * 1024

# One activation or gradient tensor. (B, T, C) = (8, 2048, 4096) in bf16 is 128 MiB; twice that
# leaves room without letting a peer make us allocate gigabytes on a header's word.
MAX_TENSOR_BYTES = 256 * 1024 * 1024

# Raw payload per stream message. hivemind's persistent connections refuse protobuf messages over
# 4 MiB; 2 MiB leaves half of that for framing and whatever header a caller puts beside a chunk.
CHUNK_BYTES = 2 * 1024 * 1024

# A tensor's rank and the size of one dimension. Element counts are bounded by MAX_TENSOR_BYTES anyway;
# these keep a shape itself small and sane (int32 indexing on every backend).
MAX_TENSOR_RANK = 8
MAX_TENSOR_DIM = 2**31 - 1

# Defaults for message fields; a field can choose a smaller (or, for strings, larger) bound.
MAX_STR_LEN = 1024  # characters in a str field
MAX_SEQUENCE_LEN = 4096  # elements in a tuple field; also msgpack's max_array_len
MAX_FIELDS = 64  # keys in any map (envelope, message body, nested struct); msgpack's max_map_len

# Integers on the wire are int64, like every language's default integer.
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1

# An error's text, as sent back to a peer in an ErrorReply.
MAX_ERROR_CHARS = 300
