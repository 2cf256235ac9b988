"""The schema mechanism's value bounds and its document mode, which run configs, DHT records and the
state manifest are read with (the wire messages' own checks are in test_protocol_codec.py)."""

from __future__ import annotations

import dataclasses

import pytest

from shoal.protocol.errors import MalformedMessage
from shoal.protocol.schema import FieldOptions, load_document, struct_kind, wire_field


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hop:
    stage: int = wire_field(ge=1, le=8)
    weight: float = wire_field(ge=0.0, le=1.0, default=0.5)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    name: str = wire_field(min_len=1, max_len=16, pattern="[a-z]+")
    mode: str = wire_field(choices=("fast", "safe"), default="safe")
    level: int = wire_field(choices=(1, 2, 4), default=1)
    hops: tuple[Hop, ...] = wire_field(min_len=1, max_len=3, default=(Hop(stage=1),))
    stages: tuple[int, ...] = wire_field(max_len=4, item=FieldOptions(ge=0, le=9), default=())
    rate: float = 1.0


GOOD = {"name": "tiny", "hops": [{"stage": 2, "weight": 0.25}], "stages": [0, 9]}


def test_a_document_loads_into_the_dataclass_with_tuples_and_defaults():
    plan = load_document(Plan, GOOD)
    assert plan == Plan(name="tiny", hops=(Hop(stage=2, weight=0.25),), stages=(0, 9))


@pytest.mark.parametrize(
    ("change", "field", "reason"),
    [
        ({"name": ""}, "name", "does not match"),
        ({"name": "Tiny"}, "name", "does not match"),
        ({"name": "x" * 17}, "name", "exceeds 16"),
        ({"mode": "reckless"}, "mode", "must be one of fast, safe"),
        ({"level": 3}, "level", "must be one of 1, 2, 4"),
        ({"hops": []}, "hops", "needs at least 1"),
        ({"hops": [{"stage": 9}]}, "hops[0].stage", "at most 8"),
        ({"hops": [{"stage": 0}]}, "hops[0].stage", "at least 1"),
        ({"hops": [{"stage": 1, "weight": -0.1}]}, "hops[0].weight", "at least 0.0"),
        ({"hops": [{"stage": 1, "colour": 1}]}, "hops[0].colour", "unknown field"),
        ({"hops": [{"weight": 0.1}]}, "hops[0].stage", "missing field 'stage'"),
        ({"stages": [0, 10]}, "stages[1]", "at most 9"),
        ({"stages": [True]}, "stages[0]", "expected int"),
        ({"rate": "1"}, "rate", "expected float"),
        ({"rate": float("inf")}, "rate", "finite"),
    ],
)
def test_a_refusal_names_the_path_of_the_offending_value(change, field, reason):
    with pytest.raises(MalformedMessage) as refused:
        load_document(Plan, GOOD | change)
    assert refused.value.field == field
    assert reason in refused.value.reason
    assert str(refused.value).startswith(f"{field}: ")


def test_documents_widen_ints_to_floats_but_exact_reads_do_not():
    assert load_document(Plan, GOOD | {"rate": 2}).rate == 2.0
    assert type(load_document(Plan, GOOD | {"rate": 2}).rate) is float
    with pytest.raises(MalformedMessage, match="rate: expected float, got int"):
        load_document(Plan, GOOD | {"rate": 2}, exact=True)


def test_the_wire_refuses_what_the_bounds_refuse_when_sending_too():
    with pytest.raises(MalformedMessage, match="hops\\[0\\].stage"):
        struct_kind(Plan).dump(Plan(name="tiny", hops=(Hop(stage=99),)), "")


def test_bounds_that_do_not_fit_the_type_are_a_programming_error():
    @dataclasses.dataclass(frozen=True)
    class Wrong:
        flag: bool = wire_field(ge=0, default=False)

    @dataclasses.dataclass(frozen=True)
    class AlsoWrong:
        ids: tuple[str, ...] = wire_field(pattern="[a-z]+", default=())

    for cls in (Wrong, AlsoWrong):
        with pytest.raises(TypeError, match="do not apply"):
            struct_kind(cls)
