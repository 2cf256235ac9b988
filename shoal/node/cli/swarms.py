"""`shoal swarms`: the swarms this machine knows by name (shoal's bundled ones, ~/.config/shoal/swarms.d/,
--swarms FILE), with their description, initial peers, runs and signing key; `--json` for a document."""

from __future__ import annotations

import argparse
import json

from shoal.dht.swarms import config_dir, known_swarms
from shoal.logs import printable


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--swarms", nargs="+", default=[], metavar="FILE", help="swarm files to read as well")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def run(args: argparse.Namespace) -> int:
    swarms = known_swarms(args.swarms)
    if args.json:
        print(json.dumps([{"name": d.name, "description": d.description, "initial_peers": list(d.initial_peers),
                           "runs": list(d.runs), "placeholder": d.placeholder, "key": d.fingerprint,
                           "source": d.source} for d in swarms.values()], indent=1))  # fmt: skip
        return 0
    for d in swarms.values():  # checked on parsing: names, peers and runs are plain; the rest made printable
        status = "PLACEHOLDER: no host yet" if d.placeholder else f"{len(d.initial_peers)} initial peer(s)"
        print(f"{d.name}  ({status}; runs: {', '.join(d.runs) or 'none listed'}; key {d.fingerprint})")
        print(f"    {printable(d.description, 500)}")
        for peer in d.initial_peers:
            print(f"    {peer}")
        print(f"    from {printable(d.source, 300)}")
    print(f"join one with: shoal node --swarm NAME   (add swarm files to {config_dir()} or pass --swarms FILE)")
    return 0
