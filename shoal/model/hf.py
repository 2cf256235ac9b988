"""shoal's decoder as a Hugging Face LLaMA checkpoint: `config.json`, `model.safetensors`,
`generation_config.json`, `tokenizer.json` and `tokenizer_config.json`, which
`transformers.AutoModelForCausalLM` and `AutoTokenizer` load as they are.

shoal's block is `LlamaForCausalLM`'s: pre-norm RMSNorm, rotary attention with Hugging Face's channel
layout (llama.py), a SwiGLU MLP, no biases, untied embedding and LM head. The one difference is in
names and in one fused matrix: shoal keeps q, k and v as one `qkv` projection. `TENSOR_NAMES` is the
whole mapping, in one table, used in both directions.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from tokenizers import Tokenizer

from shoal.errors import UsageError
from shoal.model.config import ModelConfig
from shoal.model.llama import BlockStage, HeadStage
from shoal.model.tokenizer import END_OF_TEXT

# shoal name -> Hugging Face name; `{i}` is the block's index in the whole model
HEAD_NAMES = {
    "embedding.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
BLOCK_NAMES = {
    "attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "attn.out.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "mlp_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "mlp.gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "mlp.up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "mlp.down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
QKV = "attn.qkv.weight"  # rows [q; k; v], each d_model: three Hugging Face matrices
QKV_PARTS = ("model.layers.{i}.self_attn.q_proj.weight", "model.layers.{i}.self_attn.k_proj.weight",
             "model.layers.{i}.self_attn.v_proj.weight")  # fmt: skip
TENSOR_NAMES = {**HEAD_NAMES, **BLOCK_NAMES, QKV: " + ".join(QKV_PARTS)}  # what docs/architecture.md shows

FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


class ExportError(UsageError):
    """The checkpoint cannot be written as asked; nothing was written."""


def hf_config(cfg: ModelConfig, eos_token_id: int | None) -> dict:
    """`config.json` of a `LlamaForCausalLM` with shoal's architecture."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_hidden,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": cfg.init_std,
        "bos_token_id": eos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": "float32",
        "dtype": "float32",
        "use_cache": True,
    }


def hf_tensors(head: HeadStage, stages: Iterable[BlockStage]) -> dict[str, torch.Tensor]:
    """Every weight of the model under its Hugging Face name (contiguous fp32 copies)."""
    out = {hf: value for name, value in head.state_dict().items() if (hf := HEAD_NAMES.get(name))}
    for stage in stages:
        for index, block in zip(stage.layers, stage.blocks, strict=True):
            for name, value in block.state_dict().items():
                if name == QKV:
                    for part, rows in zip(QKV_PARTS, value.chunk(3, dim=0), strict=True):
                        out[part.format(i=index)] = rows
                else:
                    out[BLOCK_NAMES[name].format(i=index)] = value
    return {name: value.detach().to(torch.float32).contiguous().clone() for name, value in out.items()}


def check_complete(cfg: ModelConfig, tensors: Mapping[str, torch.Tensor]) -> None:
    """Every weight of `cfg`'s model once, at its shape: what an export must hold."""
    expected = {**{hf: None for hf in HEAD_NAMES.values()}}
    for i in range(cfg.n_layers):
        for name in (*BLOCK_NAMES.values(), *QKV_PARTS):
            expected[name.format(i=i)] = None
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ExportError(f"the model lacks {len(missing)} tensors, e.g. {missing[0]} (a stage missing?)")
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise ExportError(f"unexpected tensor {extra[0]}")


def check_export_target(out: str | Path) -> Path:
    target = Path(out)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ExportError(f"{target} exists and is not an empty folder; choose a new one")
    return target


def export_checkpoint(
    out: str | Path, cfg: ModelConfig, head: HeadStage, stages: Iterable[BlockStage], tokenizer: Tokenizer | None
) -> Path:
    """Write the checkpoint into `out` (which must not exist, or be empty): assembled in a temporary
    folder beside it and renamed into place, so a failed export leaves nothing behind."""
    from safetensors.torch import save_file

    target = check_export_target(out)
    tensors = hf_tensors(head, stages)
    check_complete(cfg, tensors)
    eos = tokenizer.token_to_id(END_OF_TEXT) if tokenizer is not None else None
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt", "written_by": "shoal"})
        (staging / "config.json").write_text(json.dumps(hf_config(cfg, eos), indent=2) + "\n")
        generation = {"bos_token_id": eos, "eos_token_id": eos, "max_length": cfg.max_seq_len}
        (staging / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        if tokenizer is not None:
            tokenizer.save(str(staging / "tokenizer.json"))
            tokenizer_config = {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": END_OF_TEXT,
                "eos_token": END_OF_TEXT,
                "unk_token": None,
                "model_max_length": cfg.max_seq_len,
                "clean_up_tokenization_spaces": False,
            }
            (staging / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
        if target.exists():
            target.rmdir()
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target
