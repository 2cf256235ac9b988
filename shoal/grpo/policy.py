"""A whole policy: the project's LLaMA-style decoder over a task's character tokenizer, or a
Hugging Face checkpoint over its own tokenizer.

A spec is everything that makes one policy differ from another; its `model_id` is the stable string
a node declares in its record and stamps on its bundles. `PolicySpec` builds a small decoder (width,
depth, seed, warm-up) whose weights are seeded from the spec, so two nodes with the same spec start
bit-identical; `CheckpointPolicySpec` starts from a checkpoint's weights, named by their digest. In
both, "same model id" means "same starting policy".
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from shoal.device import autocast
from shoal.grpo.tasks import get_task
from shoal.grpo.tokenizer import CharTokenizer, ChatFormat, CheckpointTokenizer, PolicyTokenizer
from shoal.model.config import ModelConfig
from shoal.model.llama import DECODER_LAYOUT, BlockStage, HeadStage, KVCache

if TYPE_CHECKING:
    from shoal.model.checkpoint import Checkpoint


@dataclass(frozen=True)
class PolicySpec:
    task: str = "add2r"
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    seed: int = 0
    warmup_steps: int = 400  # supervised steps on demonstrations before any GRPO
    warmup_batch: int = 64
    warmup_lr: float = 3e-3
    max_seq_len: int = 24  # prompt + completion
    checkpoint: ClassVar[None] = None
    train_last: ClassVar[int] = 0  # a small policy trains whole

    @property
    def model_id(self) -> str:
        """Readable prefix plus a digest of every field and of the decoder's layout: equal ids mean equal
        starting weights (a warm-up cached under another layout is another model)."""
        fields = {**dataclasses.asdict(self), "layout": DECODER_LAYOUT}
        digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:10]
        return f"{self.task}-d{self.d_model}l{self.n_layers}-w{self.warmup_steps}-s{self.seed}-{digest}"

    def tokenizer(self) -> CharTokenizer:
        return CharTokenizer(get_task(self.task).alphabet)

    def model_config(self) -> ModelConfig:
        ffn = 32 * round(8 * self.d_model / 3 / 32)  # SwiGLU width ~8/3 d, a multiple of 32
        return ModelConfig(
            vocab_size=self.tokenizer().vocab_size,
            d_model=self.d_model,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            ffn_hidden=ffn,
            max_seq_len=self.max_seq_len,
        )


@dataclass(frozen=True)
class CheckpointPolicySpec:
    """A policy that starts from a Hugging Face checkpoint (shoal.model.checkpoint has read and
    checked it): its architecture and weights, its tokenizer, then the same warm-up as `PolicySpec`."""

    task: str
    checkpoint: Checkpoint = dataclasses.field(compare=False)
    seed: int = 0
    warmup_steps: int = 400
    warmup_batch: int = 64
    warmup_lr: float = 3e-3
    # train only the last this many blocks and the final norm (0: every parameter): on a CPU a
    # 135M-parameter policy's full backward is most of a round, and the last blocks move its answers most
    train_last: int = 0

    @property
    def model_id(self) -> str:
        m = self.checkpoint.model
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "checkpoint"}
        fields.update(weights=m.checkpoint, tokenizer=m.tokenizer, max_seq_len=m.max_seq_len, layout=DECODER_LAYOUT)
        digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:10]
        return f"{self.task}-hf{m.checkpoint[:8]}-w{self.warmup_steps}-s{self.seed}-{digest}"

    def tokenizer(self) -> CheckpointTokenizer:
        m = self.checkpoint.model
        chat = ChatFormat.of_checkpoint(self.checkpoint.path) if get_task(self.task).chat else None
        return CheckpointTokenizer(self.checkpoint.tokenizer_file, m.vocab_size, m.tokenizer, chat)

    def model_config(self) -> ModelConfig:
        return self.checkpoint.model


def check_policy_checkpoint(spec: CheckpointPolicySpec) -> None:
    """Refuse (ValueError, one line) a checkpoint whose tokenizer cannot write the task's text."""
    task = get_task(spec.task)
    tokenizer = spec.tokenizer()
    prompt = task.prompt(0, 0, 0).text
    tokenizer.check_round_trip([prompt, task.demonstration(prompt), task.alphabet])
    longest = rollout_seq_len(spec)
    if longest > spec.model_config().max_seq_len:
        raise ValueError(f"a prompt and its completion take {longest} positions, over the model's max_seq_len")


def rollout_seq_len(spec: PolicySpec | CheckpointPolicySpec, sample: int = 32) -> int:
    """The positions a prompt and its completion take, at the longest of `sample` of the task's prompts
    (a chat template included): what a round's memory is planned for, not the model's whole context."""
    task, tokenizer = get_task(spec.task), spec.tokenizer()
    prompts = [task.prompt(0, 0, i).text for i in range(sample)]
    return max(len(tokenizer.encode_prompt(p)) for p in prompts) + task.max_new_tokens


class Policy(nn.Module):
    """Token ids (B, T) -> logits (B, T, V), with padding never predicted where it is no token."""

    def __init__(self, spec: PolicySpec | CheckpointPolicySpec):
        super().__init__()
        self.spec = spec
        cfg = spec.model_config()
        self.head = HeadStage(cfg, spec.seed)
        self.body = BlockStage(cfg, range(cfg.n_layers), spec.seed)
        if spec.checkpoint is not None:
            from shoal.model.hf import load_stage_weights

            load_stage_weights(self.head, cfg, spec.checkpoint)
            load_stage_weights(self.body, cfg, spec.checkpoint)
        if spec.train_last:
            kept = max(0, cfg.n_layers - spec.train_last)
            frozen = [self.head.embedding, self.head.lm_head, *self.body.blocks[:kept]]
            for module in frozen:
                module.requires_grad_(False)
        tokenizer: PolicyTokenizer = spec.tokenizer()
        self.pad_id = tokenizer.pad_id
        self._masked = torch.tensor([tokenizer.pad_id]) if tokenizer.masks_padding else None
        self.compute_dtype: torch.dtype | None = None  # autocast's dtype on the policy's device (shoal/device.py)

    @property
    def model_id(self) -> str:
        return self.spec.model_id

    def new_cache(self) -> KVCache:
        return KVCache(len(self.body.blocks))

    def place(self, device: torch.device, compute_dtype: torch.dtype | None) -> Policy:
        """Compute on `device`, in `compute_dtype` autocast there (None: float32)."""
        self.compute_dtype = compute_dtype
        return self.to(device)

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """Logits (float32) where `tokens` are: the decoder runs on the policy's device, and the GRPO
        math over its log-probs (sampling, advantages, the loss, the defenses) stays in host memory,
        where it is a small share of the work and runs the same on every node. With `cache` (sampling),
        `tokens` are the positions after the cached ones, and are cached in turn."""
        return self.logits_at(tokens, None, cache)

    def logits_at(
        self, tokens: torch.Tensor, positions: torch.Tensor | None, cache: KVCache | None = None
    ) -> torch.Tensor:
        """Logits at `positions` (B, P) of each row only (None: every position): the LM head and its
        (B, P, V) output cost only what is read, where a whole row's would be most of an update's memory."""
        device = self.head.embedding.weight.device
        with autocast(device, self.compute_dtype):
            hidden = self.body(self.head.embed(tokens.to(device)), cache=cache)  # (B, T, C)
            if positions is not None:
                hidden = hidden.gather(1, positions.to(device)[..., None].expand(-1, -1, hidden.size(-1)))
            logits = self.head.logits(hidden)  # (B, P, V)
        logits = logits.float().to(tokens.device)
        return logits if self._masked is None else logits.index_fill(-1, self._masked, float("-inf"))


def completion_logits(
    policy: Policy, prompts: list[list[int]], completions: list[list[int]]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The policy's logits at every completion position, teacher-forced, in one forward pass.

    Returns (logits (N, T, V), targets (N, T), mask (N, T)) with T the longest completion; positions
    past a completion's end hold padding targets and mask False. Gradients flow into the policy.
    """
    n, width = len(prompts), max((len(c) for c in completions), default=0)
    total = max(len(p) for p in prompts) + width  # so every position below stays inside
    seqs = torch.full((n, total), policy.pad_id, dtype=torch.long)
    targets = torch.full((n, width), policy.pad_id, dtype=torch.long)
    starts = torch.empty(n, dtype=torch.long)
    lengths = torch.tensor([len(c) for c in completions], dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        seqs[i, : len(p) + len(c)] = torch.tensor(p + c)
        targets[i, : len(c)] = torch.tensor(c, dtype=torch.long)
        starts[i] = len(p) - 1  # the position whose logits predict the first completion token
    positions = starts[:, None] + torch.arange(width)  # (N, T), always < total
    logits = policy.logits_at(seqs, positions)  # (N, T, V)
    return logits, targets, torch.arange(width)[None, :] < lengths[:, None]


def completion_logprobs(
    policy: Policy, prompts: list[list[int]], completions: list[list[int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs of each completion given its prompt, in one forward pass.

    Returns (logp, mask), both (N, T) with T the longest completion; positions past a completion's
    end have mask False and logp 0. Gradients flow into the policy.
    """
    logits, targets, mask = completion_logits(policy, prompts, completions)
    picked = targets.masked_fill(~mask, 1)  # a real token in both tokenizers: padding may have log-prob -inf
    logp = F.log_softmax(logits, dim=-1).gather(-1, picked[..., None]).squeeze(-1)  # (N, T)
    return logp.masked_fill(~mask, 0.0), mask
