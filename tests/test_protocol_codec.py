"""The message codec: round trips, strict schema checks, and a decoder that only ever raises ProtocolError.

Run: .venv/bin/python -m pytest tests/test_protocol_codec.py -q
"""

from __future__ import annotations

import dataclasses
import math
import string
import typing
from unittest import mock

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shoal.protocol import (
    MAX_MESSAGE_BYTES,
    MAX_STR_LEN,
    PROTOCOL_VERSION,
    BadTensor,
    ErrorReply,
    MalformedMessage,
    MessageTooLarge,
    Ping,
    Pong,
    ProtocolError,
    TensorMeta,
    UnexpectedMessage,
    UnknownMessageType,
    UnsupportedVersion,
    codec,
    decode,
    encode,
    error_for_code,
    is_compatible,
    message,
    registered_messages,
    tag_of,
    wire_field,
)
from shoal.protocol.errors import one_line
from shoal.protocol.limits import INT64_MAX, INT64_MIN, MAX_SEQUENCE_LEN
from shoal.protocol.schema import FieldOptions
from shoal.protocol.tensors import DTYPE_SIZES

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@message("test.kitchen-sink")
class KitchenSink:
    """Every kind of field the schema supports, so the generic tests exercise all of them."""

    flag: bool
    count: int
    ratio: float
    loss: float = wire_field(allow_nonfinite=True)
    name: str = wire_field(max_len=8)
    blob: bytes = wire_field(max_len=16)
    route: tuple[int, ...] = wire_field(max_len=4)
    pair: tuple[str, float]
    meta: TensorMeta
    ping: Ping | None
    note: str | None = None


# ---------------------------------------------------------------- strategies built from the schemas


def _options(field: dataclasses.Field) -> FieldOptions:
    return next((v for v in field.metadata.values() if isinstance(v, FieldOptions)), FieldOptions())


def _value_strategy(tp: typing.Any, options: FieldOptions, top: bool = True) -> st.SearchStrategy:
    max_len = options.max_len if top else None
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is bool:
        return st.booleans()
    if tp is int:  # within the field's bounds: a value outside them is refused, as its own tests check
        low = INT64_MIN if options.ge is None else max(INT64_MIN, math.ceil(options.ge))
        high = INT64_MAX if options.le is None else min(INT64_MAX, math.floor(options.le))
        return st.integers(low, high)
    if tp is float:
        if options.ge is not None or options.le is not None:
            return st.floats(min_value=options.ge, max_value=options.le, allow_nan=False, allow_infinity=False)
        return st.floats(allow_nan=options.allow_nonfinite, allow_infinity=options.allow_nonfinite)
    if tp is str:  # short strings keep the test fast; the length bounds have their own tests
        size = min(32, MAX_STR_LEN if max_len is None else max_len)
        if options.pattern is not None:  # only what the field accepts
            return st.from_regex(options.pattern, fullmatch=True).filter(lambda text: len(text) <= (max_len or size))
        if options.token:
            return st.text(alphabet=string.ascii_letters + string.digits + "._:#@-", max_size=size)
        return st.text(max_size=size)
    if tp is bytes:
        return st.binary(max_size=64 if max_len is None else max_len)
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        (inner,) = [a for a in args if a is not type(None)]
        return st.none() | _value_strategy(inner, options, top)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        items = options.item or options
        return st.lists(_value_strategy(args[0], items, False), max_size=min(max_len or 8, 8)).map(tuple)
    if origin is tuple:
        return st.tuples(*(_value_strategy(a, options, False) for a in args))
    return message_strategy(tp)


_OVERRIDES: dict[type, st.SearchStrategy] = {
    # TensorMeta checks its own invariants: draw only what it accepts.
    TensorMeta: st.builds(
        TensorMeta,
        dtype=st.sampled_from(sorted(DTYPE_SIZES)),
        shape=st.lists(st.integers(0, 2**31 - 1), max_size=8).map(tuple),
    ),
}


def message_strategy(cls: type) -> st.SearchStrategy:
    if cls in _OVERRIDES:
        return _OVERRIDES[cls]
    hints = typing.get_type_hints(cls)
    fields = {f.name: _value_strategy(hints[f.name], _options(f)) for f in dataclasses.fields(cls)}
    return st.builds(cls, **fields)


any_message = st.sampled_from(sorted(registered_messages())).flatmap(
    lambda tag: message_strategy(registered_messages()[tag])
)


def _has_nan(value: object) -> bool:
    if isinstance(value, float):
        return math.isnan(value)
    if isinstance(value, tuple):
        return any(_has_nan(v) for v in value)
    if dataclasses.is_dataclass(value):
        return any(_has_nan(getattr(value, f.name)) for f in dataclasses.fields(value))
    return False


def _envelope(tag: str, body: object, version: object = PROTOCOL_VERSION) -> bytes:
    return msgpack.packb({"v": version, "t": tag, "b": body}, use_bin_type=True)


def _body(msg: object) -> dict:
    return msgpack.unpackb(encode(msg), raw=False)["b"]


PING = Ping(sent_at=1.5, nonce=7)
SINK = KitchenSink(
    flag=True,
    count=-3,
    ratio=0.25,
    loss=float("inf"),
    name="abc",
    blob=b"\x00\x01",
    route=(1, 2),
    pair=("x", 2.0),
    meta=TensorMeta("bfloat16", (4, 128)),
    ping=PING,
)

# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("tag", sorted(registered_messages()))
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_every_registered_message_round_trips(tag: str, data: st.DataObject) -> None:
    msg = data.draw(message_strategy(registered_messages()[tag]))
    wire = encode(msg)
    back = decode(wire, expected=type(msg))
    assert type(back) is type(msg)
    assert back == msg or _has_nan(msg)
    assert encode(back) == wire


def test_the_protocol_registers_its_messages() -> None:
    assert {"ping", "pong", "error", "tensor", "test.kitchen-sink"} <= set(registered_messages())


def test_golden_bytes_pin_the_wire_format() -> None:
    # {"v": 16, "t": "ping", "b": {"sent_at": 1.5, "nonce": 7}}: a change here breaks every deployed peer.
    expected = "83a17610a174a470696e67a16282a773656e745f6174cb3ff8000000000000a56e6f6e636507"
    assert encode(PING).hex() == expected
    assert tag_of(Ping) == "ping"


def test_nested_optional_and_default_fields_round_trip() -> None:
    assert decode(encode(SINK)) == SINK
    body = _body(SINK)
    del body["note"]  # has a default: may be omitted
    assert decode(_envelope("test.kitchen-sink", body)).note is None


def test_an_int_stands_for_a_float_locally_but_the_wire_carries_a_float() -> None:
    back = decode(encode(Ping(sent_at=3, nonce=1)))
    assert type(back.sent_at) is float and back.sent_at == 3.0


def test_error_reply_carries_a_typed_error_both_ways() -> None:
    for error in (MalformedMessage("x"), BadTensor("y"), UnsupportedVersion("z"), UnexpectedMessage("w")):
        reply = decode(encode(ErrorReply.from_error(error)), ErrorReply)
        again = reply.to_error()
        assert type(again) is type(error) and again.message == error.message
    unknown = error_for_code("teapot", "short and stout")
    assert type(unknown) is ProtocolError and "teapot" in unknown.message


def test_error_messages_are_one_bounded_line() -> None:
    error = MalformedMessage("line one\nline two\r\n" + "x" * 10_000)
    assert "\n" not in error.message and "\r" not in error.message
    assert len(error.message) <= 300
    assert one_line("a \t b") == "a b"
    # Long peer-supplied text is quoted, escaped and cut.
    with pytest.raises(UnknownMessageType) as info:
        decode(_envelope("z\n" * 20, {}))
    assert "\n" not in str(info.value) and len(str(info.value)) < 100


def test_version_rule() -> None:
    assert PROTOCOL_VERSION == 16
    assert is_compatible(PROTOCOL_VERSION)
    assert not is_compatible(PROTOCOL_VERSION + 1)
    assert not is_compatible(True)


# ---------------------------------------------------------------- strict decoding


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("nonce", True, "expected int"),  # bool is not int
        ("nonce", 1.0, "expected int"),
        ("nonce", 2**63, "int64"),
        ("nonce", 2**64 - 1, "int64"),
        ("nonce", -1.5, "expected int"),
        ("nonce", "7", "expected int"),
        ("sent_at", 1, "expected float"),  # the wire is strict; only local code may use an int
        ("sent_at", float("nan"), "finite"),
        ("sent_at", float("inf"), "finite"),
        ("sent_at", None, "expected float"),
    ],
)
def test_ping_fields_are_checked_strictly(field: str, value: object, reason: str) -> None:
    body = {"sent_at": 1.5, "nonce": 7} | {field: value}
    with pytest.raises(MalformedMessage, match=reason):
        decode(_envelope("ping", body))


def test_int64_bounds_are_inclusive() -> None:
    for nonce in (INT64_MIN, INT64_MAX):
        assert decode(_envelope("ping", {"sent_at": 0.0, "nonce": nonce})).nonce == nonce


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"flag": 1}, "expected bool"),
        ({"name": "x" * 9}, "exceeds 8"),
        ({"blob": b"x" * 17}, "exceeds 16"),
        ({"blob": "text"}, "expected bytes"),
        ({"route": [1, 2, 3, 4, 5]}, "exceeds 4"),
        ({"route": [1, "2"]}, r"route\[1\]"),
        ({"route": {"a": 1}}, "expected array"),
        ({"pair": ["x"]}, "expected 2 elements"),
        ({"pair": ["x", 1.0, 2.0]}, "expected 2 elements"),
        ({"meta": {"dtype": "float32"}}, "missing field 'shape'"),
        ({"meta": {"dtype": "float64", "shape": [1]}}, "float64"),
        ({"ping": {"sent_at": 1.0, "nonce": False}}, r"KitchenSink\.ping\.nonce"),
        ({"ping": [1.0, 2]}, "expected map"),
        ({"surprise": 1}, "unknown field"),
        ({b"flag": True}, "unknown field"),
    ],
)
def test_kitchen_sink_fields_are_checked_strictly(change: dict, reason: str) -> None:
    body = _body(SINK) | change
    with pytest.raises(ProtocolError, match=reason):
        decode(_envelope("test.kitchen-sink", body))


def test_a_nonfinite_float_is_accepted_only_where_the_field_allows_it() -> None:
    assert math.isnan(decode(_envelope("test.kitchen-sink", _body(SINK) | {"loss": float("nan")})).loss)
    with pytest.raises(MalformedMessage, match="finite"):
        decode(_envelope("test.kitchen-sink", _body(SINK) | {"ratio": float("nan")}))


def test_missing_required_fields_are_refused() -> None:
    with pytest.raises(MalformedMessage, match="missing field 'nonce'"):
        decode(_envelope("ping", {"sent_at": 1.0}))


def test_a_tensor_header_with_a_bad_meta_is_refused_as_bad_tensor() -> None:
    body = {"meta": {"dtype": "float32", "shape": [-1]}, "nbytes": 4, "num_chunks": 1}
    with pytest.raises(BadTensor):
        decode(_envelope("tensor", body))


@pytest.mark.parametrize(
    ("document", "error"),
    [
        (b"", MalformedMessage),
        (b"\xc1", MalformedMessage),  # never-used msgpack byte
        (msgpack.packb([1, "ping", {}]), MalformedMessage),  # not a map
        (msgpack.packb({"t": "ping", "b": {}}), MalformedMessage),  # no version
        (msgpack.packb({"v": "1", "t": "ping", "b": {}}), MalformedMessage),
        (msgpack.packb({"v": True, "t": "ping", "b": {}}), MalformedMessage),  # True is not version 1
        (msgpack.packb({"v": PROTOCOL_VERSION + 1, "t": "ping", "b": {}}), UnsupportedVersion),
        (msgpack.packb({"v": 0, "t": "nope", "b": None}), UnsupportedVersion),  # version first
        (msgpack.packb({"v": PROTOCOL_VERSION, "t": "ping"}), MalformedMessage),
        (msgpack.packb({"v": PROTOCOL_VERSION, "t": "ping", "b": {}, "x": 0}), MalformedMessage),
        (msgpack.packb({"v": PROTOCOL_VERSION, "t": b"ping", "b": {}}, use_bin_type=True), MalformedMessage),
        (msgpack.packb({"v": PROTOCOL_VERSION, "t": "nope", "b": {}}), UnknownMessageType),
        (msgpack.packb({"v": PROTOCOL_VERSION, "t": "ping", "b": None}), MalformedMessage),
        (_envelope("ping", {"sent_at": 1.0, "nonce": 1}) + b"\x00", MalformedMessage),  # trailing data
        (_envelope("ping", {"sent_at": 1.0, "nonce": 1})[:-1], MalformedMessage),  # truncated
        (b"\x81\x01\x01", MalformedMessage),  # int map key
        (msgpack.packb({"v": PROTOCOL_VERSION, "t": "ping", "b": msgpack.ExtType(5, b"x")}), MalformedMessage),
        (msgpack.packb({"v": PROTOCOL_VERSION, "t": "ping", "b": {"sent_at": msgpack.Timestamp(1)}}), MalformedMessage),
        (b"\xc7\x00\x05", MalformedMessage),  # zero-length ext
        (b"\x91" * 5000 + b"\x01", MalformedMessage),  # deep nesting
        (b"\xdd\xff\xff\xff\xff", MalformedMessage),  # an array claiming 4 billion elements
        (b"\xa2\xff\xfe", MalformedMessage),  # invalid UTF-8
    ],
)
def test_bad_documents_get_the_right_error(document: bytes, error: type[ProtocolError]) -> None:
    with pytest.raises(error):
        decode(document)


def test_a_repeated_map_key_is_refused_rather_than_last_one_wins() -> None:
    pack = msgpack.packb
    body = {"sent_at": 1.0, "nonce": 1}
    envelope = b"\x84" + b"".join(map(pack, ["v", 1, "t", "ping", "b", body, "b", body]))
    with pytest.raises(MalformedMessage, match="repeats a key"):
        decode(envelope)
    nested = (
        b"\x83"
        + b"".join(map(pack, ["v", 1, "t", "ping", "b"]))
        + b"\x83"
        + b"".join(map(pack, ["sent_at", 1.0, "nonce", 1, "nonce", 2]))
    )
    with pytest.raises(MalformedMessage, match="repeats a key"):
        decode(nested)


def test_expected_types_are_enforced_before_the_body() -> None:
    data = encode(PING)
    assert decode(data, (Pong, Ping)) == PING
    with pytest.raises(UnexpectedMessage, match="expected Pong or ErrorReply, got Ping"):
        decode(data, (Pong, ErrorReply))
    # The body is garbage, but the type was wrong first.
    with pytest.raises(UnexpectedMessage):
        decode(_envelope("ping", "garbage"), Pong)
    with pytest.raises(TypeError):
        decode(data, dict)


def test_non_bytes_input_is_refused() -> None:
    with pytest.raises(MalformedMessage):
        decode("not bytes")  # type: ignore[arg-type]
    assert decode(memoryview(encode(PING))) == PING
    assert decode(bytearray(encode(PING))) == PING


# ---------------------------------------------------------------- encoding checks


@pytest.mark.parametrize(
    "msg",
    [
        Ping(sent_at=float("nan"), nonce=1),
        Ping(sent_at=1.0, nonce=True),
        Ping(sent_at=1.0, nonce=2**64),
        Ping(sent_at="1", nonce=1),
        Ping(sent_at=10**400, nonce=1),
        Pong(sent_at=1.0, nonce=1, peer_state="x" * 33, stage=0, protocol_version=1),
        Pong(sent_at=1.0, nonce=1, peer_state="\ud800", stage=0, protocol_version=1),
        dataclasses.replace(SINK, route=[1, 2]),  # a list would make a frozen message unhashable
        dataclasses.replace(SINK, ping=Pong(1.0, 1, "up", 0, 1)),
    ],
)
def test_encode_refuses_what_a_peer_would_refuse(msg: object) -> None:
    with pytest.raises(MalformedMessage):
        encode(msg)


def test_encode_refuses_unregistered_and_oversized_messages() -> None:
    with pytest.raises(TypeError):
        encode({"v": 1})
    with pytest.raises(MessageTooLarge):
        encode(ErrorReply(code="x", message="y" * 100), max_bytes=64)


# ---------------------------------------------------------------- registration


def test_registering_is_one_decorator_and_refuses_mistakes() -> None:
    with pytest.raises(ValueError, match="already taken"):

        @message("ping")
        class Imposter:
            x: int

    with pytest.raises(ValueError, match="must match"):
        message("Bad Tag!")
    with pytest.raises(TypeError, match="unions"):

        @message("test.union")
        class Union_:
            x: int | str

    with pytest.raises(TypeError, match="unsupported"):

        @message("test.list")
        class Listy:
            x: list[int]

    with pytest.raises(TypeError, match="max_len"):

        @message("test.maxlen")
        class MaxLenOnInt:
            x: int = wire_field(max_len=3)

    with pytest.raises(TypeError, match="frozen"):

        @message("test.mutable")
        @dataclasses.dataclass
        class Mutable:
            x: int

    assert not {"test.union", "test.list", "test.maxlen", "test.mutable"} & set(registered_messages())


# ---------------------------------------------------------------- property tests of the decoder

# Real field names as map keys, so garbage reaches deep into the schemas (not just "unknown field").
FIELD_NAMES = sorted({f.name for cls in [*registered_messages().values(), TensorMeta] for f in dataclasses.fields(cls)})
msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=12)
    | st.binary(max_size=12),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.text(max_size=8) | st.sampled_from(FIELD_NAMES), children, max_size=4)
    ),
    max_leaves=16,
)
tags = st.sampled_from(sorted(registered_messages())) | st.text(max_size=8)
envelopes = st.fixed_dictionaries(
    {"v": st.just(PROTOCOL_VERSION) | msgpack_values, "t": tags | msgpack_values, "b": msgpack_values},
    optional={"x": msgpack_values},
)


def _decode_only_protocol_errors(data: bytes) -> None:
    try:
        msg = decode(data)
    except ProtocolError:
        return
    # Whatever the decoder accepts is a valid message: it re-encodes to the same value.
    assert type(msg) in registered_messages().values()
    assert encode(msg) == encode(decode(encode(msg)))


@FUZZ
@given(st.binary(max_size=512))
def test_arbitrary_bytes_raise_only_protocol_errors(data: bytes) -> None:
    _decode_only_protocol_errors(data)


@FUZZ
@given(msgpack_values | envelopes)
def test_structured_garbage_raises_only_protocol_errors(document: object) -> None:
    _decode_only_protocol_errors(msgpack.packb(document, use_bin_type=True))


@FUZZ
@given(any_message, st.data())
def test_one_corrupted_field_raises_only_protocol_errors(msg: object, data: st.DataObject) -> None:
    body = _body(msg)
    name = data.draw(st.sampled_from(sorted(body)))
    body[name] = data.draw(msgpack_values)
    _decode_only_protocol_errors(_envelope(tag_of(type(msg)), body))


@FUZZ
@given(any_message, st.data())
def test_mutated_bytes_raise_only_protocol_errors(msg: object, data: st.DataObject) -> None:
    raw = bytearray(encode(msg))
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    _decode_only_protocol_errors(bytes(raw[:cut]))


@FUZZ
@given(st.integers(-(2**63), 2**64 - 1).filter(lambda v: v != PROTOCOL_VERSION), any_message | msgpack_values)
def test_any_other_version_is_unsupported_whatever_follows(version: int, body: object) -> None:
    if dataclasses.is_dataclass(body):
        document = _envelope(tag_of(type(body)), _body(body), version)
    else:
        document = _envelope("no-such-tag", body, version)
    with pytest.raises(UnsupportedVersion, match=str(version)):
        decode(document)


@FUZZ
@given(st.binary(min_size=1, max_size=256), st.integers(0, 255))
def test_oversize_is_refused_before_parsing(data: bytes, limit: int) -> None:
    if len(data) <= limit:
        data += b"\x00" * (limit + 1 - len(data))
    with mock.patch.object(codec.msgpack, "unpackb", side_effect=AssertionError("parsed an oversized message")):
        with pytest.raises(MessageTooLarge):
            decode(data, max_bytes=limit)


def test_the_limit_is_inclusive_and_defaults_to_max_message_bytes() -> None:
    wire = encode(ErrorReply(code="x", message="y"))
    assert decode(wire, max_bytes=len(wire)) == ErrorReply(code="x", message="y")
    with pytest.raises(MessageTooLarge):
        decode(wire, max_bytes=len(wire) - 1)
    with pytest.raises(MessageTooLarge):
        decode(b"\x00" * (MAX_MESSAGE_BYTES + 1))
    with pytest.raises(MessageTooLarge):
        decode(_envelope("error", {"code": "x", "message": "y" * MAX_MESSAGE_BYTES}))


def test_sequence_limit_matches_msgpack_array_limit() -> None:
    doc = _envelope("test.kitchen-sink", _body(SINK) | {"route": [0] * (MAX_SEQUENCE_LEN + 1)})
    with pytest.raises(MalformedMessage):
        decode(doc)


def test_planned_starts_travel_with_a_hop_request_and_must_match_its_route() -> None:
    from shoal.protocol.pipeline import BackwardRequest, ForwardRequest, Hop, check_hop

    route = (Hop(stage=1, peer_id="a"), Hop(stage=2, peer_id="b"))
    planned = ForwardRequest(microbatch_id="m", origin="d", step=0, hop=0, route=route, starts=(10.0, 10.5))
    assert decode(encode(planned)) == planned
    check_hop(planned)
    check_hop(dataclasses.replace(planned, starts=()))  # no timetable
    with pytest.raises(MalformedMessage, match="planned starts"):
        check_hop(dataclasses.replace(planned, starts=(10.0,)))
    back = BackwardRequest(microbatch_id="m", origin="d", step=0, hop=1, route=route, starts=(11.0, 12.0, 13.0))
    with pytest.raises(MalformedMessage, match="planned starts"):
        check_hop(back)
    body = _body(planned)
    body["starts"] = [10.0, float("nan")]
    with pytest.raises(MalformedMessage):
        decode(_envelope("fwd", body))
