"""ModelConfig: the architecture of the decoder (no torch import, so planners can read sizes)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 4096
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    ffn_hidden: int = 352  # SwiGLU hidden width (~8/3 d, rounded to a multiple of 32)
    max_seq_len: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    # What an imported checkpoint may differ in (shoal/model/checkpoint.py); at these defaults they
    # leave the run id as it was before they existed.
    n_kv_heads: int = 0  # grouped-query attention: key/value heads (0: as many as n_heads)
    qkv_bias: bool = False  # biases on the q, k and v projections (Qwen2)
    tie_embeddings: bool = False  # the LM head is the embedding matrix
    checkpoint: str = ""  # SHA-256 of the weights the run starts from ("": seeded random weights)
    tokenizer: str = ""  # SHA-256 of the run's tokenizer.json ("": a BPE trained on the run's data)
    # Subspace Networks (Protocol Models): every block writes into a fixed k-dimensional subspace of the
    # residual stream, which then crosses between stages as k coefficients (0: the full d_model).
    subspace_rank: int = 0

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def residual_dim(self) -> int:
        """Width of what the blocks write to the residual stream, and of what crosses between stages."""
        return self.subspace_rank or self.d_model

    @property
    def kv_dim(self) -> int:
        """Width of the key (and of the value) projection."""
        return self.kv_heads * self.head_dim

    def block_params(self) -> int:
        """Parameters in one transformer block (attention + SwiGLU + two norms)."""
        d, f, kv = self.d_model, self.ffn_hidden, self.kv_dim
        qkv = d * (d + 2 * kv) + ((d + 2 * kv) if self.qkv_bias else 0)
        r = self.residual_dim  # the output projections write r coefficients
        return qkv + d * r + 2 * d * f + f * r + 2 * d

    def head_params(self) -> int:
        """Parameters of stage 0: embedding, final norm and LM head."""
        if self.subspace_rank:  # k-wide embedding, then the head's own anchors and the LM head, d-wide
            return self.vocab_size * (self.subspace_rank + 2 * self.d_model) + self.d_model
        matrices = 1 if self.tie_embeddings else 2
        return matrices * self.vocab_size * self.d_model + self.d_model

    def params(self) -> int:
        return self.n_layers * self.block_params() + self.head_params()
