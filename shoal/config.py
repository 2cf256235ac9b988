"""RunConfig: what the swarm trains, loaded from TOML and validated field by field.

A run config is shared by every peer of a swarm, so it is strict: unknown keys, wrong types and
inconsistent values are refused with a `ConfigError` that names the field. Its hash is the run id.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import tomllib
from dataclasses import dataclass, field
from typing import Any

from shoal.model.config import ModelConfig
from shoal.protocol.errors import MalformedMessage
from shoal.protocol.pipeline import MAX_TOKEN_BYTES, token_id_bytes
from shoal.protocol.schema import load_document
from shoal.run_sections import (
    AVERAGING_MODES,
    GRPO_JUDGES,
    GRPO_LAYOUTS,
    GRPO_MODES,
    REPAIR_RULES,
    STAGE0_AVERAGING,
    AveragingConfig,
    DataConfig,
    GRPORunConfig,
    OptimConfig,
    PipelineConfig,
    PipelineDefenseConfig,
    RepairConfig,
    SkipPipeConfig,
    TrainConfig,
)

WIRE_DTYPES = ("float32", "bfloat16", "float16", "int8")  # int8: a scale per row, then int8 rows (protocol/tensors.py)
OUTER_CODECS = ("float32", "int8", "topk")  # averaging.codec (shoal/train/outer_codec.py)
DEFAULT_MODEL = ModelConfig()
# ModelConfig fields an imported checkpoint brought in; left out of the run id at their defaults
IMPORTED_MODEL_FIELDS = ("n_kv_heads", "qkv_bias", "tie_embeddings", "checkpoint", "tokenizer", "subspace_rank")
SET_WITH_FROM = ("max_seq_len",)  # the one model field a run config may give beside `from`
DIGEST = re.compile(r"[0-9a-f]{64}")


class ConfigError(ValueError):
    """A run or node config that cannot be used; `str()` is one line naming the field."""

    def __init__(self, field_name: str, message: str):
        self.field = field_name
        super().__init__(f"{field_name}: {message}" if field_name else message)


@dataclass(frozen=True)
class RunConfig:
    name: str = "tiny"
    model: ModelConfig = field(default_factory=ModelConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    averaging: AveragingConfig = field(default_factory=AveragingConfig)
    repair: RepairConfig = field(default_factory=RepairConfig)
    defense: PipelineDefenseConfig = field(default_factory=PipelineDefenseConfig)
    skippipe: SkipPipeConfig = field(default_factory=SkipPipeConfig)
    grpo: GRPORunConfig | None = None  # present only in GRPO runs (so pipeline run ids stay as they were)

    @property
    def mode(self) -> str:
        return "pipeline" if self.grpo is None else "grpo"

    @property
    def microbatches_per_step(self) -> int:
        return self.train.batch_size // self.train.microbatch_size

    @property
    def run_id(self) -> str:
        """Content hash of the config: peers with the same run id train the same thing. A `defense`
        section at its defaults is left out of the hash, so run ids stay as they were before it, and
        so is train.eval_every: how often a data node evaluates changes nothing that is trained."""
        data = self.to_dict()
        if self.defense == PipelineDefenseConfig():
            del data["defense"]
        if self.skippipe == SkipPipeConfig():  # at its defaults: the run ids from before it existed
            del data["skippipe"]
        del data["train"]["eval_every"]
        if self.pipeline.compute_dtype == "auto":  # each node's own device decides: as before it existed
            del data["pipeline"]["compute_dtype"]
        for key in ("codec", "topk_fraction"):  # at their defaults: the run ids from before they existed
            if data["averaging"][key] == getattr(AveragingConfig(), key):
                del data["averaging"][key]
        for key in IMPORTED_MODEL_FIELDS:  # at their defaults: the run ids from before they existed
            if data["model"][key] == getattr(DEFAULT_MODEL, key):
                del data["model"][key]
        for key in ("text_field", "digest"):
            if data["data"][key] == getattr(DataConfig(), key):
                del data["data"][key]
        if self.data.digest:  # the content names the data; the path is one machine's
            del data["data"]["path"]
        for key in ("policy_checkpoint", "policy_tokenizer"):
            if "grpo" in data and not data["grpo"][key]:
                del data["grpo"][key]
        return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        if data["grpo"] is None:
            del data["grpo"]
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def to_toml(self) -> str:
        lines = [f"name = {json.dumps(self.name)}"]
        for section, values in self.to_dict().items():
            if not isinstance(values, dict):
                continue
            lines.append(f"\n[{section}]")
            lines += [f"{key} = {json.dumps(value)}" for key, value in values.items()]
        return "\n".join(lines) + "\n"

    def replace(self, overrides: dict[str, Any]) -> RunConfig:
        """Return a validated copy with dotted-path overrides, e.g. {"train.steps": 20}."""
        data = self.to_dict()
        for dotted, value in overrides.items():
            *parents, leaf = dotted.split(".")
            node = data
            for part in parents:
                if not isinstance(node.get(part), dict):
                    raise ConfigError(dotted, "unknown field")
                node = node[part]
            if leaf not in node:
                raise ConfigError(dotted, "unknown field")
            node[leaf] = value
        return run_config_from_dict(data)


def _validate_grpo(g: GRPORunConfig) -> None:
    from shoal.grpo.tasks import TASKS

    def need(ok: bool, where: str, message: str) -> None:
        if not ok:
            raise ConfigError(f"grpo.{where}", message)

    need(g.task in TASKS, "task", f"must be one of {', '.join(sorted(TASKS))}, got {g.task!r}")
    need(
        not TASKS[g.task].chat or bool(g.policy_checkpoint),
        "task",
        f"{g.task!r} is a chat task: it needs an imported instruct policy ([grpo.policy] from = DIR or .gguf)",
    )
    need(0 <= g.train_last <= 10_000, "train_last", f"must be in 0..10000 (0: every parameter), got {g.train_last}")
    for where, digest in (("policy_checkpoint", g.policy_checkpoint), ("policy_tokenizer", g.policy_tokenizer)):
        need(not digest or DIGEST.fullmatch(digest) is not None, where, "must be a SHA-256 in hex, or empty")
    need(
        bool(g.policy_checkpoint) == bool(g.policy_tokenizer),
        "policy_tokenizer",
        "a policy checkpoint comes with its tokenizer: give both digests or neither",
    )
    need(g.seed >= 0, "seed", f"must be non-negative, got {g.seed}")
    need(g.layout in GRPO_LAYOUTS, "layout", f"must be one of {', '.join(GRPO_LAYOUTS)}, got {g.layout!r}")
    need(1 <= g.prompts_per_round <= 64, "prompts_per_round", f"must be in 1..64, got {g.prompts_per_round}")
    need(2 <= g.group_size <= 16, "group_size", f"must be in 2..16, got {g.group_size}")
    need(0.0 < g.lr <= 1.0, "lr", f"must be in (0, 1], got {g.lr}")
    need(g.mode in GRPO_MODES, "mode", f"must be one of {', '.join(GRPO_MODES)}, got {g.mode!r}")
    need(g.is_cap >= 1.0, "is_cap", f"must be at least 1, got {g.is_cap}")
    need(g.kl_threshold > 0.0, "kl_threshold", f"must be positive, got {g.kl_threshold}")
    need(0.1 <= g.round_deadline_s <= 600.0, "round_deadline_s", f"must be in [0.1, 600], got {g.round_deadline_s}")
    need(0 <= g.max_peers <= 64, "max_peers", f"must be in 0..64, got {g.max_peers}")
    need(g.rounds >= 1, "rounds", f"must be at least 1, got {g.rounds}")
    need(g.eval_every >= 1, "eval_every", f"must be at least 1, got {g.eval_every}")
    need(1 <= g.eval_prompts <= 4096, "eval_prompts", f"must be in 1..4096, got {g.eval_prompts}")
    need(0 <= g.sample_top_k <= 64, "sample_top_k", f"must be in 0..64 (0: no restriction), got {g.sample_top_k}")
    need(0 <= g.top_k <= 64, "top_k", f"must be in 0..64 (0: no top-k check), got {g.top_k}")
    need(
        g.sample_top_k == 0 or g.top_k == 0 or g.top_k >= g.sample_top_k,
        "top_k",
        f"must be at least sample_top_k ({g.sample_top_k}) or honest tokens get rejected, got {g.top_k}",
    )
    need(g.judge in GRPO_JUDGES, "judge", f"must be one of {', '.join(GRPO_JUDGES)}, got {g.judge!r}")
    need(
        g.judge != "policy" or bool(g.policy_checkpoint),
        "judge",
        "'policy' needs an imported instruct policy ([grpo.policy] from = DIR): a task's character policy cannot read",
    )
    need(0.0 <= g.length_excess <= 10.0, "length_excess", f"must be in [0, 10], got {g.length_excess}")
    need(0 <= g.length_memory <= 65536, "length_memory", f"must be in 0..65536, got {g.length_memory}")
    need(0 <= g.max_strikes <= 1000, "max_strikes", f"must be in 0..1000 (0: never drop), got {g.max_strikes}")


def _validate(cfg: RunConfig) -> None:
    from shoal.device import COMPUTE_DTYPES  # the device module owns them (torch is loaded to check a run)

    m, p, t, o, d = cfg.model, cfg.pipeline, cfg.train, cfg.optim, cfg.data

    def need(ok: bool, where: str, message: str) -> None:
        if not ok:
            raise ConfigError(where, message)

    need(bool(cfg.name.strip()), "name", "must not be empty")
    for where, value in [
        ("model.vocab_size", m.vocab_size),
        ("model.d_model", m.d_model),
        ("model.n_layers", m.n_layers),
        ("model.n_heads", m.n_heads),
        ("model.ffn_hidden", m.ffn_hidden),
        ("model.max_seq_len", m.max_seq_len),
        ("train.steps", t.steps),
        ("train.seq_len", t.seq_len),
        ("train.batch_size", t.batch_size),
        ("train.microbatch_size", t.microbatch_size),
        ("train.eval_batches", t.eval_batches),
    ]:
        need(value > 0, where, f"must be positive, got {value}")
    need(m.vocab_size >= 260, "model.vocab_size", f"must be at least 260 (256 bytes + specials), got {m.vocab_size}")
    need(m.d_model % m.n_heads == 0, "model.n_heads", f"must divide model.d_model ({m.d_model}), got {m.n_heads}")
    need(m.head_dim % 2 == 0, "model.n_heads", f"head dim d_model/n_heads must be even for rotary, got {m.head_dim}")
    need(m.rope_theta > 0, "model.rope_theta", "must be positive")
    need(m.norm_eps > 0, "model.norm_eps", "must be positive")
    need(m.init_std > 0, "model.init_std", "must be positive")
    need(
        m.n_kv_heads >= 0 and m.n_heads % m.kv_heads == 0,
        "model.n_kv_heads",
        f"must divide model.n_heads ({m.n_heads}), or be 0 for as many, got {m.n_kv_heads}",
    )
    for where, digest in (("model.checkpoint", m.checkpoint), ("model.tokenizer", m.tokenizer)):
        need(not digest or DIGEST.fullmatch(digest) is not None, where, "must be a SHA-256 in hex, or empty")
    need(
        bool(m.checkpoint) == bool(m.tokenizer),
        "model.tokenizer",
        "a run that starts from a checkpoint uses its tokenizer: give both digests or neither",
    )
    need(
        0 <= m.subspace_rank < m.d_model,
        "model.subspace_rank",
        f"must be 0 (off) or between 1 and model.d_model - 1 ({m.d_model - 1}), got {m.subspace_rank}",
    )
    need(
        not (m.subspace_rank and (m.checkpoint or m.tie_embeddings)),
        "model.subspace_rank",
        "needs its own embedding, not an imported checkpoint's or one tied to the LM head: leave it at 0",
    )
    need(
        not m.subspace_rank or t.microbatch_size * m.max_seq_len * token_id_bytes(m.vocab_size) <= MAX_TOKEN_BYTES,
        "train.microbatch_size",
        f"a Subspace Network's microbatch travels with its token ids, which must fit {MAX_TOKEN_BYTES} bytes",
    )
    need(p.stages >= 2, "pipeline.stages", f"needs stage 0 and at least one block stage, got {p.stages}")
    need(
        p.stages - 1 <= m.n_layers,
        "pipeline.stages",
        f"{p.stages - 1} block stages but only {m.n_layers} blocks (model.n_layers)",
    )
    need(p.wire_dtype in WIRE_DTYPES, "pipeline.wire_dtype", f"must be one of {', '.join(WIRE_DTYPES)}")
    need(p.compute_dtype in COMPUTE_DTYPES, "pipeline.compute_dtype", f"must be one of {', '.join(COMPUTE_DTYPES)}")
    need(t.seq_len <= m.max_seq_len, "train.seq_len", f"exceeds model.max_seq_len ({m.max_seq_len})")
    need(
        t.batch_size % t.microbatch_size == 0,
        "train.microbatch_size",
        f"must divide train.batch_size ({t.batch_size}), got {t.microbatch_size}",
    )
    need(t.seed >= 0, "train.seed", "must be non-negative")
    need(t.eval_every >= 0, "train.eval_every", f"must be zero (only at the end) or positive, got {t.eval_every}")
    need(o.lr > 0, "optim.lr", f"must be positive, got {o.lr}")
    need(0.0 <= o.min_lr_ratio <= 1.0, "optim.min_lr_ratio", "must be in [0, 1]")
    need(o.warmup_steps >= 0, "optim.warmup_steps", "must be non-negative")
    need(o.weight_decay >= 0, "optim.weight_decay", "must be non-negative")
    need(0.0 <= o.beta1 < 1.0, "optim.beta1", "must be in [0, 1)")
    need(0.0 <= o.beta2 < 1.0, "optim.beta2", "must be in [0, 1)")
    need(o.grad_clip > 0, "optim.grad_clip", "must be positive")
    need(0.0 < d.val_fraction < 0.5, "data.val_fraction", "must be in (0, 0.5)")
    need(bool(d.text_field.strip()), "data.text_field", "must name a field")
    need(not d.digest or DIGEST.fullmatch(d.digest) is not None, "data.digest", "must be a SHA-256 in hex, or empty")
    a = cfg.averaging
    need(a.mode in AVERAGING_MODES, "averaging.mode", f"must be one of {', '.join(AVERAGING_MODES)}, got {a.mode!r}")
    need(a.inner_steps >= 1, "averaging.inner_steps", f"must be at least 1, got {a.inner_steps}")
    need(0.0 <= a.alpha < 1.0, "averaging.alpha", f"must be in [0, 1), got {a.alpha}")
    need(0.0 < a.beta <= 1.0, "averaging.beta", f"must be in (0, 1], got {a.beta}")
    need(0.0 <= a.gamma <= 2.0, "averaging.gamma", f"must be in [0, 2], got {a.gamma}")
    need(a.group_size == 2, "averaging.group_size", f"only pairs (2) are implemented, got {a.group_size}")
    need(a.exchange_timeout_s > 0, "averaging.exchange_timeout_s", "must be positive")
    need(a.codec in OUTER_CODECS, "averaging.codec", f"must be one of {', '.join(OUTER_CODECS)}, got {a.codec!r}")
    need(a.codec != "topk" or a.mode == "noloco", "averaging.codec",
         f"topk needs averaging.mode noloco (an all-reduce sums dense tensors), got mode {a.mode!r}")  # fmt: skip
    need(0.0 < a.topk_fraction <= 1.0, "averaging.topk_fraction", f"must be in (0, 1], got {a.topk_fraction}")
    need(a.stage0 in STAGE0_AVERAGING, "averaging.stage0",
         f"must be one of {', '.join(STAGE0_AVERAGING)}, got {a.stage0!r}")  # fmt: skip
    need(a.stage0_every >= 1, "averaging.stage0_every", f"must be at least 1, got {a.stage0_every}")
    need(a.stage0_resync_every >= 1, "averaging.stage0_resync_every",
         f"must be at least 1, got {a.stage0_resync_every}")  # fmt: skip
    r = cfg.repair
    need(r.rule in REPAIR_RULES, "repair.rule", f"must be one of {', '.join(REPAIR_RULES)}, got {r.rule!r}")
    need(
        r.swap_share <= 1.0, "repair.swap_share", f"must be at most 1 (or negative for the default), got {r.swap_share}"
    )
    need(r.lr_scale > 0, "repair.lr_scale", f"must be positive, got {r.lr_scale}")
    need(1 <= r.edge_copy_every <= 100_000, "repair.edge_copy_every", f"must be in 1..100000, got {r.edge_copy_every}")
    need(0 <= r.backup_every <= 100_000, "repair.backup_every", f"must be in 0..100000, got {r.backup_every}")
    need(
        r.weights_from in ("unclipped", "clipped"),
        "repair.weights_from",
        f"must be unclipped or clipped, got {r.weights_from!r}",
    )
    _validate_defense(cfg.defense)
    k = cfg.skippipe
    need(0 <= k.max_jump <= 1000, "skippipe.max_jump", f"must be in 0..1000 (0: no cap), got {k.max_jump}")
    need(
        0 <= k.full_pass_every <= 1_000_000,
        "skippipe.full_pass_every",
        f"must be in 0..1000000 (0: never), got {k.full_pass_every}",
    )
    if cfg.grpo is not None:
        _validate_grpo(cfg.grpo)


def _validate_defense(f: PipelineDefenseConfig) -> None:
    def need(ok: bool, where: str, message: str) -> None:
        if not ok:
            raise ConfigError(f"defense.{where}", message)

    need(1.0 < f.outer_tolerance <= 1000.0, "outer_tolerance", f"must be in (1, 1000], got {f.outer_tolerance}")
    need(1 <= f.outer_window <= 1000, "outer_window", f"must be in 1..1000, got {f.outer_window}")
    need(0.0 <= f.audit_rate <= 1.0, "audit_rate", f"must be in [0, 1], got {f.audit_rate}")
    need(0.0 <= f.step_audit_rate <= 1.0, "step_audit_rate", f"must be in [0, 1], got {f.step_audit_rate}")
    need(1.0 < f.audit_tolerance <= 1000.0, "audit_tolerance", f"must be in (1, 1000], got {f.audit_tolerance}")
    need(0.0 < f.audit_min_spread <= 100.0, "audit_min_spread", f"must be in (0, 100], got {f.audit_min_spread}")
    need(1 <= f.audit_window <= 10_000, "audit_window", f"must be in 1..10000, got {f.audit_window}")
    need(1 <= f.audit_failures <= 1000, "audit_failures", f"must be in 1..1000, got {f.audit_failures}")
    need(
        f.audit_failures <= f.audit_memory <= 1000,
        "audit_memory",
        f"must be in audit_failures..1000, got {f.audit_memory}",
    )


def run_config_from_dict(data: dict[str, Any]) -> RunConfig:
    """The run config a decoded TOML table describes: its shape and types checked by the schema
    (protocol/schema.py: unknown keys and wrong types refused, ints widened to floats), then the
    bounds and the relations between fields by `_validate`."""
    try:
        cfg = load_document(RunConfig, data)
    except MalformedMessage as e:
        raise ConfigError(e.field, e.reason) from None
    _validate(cfg)
    return cfg


def parse_run_config(text: str, source: str = "run config") -> RunConfig:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError("", f"{source}: not valid TOML ({e})") from None
    return run_config_from_dict(data)
