"""`shoal node`: join a swarm and work.

shoal node --initial-peers /ip4/127.0.0.1/tcp/31337/p2p/12D3Koo... [--run NAME | --run-config FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from shoal.node.config import NetworkOptions, NodeConfig, OutputOptions
from shoal.options import add_options

NETWORK_FLAGS = ("initial_peers", "swarm", "swarm_files", "host_maddrs", "announce_maddrs")


def add_network_arguments(parser: argparse.ArgumentParser, with_identity: bool = True) -> None:
    """The network flags every command that joins a swarm shares (`NetworkOptions`)."""
    add_options(parser, NetworkOptions, (*NETWORK_FLAGS, "identity") if with_identity else NETWORK_FLAGS)


def add_metrics_arguments(parser: argparse.ArgumentParser) -> None:
    add_options(parser, OutputOptions, ("metrics_port", "metrics_host"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    NodeConfig.add_arguments(parser)


def client_network(args: argparse.Namespace) -> NetworkOptions:
    """The network flags of a command that reads the swarm (status, export, dashboard), with the initial
    peers of `--swarm`; UsageError when they name no way in."""
    from shoal.dht.swarms import initial_peers_from
    from shoal.errors import UsageError

    peers, _ = initial_peers_from(args.initial_peers, args.swarm, args.swarms)
    if not peers:
        raise UsageError("--initial-peers MADDR or --swarm NAME is required: how to reach the swarm")
    return NetworkOptions(initial_peers=peers, swarm=args.swarm, swarm_files=tuple(args.swarms),
                          host_maddrs=tuple(args.host_maddrs))  # fmt: skip


def with_swarm_peers(config: NodeConfig) -> NodeConfig:
    """`config` with the initial peers of the swarm `--swarm` names (its signed document), if it names one."""
    from shoal.dht.swarms import initial_peers_from

    network = config.network
    peers, document = initial_peers_from(network.initial_peers, network.swarm, network.swarm_files)
    if document is None:
        return config
    return dataclasses.replace(config, network=dataclasses.replace(network, initial_peers=peers))


def run(args: argparse.Namespace) -> int:
    config = NodeConfig.from_args(args)
    import torch

    from shoal.device import DeviceError, choose_device
    from shoal.errors import UsageError
    from shoal.node.cli.runtime import run_daemon
    from shoal.node.daemon import Node

    if config.limits.threads is not None:
        torch.set_num_threads(config.limits.threads)
    try:
        device = choose_device(config.limits.device)  # a device this machine lacks: one line, before anything starts
    except DeviceError as e:
        raise UsageError(str(e)) from None
    config = with_swarm_peers(config)
    if config.experiment.link is not None:
        from shoal.p2p.shaper import LinkShape, shape_links

        try:
            shape_links(LinkShape.parse(config.experiment.link))
        except ValueError as e:
            raise UsageError(f"--experiment-link: {e}") from None
        print(f"shoal node: EXPERIMENT: every send shaped as a {config.experiment.link} (Mbit/s:ms) link",
              file=sys.stderr)  # fmt: skip
    if not config.network.initial_peers:
        print("shoal node: no --initial-peers: starting a new swarm of one", file=sys.stderr)
    elif config.network.swarm:
        peers = len(config.network.initial_peers)
        print(f"shoal node: joining swarm {config.network.swarm} through its {peers} initial peer(s)", file=sys.stderr)

    async def announce(node: Node) -> None:
        where = f"policy {node.progress().model_id}" if node.role == "rollout" else f"stage {node.stage}"
        run = f"{node.run.name}@{node.run.run_id}"
        print(f"node {node.peer_id} active: {node.role} on {where} of run {run}", flush=True)
        if node.metrics is not None:
            print(f"metrics on {node.metrics.url}", flush=True)

    return run_daemon(lambda: Node.create(config, device), announce, config.limits.exit_timeout_s)
