"""`shoal train --local`: the single-process reference trainer, with a progress bar and a report.

shoal train --local --steps 150 --report out
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

from shoal.config import ConfigError, RunConfig
from shoal.device import DEVICE_HELP
from shoal.errors import UsageError
from shoal.run_files import DEFAULT_RUN, RunSource, load_run_source


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags that choose a run config; shared by every command that trains."""
    parser.add_argument("--run", default=None, help=f"bundled run name (default: {DEFAULT_RUN})")
    parser.add_argument("--run-config", default=None, metavar="FILE", help="run config TOML file")
    parser.add_argument("--data", default=None, metavar="PATH", help="text file or folder to train on")
    parser.add_argument("--steps", type=int, default=None, help="override train.steps")
    parser.add_argument("--seed", type=int, default=None, help="override train.seed")


def resolve_run(args: argparse.Namespace) -> RunConfig:
    return resolve_run_source(args).config


def resolve_run_source(args: argparse.Namespace) -> RunSource:
    """The run the flags choose, with the overrides applied, and where its checkpoint is (if any)."""
    if args.run and args.run_config:
        raise UsageError("give --run or --run-config, not both")
    source = load_run_source(args.run_config or args.run or DEFAULT_RUN)
    return RunSource(_overridden(source.config, args), source.checkpoint_dir)


def _overridden(run: RunConfig, args: argparse.Namespace) -> RunConfig:
    overrides: dict[str, Any] = {}
    if args.data is not None:
        from shoal.train.data import with_local_data

        run = with_local_data(run, args.data)
    if args.steps is not None:
        overrides["train.steps"] = args.steps
    if args.seed is not None:
        overrides["train.seed"] = args.seed
    try:
        return run.replace(overrides)
    except ConfigError as e:
        raise ConfigError(f"--{e.field.split('.')[-1]}", str(e).split(": ", 1)[-1]) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--local",
        action="store_true",
        required=True,
        help="train in this one process (the reference; the swarm is `shoal demo`/`node`)",
    )
    add_run_arguments(parser)
    parser.add_argument("--report", default="report", metavar="DIR", help="write report.json and loss.png here")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    parser.add_argument("--device", default="auto", help=DEVICE_HELP)
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument(
        "--export", default=None, metavar="DIR", help="also write the trained model as a Hugging Face checkpoint"
    )


def unigram_entropy(tokens, vocab_size: int) -> float:
    """Entropy (nats) of the token frequencies: the loss of a model that ignores context."""
    import torch

    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for start in range(0, len(tokens), 1 << 22):  # the tokens are memory-mapped: widen a slice at a time
        counts += torch.bincount(tokens[start : start + (1 << 22)].long(), minlength=vocab_size)[:vocab_size]
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


def run(args: argparse.Namespace) -> int:
    source = resolve_run_source(args)
    run_config = source.config
    if args.export:
        from shoal.model.hf import check_export_target, check_exportable

        check_exportable(run_config.model)  # before training: a bad --export costs nothing
        check_export_target(args.export)
    import torch
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from shoal.device import DeviceError, choose_device
    from shoal.report import write_report
    from shoal.train.data import load_token_splits
    from shoal.train.reference import ReferenceTrainer

    if args.threads is not None:
        if args.threads < 1:
            raise UsageError("--threads must be at least 1")
        torch.set_num_threads(args.threads)
    try:
        device = choose_device(args.device)
    except DeviceError as e:
        raise UsageError(str(e)) from None
    checkpoint = None
    if source.checkpoint_dir is not None:
        from shoal.model.checkpoint import verify

        checkpoint = verify(source.checkpoint_dir, run_config.model)
    tokenizer_file = checkpoint.tokenizer_file if checkpoint is not None else None
    splits = load_token_splits(run_config.data, run_config.model.vocab_size, tokenizer_file)
    trainer = ReferenceTrainer(run_config, splits, checkpoint, device)
    columns = [
        TextColumn("[bold]train"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TextColumn("loss {task.fields[loss]:.3f}"),
        TextColumn("{task.fields[tps]:,.0f} tok/s"),
        TimeElapsedColumn(),
    ]
    with Progress(*columns, disable=args.quiet, transient=False) as progress:
        task = progress.add_task("train", total=run_config.train.steps, loss=math.nan, tps=0.0)
        result = trainer.train(lambda r: progress.update(task, advance=1, loss=r.loss, tps=r.tokens_per_s))
    entropy = unigram_entropy(splits.train, run_config.model.vocab_size)
    report = {
        "mode": "local",
        "run": run_config.name,
        "run_id": run_config.run_id,
        "steps": result.steps,
        "initial_loss": result.initial_loss,
        "final_loss": result.final_loss,
        "val_loss": result.val_loss,
        "unigram_entropy": entropy,
        "tokens_per_s": result.tokens_per_s,
        "params": result.params,
        "train_wall_s": result.wall_s,
        "threads": torch.get_num_threads(),
        "device": str(device),
        "compute_dtype": str(trainer.compute_dtype or torch.float32).removeprefix("torch."),
        "data": {
            "source": splits.source,
            "train_tokens": len(splits.train),
            "val_tokens": len(splits.val),
            "bytes_per_token": splits.bytes_per_token,
        },
        "losses": [r.loss for r in result.history],
        "val_losses": [[r.step, r.val_loss] for r in result.history if r.val_loss is not None],  # train.eval_every
    }
    curves = {"train": ([r.step for r in result.history], report["losses"])}
    if report["val_losses"]:
        curves["validation"] = ([s for s, _ in report["val_losses"]], [v for _, v in report["val_losses"]])
    path = write_report(
        args.report,
        report,
        curves,
        f"shoal train --local ({run_config.name})",
    )
    print(
        f"steps {result.steps}  loss {result.initial_loss:.3f} -> {result.final_loss:.3f}  "
        f"val {result.val_loss:.3f}  (unigram entropy {entropy:.3f})  "
        f"{result.tokens_per_s:,.0f} tok/s  params {result.params:,}",
        file=sys.stderr,
    )
    print(path)
    if args.export:
        from shoal.model.hf import export_checkpoint
        from shoal.train.data import run_tokenizer

        tokenizer = run_tokenizer(run_config.data, run_config.model.vocab_size, tokenizer_file)
        out = export_checkpoint(args.export, run_config.model, trainer.head, trainer.blocks, tokenizer,
                                source=checkpoint.path if checkpoint is not None else None)  # fmt: skip
        print(out)
    return 0
