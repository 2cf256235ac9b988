"""`shoal dashboard`: watch a swarm in a browser.

shoal dashboard --initial-peers /ip4/127.0.0.1/tcp/31337/p2p/Qm... [--run NAME] [--port 8080]
then open the URL it prints (http://127.0.0.1:8080/).
"""

from __future__ import annotations

import argparse
import json

from shoal.files import atomic_write
from shoal.node.cli.node import add_network_arguments, client_network


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_network_arguments(parser, with_identity=False)
    parser.add_argument("--run", default=None, metavar="NAME[@RUN_ID]", help="the run to watch")
    parser.add_argument("--run-config", default=None, metavar="FILE", help="or the run in this TOML file")
    parser.add_argument("--host", default="127.0.0.1", help="where the page listens (default: loopback only)")
    parser.add_argument("--port", type=int, default=8080, help="its port (0: a free one, printed)")
    parser.add_argument("--interval-s", type=float, default=3.0, help="seconds between two reads of the swarm")
    parser.add_argument(
        "--ready-file", default=None, metavar="PATH", help="write {url, host, port} here as JSON once serving"
    )


def _write_ready_file(path: str, url: str, host: str, port: int) -> None:
    atomic_write(path, json.dumps({"url": url, "host": host, "port": port}))


def run(args: argparse.Namespace) -> int:
    from shoal.dashboard.server import Dashboard
    from shoal.dht.identity import load_identity
    from shoal.dht.swarm import SwarmDHT
    from shoal.errors import UsageError
    from shoal.node.cli.runtime import run_daemon
    from shoal.node.config import NodeConfig, RunChoice
    from shoal.node.run_source import resolve_run

    network = client_network(args)
    if not 0.2 <= args.interval_s <= 600:
        raise UsageError("--interval-s must be between 0.2 and 600 seconds")
    lookup = NodeConfig(network=network, run=RunChoice(run_name=args.run, run_config_path=args.run_config))

    async def create() -> Dashboard:
        dht = await SwarmDHT.create(load_identity(None), network.initial_peers, network.host_maddrs, client_mode=True)
        try:
            run_config = await resolve_run(dht, lookup)
        except BaseException:
            await dht.shutdown()
            raise
        return await Dashboard.create(dht, run_config, args.host, args.port, args.interval_s)

    async def announce(dashboard: Dashboard) -> None:
        host, port = dashboard.server.sockets[0].getsockname()[:2]
        if args.ready_file:
            _write_ready_file(args.ready_file, dashboard.url, host, port)
        print(f"dashboard of run {dashboard.run.name}@{dashboard.run.run_id} on {dashboard.url}", flush=True)

    return run_daemon(create, announce)
