"""What holding a stage costs in memory, before a node takes it: a pure estimate from the run's shapes.

A stage's memory is what it keeps for the whole run (float32 weights, their gradients, AdamW's two
moments, and the outer optimizer's slow weights and momentum when replicas average; where data nodes
audit steps, a worker's transcripts of its last steps) plus what every
microbatch in flight keeps until its backward (the activations autograd saves), plus, on stage 0,
one loss at a time over the whole vocabulary. The estimate is meant as an upper bound at float32: it
counts the attention matrix the math kernel materialises and ignores that autocast keeps some tensors
in half precision. tests/test_memory_estimate.py holds it within 0.9-1.5x of measured peaks.

    need = stage_memory(run.model, run.train, stages=3, stage=1, averages=True)
    need.total(max_inflight=4) <= free_bytes * (1 - HEADROOM)
"""

from __future__ import annotations

from dataclasses import dataclass

from shoal.model.config import ModelConfig

FLOAT_BYTES = 4
HEADROOM = 0.1  # of a device's memory a stage may not count on (allocator slack, other work)
# What computing at all takes before any stage: kernels' code paged in, thread pools, workspaces
# (measured: 100-130 MiB of resident set for the first forward and backward on a CPU)
RUNTIME_BYTES = 160 * 1024**2
GIB = 1024**3
# Inner steps a worker keeps the transcript of for step audits (shoal/train/transcripts.py): a data node
# asks for the step it audits once that step closes, by which time its worker is at most one step on.
AUDIT_KEPT_STEPS = 2


@dataclass(frozen=True)
class StageMemory:
    """Bytes a stage holds: `fixed` all run long, `per_microbatch` for each microbatch in flight, and
    `working` once at a time (stage 0's logits and their gradient)."""

    stage: int
    params: int
    fixed: int
    per_microbatch: int
    working: int
    what: str = ""  # what it is, for a refusal ("" : the stage, by its number)

    def total(self, max_inflight: int) -> int:
        return RUNTIME_BYTES + self.fixed + self.working + max(1, max_inflight) * self.per_microbatch


def block_activation_bytes(model: ModelConfig, microbatch_size: int, seq_len: int) -> int:
    """What autograd keeps per block for one microbatch: the norms' inputs and outputs, q/k/v and the
    rotated q/k, the attention output, both residual sums, SwiGLU's gate, up, activation and product,
    the Linears' inputs the W pass keeps, and the attention weights (batch x heads x T x T) the math
    kernel keeps. Measured per token: 3,150 floats at d 128, f 352 and 9,850 at d 384, f 1024."""
    tokens = microbatch_size * seq_len
    per_token = 14 * model.d_model + 5 * model.ffn_hidden
    attention = microbatch_size * model.n_heads * seq_len * seq_len
    return FLOAT_BYTES * (tokens * per_token + attention)


def stage_params(model: ModelConfig, blocks: int, stage: int) -> int:
    return model.head_params() if stage == 0 else blocks * model.block_params()


def stage_memory(
    model: ModelConfig,
    microbatch_size: int,
    seq_len: int,
    blocks: int,
    stage: int,
    averages: bool,
    held_values: int = 0,
    audited_microbatches: int = 0,
    replayed_params: int = 0,
) -> StageMemory:
    """The memory of stage `stage` holding `blocks` blocks (stage 0: the embedding, norm and head);
    `held_values`: float32 values its workers hold on the host for copies (planning/backups.py
    `held_values`: CheckFree+'s stage 0, a neighbour's backup snapshot, their own); `audited_microbatches`:
    where data nodes audit steps, the microbatches of a step, whose inputs and output gradients a
    worker keeps in its transcripts (0: no audits); `replayed_params`: on stage 0, the largest block stage
    a data node's step audit replays (0: no audits)."""
    params = stage_params(model, blocks, stage)
    # weights, gradients, AdamW's moments, outer φ and momentum, and one more for the step's temporaries
    # (gradient clipping's and the fused AdamW's)
    copies = 1 + 1 + 2 + (2 if averages else 0) + 1
    tokens = microbatch_size * seq_len
    if audited_microbatches and stage != 0:
        # transcripts: θ before each kept step and after the last (one tensor where nothing moved θ between
        # steps), AdamW's moments before each kept step and the next one's while it is taken, and each
        # microbatch's input and output gradient for the kept steps and the one being gathered
        copies += (AUDIT_KEPT_STEPS + 1) + 2 * (AUDIT_KEPT_STEPS + 1)
    io = 2 * FLOAT_BYTES * tokens * model.residual_dim * audited_microbatches * (AUDIT_KEPT_STEPS + 1)
    fixed = FLOAT_BYTES * (params * copies + held_values) + (io if stage != 0 else 0)
    if stage == 0:
        # per microbatch: its embedding output, kept until the gradient comes home; once at a time: the
        # logits, their log-softmax, its gradient and the logits' gradient, over the whole vocabulary
        # and while a step audit runs: the transcript (θ before and after, both moments), the stage built
        # to replay it, its gradients and moments, and the replayed θ
        logits = 4 * FLOAT_BYTES * tokens * model.vocab_size
        return StageMemory(stage, params, fixed, FLOAT_BYTES * tokens * model.d_model,
                           logits + 9 * FLOAT_BYTES * replayed_params)  # fmt: skip
    per_microbatch = blocks * block_activation_bytes(model, microbatch_size, seq_len)
    return StageMemory(stage, params, fixed, per_microbatch + 2 * FLOAT_BYTES * tokens * model.d_model, 0)


def policy_memory(
    model: ModelConfig, rows: int, seq_len: int, completion_len: int | None = None, trained_blocks: int = 0
) -> StageMemory:
    """A rollout worker's whole policy: float32 weights, gradients and Adam's moments (and one copy for
    the step's temporaries), and one learning step's activations over `rows` sequences of `seq_len`:
    every trained block's (`trained_blocks`, 0: all; a frozen block keeps none), and the logits with
    their log-softmax and gradients, over the whole vocabulary, at the `completion_len` positions of
    each row that the loss reads (None: all of them)."""
    params = model.params()
    kept = min(model.n_layers, trained_blocks or model.n_layers)
    blocks = kept * block_activation_bytes(model, rows, seq_len)
    logits = 4 * FLOAT_BYTES * rows * (seq_len if completion_len is None else completion_len) * model.vocab_size
    return StageMemory(0, params, FLOAT_BYTES * params * 5, blocks + logits, 0, what="the policy")


def usable_bytes(free_bytes: int) -> int:
    """Of a device's free memory, what a stage may plan on."""
    return int(free_bytes * (1.0 - HEADROOM))


def fits(need: StageMemory, free_bytes: int, max_inflight: int = 1) -> bool:
    return need.total(max_inflight) <= usable_bytes(free_bytes)


def inflight_budget(need: StageMemory, free_bytes: int, share: float, cap: int) -> int:
    """Microbatches to hold at once: `share` of what the stage's fixed memory leaves, at least 1."""
    spare = usable_bytes(free_bytes) - RUNTIME_BYTES - need.fixed - need.working
    return max(1, min(cap, int(spare * share) // max(1, need.per_microbatch)))


def gib(n_bytes: float) -> str:
    return f"{n_bytes / GIB:.1f} GiB" if n_bytes >= GIB else f"{n_bytes / 1024**2:.0f} MiB"


def refusal(need: StageMemory, free_bytes: int) -> str:
    """Why a stage does not fit, in the words a log line and `shoal status` use."""
    what = need.what or ("stage 0 (the data role)" if need.stage == 0 else f"stage {need.stage}")
    return f"{what} needs ~{gib(need.total(1))}, this node has {gib(usable_bytes(free_bytes))} free"
