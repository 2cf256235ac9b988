"""A compact LLaMA-style decoder, written as pipeline stages.

Stage 0 (`HeadStage`) owns the token embedding, the final RMSNorm, the LM head and the loss, so
a microbatch starts and ends on the peer that holds the data and the labels. Block stages
(`BlockStage`) each own a contiguous range of transformer blocks. `Llama` is the same network in
one module: the single-process reference that the stage split must reproduce.

Every weight is drawn from a generator seeded by (run seed, block index), so any replica of any
stage, on any machine, under any stage split, starts bit-identical without a download.

With `subspace_rank` k > 0 the network is a Subspace Network (Protocol Models, Ramasinghe et al. 2025):
the residual stream is x = anchor[token] + c·Uᵀ, where U (d × k, orthonormal) and the anchor embedding
(vocab × d) are fixed, drawn from the run seed, and never trained, and every block adds to the k
coefficients c only (its two output projections write k values, not d). So what crosses between
stages, forward and backward, is c and its gradient, exactly: k values a token where a full stream
is d, and the token ids, which rebuild the anchors. The trained embedding gives k coefficients a
token. Where this deviates from the paper:
- the paper keeps d-wide output projections and projects them onto U after each step; these are
  k-wide from the start (W = U·A, with AdamW on A): the same functions, another optimizer path;
- the paper's token embedding is static everywhere; here the blocks read the fixed anchors, but the
  head reads the final stream with an anchor embedding of its own that it trains (`HeadStage.anchor`,
  starting as the fixed one). It costs no bytes (stage 0 holds it) and on `tiny` it is what closes
  the loss gap: at 60 steps a static anchor at the head lost 3.7 % against the full-width model.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from shoal.model.config import ModelConfig
from shoal.model.split_backward import WeightGrads, input_grad_first, recording_linears

# Bumped when the same weights would compute another function (2: Hugging Face's rotary layout), so
# that weights cached or saved under another layout are never taken for these.
DECODER_LAYOUT = 2


Lift = Callable[[torch.Tensor], torch.Tensor]  # a Subspace Network's coefficients -> the residual stream


def derive_seed(seed: int, *labels: object) -> int:
    """A stable 63-bit seed from a base seed and labels (Python's hash() is salted per process)."""
    text = ":".join([str(seed), *map(str, labels)]).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") >> 1


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each position's angles, (T, hd), in float32 as Hugging Face's LLaMA computes them
    (so an exported checkpoint gives the same logits): channel i and i + hd/2 share frequency i."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.int64).float(), inv_freq)  # (T, hd/2)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, H, T, hd), rotating each pair of channels (i, i + hd/2) by its position's angle
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Subspace(nn.Module):
    """The fixed part of a Subspace Network: the basis U (d × k) the blocks write in and the anchor
    embedding that carries each token's identity at full width. Rebuilt from the run seed wherever
    it is needed (non-persistent buffers), so it is never sent, saved or averaged."""

    def __init__(self, cfg: ModelConfig, seed: int):
        super().__init__()
        generator = torch.Generator().manual_seed(derive_seed(seed, "subspace"))
        gaussian = torch.randn(cfg.d_model, cfg.subspace_rank, generator=generator, dtype=torch.float64)
        basis = torch.linalg.qr(gaussian).Q.to(torch.float32)  # orthonormal columns
        anchors = torch.empty(cfg.vocab_size, cfg.d_model).normal_(0.0, cfg.init_std, generator=generator)
        self.register_buffer("basis", basis, persistent=False)
        self.register_buffer("anchors", anchors, persistent=False)


class KVCache:
    """Each block's keys and values of the positions a generating policy has read so far, so that the
    next token costs one position's compute, not the whole sequence's (GRPO's sampling; never trained)."""

    def __init__(self, n_blocks: int):
        self.keys: list[torch.Tensor | None] = [None] * n_blocks
        self.values: list[torch.Tensor | None] = [None] * n_blocks

    @property
    def length(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].size(2)

    def repeat_rows(self, times: int) -> None:
        """Every row `times` times in a row (one prompt read once, then sampled `times` ways)."""
        self.keys = [k.repeat_interleave(times, dim=0) for k in self.keys]
        self.values = [v.repeat_interleave(times, dim=0) for v in self.values]


class Attention(nn.Module):
    """Causal self-attention with rotary positions; `n_kv_heads` < `n_heads` is grouped-query
    attention (each key/value head serves n_heads / n_kv_heads query heads)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, cfg.d_model + 2 * cfg.kv_dim, bias=cfg.qkv_bias)  # rows [q; k; v]
        self.out = nn.Linear(cfg.d_model, cfg.residual_dim, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None = None, index: int = 0
    ) -> torch.Tensor:
        """`cache`: the positions before these (block `index`'s entry), which these are appended to."""
        B, T, C = x.shape
        kv = self.kv_heads * self.head_dim
        q, k, v = self.qkv(x).split((C, kv, kv), dim=-1)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k, v = (z.view(B, T, self.kv_heads, self.head_dim).transpose(1, 2) for z in (k, v))
        past = 0 if cache is None or cache.keys[index] is None else cache.keys[index].size(2)
        q, k = (
            apply_rotary(q, cos[past : past + T], sin[past : past + T]),
            apply_rotary(k, cos[past : past + T], sin[past : past + T]),
        )
        if cache is not None:
            if past:
                k, v = torch.cat((cache.keys[index], k), dim=2), torch.cat((cache.values[index], v), dim=2)
            cache.keys[index], cache.values[index] = k, v
        grouped = self.kv_heads != self.n_heads
        # position t sees every cached position and those of its own up to itself
        mask = None if past == 0 or T == 1 else torch.ones(T, past + T, dtype=torch.bool).tril(past).to(x.device)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=past == 0, enable_gqa=grouped)
        return self.out(y.transpose(1, 2).reshape(B, T, C))  # y: (B, H, T, hd)


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.down = nn.Linear(cfg.ffn_hidden, cfg.residual_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        lift: Lift | None = None,
        cache: KVCache | None = None,
        index: int = 0,
    ) -> torch.Tensor:
        """`x` is the residual stream, or with `lift` (a Subspace Network) its coefficients, which
        `lift` turns into the stream each sublayer reads."""
        read = x if lift is None else lift(x)
        x = x + self.attn(self.attn_norm(read), cos, sin, cache, index)
        read = x if lift is None else lift(x)
        return x + self.mlp(self.mlp_norm(read))


def _init_block(block: Block, cfg: ModelConfig, generator: torch.Generator) -> None:
    # Residual output projections are scaled down with depth (GPT-2), so deep stacks start stable.
    residual_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    with torch.no_grad():
        for name, param in block.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            elif name in ("attn.out.weight", "mlp.down.weight"):
                param.normal_(0.0, residual_std, generator=generator)
            else:
                param.normal_(0.0, cfg.init_std, generator=generator)


def build_block(cfg: ModelConfig, seed: int, index: int) -> Block:
    block = Block(cfg)
    _init_block(block, cfg, torch.Generator().manual_seed(derive_seed(seed, "block", index)))
    return block


def _subspace_lift(subspace: Subspace | None, tokens: torch.Tensor | None) -> Lift | None:
    if subspace is None:
        return None
    if tokens is None:
        raise ValueError("a Subspace Network's stage needs the microbatch's token ids")
    anchors = F.embedding(tokens, subspace.anchors)  # once per stage, not once per sublayer
    return lambda coefficients: anchors + coefficients @ subspace.basis.T  # (B, T, k) -> the stream (B, T, d)


class BlockStage(nn.Module):
    """Transformer blocks [first, first + len(blocks)): activation (B, T, C) in, (B, T, C) out, where C
    is `residual_dim` (d_model, or the subspace rank, with the token ids given as well)."""

    def __init__(self, cfg: ModelConfig, layers: range, seed: int):
        super().__init__()
        self.layers = layers
        self.blocks = nn.ModuleList(build_block(cfg, seed, i) for i in layers)
        self.subspace = Subspace(cfg, seed) if cfg.subspace_rank else None
        cos, sin = rotary_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(
        self, x: torch.Tensor, tokens: torch.Tensor | None = None, cache: KVCache | None = None
    ) -> torch.Tensor:
        """`cache` (a whole policy generating): `x` is the positions after the cached ones."""
        lift = _subspace_lift(self.subspace, tokens)
        for index, block in enumerate(self.blocks):
            x = block(x, self.cos, self.sin, lift, cache, index)
        return x


class HeadStage(nn.Module):
    """Stage 0: token ids -> embeddings on the way in; activations -> logits -> loss on the way out.
    In a Subspace Network the embedding gives k coefficients, and the final stream is rebuilt from
    them on the head's own trained `anchor` embedding."""

    def __init__(self, cfg: ModelConfig, seed: int):
        super().__init__()
        self.embedding = nn.Embedding(cfg.vocab_size, cfg.residual_dim)
        self.subspace = Subspace(cfg, seed) if cfg.subspace_rank else None
        if self.subspace is not None:
            self.anchor = nn.Embedding(cfg.vocab_size, cfg.d_model)
            with torch.no_grad():
                self.anchor.weight.copy_(self.subspace.anchors)
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        generator = torch.Generator().manual_seed(derive_seed(seed, "head"))
        with torch.no_grad():
            self.embedding.weight.normal_(0.0, cfg.init_std, generator=generator)
            if cfg.tie_embeddings:
                self.lm_head.weight = self.embedding.weight  # one parameter, used on the way in and out
            else:
                self.lm_head.weight.normal_(0.0, cfg.init_std, generator=generator)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embedding(tokens)  # (B, T) -> (B, T, C)

    def logits(self, x: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        if self.subspace is not None:  # coefficients -> the full stream
            if tokens is None:
                raise ValueError("a Subspace Network's head needs the microbatch's token ids")
            x = self.anchor(tokens) + x @ self.subspace.basis.T
        return self.lm_head(self.norm(x))  # (B, T, C) -> (B, T, V)

    def loss(self, x: torch.Tensor, targets: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.logits(x, tokens)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))

    def loss_and_input_grad(
        self, x: torch.Tensor, targets: torch.Tensor, loss_scale: float = 1.0, tokens: torch.Tensor | None = None
    ) -> tuple[float, torch.Tensor, WeightGrads]:
        """The loss of a microbatch and the B pass of `loss * loss_scale`: the gradient in `x`, which
        the last block stage waits for, and the norm's weight gradient. The LM head's weight
        gradient (a third of this stage's backward) is the W pass, returned for later."""
        x = x.detach().requires_grad_(True)
        with torch.enable_grad(), recording_linears(self) as calls:
            loss = self.loss(x, targets, tokens)
            x_grad, weight_grads = input_grad_first(self, x, loss * loss_scale, None, calls)
        return float(loss.detach()), x_grad, weight_grads


class Llama(nn.Module):
    """The unsplit network: the single-process reference for numerical-parity tests."""

    def __init__(self, cfg: ModelConfig, seed: int):
        super().__init__()
        self.head = HeadStage(cfg, seed)
        self.blocks = nn.ModuleList(build_block(cfg, seed, i) for i in range(cfg.n_layers))
        cos, sin = rotary_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.head.embed(tokens)
        lift = _subspace_lift(self.head.subspace, tokens)
        for block in self.blocks:
            x = block(x, self.cos, self.sin, lift)
        return self.head.loss(x, targets, tokens)
