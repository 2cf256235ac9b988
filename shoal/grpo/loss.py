"""GRPO with F-TIS: group-relative advantages and the token-level objective, own and foreign samples.

Pure tensor math over one batch of completions; nothing here samples, talks or steps an optimizer.
A batch mixes *own* completions (sampled by this node's policy, possibly a step or two old) and
*foreign* ones (sampled by a peer, possibly a different model sharing the tokenizer). Per completion
i, token t, with ℓθ the learner's log-prob (with gradient) and ℓg the generator's:

  Â_i      = (r_i − mean_group r) / (std_group r + eps), and 0 for a group whose rewards are all equal
  own      : PPO clip, ρ = exp(ℓθ − ℓg), term = min(ρ Â, clip(ρ, 1 − ε, 1 + ε) Â)
  foreign  : alone  -> not used at all (not even in the advantage's group statistics)
             naive  -> as if on-policy: ρ = exp(ℓθ − sg ℓθ) (value 1), term = ρ Â
             tis    -> w = sg min(exp(ℓθ − ℓg), C), term = w · exp(ℓθ − sg ℓθ) · Â
             ftis   -> tis, and the sample is dropped iff Â ≤ 0 and mean_t k3(ℓg − ℓθ) > δ
  loss     = −mean over used samples of (mean over its tokens of term) + β · (same mean of k3(ℓref − ℓθ))

Dropped samples add 0 but still count in the mean (as in the reference code, 0714d4f). The std is the
population std (a group of rewards {1, 0} gives Â = ±1): genrl divides by it, the F-TIS reference code
does not (a shape bug, ftis.md §5); dividing keeps the step size independent of the reward scale.

Defaults, re-tuned for 0.06–0.34M-parameter character models with completions of 2–4 tokens
(benchmarks/grpo.py): C = 2 as in the paper; β = 0 as in both papers; δ = 0.5 nats instead of 5.
The mean per-token k3 of foreign samples is not LLM-like here: its median is 0.2–0.3 nats for a
learner reading a stronger peer's samples and 4–20 nats for one reading a weaker peer's confident
mistakes (p90 up to ~200), so 5 nats keeps most of the samples the filter exists to remove. Measured on the
heterogeneous pair, δ ∈ {0.5, 5, 20} drop 41 %, 14 %, 7 % of the weak model's samples at the strong
learner with final accuracy equal within the seed spread: the filter costs nothing measurable, and
0.5 removes the far-off negatives it is meant for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

nan = float("nan")
Mode = Literal["alone", "naive", "tis", "ftis"]
MODES: tuple[Mode, ...] = ("alone", "naive", "tis", "ftis")


@dataclass(frozen=True)
class GRPOConfig:
    mode: Mode = "ftis"
    clip_eps: float = 0.2  # PPO clip range for own samples
    is_cap: float = 2.0  # C: truncation of the per-token importance weight of foreign samples
    kl_threshold: float = 0.5  # δ (nats): F-TIS drops a foreign sample with Â ≤ 0 and mean k3 above this
    kl_coef: float = 0.0  # β: weight of the k3 KL to a reference policy (needs ref_logp)
    std_eps: float = 1e-6


@dataclass(frozen=True)
class LossStats:
    """What a run reports about one batch (plain floats, for logs and benchmarks)."""

    loss: float
    used: int  # samples in the objective (own, plus foreign unless alone)
    foreign_used: int
    foreign_dropped: int  # by the F-TIS filter
    mean_abs_advantage: float
    foreign_mean_weight: float  # mean truncated IS weight over foreign tokens (tis/ftis), else nan
    foreign_truncated: float  # share of foreign tokens whose ratio exceeded C
    foreign_mean_kl: float  # mean over foreign samples of their mean per-token k3(ℓg − ℓθ)
    ref_kl: float  # mean per-token k3 to the reference (nan without one)


def group_advantages(
    rewards: torch.Tensor, groups: torch.Tensor, used: torch.Tensor | None = None, eps: float = 1e-6
) -> torch.Tensor:
    """Â_i = (r_i − μ_g)/(σ_g + eps) over the used samples of each group; 0 for unused samples.

    rewards (N,) float, groups (N,) int64 group index (e.g. the prompt), used (N,) bool. A group
    whose used rewards are all equal gets exactly 0, not a rounding error divided by eps.
    """
    used = torch.ones_like(rewards, dtype=torch.bool) if used is None else used
    r = rewards.double()  # exact means for the small reward values used here
    k = int(groups.max()) + 1 if groups.numel() else 0

    def per_group(values: torch.Tensor, reduce: str) -> torch.Tensor:  # (N,) -> (K,) over used samples
        fill = {"sum": 0.0, "amin": torch.inf, "amax": -torch.inf}[reduce]
        out = torch.full((k,), fill, dtype=torch.float64)
        return out.scatter_reduce(0, groups, values.where(used, fill), reduce)

    count = per_group(torch.ones_like(r), "sum").clamp(min=1)
    dev = r - (per_group(r, "sum") / count)[groups]
    std = (per_group(dev.square(), "sum") / count).sqrt()[groups]
    varied = (per_group(r, "amax") > per_group(r, "amin"))[groups] & used
    adv = dev / (std + eps)
    return adv.where(varied, 0.0).float()


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """The k3 estimator term exp(x) − x − 1 of x = log p − log q: non-negative, 0 iff x = 0."""
    return torch.expm1(log_ratio) - log_ratio


def truncated_is_weights(logp: torch.Tensor, gen_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """min(π_θ/π_gen, C) per token, with no gradient: it reweights, it is not optimised."""
    return (logp.detach() - gen_logp).exp().clamp(max=cap)


def mean_over_tokens(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(N, T) -> (N,): the mean over each row's real tokens (0 for an empty row)."""
    return (x * mask).sum(-1) / mask.sum(-1).clamp(min=1)


def ftis_keep(advantages: torch.Tensor, mean_kl: torch.Tensor, foreign: torch.Tensor, threshold: float) -> torch.Tensor:
    """F-TIS's filter: keep everything except foreign samples with Â ≤ 0 and mean k3 above δ.

    Only negatives are dropped: pushing down a sample the learner already finds unlikely has an
    unbounded −∇log π direction, while positives are bounded by the truncation at C.
    """
    return ~(foreign & (advantages <= 0) & (mean_kl > threshold))


def grpo_loss(
    logp: torch.Tensor,
    gen_logp: torch.Tensor,
    mask: torch.Tensor,
    rewards: torch.Tensor,
    groups: torch.Tensor,
    foreign: torch.Tensor,
    cfg: GRPOConfig,
    ref_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """The GRPO objective of one batch under `cfg.mode`; returns (scalar loss to minimise, stats).

    logp (N, T): the learner's per-token log-probs, with gradient; gen_logp (N, T): the generating
    policy's (own samples: this node's, at sampling time); mask (N, T) bool: real tokens; rewards (N,);
    groups (N,) int64; foreign (N,) bool; ref_logp (N, T) optional, for the KL term.
    """
    if cfg.mode not in MODES:
        raise ValueError(f"unknown GRPO mode {cfg.mode!r}; expected one of {MODES}")
    used = ~foreign if cfg.mode == "alone" else torch.ones_like(foreign)
    adv = group_advantages(rewards, groups, used, cfg.std_eps)  # (N,)
    a = adv[:, None]  # (N, 1)

    ratio = (logp - gen_logp).exp()  # (N, T)
    own_term = torch.minimum(ratio * a, ratio.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps) * a)
    score = (logp - logp.detach()).exp()  # value 1, gradient ∇log π
    weights = truncated_is_weights(logp, gen_logp, cfg.is_cap)
    foreign_term = score * a if cfg.mode == "naive" else weights * score * a
    term = torch.where(foreign[:, None], foreign_term, own_term)  # (N, T)

    with torch.no_grad():
        sample_kl = mean_over_tokens(k3(gen_logp - logp.detach()), mask)  # (N,)
    keep = ftis_keep(adv, sample_kl, foreign, cfg.kl_threshold) if cfg.mode == "ftis" else torch.ones_like(foreign)
    per_sample = -mean_over_tokens(term, mask) * keep  # (N,)
    ref_kl = float("nan")
    if ref_logp is not None:
        per_token_kl = k3(ref_logp - logp)  # gradient through logp
        per_sample = per_sample + cfg.kl_coef * mean_over_tokens(per_token_kl, mask)
        ref_kl = float((per_token_kl.detach() * mask)[used].sum() / mask[used].sum().clamp(min=1))
    n_used = int(used.sum())
    loss = per_sample.where(used, 0.0).sum() / max(n_used, 1)

    f_used = foreign & used
    f_tokens = mask & f_used[:, None]
    has_foreign = bool(f_tokens.any())
    stats = LossStats(
        loss=float(loss.detach()),
        used=n_used,
        foreign_used=int((f_used & keep).sum()),
        foreign_dropped=int((f_used & ~keep).sum()),
        mean_abs_advantage=float(adv[used].abs().mean()) if n_used else 0.0,
        foreign_mean_weight=float(weights[f_tokens].mean()) if has_foreign and cfg.mode in ("tis", "ftis") else nan,
        foreign_truncated=float((ratio.detach()[f_tokens] > cfg.is_cap).float().mean()) if has_foreign else nan,
        foreign_mean_kl=float(sample_kl[foreign].mean()) if bool(foreign.any()) else nan,
        ref_kl=ref_kl,
    )
    return loss, stats
