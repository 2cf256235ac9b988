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

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def block_params(self) -> int:
        """Parameters in one transformer block (attention + SwiGLU + two norms)."""
        d, f = self.d_model, self.ffn_hidden
        return 4 * d * d + 3 * d * f + 2 * d

    def head_params(self) -> int:
        """Parameters of stage 0: embedding, final norm and LM head."""
        return 2 * self.vocab_size * self.d_model + self.d_model

    def params(self) -> int:
        return self.n_layers * self.block_params() + self.head_params()
