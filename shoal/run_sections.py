"""The sections of a run config (`[pipeline]`, `[train]`, `[optim]`, ...): what each field means and its
default. `RunConfig` (shoal/config.py) holds them and checks the bounds and relations between them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PipelineConfig:
    stages: int = 3  # stage 0 (embedding, head, loss) + block stages 1..S-1
    wire_dtype: str = "float32"  # dtype of activations and gradients between peers
    # matrix products' precision on each node: auto (bf16 autocast where the device has it, float32
    # elsewhere: CPUs, pre-Ampere GPUs), float32, or bfloat16 (autocast on any device, the CPU included)
    compute_dtype: str = "auto"


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 150
    seq_len: int = 128
    batch_size: int = 16  # sequences per optimizer step
    microbatch_size: int = 4  # sequences per microbatch
    seed: int = 0
    eval_batches: int = 8
    eval_every: int = 0  # steps between validation evaluations during training (0: only after the last step)

    def evaluates_after(self, step: int) -> bool:
        """Whether validation runs after `step` mid-run (the evaluation after the last step always does)."""
        return self.eval_every > 0 and (step + 1) % self.eval_every == 0 and step + 1 < self.steps


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 15
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0


@dataclass(frozen=True)
class DataConfig:
    """What the data nodes train on (the forms are in shoal.model.documents). `digest` is the
    SHA-256 of the dataset's files, filled in where the run is defined; with it, `path` is only
    where the defining machine keeps the data: the run id leaves it out and every data node checks
    its own copy (`--data PATH`) against the digest."""

    path: str = ""  # text file or folder, .jsonl, .parquet, save_to_disk folder; empty: the default corpus
    val_fraction: float = 0.05
    text_field: str = "text"  # the text's field in .jsonl records, its column in .parquet and Arrow
    digest: str = ""


AVERAGING_MODES = ("noloco", "diloco", "none")
STAGE0_AVERAGING = ("gradients", "mean", "outer")  # averaging.stage0


@dataclass(frozen=True)
class AveragingConfig:
    """How replicas of a stage share weights (papers/noloco.md). Defaults are NoLoCo's α, β, γ and
    n; H is scaled to the tiny run (the paper's 50 of 25,000 steps would never sync in 150). For the
    DiLoCo baseline use α 0.3, γ 0 (`shoal demo --averaging diloco` sets them)."""

    mode: str = "noloco"  # noloco (random pairs), diloco (all-reduce over the stage's replicas), none
    inner_steps: int = 10  # H: inner steps between outer steps
    alpha: float = 0.5  # outer momentum
    beta: float = 0.7  # outer learning rate
    gamma: float = 0.7  # NoLoCo's pull toward the pair mean
    group_size: int = 2  # NoLoCo's n
    exchange_timeout_s: float = 10.0  # no partner by then: a local outer step
    # what an exchange sends (shoal/train/outer_codec.py): float32, int8 (φ and Δ in int8 blocks) or
    # topk (φ in int8 blocks, Δ's largest topk_fraction with error feedback; noloco only)
    codec: str = "float32"
    topk_fraction: float = 0.02
    # Stage 0 (embedding, final norm, head), whose replicas are the data nodes, each on its own shard.
    # "gradients": before each optimizer step they average its gradients in pairs (data parallelism,
    # shoal/train/gradient_mean.py), and its weights every `stage0_resync_every` steps, which brings
    # back together replicas a missed exchange set apart. "mean": every `stage0_every` steps they
    # replace its weights with their pair's mean (the outer step with α 0, β 1, γ 1). "outer": as every
    # stage (H, α, β, γ above). Two data nodes against one on tiny at equal tokens: docs/benchmarks.md,
    # "Data nodes" (benchmarks/data_nodes.py).
    stage0: str = "gradients"
    stage0_every: int = 1
    stage0_resync_every: int = 10


REPAIR_RULES = ("checkfree", "checkfree_plus", "uniform", "copy", "random")


@dataclass(frozen=True)
class RepairConfig:
    """How a node rebuilds a block stage that no live replica holds any more (papers/checkfree.md;
    the rules are in shoal.train.repair). checkfree: gradient-weighted average of the two neighbours,
    an edge stage copies its one block neighbour; checkfree_plus: edge stages copy their swap partner,
    and `swap_share` of the microbatches run with the partners swapped so that they learn to stand in
    for each other (it costs some convergence without failures, so it is not the default), and stage
    0's neighbours keep a copy of it; uniform, copy and random are the baselines."""

    rule: str = "checkfree"
    swap_share: float = -1.0  # <0: 0.5 under checkfree_plus, 0 otherwise
    lr_scale: float = 1.1  # the rebuilt stage's fresh optimizer runs at this multiple of the schedule
    weights_from: str = "unclipped"  # the gradient norm that weighs the neighbours: unclipped or clipped
    # checkfree_plus: the workers of stage 0's neighbours (stages 1 and S-1) copy it every this many of
    # their inner steps, so that a lost stage 0 comes back from a copy (shoal/node/stage/kept_copies.py)
    edge_copy_every: int = 10
    # stage backups (beyond the papers): the workers of each block stage keep the latest snapshot of the
    # one before it (the first keeps the last), taken at each outer step, or every this many inner steps
    # in a run without an outer optimizer, and sent as its int8 change, checked by digest; a stage that
    # loses every replica is restored from it before any rebuild by `rule` is tried. 0: no backups.
    backup_every: int = 10
    # a run imported from a checkpoint: a lost stage with no backup left comes back from the checkpoint's
    # own tensors for it, where the node taking it holds the files, before any rebuild by `rule`
    from_checkpoint: bool = True

    @property
    def swaps(self) -> float:
        if self.swap_share >= 0:
            return self.swap_share
        return 0.5 if self.rule == "checkfree_plus" else 0.0


@dataclass(frozen=True)
class SkipPipeConfig:
    """How data nodes that send SkipPipe's partial paths (`shoal node --paths skippipe`) plan them
    (papers/skippipe.md; shoal.planning.skippipe). The defaults are the authors' ICLR code's."""

    # every data node plans the step's paths for all data nodes from the same inputs (the swarm as the
    # DHT advertises it, seeded by run and step) and releases its own microbatches at the planned
    # times, so their paths do not collide; false: each plans its own paths alone, as it comes
    timetable: bool = True
    max_jump: int = 3  # stages a path may jump past the highest it visited (ICLR code 3, arXiv 4; 0: no cap)
    full_pass_every: int = 10  # every Nth step runs every microbatch through every stage (0: never)


@dataclass(frozen=True)
class PipelineDefenseConfig:
    """Defenses of a pipeline run against hostile stage replicas (docs/security.md), on by default.

    The robust outer step (shoal.train.robust): a NoLoCo partner whose pseudo-gradient norm, or whose fast
    weights' distance to ours, is beyond `outer_tolerance` times the median this replica has seen over its
    last `outer_window` outer steps is refused (a local step instead); a DiLoCo mean that far from our own
    pseudo-gradient is clipped toward it (CenteredClip). Audits (shoal.train.audit): at each step a data
    node, with probability `audit_rate`, sends one microbatch's activation to two replicas of a stage and
    compares their outputs against the spread it has seen between replicas (`audit_tolerance` times its
    median, never below `audit_min_spread`); a disagreement is settled by a third replica when the stage has
    one. Step audits replay a replica's inner step (`step_audit_rate`). Blamed in `audit_failures` of the
    last `audit_memory` audits it took part in, a replica is excluded from that data node's routes and
    listed, with the reason, in its record and in `shoal status`."""

    robust_outer: bool = True
    outer_tolerance: float = 3.0
    outer_window: int = 8
    audit_rate: float = 0.1  # per data-node step; 0: no audits
    audit_tolerance: float = 2.5
    audit_min_spread: float = 0.5  # output distance / update size an audit always lets pass
    audit_window: int = 32  # passed audits per stage the median spread is taken over
    audit_failures: int = 2  # blamed audits, among a replica's last `audit_memory`, that exclude it
    audit_memory: int = 3
    # Step audits (shoal.train.step_audit): at each step a data node, with this probability, replays one
    # inner step of one replica that served it and excludes the replica if its weights moved other than
    # its gradients say. Every worker then keeps its last steps' transcripts (θ and AdamW's moments
    # before the step, each microbatch's input and output gradient): 3 x its stage's weights in memory
    step_audit_rate: float = 0.1


GRPO_LAYOUTS = ("horizontal", "vertical")
GRPO_MODES = ("alone", "naive", "tis", "ftis")
GRPO_JUDGES = ("claims", "policy", "none")  # shoal.grpo.defenses.make_judge


@dataclass(frozen=True)
class GRPORunConfig:
    """A GRPO run (DESIGN §6): what every rollout worker must agree on so that all derive the same
    prompts and accept each other's bundles. The policy (width, depth, warm-up) is each node's own
    choice, declared in its record as a model id."""

    task: str = "add2r"
    seed: int = 0  # with the round (and, vertical, the peer id) it seeds every prompt
    layout: str = "horizontal"  # horizontal: all nodes share the round's prompts; vertical: each its own
    prompts_per_round: int = 16  # B
    group_size: int = 4  # completions a node samples per prompt (its share of a horizontal group)
    lr: float = 1e-3
    mode: str = "ftis"  # how foreign completions count: alone, naive, tis or ftis (shoal.grpo.loss)
    is_cap: float = 2.0  # C: truncation of foreign importance weights
    kl_threshold: float = 0.5  # δ (nats): F-TIS drops far-off negative foreign samples
    round_deadline_s: float = 5.0  # how long a node waits for peers' bundles after sending its own
    max_peers: int = 4  # k: a node sends its bundle to at most this many live rollout peers
    rounds: int = 30
    eval_every: int = 5  # rounds between held-out accuracy evaluations
    eval_prompts: int = 128
    # defenses against poisoned rollouts (shoal.grpo.defenses, docs/security.md); off only in experiments
    defenses: bool = True
    sample_top_k: int = 4  # k_g: honest nodes sample from their top k tokens, so peers can check them
    top_k: int = 6  # k_v: a same-policy peer's tokens must all be in this node's top k; 0: no top-k check
    judge: str = "claims"  # who reads full-reward foreign workings: claims (arithmetic), policy (imported), none
    length_rule: bool = True  # a completion over (1 + length_excess) x its reference length earns nothing
    length_excess: float = 0.25
    length_memory: int = 256  # own rewarded right answers per prompt length the reference remembers; 0: group only
    max_strikes: int = 0  # failing bundles in a row before their sender is dropped; 0: never (see docs/security.md)
    # `[grpo.policy] from = "DIR"`: the Hugging Face checkpoint rollout workers post-train, by digest
    # (shoal.model.checkpoint). Its tokenizer is the run's: every bundle is in it. A node may start
    # from another checkpoint with the same tokenizer (its own policy, as width and depth are).
    policy_checkpoint: str = ""
    policy_tokenizer: str = ""
    # an imported policy trains only its last this many blocks and final norm (0: every parameter)
    train_last: int = 0
