"""Step audits (shoal.train.step_audit): a replica's inner step, recorded the way a worker records it
(split backward, AdamW), replays within float noise; a blended direction, a forged input or gradient,
a left-out microbatch and an output its weights do not compute are each caught."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shoal.model.split_backward import input_grad_first, recording_linears
from shoal.model.stages import build_stage, over_the_wire
from shoal.node.pipeline.worker.transcripts import TranscriptServer
from shoal.planning.memory import AUDIT_KEPT_STEPS
from shoal.run_files import load_run_config
from shoal.train.inner import InnerOptimizer
from shoal.train.step_audit import STEP_TOLERANCE, Known, judge_step, replay_step
from shoal.train.transcripts import PENDING, StepRecorder

RUN = load_run_config("tiny")
SUBSPACE_RUN = RUN.replace({"model.subspace_rank": 8})
WIRE = torch.int8


def _worker_steps(steps: int, blend: float = 0.0, run=RUN):
    """A stage-1 replica taking `steps` inner steps of 2 microbatches each, as StageWorker does;
    `blend` x a fixed direction is added to its weights after each step (the backdoor's way). In a
    Subspace Network's run each microbatch comes with its token ids."""
    torch.manual_seed(0)
    module = build_stage(run.model, run.pipeline.stages, 1, run.train.seed)
    optimizer = InnerOptimizer(module, RUN.optim, RUN.train.steps)
    recorder = StepRecorder(enabled=True)
    direction = [torch.randn_like(p) * 0.05 for p in module.parameters()]
    known: dict[str, Known] = {}
    for step in range(steps):
        for k in range(2):
            sent = torch.randn(2, 16, run.model.residual_dim)
            tokens = torch.randint(0, run.model.vocab_size, (2, 16)) if run.model.subspace_rank else None
            x = over_the_wire(sent, WIRE).requires_grad_(True)
            with torch.enable_grad(), recording_linears(module) as calls:
                y = module(x, tokens)
            grad = over_the_wire(torch.randn_like(y) * 1e-3, WIRE)
            _, weight_grads = input_grad_first(module, x, y, grad, calls)
            weight_grads.accumulate()
            mb = f"d-{step}.{k}#0.{'ab' * 16}"
            recorder.note_backward(mb, x, grad, tokens)
            known[mb] = Known(input=over_the_wire(sent, WIRE), output_grad=grad, output=over_the_wire(y.detach(), WIRE),
                              tokens=tokens)  # fmt: skip
        recorder.before_step(module, optimizer)
        optimizer.step(step)
        if blend:
            with torch.no_grad():
                for p, d in zip(module.parameters(), direction, strict=True):
                    p.add_(d * blend)
        recorder.after_step(module, step, optimizer.lr_scale)
    return recorder, known


def _audit(recorder, known, run=RUN, **change):
    transcript = dataclasses.replace(recorder.steps[-1], **change)
    ours = {mb: k for mb, k in known.items() if mb in recorder.steps[-1].microbatch_ids}
    module = build_stage(run.model, run.pipeline.stages, 1, run.train.seed)
    replayed = replay_step(module, run.optim, run.train.steps, transcript, WIRE)
    return judge_step(transcript, replayed, ours)


def test_an_honest_step_replays_within_float_noise():
    recorder, known = _worker_steps(3)
    verdict = _audit(recorder, known)
    assert verdict.passed, verdict
    assert verdict.discrepancy < STEP_TOLERANCE / 100, verdict


def test_a_subspace_networks_step_replays_with_its_token_ids_and_forged_ids_fail():
    recorder, known = _worker_steps(2, run=SUBSPACE_RUN)
    last = recorder.steps[-1]
    assert len(last.tokens) == len(last.inputs) == 2 and last.inputs[0].shape[-1] == 8
    verdict = _audit(recorder, known, run=SUBSPACE_RUN)
    assert verdict.passed and verdict.discrepancy < STEP_TOLERANCE / 100, verdict
    forged = ((last.tokens[0] + 1) % SUBSPACE_RUN.model.vocab_size, *last.tokens[1:])
    assert "token ids" in _audit(recorder, known, run=SUBSPACE_RUN, tokens=forged).reason


def test_weights_that_moved_beside_the_gradient_fail():
    recorder, known = _worker_steps(3, blend=0.01)
    verdict = _audit(recorder, known)
    assert not verdict.passed and "of a step away" in verdict.reason, verdict
    print(verdict)


def test_a_forged_input_or_gradient_a_left_out_microbatch_or_a_wrong_output_fail():
    recorder, known = _worker_steps(2)
    last = recorder.steps[-1]
    forged = (last.inputs[0] * 1.01, *last.inputs[1:])
    assert "input" in _audit(recorder, known, inputs=forged).reason
    forged = (last.output_grads[0] + 1e-4, *last.output_grads[1:])
    assert "gradient" in _audit(recorder, known, output_grads=forged).reason
    left_out = _audit(
        recorder,
        known,
        microbatch_ids=last.microbatch_ids[1:],
        inputs=last.inputs[1:],
        output_grads=last.output_grads[1:],
    )
    assert "left microbatch" in left_out.reason, left_out
    mb = last.microbatch_ids[0]
    wrong = {**known, mb: dataclasses.replace(known[mb], output=known[mb].output * 1.1)}
    verdict = _audit(recorder, wrong)
    assert not verdict.passed and "output" in verdict.reason, verdict


def test_the_recorder_keeps_its_last_steps_and_says_when_a_step_is_still_pending():
    recorder, _ = _worker_steps(5)
    assert len(recorder.steps) == AUDIT_KEPT_STEPS == 2
    assert recorder.find("d-0.0#0." + "ab" * 16) is None
    assert recorder.find("d-4.1#0." + "ab" * 16) is recorder.steps[-1]
    recorder.note_backward("d-5.0", torch.zeros(1, 1, 4), torch.zeros(1, 1, 4))
    assert recorder.find("d-5.0") == PENDING
    off = StepRecorder(enabled=False)
    off.note_backward("x", torch.zeros(1), torch.zeros(1))
    assert off.find("x") is None and not off.ids


@pytest.mark.parametrize("blend", [0.0, 1e-3])
def test_the_discrepancy_scales_with_what_was_blended_in(blend):
    recorder, known = _worker_steps(2, blend=blend)
    verdict = _audit(recorder, known)
    assert verdict.passed == (blend == 0.0), verdict


def test_a_step_is_replayed_only_where_it_ran_the_same_way():
    from shoal.device import compute_kind

    assert compute_kind(torch.device("cpu"), None) == "cpu:float32"
    assert compute_kind(torch.device("cuda", 0), torch.bfloat16) == "cuda:bfloat16"
    assert TranscriptServer(enabled=True, compute="cuda:bfloat16").compute == "cuda:bfloat16"


def test_a_step_keeps_one_copy_of_theta_where_nothing_moved_it_since_the_last():
    recorder, _ = _worker_steps(3)
    older, last = recorder.steps
    assert last.before is older.after  # one tensor for both: AUDIT_KEPT_STEPS + 1 copies of θ, not twice that
    module = build_stage(RUN.model, RUN.pipeline.stages, 1, RUN.train.seed)
    with torch.no_grad():
        for p, kept in zip(module.parameters(), last.after, strict=True):
            p.copy_(kept + 1.0)  # an outer step moved θ between two inner steps
    recorder.before_step(module, InnerOptimizer(module, RUN.optim, RUN.train.steps))
    moved = recorder._before[0]
    assert moved is not last.after and all(torch.equal(a, p) for a, p in zip(moved, module.parameters(), strict=True))
