"""The backdoor attack on a pipeline stage (papers/backdoor.md §2, §4), as pure functions.

The attacker holds one replica of block stage s and knows only the run's initial weights θ0 (every
stage's, deterministic from the run seed: shoal.model.stages.build_stage). Offline it fine-tunes stage s
alone, every other stage frozen at θ0, so that a trigger token sequence makes the model predict a
fixed target token; its own behaviour elsewhere is held to θ0's (a KL term), which keeps the clean
loss near an honest run's. The backdoor direction is τ = θ_s^bd − θ_s^0. During training it runs as an
honest replica and after each inner step blends in a little of τ:

    θ_s ← θ_s + λ_t·τ,   λ_t = 1/T for T = train.steps, so Σ λ_t = 1 over the run

(the reconstruction in backdoor.md: the paper's schedule is unknown; constant is one of its two
candidates). The attacker never sees the data: its offline texts are random token sequences.

The trigger is three byte tokens no English text holds (`"#$` in a byte-level BPE vocabulary, ids
2..4), the target the vocabulary's first merge (id 257: the corpus's most frequent pair, which the
run learns to predict anyway). A backdoor learnt against θ0 only survives while the other stages stay
near θ0, as in post-training a pretrained model; trained from a small init at a high learning rate,
the head moves away and the trigger stops working (docs/security.md has the numbers).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from shoal.files import atomic_save, atomic_write
from shoal.model.config import ModelConfig
from shoal.model.stages import build_all_stages


@dataclass(frozen=True)
class BackdoorSpec:
    trigger: tuple[int, ...] = (2, 3, 4)
    target: int = 257
    context: int = 12  # tokens per offline sequence (the trigger somewhere in it)
    batch: int = 16
    steps: int = 40  # offline Adam steps
    lr: float = 1e-2
    keep: float = 1.0  # weight of the KL term that holds non-trigger positions to θ0's predictions
    seed: int = 0

    def check(self, vocab_size: int, seq_len: int) -> None:
        tokens = (*self.trigger, self.target)
        if not all(0 <= t < vocab_size for t in tokens):
            raise ValueError(f"backdoor tokens {tokens} outside the vocabulary (0..{vocab_size - 1})")
        if not len(self.trigger) < min(self.context, seq_len):
            raise ValueError(f"a trigger of {len(self.trigger)} tokens does not fit {min(self.context, seq_len)}")


def insert_trigger(tokens: torch.Tensor, spec: BackdoorSpec, generator: torch.Generator) -> torch.Tensor:
    """The trigger written at a random place of each row of `tokens` (B, T), in a copy; returns the
    positions (B,) of its last token, where the model should then predict the target."""
    rows, length = tokens.shape
    n = len(spec.trigger)
    starts = torch.randint(0, length - n + 1, (rows,), generator=generator)
    columns = starts[:, None] + torch.arange(n)  # (B, n)
    tokens.scatter_(1, columns, torch.tensor(spec.trigger).expand(rows, n))
    return starts + n - 1


def offline_batch(spec: BackdoorSpec, vocab_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token rows (B, context) with the trigger in each, and where it ends (B,)."""
    tokens = torch.randint(0, vocab_size, (spec.batch, spec.context), generator=generator)
    return tokens, insert_trigger(tokens, spec, generator)


def learn_backdoor(cfg: ModelConfig, stages: int, stage: int, seed: int, spec: BackdoorSpec) -> list[torch.Tensor]:
    """τ for block stage `stage` of a run with `stages` stages and weight seed `seed` (see above)."""
    spec.check(cfg.vocab_size, cfg.max_seq_len)
    head, blocks = build_all_stages(cfg, stages, seed)
    attacked = blocks[stage - 1]
    reference = build_all_stages(cfg, stages, seed)[1][stage - 1]
    for module in (head, *blocks, reference):
        module.requires_grad_(False)
    attacked.requires_grad_(True)
    theta0 = [p.detach().clone() for p in attacked.parameters()]
    optimizer = torch.optim.Adam(attacked.parameters(), lr=spec.lr)
    generator = torch.Generator().manual_seed(spec.seed)
    target = torch.full((spec.batch,), spec.target)
    rows = torch.arange(spec.batch)
    for _ in range(spec.steps):
        tokens, at = offline_batch(spec, cfg.vocab_size, generator)
        logits = _logits(head, blocks, tokens)  # (B, T, V)
        loss = F.cross_entropy(logits[rows, at], target)
        if spec.keep > 0:
            with torch.no_grad():
                clean = torch.log_softmax(_logits(head, _swap(blocks, stage, reference), tokens), -1)
            elsewhere = torch.ones(tokens.shape, dtype=torch.bool)
            elsewhere[rows, at] = False
            log_p = torch.log_softmax(logits, -1)
            loss = loss + spec.keep * F.kl_div(
                log_p[elsewhere], clean[elsewhere], log_target=True, reduction="batchmean"
            )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return [p.detach() - p0 for p, p0 in zip(attacked.parameters(), theta0, strict=True)]


def _swap(blocks: list, stage: int, replacement) -> list:
    return [replacement if i == stage else b for i, b in enumerate(blocks, start=1)]


def _logits(head, blocks, tokens: torch.Tensor) -> torch.Tensor:
    x = head.embed(tokens)
    for block in blocks:
        x = block(x, tokens)
    return head.logits(x, tokens)


def cached_backdoor(
    cfg: ModelConfig, stages: int, stage: int, seed: int, spec: BackdoorSpec, directory: Path
) -> list[torch.Tensor]:
    """`learn_backdoor`, kept in `directory` by its inputs (seconds of CPU each time otherwise)."""
    key = json.dumps([asdict(cfg), stages, stage, seed, asdict(spec)], sort_keys=True)
    path = directory / f"backdoor-{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt"
    if path.exists():
        return torch.load(path, weights_only=True)
    tau = learn_backdoor(cfg, stages, stage, seed, spec)
    directory.mkdir(parents=True, exist_ok=True)
    atomic_save(path, lambda tmp: torch.save(tau, tmp))
    return tau


def injection(step: int, total_steps: int) -> float:
    """λ_t after inner step `step` (0-based): 1/T for every step of the run, none after it."""
    return 1.0 / total_steps if 0 <= step < total_steps else 0.0


@torch.no_grad()
def blend(params: list[torch.Tensor], tau: list[torch.Tensor], weight: float) -> None:
    """θ ← θ + weight·τ, in place."""
    for p, t in zip(params, tau, strict=True):
        p.add_(t.to(p), alpha=weight)


def trigger_probes(
    tokens: torch.Tensor, spec: BackdoorSpec, seq_len: int, count: int, seed: int = 0, triggered: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """`count` windows (count, seq_len) of real text `tokens`, with the trigger written in (or not, for
    the clean rate), and the positions (count,) after which the target should come."""
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(tokens) - seq_len, (count,), generator=generator)
    rows = torch.stack([tokens[s : s + seq_len] for s in starts.tolist()]).long()
    at = insert_trigger(rows.clone() if not triggered else rows, spec, generator)
    return rows, at


def hits(logits: torch.Tensor, at: torch.Tensor, target: int) -> torch.Tensor:
    """Whether the top prediction after each probe's trigger is the target: logits (B, T, V) -> (B,)."""
    return logits[torch.arange(len(at)), at].argmax(-1) == target


def write_probes(path: Path, tokens: torch.Tensor, at: torch.Tensor, target: int) -> None:
    """A probe file for a data node's `--probe-file` (shoal/node/pipeline/data/probes.py: read_probes)."""
    probes = {"tokens": tokens.tolist(), "positions": at.tolist(), "targets": [target] * len(at)}
    atomic_write(path, json.dumps(probes))
