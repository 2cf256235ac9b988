"""The demo report's account of a stage repair, from the data node's progress events."""

from __future__ import annotations

import pytest

from shoal.demo.report import repair_summary


def _step(step: int, loss: float, val: float | None = None) -> dict:
    return {"event": "step", "step": step, "loss": loss, **({"val_loss": val} if val is not None else {})}


REPAIR = {"event": "repair", "step": 5, "stage": 2, "rule": "checkfree", "sources": [1, 3], "inner_step": 4,
          "seconds": 0.4, "note": ""}  # fmt: skip


def test_a_repair_is_measured_on_validation_loss_where_the_run_evaluates_every_step():
    losses = [3.0, 2.9, 2.8, 2.7, 3.3, 2.75, 2.6]
    vals = [3.1, 3.0, 2.9, 2.8, 3.2, 3.0, 2.79]  # back under 2.8 (after step 3) at step 6: 2 steps after 4
    events = [_step(s, loss, val) for s, (loss, val) in enumerate(zip(losses, vals, strict=True))]
    (row,) = repair_summary([*events[:5], REPAIR, *events[5:]], wipe={"stage": 2, "step": 4})
    assert row["loss_before"] == pytest.approx(2.8) and row["steps_to_recover"] == 0  # training loss: step 5
    assert (row["val_before"], row["val_after"], row["val_steps_to_recover"]) == (2.8, 3.2, 2)


def test_without_validation_during_training_the_repair_has_no_validation_fields():
    events = [_step(s, loss) for s, loss in enumerate([3.0, 2.9, 2.8, 2.7, 3.3, 2.75, 2.6])]
    (row,) = repair_summary([*events[:5], REPAIR, *events[5:]], wipe=None)
    assert "val_before" not in row and row["steps_to_recover"] == 0
