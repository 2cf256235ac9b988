"""Waits derived from what is sent (planning/time_limits.py): the run's constants are floors, raised
where a stage's exchange or copy takes longer at the planned link speed. Toy stages keep their floors;
a SmolLM2-sized stage gets the time its bytes take."""

from __future__ import annotations

import pytest
import torch

from shoal.model.stages import build_stage
from shoal.node.averaging.base import exchange_timeout_s
from shoal.node.stage.copy import BUSY_WAIT_S, busy_wait_s
from shoal.planning.time_limits import PLANNED_LINK_BYTES_PER_S, SLACK, transfer_s, wait_limit_s
from shoal.run_files import load_run_config

# SmolLM2-135M's shape (tests/test_model_gguf_import.py reads a real one; this needs only its sizes)
SMOLLM2 = {"model.vocab_size": 49152, "model.d_model": 576, "model.n_layers": 30, "model.n_heads": 9,
           "model.n_kv_heads": 3, "model.ffn_hidden": 1536, "model.tie_embeddings": True,
           "pipeline.stages": 4, "averaging.codec": "topk"}  # fmt: skip


def test_a_limit_is_its_floor_until_the_bytes_take_longer():
    assert wait_limit_s(10.0) == 10.0
    assert wait_limit_s(10.0, n_bytes=PLANNED_LINK_BYTES_PER_S) == 10.0  # 1 s of transfer: the floor
    assert wait_limit_s(10.0, n_bytes=100 * PLANNED_LINK_BYTES_PER_S) == SLACK * 100
    assert wait_limit_s(1.0, n_bytes=8e6, bytes_per_s=1e6) == SLACK * 8
    assert transfer_s(0) == 0.0
    with pytest.raises(ValueError):
        transfer_s(-1)
    with pytest.raises(ValueError):
        transfer_s(1, bytes_per_s=0)


def test_the_bundled_toy_runs_keep_their_constants():
    for name in ("tiny", "small"):
        run = load_run_config(name)
        assert exchange_timeout_s(run) == run.averaging.exchange_timeout_s
        with torch.device("meta"):
            assert busy_wait_s(build_stage(run.model, run.pipeline.stages, 1, 0)) == BUSY_WAIT_S


def test_a_real_sized_stage_waits_as_long_as_its_bytes_take():
    run = load_run_config("tiny").replace(SMOLLM2)
    limit = exchange_timeout_s(run)
    # stage 0's float32 exchange (φ and Δ of a 28 M-parameter embedding, 8 bytes each) is the largest
    assert limit == pytest.approx(SLACK * 2 * 8 * 49152 * 576 / PLANNED_LINK_BYTES_PER_S, rel=0.01)
    assert limit > 5 * run.averaging.exchange_timeout_s
    alone = run.replace({"averaging.mode": "none", "averaging.codec": "float32"})
    assert exchange_timeout_s(alone) == run.averaging.exchange_timeout_s  # no exchange to wait for
    with torch.device("meta"):
        stage = build_stage(run.model, 2, 1, 0)  # all 30 blocks in one stage: 106 M parameters
    params = sum(p.numel() for p in stage.parameters())
    assert busy_wait_s(stage) == pytest.approx(SLACK * 16 * params / PLANNED_LINK_BYTES_PER_S)  # θ, φ, 2 moments
    assert busy_wait_s(stage) > BUSY_WAIT_S
