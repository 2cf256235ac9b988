"""A run that starts from a Hugging Face checkpoint on disk: a tiny random model written by
`transformers` in the test (LLaMA with grouped-query attention; Qwen2 with q/k/v biases and tied
embeddings), imported through `[model] from`, computes `transformers`' logits, goes back out as the
same checkpoint, and is refused with one line when the files are not what they claim."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from shoal.config import ConfigError
from shoal.model.checkpoint import CheckpointError, verify
from shoal.model.hf import export_checkpoint
from shoal.model.tokenizer import train_tokenizer
from shoal.run_files import load_run_source
from shoal.train.data import load_token_splits
from shoal.train.reference import ReferenceTrainer
from tests.helpers.tiny import sample_text

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

VOCAB = 300
ARCHITECTURES = {
    "llama-gqa": ("LlamaConfig", {"num_key_value_heads": 2, "tie_word_embeddings": False}),
    "qwen2-bias-tied": ("Qwen2Config", {"num_key_value_heads": 2, "tie_word_embeddings": True}),
}


def write_checkpoint(folder, architecture: str = "llama-gqa", tokenizer_vocab: int = VOCAB):
    """A random checkpoint as `transformers` saves it, with a BPE tokenizer.json beside it."""
    import transformers

    config_class, extra = ARCHITECTURES[architecture]
    config = getattr(transformers, config_class)(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        max_position_embeddings=32, rms_norm_eps=1e-6, rope_theta=10000.0, **extra,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # random biases, so that a dropped one would show in the logits
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.1)
    model.save_pretrained(folder)
    train_tokenizer(sample_text(3000), tokenizer_vocab).save(str(folder / "tokenizer.json"))
    return model


def write_run(tmp_path, folder, steps: int = 2, lr: float = 1e-9, sections: str = "", **model) -> object:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(sample_text(4000))
    model_lines = "".join(f"{key} = {json.dumps(value)}\n" for key, value in model.items())
    path = tmp_path / "run.toml"
    path.write_text(
        f'name = "imported"\n[model]\nfrom = {json.dumps(str(folder.name))}\n{model_lines}'
        f"[pipeline]\nstages = 3\n[train]\nsteps = {steps}\nseq_len = 32\nbatch_size = 8\nmicrobatch_size = 2\n"
        f"eval_batches = 2\n[optim]\nlr = {lr}\nwarmup_steps = 0\nweight_decay = 0.0\n"
        f'[averaging]\nmode = "none"\n[defense]\naudit_rate = 0.0\n[data]\npath = {json.dumps(str(corpus))}\n'
        f"{sections}"
    )
    return path


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_an_imported_checkpoint_computes_transformers_logits_and_exports_back_as_itself(tmp_path, architecture):
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "hf"
    theirs = write_checkpoint(folder, architecture)
    source = load_run_source(str(write_run(tmp_path, folder)))
    run, checkpoint = source.config, verify(source.checkpoint_dir, source.config.model)
    assert source.checkpoint_dir == folder and len(run.model.checkpoint) == 64
    assert (run.model.n_kv_heads, run.model.qkv_bias) == (2, architecture.startswith("qwen2"))
    assert run.model.tie_embeddings == architecture.endswith("tied")
    trainer = ReferenceTrainer(run, load_token_splits(run.data, VOCAB, checkpoint.tokenizer_file), checkpoint)
    with torch.no_grad():
        expected = theirs(input_ids=_tokens()).logits
    assert (trainer.logits(_tokens()) - expected).abs().max().item() < 1e-5

    out = export_checkpoint(tmp_path / "out", run.model, trainer.head, trainer.blocks, None, source=folder)
    again = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, dtype=torch.float32).eval()
    assert type(again).__name__ == type(theirs).__name__
    with torch.no_grad():
        assert (again(input_ids=_tokens()).logits - expected).abs().max().item() < 1e-5
    assert (out / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()


def test_the_run_id_hashes_the_checkpoint_not_its_path(tmp_path):
    first, moved = tmp_path / "a", tmp_path / "b"
    first.mkdir(), moved.mkdir()
    write_checkpoint(first / "hf")
    shutil.copytree(first / "hf", moved / "hf")
    a = load_run_source(str(write_run(first, first / "hf"))).config
    b = load_run_source(str(write_run(moved, moved / "hf"))).config
    assert a.model == b.model  # the model section, digests included, is the same
    assert a.run_id == b.run_id  # and so is the corpus, by content (data.digest), at another path
    write_checkpoint(moved / "hf", "qwen2-bias-tied")
    assert load_run_source(str(moved / "run.toml")).config.model.checkpoint != a.model.checkpoint


def _edit_config(folder, **changes) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda f: _edit_config(f, architectures=["GPT2LMHeadModel"]), "architecture 'GPT2LMHeadModel' is not supp"),
        (lambda f: _edit_config(f, rope_parameters={"rope_type": "llama3", "rope_theta": 1e4}), "rope scaling"),
        (lambda f: _edit_config(f, intermediate_size=96), "has shape \\[64, 32\\], config.json implies \\[96, 32\\]"),
        (lambda f: _edit_config(f, num_hidden_layers=5), "tensor model.layers.4.input_layernorm.weight is missing"),
        (lambda f: os.truncate(f / "model.safetensors", os.path.getsize(f / "model.safetensors") - 100), "truncated"),
        (lambda f: train_tokenizer(sample_text(3000), 400).save(str(f / "tokenizer.json")), "tokens, more than"),
        (lambda f: (f / "tokenizer.json").unlink(), "no readable tokenizer.json"),
    ],
    ids=["architecture", "rope-scaling", "shape", "missing-layer", "truncated", "tokenizer-vocab", "no-tokenizer"],
)
def test_a_checkpoint_that_is_not_what_it_claims_is_refused_in_one_line(tmp_path, damage, message):
    folder = tmp_path / "hf"
    write_checkpoint(folder)
    damage(folder)
    with pytest.raises(ConfigError, match=message) as refused:
        load_run_source(str(write_run(tmp_path, folder)))
    assert refused.value.field == "model.from" and "\n" not in str(refused.value)


def test_model_fields_beside_from_and_a_changed_checkpoint_are_refused(tmp_path):
    folder = tmp_path / "hf"
    write_checkpoint(folder)
    with pytest.raises(ConfigError, match="model.d_model: comes from the checkpoint"):
        load_run_source(str(write_run(tmp_path, folder, d_model=64)))
    with pytest.raises(ConfigError, match="model.max_seq_len: must be an integer"):
        load_run_source(str(write_run(tmp_path, folder, max_seq_len="long")))
    run = load_run_source(str(write_run(tmp_path, folder, max_seq_len=32))).config
    assert run.model.max_seq_len == 32  # a run may train on shorter sequences than the checkpoint allows
    train_tokenizer(sample_text(2000), 290).save(str(folder / "tokenizer.json"))
    with pytest.raises(CheckpointError, match="is not the run's"):
        verify(folder, run.model)


def test_shoal_train_refuses_a_truncated_checkpoint_with_one_line_and_writes_nothing(tmp_path):
    folder = tmp_path / "hf"
    write_checkpoint(folder)
    os.truncate(folder / "model.safetensors", 1000)
    run_file = write_run(tmp_path, folder)
    done = subprocess.run(
        [sys.executable, "-m", "shoal.cli", "train", "--local", "--run-config", str(run_file), "--quiet",
         "--report", str(tmp_path / "report"), "--export", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "truncated" in done.stderr
    assert not (tmp_path / "report").exists() and not (tmp_path / "out").exists()


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_swarm_of_real_daemons_serves_an_imported_checkpoint_with_transformers_predictions(swarm, tmp_path):
    """Three stages over real daemons: the data node and one replica of each block stage read the
    checkpoint (from the run file's `from`, or `--checkpoint DIR`); a second replica of stage 2 has no
    files and copies its stage from the first, while a node that has neither files nor a replica to
    copy from refuses to start. After two steps at lr 1e-9 the swarm's top prediction
    at every probed position is `transformers`' own."""
    from tests.helpers.processes import done_event, wait_until

    folder = tmp_path / "hf"
    theirs = write_checkpoint(folder)
    run_file = write_run(tmp_path, folder)
    tokens = torch.randint(0, VOCAB, (16, 24), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(16) + 4
    with torch.no_grad():
        expected = theirs(input_ids=tokens).logits.argmax(-1)[torch.arange(16), positions]
    probes = tmp_path / "probes.json"
    probes.write_text(json.dumps({"tokens": tokens.tolist(), "positions": positions.tolist(),
                                  "targets": expected.tolist()}))  # fmt: skip

    entry = swarm.start_bootstrap("--run-config", str(run_file)).maddrs[0]
    common = ("--record-ttl", "6", "--role", "worker")
    alone = swarm.start_node([entry], *common, "--run", "imported", "--stage", "1", wait=False)
    wait_until(lambda: not alone.alive, 120, "a first node with no checkpoint and no replica to copy to refuse")
    assert alone.process.returncode == 2 and "give --checkpoint DIR" in alone.log()
    first = swarm.start_node([entry], *common, "--run-config", str(run_file), "--stage", "1")
    second = swarm.start_node([entry], *common, "--run", "imported", "--checkpoint", str(folder), "--stage", "2")
    copied = swarm.start_node([entry], *common, "--run", "imported", "--stage", "2")
    assert f"copied stage 2 from {second.peer_id[-8:]}" in copied.log()
    progress = tmp_path / "progress.jsonl"
    swarm.start_node([entry], "--run", "imported", "--checkpoint", str(folder), "--role", "data",
                     "--record-ttl", "6", "--probe-file", str(probes), "--progress-file", str(progress))  # fmt: skip
    done = wait_until(lambda: done_event(progress), 240, "the data node to finish")
    assert done["microbatches_abandoned"] == 0 and done["steps"] == 2
    assert done["probe"] == {"probes": 16, "answered": 16, "hits": 16, "share": 1.0}
    assert first.alive and second.alive and copied.alive


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_lost_stage_of_an_imported_run_with_no_backup_left_comes_back_from_its_checkpoint(swarm, tmp_path):
    """Stage 2's only replica dies mid-run and no neighbour keeps a backup: the newcomer, which holds the
    checkpoint, takes the stage's tensors from it (the pretrained model, without the few steps of
    fine-tuning since) rather than CheckFree's mix of a neighbour, and says so in one line."""
    from tests.helpers.processes import done_event, progress_events, wait_until

    folder = tmp_path / "hf"
    write_checkpoint(folder)
    run_file = write_run(tmp_path, folder, steps=12, lr=1e-3, sections="[repair]\nbackup_every = 0\n")
    entry = swarm.start_bootstrap("--run-config", str(run_file)).maddrs[0]
    common = ("--record-ttl", "6", "--role", "worker", "--run-config", str(run_file), "--checkpoint", str(folder))
    swarm.start_node([entry], *common, "--stage", "1")
    lost = swarm.start_node([entry], *common, "--stage", "2", "--inject-crash-at-step", "5")
    progress = tmp_path / "progress.jsonl"
    swarm.start_node([entry], *common[:2], "--role", "data", *common[4:], "--progress-file", str(progress))
    wait_until(lambda: not lost.alive, 180, "stage 2's only replica to crash at step 5")
    newcomer = swarm.start_node([entry], *common, "--stage", "2")
    done = wait_until(lambda: done_event(progress), 240, "the data node to finish")
    lines = [line for line in newcomer.log().splitlines() if "restored from the checkpoint's own tensors" in line]
    assert len(lines) == 1 and "rebuilt by" not in newcomer.log(), newcomer.log()[-3000:]
    assert "no backup of it left" not in newcomer.log()  # backups are off: nothing to look for
    assert done["microbatches_abandoned"] == 0 and done["steps"] == 12, done["abandoned_reasons"]
    repairs = [(e["stage"], e["rule"]) for e in progress_events(progress) if e["event"] == "repair"]
    assert repairs == [(2, "checkpoint")]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_shoal_demo_hands_its_nodes_an_imported_runs_checkpoint_and_trains_it(tmp_path):
    """`shoal demo --run-config` on a run with `[model] from`: its nodes start with `--checkpoint`, as a
    volunteer would have the files, so none refuses for want of them, and the swarm trains; the data is
    read with the checkpoint's tokenizer (a tokenizer trained to the model's vocabulary would not be it)."""
    folder = tmp_path / "hf"
    write_checkpoint(folder)
    run_file = write_run(tmp_path, folder)
    report_dir = tmp_path / "report"
    argv = [sys.executable, "-m", "shoal.cli", "demo", "--run-config", str(run_file), "--steps", "4",
            "--workers-per-stage", "1", "--quiet", "--report", str(report_dir),
            "--workdir", str(tmp_path / "work")]  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((report_dir / "report.json").read_text())
    assert report["steps"] == 4 and report["microbatches_abandoned"] == 0
    assert report["microbatches_completed"] == report["microbatches_injected"] > 0
    logs = "".join(p.read_text() for p in (tmp_path / "work").glob("*.log"))
    assert "--checkpoint" not in logs and "starting from the initialisation" not in logs
