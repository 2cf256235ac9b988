"""What this machine can give the run: measured forward+backward speed on its device, the memory that
device has, and what a stage would take of it (planning/memory.py)."""

from __future__ import annotations

import statistics
import time

import torch

from shoal.config import RunConfig
from shoal.device import DeviceInfo, PeakMemory, autocast, autocast_dtype, synchronize
from shoal.model.llama import BlockStage
from shoal.model.split_backward import input_grad_first, recording_linears
from shoal.model.stages import build_stage, stage_layers
from shoal.planning.backups import held_values
from shoal.planning.memory import AUDIT_KEPT_STEPS, GIB, StageMemory, stage_memory, stage_params
from shoal.planning.memory import inflight_budget as memory_inflight_budget
from shoal.train.inner import InnerOptimizer, OptimizerState
from shoal.train.outer import OuterState
from shoal.train.step_audit import StepTranscript, replay_step
from shoal.train.transcripts import StepRecorder

MEMORY_SHARE = 0.25  # of the memory a stage's fixed part leaves, what in-flight activations may take
MAX_INFLIGHT_CAP = 256


def measure_block_throughput(
    run: RunConfig,
    repeats: int = 5,
    window_s: float = 0.25,
    most: int = 50,
    device: torch.device | None = None,
) -> float:
    """Microbatches x blocks per second of forward+backward: one block, one microbatch, on `device`
    (default the CPU) in the run's compute precision there.

    Passes are timed for at least `window_s` (at least `repeats` passes, at most `most`), and the
    speed is that of the faster quartile's edge. Nodes that start together measure while the others
    import and measure too: the median of five quick passes read 154-944 blocks/s on the same 2 cores,
    and routing and stage choice weigh replicas by it. A burst slows a few passes of a longer window;
    a machine busy all along slows them all, and the measure still says so."""
    device = device or torch.device("cpu")
    dtype = autocast_dtype(device, run.pipeline.compute_dtype)
    m, t = run.model, run.train
    stage = BlockStage(m, range(0, 1), seed=run.train.seed).to(device)
    x = torch.randn(t.microbatch_size, t.seq_len, m.residual_dim, device=device)
    tokens = torch.randint(0, m.vocab_size, (t.microbatch_size, t.seq_len), device=device)
    timings: list[float] = []
    first = time.perf_counter()
    while len(timings) < most and (len(timings) < repeats or time.perf_counter() - first < window_s):
        started = time.perf_counter()
        x_in = x.detach().requires_grad_(True)
        with autocast(device, dtype):
            y = stage(x_in, tokens)
        y.backward(torch.ones_like(y))
        synchronize(device)
        timings.append(time.perf_counter() - started)
    timings = timings[1:]  # the first pass warms up allocators and kernels
    return 1.0 / statistics.quantiles(timings, n=4)[0]


def tokens_per_s(run: RunConfig, block_throughput: float) -> float:
    """The same speed in tokens: a microbatch's tokens through one block, forward and backward, per second."""
    return block_throughput * run.train.microbatch_size * run.train.seq_len


def stage_need(run: RunConfig, stage: int) -> StageMemory:
    """What holding `stage` of this run takes (planning/memory.py), at its largest sequence length."""
    stages = run.pipeline.stages
    blocks = len(stage_layers(run.model.n_layers, stages, stage))
    averages = run.averaging.mode != "none"

    def params_of(s: int) -> int:
        return stage_params(run.model, len(stage_layers(run.model.n_layers, stages, s)), s)

    held = held_values(stages, stage, params_of, run.repair.rule, run.repair.backup_every > 0)
    audits = run.defense.step_audit_rate > 0
    audited = run.train.batch_size // run.train.microbatch_size if audits else 0
    replayed = max(map(params_of, range(1, stages)), default=0) if audits and stage == 0 else 0
    return stage_memory(run.model, run.train.microbatch_size, run.train.seq_len, blocks, stage, averages, held,
                        audited, replayed)  # fmt: skip


def memory_for_stages(info: DeviceInfo, limit_gib: float | None) -> int:
    """The memory this node plans its stage in: its device's free memory, or `--memory-limit` if less."""
    if limit_gib is None:
        return info.free_bytes
    return min(info.free_bytes, int(limit_gib * GIB))


def inflight_budget(run: RunConfig, stage: int, free_bytes: int) -> int:
    return memory_inflight_budget(stage_need(run, stage), free_bytes, MEMORY_SHARE, MAX_INFLIGHT_CAP)


def measure_stage_peak(run: RunConfig, stage: int, max_inflight: int, device: torch.device) -> int:
    """Bytes a stage took at its peak: built, `max_inflight` forwards held at once, their backwards
    (B, then W, as a worker runs them) and an inner step, with the outer optimizer's state if the run
    averages; where data nodes audit steps, a worker's transcripts and, on stage 0, the replay of an
    audited step of the largest block stage. On the CPU it is the resident set's peak above its size at
    the call, so other threads' work counts too: the tests run it alone in a fresh process."""

    with PeakMemory(device) as peak:
        _run_stage_rounds(run, stage, max_inflight, device)
    return peak.bytes


def _run_stage_rounds(run: RunConfig, stage: int, max_inflight: int, device: torch.device) -> None:

    dtype = autocast_dtype(device, run.pipeline.compute_dtype)
    m, t = run.model, run.train
    module = build_stage(m, run.pipeline.stages, stage, t.seed).to(device)
    optimizer = InnerOptimizer(module, run.optim, t.steps)
    outer = OuterState.from_module(module) if run.averaging.mode != "none" else None
    recorder = StepRecorder(enabled=stage != 0 and run.defense.step_audit_rate > 0)
    generator = torch.Generator().manual_seed(0)
    # the second round runs with AdamW's moments allocated, as every later step does; audited workers'
    # transcripts fill up over AUDIT_KEPT_STEPS rounds and the one after
    for step in range(1 + AUDIT_KEPT_STEPS if recorder.enabled else 2):
        held = []
        for _ in range(max_inflight):
            if stage == 0:
                tokens = torch.randint(0, m.vocab_size, (t.microbatch_size, t.seq_len), generator=generator)
                with autocast(device, dtype):
                    held.append(module.embed(tokens.to(device)))
                continue
            x = torch.randn(t.microbatch_size, t.seq_len, m.residual_dim, generator=generator).to(device)
            tokens = torch.randint(0, m.vocab_size, (t.microbatch_size, t.seq_len), generator=generator).to(device)
            x.requires_grad_(True)
            with torch.enable_grad(), recording_linears(module) as calls, autocast(device, dtype):
                held.append((x, module(x, tokens), calls))
        for item in held:
            if stage == 0:
                targets = torch.randint(0, m.vocab_size, (t.microbatch_size, t.seq_len), generator=generator)
                x = torch.randn(t.microbatch_size, t.seq_len, m.residual_dim, generator=generator).to(device)
                with autocast(device, dtype):
                    _, _, weight_grads = module.loss_and_input_grad(x, targets.to(device), tokens=targets.to(device))
                item.backward(torch.ones_like(item))
            else:
                x, y, calls = item
                _, weight_grads = input_grad_first(module, x, y, torch.ones_like(y), calls)
                recorder.note_backward(str(len(recorder.ids)), x, torch.ones_like(y))
            weight_grads.accumulate()
        del held
        recorder.before_step(module, optimizer)
        optimizer.step()
        recorder.after_step(module, step, 1.0)
    if stage == 0 and run.defense.step_audit_rate > 0:
        _replay_an_audited_step(run, device, generator)
    synchronize(device)
    del outer, recorder


def _replay_an_audited_step(run: RunConfig, device: torch.device, generator: torch.Generator) -> None:
    """What a data node holds while a step audit runs: a transcript of the largest block stage's step as
    it arrives, and its replay (shoal/node/pipeline/data/step_audits.py)."""
    m, t, stages = run.model, run.train, run.pipeline.stages
    stage = max(range(1, stages), key=lambda s: len(stage_layers(m.n_layers, stages, s)))
    module = build_stage(m, stages, stage, t.seed).to(device)
    params = [p.detach() for p in module.parameters()]
    rows = t.batch_size // t.microbatch_size
    transcript = StepTranscript(
        step=1, lr_scale=1.0,
        state=OptimizerState(1, (1.0,) * len(params), tuple(torch.zeros_like(p) for p in params),
                             tuple(torch.ones_like(p) for p in params)),
        before=tuple(p.clone() for p in params), after=tuple(p.clone() for p in params),
        microbatch_ids=tuple(str(k) for k in range(rows)),
        inputs=tuple(torch.randn(t.microbatch_size, t.seq_len, m.residual_dim, generator=generator).to(device)
                     for _ in range(rows)),
        output_grads=tuple(torch.randn(t.microbatch_size, t.seq_len, m.residual_dim, generator=generator).to(device)
                           for _ in range(rows)),
    )  # fmt: skip
    replay_step(module, run.optim, t.steps, transcript, torch.float32)
