"""shoal's decoder in and out of Hugging Face checkpoints: a run's stages loaded from one, tensor by
tensor, and the swarm's model written as one that `transformers.AutoModelForCausalLM` and
`AutoTokenizer` load as they are (`config.json`, `model.safetensors`, `generation_config.json`,
`tokenizer.json`, `tokenizer_config.json`).

shoal's block is `LlamaForCausalLM`'s: pre-norm RMSNorm, rotary attention with Hugging Face's channel
layout (llama.py), grouped-query attention, a SwiGLU MLP; Qwen2's q/k/v biases and tied embeddings
are options. The one difference is in names and in one fused matrix: shoal keeps q, k and v as one
`qkv` projection. `stage_names` is the whole mapping (from the table in checkpoint.py), used both ways.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch
from tokenizers import Tokenizer

from shoal.errors import UsageError
from shoal.model.checkpoint import BLOCK_NAMES, HEAD_NAMES, QKV_PARTS, Checkpoint, CheckpointError, expected_shapes
from shoal.model.config import ModelConfig
from shoal.model.llama import BlockStage, HeadStage
from shoal.model.stages import build_stage
from shoal.model.tokenizer import END_OF_TEXT

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


class ExportError(UsageError):
    """The checkpoint cannot be written as asked; nothing was written."""


def stage_names(module: HeadStage | BlockStage, cfg: ModelConfig) -> dict[str, tuple[str, ...]]:
    """Each entry of the stage's state dict -> the Hugging Face tensors it is made of (q, k and v
    stacked for `qkv`; a tied LM head is the embedding)."""
    if isinstance(module, HeadStage):
        names = {name: (hf,) for name, hf in HEAD_NAMES.items()}
        if cfg.tie_embeddings:
            names["lm_head.weight"] = names["embedding.weight"]
        return names
    names = {}
    for j, i in enumerate(module.layers):
        for name in module.blocks[j].state_dict():
            parts = QKV_PARTS.get(name) or (BLOCK_NAMES[name],)
            names[f"blocks.{j}.{name}"] = tuple(part.format(i=i) for part in parts)
    return names


def load_stage_weights(module: HeadStage | BlockStage, cfg: ModelConfig, checkpoint: Checkpoint) -> None:
    """Replace the stage's weights with the checkpoint's (`checkpoint.verify`: the run's), reading only
    this stage's tensors from the memory-mapped safetensors files, as float32."""
    from safetensors import safe_open

    names = stage_names(module, cfg)
    wanted = {hf for parts in names.values() for hf in parts}
    loaded: dict[str, torch.Tensor] = {}
    for file in sorted({checkpoint.tensors[hf].file for hf in wanted}):
        try:
            with safe_open(str(file), framework="pt") as f:
                for hf in wanted:
                    if checkpoint.tensors[hf].file == file:
                        loaded[hf] = f.get_tensor(hf).to(torch.float32)
        except Exception as e:  # safetensors' own error for a file that changed since it was checked
            raise CheckpointError(f"checkpoint {checkpoint.path}: {file.name} cannot be read ({e})") from None
    state = {name: torch.cat([loaded[hf] for hf in parts]) for name, parts in names.items()}
    module.load_state_dict(state, strict=True)


def initial_stage(
    cfg: ModelConfig, stages: int, stage: int, seed: int, checkpoint: Checkpoint | None
) -> HeadStage | BlockStage:
    """The stage a run starts from: the checkpoint's weights when the run has one and this machine
    holds it, else the seeded ones (which a node of an imported run then replaces by a copy)."""
    module = build_stage(cfg, stages, stage, seed)
    if cfg.checkpoint and checkpoint is not None:
        load_stage_weights(module, cfg, checkpoint)
    return module


def hf_config(cfg: ModelConfig, eos_token_id: int | None) -> dict:
    """`config.json` for shoal's architecture: a `Qwen2ForCausalLM` when q, k and v have biases,
    else a `LlamaForCausalLM`."""
    qwen = cfg.qkv_bias
    config = {
        "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
        "model_type": "qwen2" if qwen else "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_hidden,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_scaling": None,
        "attention_dropout": 0.0,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "bos_token_id": eos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": "float32",
        "dtype": "float32",
        "use_cache": True,
    }
    if qwen:
        config.update({"use_sliding_window": False, "sliding_window": None})
    else:
        config.update({"attention_bias": False, "mlp_bias": False})
    return config


def hf_tensors(cfg: ModelConfig, head: HeadStage, stages: Iterable[BlockStage]) -> dict[str, torch.Tensor]:
    """Every weight of the model under its Hugging Face name (contiguous fp32 copies)."""
    sizes = (cfg.d_model, cfg.kv_dim, cfg.kv_dim)
    out = {}
    for module in (head, *stages):
        state = module.state_dict()
        for name, parts in stage_names(module, cfg).items():
            if name == "lm_head.weight" and cfg.tie_embeddings:
                continue  # the embedding; transformers ties it back from config.json
            values = state[name].split(sizes, dim=0) if len(parts) == 3 else (state[name],)
            out.update(zip(parts, values, strict=True))
    return {
        name: value.detach().to(device="cpu", dtype=torch.float32, copy=True).contiguous()
        for name, value in out.items()
    }


def check_complete(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
    """Every weight of `cfg`'s model once, at its shape: what an export must hold."""
    expected = expected_shapes(cfg)
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ExportError(f"the model lacks {len(missing)} tensors, e.g. {missing[0]} (a stage missing?)")
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise ExportError(f"unexpected tensor {extra[0]}")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise ExportError(f"tensor {name} has shape {list(tensors[name].shape)}, not {list(shape)}")


def check_exportable(cfg: ModelConfig) -> None:
    """A Subspace Network is no Hugging Face LLaMA: its head reads the stream through anchors of its own."""
    if cfg.subspace_rank:
        raise ExportError("a Subspace Network (model.subspace_rank > 0) cannot be written as a Hugging Face model")


def check_export_target(out: str | Path) -> Path:
    target = Path(out)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ExportError(f"{target} exists and is not an empty folder; choose a new one")
    return target


def export_checkpoint(
    out: str | Path,
    cfg: ModelConfig,
    head: HeadStage,
    stages: Iterable[BlockStage],
    tokenizer: Tokenizer | None,
    source: Path | None = None,
) -> Path:
    """Write the checkpoint into `out` (which must not exist, or be empty): assembled in a temporary
    folder beside it and renamed into place, so a failed export leaves nothing behind. A run imported
    from a checkpoint (`source`) keeps that checkpoint's tokenizer files and generation config;
    otherwise `tokenizer` (shoal's BPE, or None for the model alone) is written."""
    from safetensors.torch import save_file

    check_exportable(cfg)
    target = check_export_target(out)
    tensors = hf_tensors(cfg, head, stages)
    check_complete(cfg, tensors)
    eos = tokenizer.token_to_id(END_OF_TEXT) if tokenizer is not None else None
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt", "written_by": "shoal"})
        config = hf_config(cfg, eos)
        if source is not None:
            _copy_tokenizer(source, staging, config)
        else:
            generation = {"bos_token_id": eos, "eos_token_id": eos, "max_length": cfg.max_seq_len}
            (staging / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
            if tokenizer is not None:
                _write_tokenizer(tokenizer, cfg, staging)
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if target.exists():
            target.rmdir()
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def _copy_tokenizer(source: Path, staging: Path, config: dict) -> None:
    """The imported checkpoint's tokenizer and special-token ids, as they were."""
    original = json.loads((source / "config.json").read_text())
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key in original:
            config[key] = original[key]
    for name in (*TOKENIZER_FILES, "generation_config.json"):
        if (source / name).is_file():
            shutil.copyfile(source / name, staging / name)


def _write_tokenizer(tokenizer: Tokenizer, cfg: ModelConfig, staging: Path) -> None:
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
