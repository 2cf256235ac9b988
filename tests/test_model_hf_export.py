"""A trained model out as a Hugging Face LLaMA checkpoint: `transformers` loads it offline and computes
the same logits as shoal's own forward; the tokenizer loads and encodes the same ids."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from shoal.model.hf import ExportError, export_checkpoint, hf_tensors
from shoal.train.data import load_token_splits, run_tokenizer
from shoal.train.reference import ReferenceTrainer
from tests.helpers.tiny import sample_text, tiny_run

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"


def _trained(tmp_path, steps: int = 3):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(sample_text(4000))
    run = tiny_run(**{"data.path": str(corpus), "train.steps": steps})
    trainer = ReferenceTrainer(run, load_token_splits(run.data, run.model.vocab_size))
    for step in range(steps):
        trainer.train_step(step)
    return run, trainer


def test_an_exported_checkpoint_loads_in_transformers_with_the_same_logits_and_tokens(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run, trainer = _trained(tmp_path)
    tokenizer = run_tokenizer(run.data, run.model.vocab_size)
    out = export_checkpoint(tmp_path / "hf", run.model, trainer.head, trainer.blocks, tokenizer)
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"
    ]  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, dtype=torch.float32).eval()
    assert type(model).__name__ == "LlamaForCausalLM"
    tokens = torch.randint(
        0, run.model.vocab_size, (2, run.model.max_seq_len), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        theirs = model(input_ids=tokens).logits
    ours = trainer.logits(tokens)
    assert (theirs - ours).abs().max().item() < 1e-5

    hf_tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    text = "the swarm trains one model together"
    assert hf_tokenizer(text)["input_ids"] == tokenizer.encode(text).ids
    assert hf_tokenizer.decode(tokenizer.encode(text).ids) == text
    assert hf_tokenizer.eos_token == "<|endoftext|>"


def test_every_weight_is_exported_once_and_qkv_splits_into_three(tmp_path):
    run, trainer = _trained(tmp_path, steps=1)
    tensors = hf_tensors(run.model, trainer.head, trainer.blocks)
    params = sum(p.numel() for m in (trainer.head, *trainer.blocks) for p in m.parameters())
    assert sum(t.numel() for t in tensors.values()) == params
    qkv = trainer.blocks[0].blocks[0].attn.qkv.weight
    d = run.model.d_model
    assert torch.equal(tensors["model.layers.0.self_attn.k_proj.weight"], qkv[d : 2 * d])
    last = run.model.n_layers - 1
    assert f"model.layers.{last}.mlp.down_proj.weight" in tensors


def test_an_export_into_a_folder_that_holds_files_writes_nothing_and_a_missing_stage_is_refused(tmp_path):
    run, trainer = _trained(tmp_path, steps=1)
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match="not an empty folder"):
        export_checkpoint(taken, run.model, trainer.head, trainer.blocks, None)
    assert [p.name for p in taken.iterdir()] == ["notes.txt"]
    with pytest.raises(ExportError, match="lacks"):
        export_checkpoint(tmp_path / "partial", run.model, trainer.head, trainer.blocks[:1], None)
    assert not (tmp_path / "partial").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".partial")]
    subspace = dataclasses.replace(run.model, subspace_rank=8)
    with pytest.raises(ExportError, match="Subspace Network"):
        export_checkpoint(tmp_path / "subspace", subspace, trainer.head, trainer.blocks, None)
    assert not (tmp_path / "subspace").exists()


def test_shoal_train_local_exports_and_a_five_line_script_generates_from_it(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(sample_text(4000))
    config = tmp_path / "run.toml"
    config.write_text(tiny_run(**{"data.path": str(corpus), "train.steps": 2}).to_toml())
    out = tmp_path / "hf"
    done = subprocess.run(
        [sys.executable, "-m", "shoal.cli", "train", "--local", "--run-config", str(config), "--quiet",
         "--report", str(tmp_path / "report"), "--export", str(out)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 4
    script = (
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        f"tokenizer = AutoTokenizer.from_pretrained({str(out)!r})\n"
        f"model = AutoModelForCausalLM.from_pretrained({str(out)!r})\n"
        "ids = tokenizer('the swarm', return_tensors='pt').input_ids\n"
        "print(tokenizer.decode(model.generate(ids, max_new_tokens=8, do_sample=False)[0]))\n"
    )
    generated = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240,
                               env={**os.environ, "HF_HUB_OFFLINE": "1"})  # fmt: skip
    assert generated.returncode == 0, generated.stderr
    assert generated.stdout.startswith("the swarm")
    again = subprocess.run(
        [sys.executable, "-m", "shoal.cli", "train", "--local", "--run-config", str(config), "--quiet",
         "--report", str(tmp_path / "report2"), "--export", str(out)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert again.returncode == 2 and "not an empty folder" in again.stderr and "Traceback" not in again.stderr
