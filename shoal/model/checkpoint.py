"""A Hugging Face checkpoint folder on disk, read without loading it.

What a run that starts from a checkpoint needs before any tensor is touched: the architecture as
`ModelConfig` fields, the SHA-256 of the weights and of the tokenizer (the run id hashes those, not
the path), and every check its headers allow: a supported architecture, every tensor present at the
shape `config.json` implies, no file cut short, a tokenizer that fits the vocabulary. Nothing here
imports torch: the run config is read with it (shoal/config.py), and planners read run configs.

Supported: the LLaMA family as `transformers` writes it, which LLaMA 1/2, SmolLM, TinyLlama, Mistral
(without a sliding window) and Qwen2/2.5 (its q, k and v biases included) share. The names are in
`HEAD_NAMES` and `BLOCK_NAMES`, one table used both ways (shoal/model/hf.py moves the tensors).
A `.gguf` file is read as the folder it converts to (shoal/model/gguf.py, which does import torch).
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoal.errors import UsageError
from shoal.model.config import ModelConfig

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"  # a checkpoint sharded over several files
TOKENIZER = "tokenizer.json"
DTYPES = ("F32", "F16", "BF16")  # what a checkpoint's tensors may be stored as (read as float32)
MAX_HEADER_BYTES = 100 << 20  # a safetensors header is JSON; safetensors itself refuses more
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)  # buffers older checkpoints saved; computed, not trained

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
# shoal keeps q, k and v as one projection, rows [q; k; v]: three Hugging Face tensors each
QKV_WEIGHT, QKV_BIAS = "attn.qkv.weight", "attn.qkv.bias"
QKV_PARTS = {
    QKV_WEIGHT: tuple(f"model.layers.{{i}}.self_attn.{p}_proj.weight" for p in "qkv"),
    QKV_BIAS: tuple(f"model.layers.{{i}}.self_attn.{p}_proj.bias" for p in "qkv"),
}


class CheckpointError(UsageError):
    """A checkpoint folder that cannot be used; one line naming the folder and what is wrong."""


@dataclass(frozen=True)
class TensorEntry:
    file: Path
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    model: ModelConfig  # the architecture, with the weights' and tokenizer's digests
    tensors: dict[str, TensorEntry]  # Hugging Face name -> where it is
    tokenizer_vocab: int

    @property
    def tokenizer_file(self) -> Path:
        return self.path / TOKENIZER


def model_fields(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """`ModelConfig` fields from a `config.json`; refuses what shoal's decoder does not compute."""

    def get(key: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
        value = hf.get(key, default)
        if value is None or isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
            raise CheckpointError(f"{where}: config.json {key} must be {getattr(kind, '__name__', 'a number')}, "
                                  f"got {value!r}")  # fmt: skip
        return value

    architectures = hf.get("architectures") or [hf.get("model_type")]
    architecture = architectures[0] if isinstance(architectures, list) and architectures else architectures
    if architecture not in ARCHITECTURES:
        raise CheckpointError(f"{where}: architecture {architecture!r} is not supported "
                              f"(supported: {', '.join(ARCHITECTURES)})")  # fmt: skip

    def refuse_unless(ok: bool, what: str) -> None:
        if not ok:
            raise CheckpointError(f"{where}: {architecture} with {what} is not supported")

    refuse_unless(hf.get("hidden_act", "silu") == "silu", f"hidden_act {hf.get('hidden_act')!r}")
    refuse_unless(not hf.get("mlp_bias"), "MLP biases")
    qkv_bias = architecture == "Qwen2ForCausalLM"
    refuse_unless(qkv_bias or not hf.get("attention_bias"), "attention biases")
    refuse_unless(hf.get("sliding_window") is None or architecture == "Qwen2ForCausalLM", "a sliding window")
    refuse_unless(not hf.get("use_sliding_window"), "a sliding window")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else rope
    refuse_unless(rope_type == "default", f"rope scaling {rope_type!r}")
    theta = rope["rope_theta"] if isinstance(rope, dict) and "rope_theta" in rope else hf.get("rope_theta", 1e4)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise CheckpointError(f"{where}: config.json rope_theta must be a positive number, got {theta!r}")

    d_model, n_heads = get("hidden_size", int), get("num_attention_heads", int)
    n_kv_heads = get("num_key_value_heads", int, n_heads)
    if n_heads <= 0 or d_model % n_heads or n_kv_heads <= 0 or n_heads % n_kv_heads:
        raise CheckpointError(f"{where}: {n_heads} heads and {n_kv_heads} key/value heads do not split "
                              f"hidden_size {d_model}")  # fmt: skip
    refuse_unless(hf.get("head_dim") in (None, d_model // n_heads), f"head_dim {hf.get('head_dim')} != hidden/heads")
    return {
        "vocab_size": get("vocab_size", int),
        "d_model": d_model,
        "n_layers": get("num_hidden_layers", int),
        "n_heads": n_heads,
        "ffn_hidden": get("intermediate_size", int),
        "max_seq_len": get("max_position_embeddings", int),
        "rope_theta": float(theta),
        "norm_eps": float(get("rms_norm_eps", (int, float), 1e-6)),
        "init_std": float(get("initializer_range", (int, float), 0.02)),
        "n_kv_heads": 0 if n_kv_heads == n_heads else n_kv_heads,
        "qkv_bias": qkv_bias,
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
    }


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of `cfg` holds, by Hugging Face name, at its shape."""
    d, v, f, kv = cfg.d_model, cfg.vocab_size, cfg.ffn_hidden, cfg.kv_dim
    shapes: dict[str, tuple[int, ...]] = {HEAD_NAMES["embedding.weight"]: (v, d), HEAD_NAMES["norm.weight"]: (d,)}
    if not cfg.tie_embeddings:
        shapes[HEAD_NAMES["lm_head.weight"]] = (v, d)
    block = {
        "attn_norm.weight": (d,),
        "attn.out.weight": (d, d),
        "mlp_norm.weight": (d,),
        "mlp.gate.weight": (f, d),
        "mlp.up.weight": (f, d),
        "mlp.down.weight": (d, f),
    }
    qkv = {QKV_WEIGHT: ((d, d), (kv, d), (kv, d))}
    if cfg.qkv_bias:
        qkv[QKV_BIAS] = ((d,), (kv,), (kv,))
    for i in range(cfg.n_layers):
        shapes.update({BLOCK_NAMES[name].format(i=i): shape for name, shape in block.items()})
        for name, part_shapes in qkv.items():
            shapes.update({part.format(i=i): s for part, s in zip(QKV_PARTS[name], part_shapes, strict=True)})
    return shapes


def safetensors_header(file: Path, where: str) -> dict[str, TensorEntry]:
    """The tensors a .safetensors file holds, from its header alone; refuses a file cut short."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > min(MAX_HEADER_BYTES, size - 8):
                raise CheckpointError(f"{where}: {file.name} is truncated or not a safetensors file")
            header = json.loads(f.read(length))
    except (OSError, struct.error, ValueError) as e:
        raise CheckpointError(f"{where}: {file.name} is not a readable safetensors file ({e})") from None
    entries, end = {}, 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (_, stop) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{where}: {file.name} has a malformed entry for {name}") from None
        if dtype not in DTYPES:
            raise CheckpointError(f"{where}: tensor {name} is {dtype}; shoal reads {', '.join(DTYPES)}")
        entries[name] = TensorEntry(file, dtype, shape)
        end = max(end, stop)
    if 8 + length + end != size:
        raise CheckpointError(f"{where}: {file.name} is truncated ({size} bytes, its header says {8 + length + end})")
    return entries


def weight_files(path: Path, where: str) -> list[Path]:
    if (path / WEIGHTS).is_file():
        return [path / WEIGHTS]
    if (path / WEIGHTS_INDEX).is_file():
        try:
            names = sorted(set(json.loads((path / WEIGHTS_INDEX).read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as e:
            raise CheckpointError(f"{where}: {WEIGHTS_INDEX} is not readable ({e})") from None
        if any(Path(n).name != n for n in names):
            raise CheckpointError(f"{where}: {WEIGHTS_INDEX} names a file outside the folder")
        return [path / n for n in names]
    raise CheckpointError(f"{where}: no {WEIGHTS} (shoal reads safetensors checkpoints)")


def file_digest(files: list[Path]) -> str:
    """SHA-256 over the files' names and bytes, in order."""
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode() + b"\0")
        with open(file, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def read_checkpoint(path: str | Path, max_seq_len: int | None = None) -> Checkpoint:
    """Read and check a checkpoint folder (or a `.gguf` file, converted once into a folder:
    shoal/model/gguf.py); `max_seq_len` trims the positions a run uses."""
    path = Path(path)
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise CheckpointError(f"checkpoint {path}: no such GGUF file")
        from shoal.model.gguf import GGUFError, converted_folder

        try:
            path = converted_folder(path)
        except GGUFError as e:
            raise CheckpointError(str(e)) from None
    where = f"checkpoint {path}"
    try:
        hf = json.loads((path / "config.json").read_text())
    except OSError as e:
        raise CheckpointError(f"{where}: no readable config.json ({e.strerror})") from None
    except ValueError as e:
        raise CheckpointError(f"{where}: config.json is not JSON ({e})") from None
    if not isinstance(hf, dict):
        raise CheckpointError(f"{where}: config.json is not a JSON object")
    fields = model_fields(hf, where)
    if max_seq_len is not None:
        fields["max_seq_len"] = max_seq_len
    files = weight_files(path, where)
    tensors: dict[str, TensorEntry] = {}
    for file in files:
        tensors.update(safetensors_header(file, where))
    cfg = ModelConfig(**fields)
    for name, shape in expected_shapes(cfg).items():
        entry = tensors.get(name)
        if entry is None:
            raise CheckpointError(f"{where}: tensor {name} is missing")
        if entry.shape != shape:
            raise CheckpointError(f"{where}: tensor {name} has shape {list(entry.shape)}, config.json implies "
                                  f"{list(shape)}")  # fmt: skip
    expected = expected_shapes(cfg).keys() | ({HEAD_NAMES["lm_head.weight"]} if cfg.tie_embeddings else set())
    for name in tensors:
        if name not in expected and not name.endswith(IGNORED_SUFFIXES):
            raise CheckpointError(f"{where}: unexpected tensor {name} (not a layout shoal reads)")
    vocab, tokenizer_digest = read_tokenizer(path, cfg.vocab_size, where)
    model = ModelConfig(**fields, checkpoint=file_digest(files), tokenizer=tokenizer_digest)
    return Checkpoint(path, model, tensors, vocab)


def read_tokenizer(path: Path, vocab_size: int, where: str) -> tuple[int, str]:
    """The tokenizer's vocabulary size and digest; refuses one with ids the embedding does not have."""
    from tokenizers import Tokenizer

    file = path / TOKENIZER
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises its own Exception for a missing or malformed file
        raise CheckpointError(f"{where}: no readable {TOKENIZER} ({str(e).splitlines()[0][:200]})") from None
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    if vocab > vocab_size:
        raise CheckpointError(f"{where}: {TOKENIZER} has {vocab} tokens, more than config.json's vocab_size "
                              f"{vocab_size}")  # fmt: skip
    return vocab, file_digest([file])


def verify(path: str | Path, cfg: ModelConfig) -> Checkpoint:
    """The checkpoint at `path`, refused unless it is exactly the one the run `cfg` starts from."""
    checkpoint = read_checkpoint(path, cfg.max_seq_len)
    if checkpoint.model.checkpoint != cfg.checkpoint:
        raise CheckpointError(f"checkpoint {path}: its weights ({checkpoint.model.checkpoint[:12]}) are not the "
                              f"ones this run starts from ({cfg.checkpoint[:12]})")  # fmt: skip
    if checkpoint.model.tokenizer != cfg.tokenizer:
        raise CheckpointError(f"checkpoint {path}: its {TOKENIZER} ({checkpoint.model.tokenizer[:12]}) is not the "
                              f"run's ({cfg.tokenizer[:12]})")  # fmt: skip
    return checkpoint
