"""Every extension point is one table, and every name the run config accepts is in it (and only those):
a new method is one module plus one line."""

from __future__ import annotations

from shoal.config import WIRE_DTYPES
from shoal.p2p.wire_codecs import WIRE_CODECS


def test_every_wire_dtype_the_config_accepts_has_a_codec_and_no_codec_is_unreachable() -> None:
    assert set(WIRE_CODECS) == set(WIRE_DTYPES)
    assert all(name == codec.name for name, codec in WIRE_CODECS.items())


def test_every_outer_codec_the_config_accepts_is_in_the_table() -> None:
    from shoal.config import OUTER_CODECS
    from shoal.train.outer_codec import OUTER_CODEC_TABLE

    assert set(OUTER_CODEC_TABLE) == set(OUTER_CODECS)


def test_every_repair_rule_the_config_accepts_has_a_planner() -> None:
    from shoal.config import REPAIR_RULES
    from shoal.train.repair import REPAIR_PLANNERS

    assert set(REPAIR_PLANNERS) == set(REPAIR_RULES)
