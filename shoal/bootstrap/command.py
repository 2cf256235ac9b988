"""`shoal bootstrap`: host a bootstrap peer and print the addresses others pass as --initial-peers.

shoal bootstrap --identity bootstrap.id --host-maddrs /ip4/0.0.0.0/tcp/31337 --run-config run.toml
"""

from __future__ import annotations

import argparse
import sys

from shoal.node.cli.node import add_metrics_arguments, add_network_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_network_arguments(parser)
    parser.add_argument(
        "--run-config",
        default=None,
        metavar="FILE",
        help="publish this run (signed) as the swarm's default, and keep republishing it",
    )
    parser.add_argument("--record-ttl", type=float, default=60.0, help="lifetime of the published run record")
    parser.add_argument(
        "--publish-swarm",
        default=None,
        metavar="FILE",
        help="write this swarm's document (its addresses and runs, signed by this peer's identity) to FILE, for "
        "volunteers to join with --swarms FILE --swarm NAME",
    )
    parser.add_argument(
        "--no-relay-service",
        dest="relay_service",
        action="store_false",
        help="do not relay for nodes behind NAT (by default a bootstrap peer relays, within limits set from its run)",
    )
    parser.add_argument("--swarm-name", default=None, metavar="NAME", help="the swarm's name (default: the run's)")
    parser.add_argument("--swarm-description", default="", metavar="TEXT", help="one line on what the swarm trains")
    add_metrics_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from shoal.bootstrap.peer import BootstrapPeer
    from shoal.errors import UsageError
    from shoal.files import atomic_write
    from shoal.node.cli.runtime import run_daemon
    from shoal.run_files import load_run_config

    run_config = load_run_config(args.run_config) if args.run_config else None
    if not 3.0 <= args.record_ttl <= 3600.0:
        raise UsageError("--record-ttl must be between 3 and 3600 seconds")
    swarm_name = args.swarm_name or (run_config.name.lower() if run_config is not None else None)
    if args.publish_swarm and swarm_name is None:
        raise UsageError("--publish-swarm needs --swarm-name NAME (or a --run-config to name it after)")
    if args.publish_swarm:
        from shoal.dht.swarms import check_name_and_description

        check_name_and_description(swarm_name, args.swarm_description)
    if args.publish_swarm and args.identity is None:
        raise UsageError("--publish-swarm needs --identity FILE: the document is signed by the key volunteers will "
                         "dial, so it must outlive this process")  # fmt: skip

    async def create() -> BootstrapPeer:
        peer = await BootstrapPeer.create(
            args.identity,
            args.host_maddrs,
            args.announce_maddrs,
            args.initial_peers,
            run_config,
            args.record_ttl,
            relay_service=args.relay_service,
        )
        if args.metrics_port is not None:
            from shoal.bootstrap.metrics import BootstrapCollector
            from shoal.node.metrics import MetricsServer, registry_for

            try:
                registry = registry_for(BootstrapCollector(peer))
                who = peer.dht.peer_id[-8:]
                peer.metrics = await MetricsServer.create(registry, args.metrics_host, args.metrics_port, who)
            except BaseException:
                await peer.shutdown()
                raise
        return peer

    async def announce(peer: BootstrapPeer) -> None:
        maddrs = await peer.maddrs()
        for maddr in maddrs:
            print(maddr, flush=True)
        if args.publish_swarm:
            from shoal.dht.swarms import sign_swarm

            runs = [run_config.name] if run_config is not None else []
            tcp = [m for m in maddrs if "/tcp/" in m and "/p2p-circuit" not in m][:32]
            document = sign_swarm(swarm_name, args.swarm_description, tcp, runs, peer.dht.identity.signing_key)
            if all(m.startswith(("/ip4/127.", "/ip6/::1/")) for m in tcp):
                print("warning: the swarm document lists loopback addresses only: volunteers on other machines "
                      "need --host-maddrs /ip4/0.0.0.0/tcp/PORT --announce-maddrs /ip4/PUBLIC_IP/tcp/PORT (or "
                      "/dns4/NAME/tcp/PORT)", file=sys.stderr, flush=True)  # fmt: skip
            atomic_write(args.publish_swarm, document.to_toml())
            join = f"shoal node --swarms {args.publish_swarm} --swarm {swarm_name}"
            print(f"swarm document {args.publish_swarm}: volunteers join with {join}", file=sys.stderr, flush=True)
        if run_config is not None:
            print(f"publishing run {run_config.name}@{run_config.run_id}", file=sys.stderr, flush=True)
        if peer.metrics is not None:
            print(f"metrics on {peer.metrics.url}", file=sys.stderr, flush=True)

    return run_daemon(create, announce)
