"""Where the run this node joins comes from: a run file, a name published in the swarm, the swarm's
default, or the bundled one; and the checkpoint it starts from on this machine, checked against it."""

from __future__ import annotations

import asyncio
import logging

from shoal.config import RunConfig
from shoal.dht.runs import PublishedRun, collision_report
from shoal.dht.swarm import SwarmDHT
from shoal.errors import UsageError
from shoal.model.checkpoint import Checkpoint, verify
from shoal.node.config import NodeConfig
from shoal.run_files import load_run_config, load_run_source

logger = logging.getLogger(__name__)

RUN_LOOKUP_ATTEMPTS = 5


async def resolve_run(dht: SwarmDHT, config: NodeConfig) -> RunConfig:
    """The run to join: a file, a name published in the swarm, the swarm's default, or the bundled one."""
    published_run = False
    if config.run.run_config_path:
        run = load_run_config(config.run.run_config_path)
        await dht.read_runs(run.name)  # learn the run's claim, if published, to keep it alive (republish_run)
    else:
        name, _, pinned = (config.run.run_name or "").partition("@")
        published: list[PublishedRun] = []
        for attempt in range(RUN_LOOKUP_ATTEMPTS):
            published = [p for p in await dht.read_runs(name or None) if p.config.run_id.startswith(pinned)]
            if published or not name:
                break
            await asyncio.sleep(0.5 * (attempt + 1))
        report = collision_report(published, name or None)  # several runs under one name: the first claim
        if report:
            logger.warning("[%s] %s", dht.peer_id[-8:], report)
        if published:
            run, published_run = published[0].config, True
        elif name:
            raise UsageError(f"no run named {config.run.run_name!r} is published in this swarm "
                             f"({await published_names(dht, config)})")  # fmt: skip
        else:
            run = load_run_config("tiny")
            logger.info("[%s] the swarm publishes no default run; using the bundled %r", dht.peer_id[-8:], run.name)
    if config.run.data_path:
        from shoal.train.data import with_local_data

        if published_run and not run.data.digest:
            raise UsageError(
                f"--data: run {run.name!r} names no data digest (it trains each machine's default corpus), "
                "so this data cannot be checked against it"
            )
        run = await asyncio.to_thread(with_local_data, run, config.run.data_path)
    return run


async def published_names(dht: SwarmDHT, config: NodeConfig) -> str:
    """What a node looking for a run it did not find is told is there: the swarm's default run, and the
    runs its swarm document lists (the DHT cannot list the names published under it)."""
    default = sorted({f"{p.config.name}@{p.config.run_id}" for p in await dht.read_runs(None)})
    said = [f"its default run: {', '.join(default)}" if default else "it publishes no default run"]
    if config.network.swarm:
        from shoal.dht.swarms import resolve_swarm

        listed = resolve_swarm(config.network.swarm, config.network.swarm_files).runs
        said.append(f"swarm {config.network.swarm} lists: {', '.join(listed) or 'none'}")
    return "; ".join(said)


def run_checkpoint(run: RunConfig, config: NodeConfig) -> Checkpoint | None:
    """This machine's copy of the checkpoint the run starts from (--checkpoint, or the run file's
    `[model] from`), verified against the run's digests; None where the run has none or it is not here."""
    folder = config.run.checkpoint_dir
    if run.grpo is not None and run.grpo.policy_checkpoint:
        return policy_checkpoint(run, config)
    if not run.model.checkpoint:
        if folder:
            raise UsageError(f"--checkpoint: run {run.name} starts from no checkpoint")
        return None
    if folder is None and config.run.run_config_path:
        folder = load_run_source(config.run.run_config_path).checkpoint_dir
    return verify(folder, run.model) if folder is not None else None


def policy_checkpoint(run: RunConfig, config: NodeConfig) -> Checkpoint | None:
    """The checkpoint this node's rollouts post-train: the run's (`[grpo.policy] from`), or another in
    the run's tokenizer (`--checkpoint DIR`: this node's own policy choice, as --width is); None where
    this machine has neither (a rollout worker then refuses to start)."""
    from shoal.model.checkpoint import CheckpointError, read_checkpoint

    assert run.grpo is not None
    folder = config.run.checkpoint_dir
    if folder is None and config.run.run_config_path:
        folder = load_run_source(config.run.run_config_path).checkpoint_dir
    if folder is None:
        return None
    checkpoint = read_checkpoint(folder)
    if checkpoint.model.tokenizer != run.grpo.policy_tokenizer:
        raise CheckpointError(f"checkpoint {folder}: its tokenizer.json ({checkpoint.model.tokenizer[:12]}) is "
                              f"not the run's ({run.grpo.policy_tokenizer[:12]}); every bundle is in it")  # fmt: skip
    return checkpoint
