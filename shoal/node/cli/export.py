"""`shoal export`: the swarm's model as a Hugging Face LLaMA checkpoint (shoal/model/hf.py).

shoal export --initial-peers /ip4/127.0.0.1/tcp/31337/p2p/Qm... [--run NAME] --out DIR

Each stage's weights come from one live replica over the join-by-copy stream (stage 0 from a data
node, block stages from their workers): the most trained replica that answers. Replicas of a stage
differ between outer steps (NoLoCo never makes them equal), so the export is the model one route
through the swarm computes, taken stage by stage while the swarm trains. The tokenizer comes from
the run's data, where this machine has it (`--data PATH` points at a copy); without it the export
holds the model only, and says so.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from shoal.errors import UsageError
from shoal.node.cli.node import add_network_arguments, client_network

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_network_arguments(parser, with_identity=False)
    parser.add_argument("--run", default=None, metavar="NAME[@RUN_ID]", help="the run to export")
    parser.add_argument("--run-config", default=None, metavar="FILE", help="or the run in this TOML file")
    parser.add_argument("--out", required=True, metavar="DIR", help="a new (or empty) folder for the checkpoint")
    parser.add_argument("--data", default=None, metavar="PATH", help="the run's data here, for its tokenizer")
    parser.add_argument("--checkpoint", default=None, metavar="DIR",
                        help="a run imported from a checkpoint: that checkpoint here, for its tokenizer")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=60.0, metavar="S", help="per stage copy (default 60)")


async def gather_stages(transport: Any, run: Any, view: Any, timeout_s: float) -> list[Any]:
    """Every stage's module, with the weights of the most trained live replica that gave them."""
    from shoal.model.stages import build_stage
    from shoal.node.stage.copy import fetch_stage

    modules = []
    for stage in range(run.pipeline.stages):
        module = build_stage(run.model, run.pipeline.stages, stage, run.train.seed)
        reference = [p.detach() for p in module.parameters()]
        replicas = sorted((n for n in view.replicas(stage) if n.state == "active"), key=lambda n: -n.inner_step)
        if not replicas:
            raise UsageError(f"stage {stage} has no live replica: nothing to export it from")
        errors = []
        for replica in replicas:
            try:
                fetched = await fetch_stage(transport, replica.peer_id, stage, reference, timeout_s)
            except Exception as e:
                errors.append(f"{replica.peer_id[-8:]}: {e}")
                continue
            for param, value in zip(module.parameters(), fetched.theta, strict=True):
                param.data.copy_(value)
            print(f"stage {stage}: {replica.peer_id} (inner step {fetched.inner_step})", file=sys.stderr)
            break
        else:
            raise UsageError(f"no replica of stage {stage} gave its weights ({'; '.join(errors)[:300]})")
        modules.append(module)
    return modules


def run(args: argparse.Namespace) -> int:
    import uvloop

    from shoal.dht.identity import load_identity
    from shoal.dht.swarm import SwarmDHT
    from shoal.model.hf import check_export_target, export_checkpoint
    from shoal.node.config import NodeConfig, RunChoice
    from shoal.node.run_source import resolve_run, run_checkpoint

    network = client_network(args)
    if args.timeout <= 0:
        raise UsageError("--timeout must be positive")
    check_export_target(args.out)
    lookup = NodeConfig(
        network=network,
        run=RunChoice(
            run_name=args.run, run_config_path=args.run_config, data_path=args.data, checkpoint_dir=args.checkpoint
        ),
    )

    async def main() -> tuple[Any, list[Any]]:
        dht = await SwarmDHT.create(load_identity(None), network.initial_peers, network.host_maddrs, client_mode=True)
        try:
            run_config = await resolve_run(dht, lookup)
            view = await dht.read_view(run_config)
            return run_config, await gather_stages(dht.transport, run_config, view, args.timeout)
        finally:
            await dht.shutdown()

    run_config, (head, *blocks) = uvloop.run(main())
    checkpoint = run_checkpoint(run_config, lookup)
    if run_config.model.checkpoint and checkpoint is None:
        raise UsageError(f"run {run_config.name} starts from a checkpoint: give --checkpoint DIR for its tokenizer")
    if checkpoint is not None:  # the imported checkpoint's own tokenizer files, as they were
        print(export_checkpoint(args.out, run_config.model, head, blocks, None, source=checkpoint.path))
    else:
        print(export_checkpoint(args.out, run_config.model, head, blocks, _tokenizer(run_config)))
    return 0


def _tokenizer(run_config: Any) -> Any:
    from shoal.train.data import run_tokenizer

    try:
        return run_tokenizer(run_config.data, run_config.model.vocab_size)
    except UsageError as e:
        print(f"shoal export: no tokenizer exported ({e}); pass --data with the run's data", file=sys.stderr)
        return None
