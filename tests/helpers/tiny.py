"""Tiny, hermetic run configs and text: no apt package, no download, seconds on 2 cores."""

from __future__ import annotations

import random

from shoal.config import RunConfig, run_config_from_dict

WORDS = (
    "the swarm trains one model together while peers come and go across the network "
    "each stage holds a few blocks and passes activations forward and gradients back "
    "a data node samples text embeds it and computes the loss when the activation returns"
).split()


def sample_text(n_words: int = 30000, seed: int = 0) -> str:
    """Pseudo-English with real structure (a small Markov chain over a fixed vocabulary)."""
    rng = random.Random(seed)
    successors = {w: rng.sample(WORDS, 4) for w in WORDS}
    word, out = WORDS[0], []
    for i in range(n_words):
        out.append(word)
        word = rng.choice(successors[word]) if rng.random() < 0.9 else rng.choice(WORDS)
        if i % 17 == 16:
            out.append(".\n")
    return " ".join(out)


def tiny_run(**overrides) -> RunConfig:
    data = {
        "name": "test-tiny",
        "model": {"vocab_size": 300, "d_model": 32, "n_layers": 4, "n_heads": 4, "ffn_hidden": 64, "max_seq_len": 32},
        "pipeline": {"stages": 3},
        "train": {"steps": 20, "seq_len": 32, "batch_size": 8, "microbatch_size": 2, "eval_batches": 2},
        "optim": {"lr": 1e-2, "warmup_steps": 2},
    }
    run = run_config_from_dict(data)
    return run.replace(overrides) if overrides else run


def write_tiny_run(directory, **overrides):
    """A hermetic run on disk: a corpus file and a run TOML pointing at it; returns the TOML's path."""
    from pathlib import Path

    directory = Path(directory)
    corpus = directory / "corpus.txt"
    corpus.write_text(sample_text(30000))
    path = directory / "run.toml"
    path.write_text(tiny_run(**{"data.path": str(corpus), **overrides}).to_toml())
    return path
