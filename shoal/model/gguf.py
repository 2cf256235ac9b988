"""A GGUF file (llama.cpp's and Ollama's format) as a Hugging Face checkpoint folder.

A run, `--checkpoint` and `shoal export` take a `.gguf` file wherever they take a folder: it is
converted once, through `transformers`' own GGUF reader, into `<cache>/gguf/<sha256 of the file>/`,
and everything after reads that folder as it reads any checkpoint (checkpoint.py). Quantized tensors
(Q4_1, Q8_0, ...) are dequantized to float32: the run trains the file's weights as the file holds
them, not the model's original ones, and a line says so at each conversion.

The folder is the same bytes on every machine that converts the same file (the run id hashes the
weights and tokenizer, so two volunteers with one GGUF must agree): tensors are written by name in
one order with fixed metadata, and `transformers` is pinned. Conversions of one file by several
processes at once (a demo starts its nodes together) take turns on a lock, and the first one's
folder is what the others read.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from shoal.errors import UsageError
from shoal.model.corpus import cache_dir

logger = logging.getLogger(__name__)


class GGUFError(UsageError):
    """A GGUF file that cannot be converted; one line naming the file (read_checkpoint passes it on as a
    CheckpointError)."""


SUFFIX = ".gguf"
# the files of a Hugging Face folder that checkpoint.py reads (which imports this module, not the reverse)
WEIGHTS, TOKENIZER = "model.safetensors", "tokenizer.json"
# GGUF `general.architecture` -> what the converted config.json names (checkpoint.ARCHITECTURES)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
SOURCE_NOTE = "gguf.json"  # in the converted folder: which file it came from and how its tensors were stored
DEQUANTIZED = ("F32", "F16", "BF16")  # stored types that convert exactly; anything else is a dequantization


def is_gguf(path: Path) -> bool:
    return path.suffix.lower() == SUFFIX and path.is_file()


def content_digest(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def describe(file: Path) -> tuple[str, dict[str, int]]:
    """The file's architecture and how many tensors of each stored type it holds, read from its
    header (memory-mapped, no tensor is decoded)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(file))
        field = reader.fields["general.architecture"]
        architecture = bytes(field.parts[field.data[0]]).decode()
    except (KeyError, ValueError, OSError, IndexError) as e:
        raise GGUFError(f"checkpoint {file}: not a readable GGUF file ({e})") from None
    types: dict[str, int] = {}
    for tensor in reader.tensors:
        types[tensor.tensor_type.name] = types.get(tensor.tensor_type.name, 0) + 1
    return architecture, types


def converted_folder(file: Path, cache: Path | None = None) -> Path:
    """The checkpoint folder converted from `file`, converting it now unless the cache has it."""
    file = Path(file)
    root = (cache or cache_dir()) / "gguf"
    root.mkdir(parents=True, exist_ok=True)
    digest = content_digest(file)
    folder = root / digest
    if (folder / SOURCE_NOTE).is_file():
        return folder
    with open(root / f"{digest}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also by a killed process
        if not (folder / SOURCE_NOTE).is_file():
            _convert(file, digest, folder)
    return folder


def _convert(file: Path, digest: str, folder: Path) -> None:
    architecture, types = describe(file)
    if architecture not in ARCHITECTURES:
        raise GGUFError(f"checkpoint {file}: GGUF architecture {architecture!r} is not supported "
                              f"(supported: {', '.join(ARCHITECTURES)})")  # fmt: skip
    quantized = sorted(kind for kind in types if kind not in DEQUANTIZED)
    logger.warning(
        "converting %s (GGUF, %s) into %s once: %s",
        file.name, architecture, folder,
        f"its {', '.join(quantized)} tensors are dequantized to float32; the run trains these weights, "
        "not the model's original ones" if quantized else "its tensors are stored unquantized",
    )  # fmt: skip
    staging = Path(tempfile.mkdtemp(prefix=f".{digest[:16]}.", dir=folder.parent))
    try:
        _write_folder(file, architecture, staging)
        (staging / SOURCE_NOTE).write_text(json.dumps(
            {"file": file.name, "sha256": digest, "architecture": architecture, "tensor_types": types,
             "dequantized": quantized}, indent=1, sort_keys=True,
        ) + "\n")  # fmt: skip
        os.replace(staging, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _write_folder(file: Path, architecture: str, out: Path) -> None:
    """config.json, model.safetensors (float32, by name) and the tokenizer files from `transformers`'
    reading of the file."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
        model = AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name, dtype=torch.float32)
    except (ValueError, KeyError, OSError, ImportError) as e:
        reason = str(e).splitlines()[0][:200]
        raise GGUFError(f"checkpoint {file}: transformers cannot read it ({reason})") from None
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the folder holds plain float32 tensors
    config["architectures"] = [ARCHITECTURES[architecture]]
    config["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True) + "\n")
    state = model.state_dict()
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)  # the embedding, as transformers saves a tied head
    tensors = {name: state[name].detach().to(torch.float32).contiguous() for name in sorted(state)}
    save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt"})
    tokenizer.save_pretrained(str(out))
    if not (out / TOKENIZER).is_file():
        raise GGUFError(f"checkpoint {file}: its tokenizer did not convert to a {TOKENIZER}")
