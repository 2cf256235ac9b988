"""`shoal doctor --initial-peers MADDR ...`: what is at each address, step by step (its name, TCP, the
libp2p handshake, the shoal ping and version), one line each; exit 0 if every one answers as a shoal
peer of this version, else 2. The same diagnosis a node prints when its join fails."""

from __future__ import annotations

import argparse
import sys

from shoal.errors import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--initial-peers", nargs="+", default=[], metavar="MADDR", help="the addresses to look at")
    parser.add_argument("--timeout", type=float, default=5.0, metavar="S", help="per step (default 5)")


def run(args: argparse.Namespace) -> int:
    import uvloop

    from shoal.dht.diagnose import diagnose_all

    if not args.initial_peers:
        raise UsageError("--initial-peers is required: the addresses to look at")
    if args.timeout <= 0:
        raise UsageError("--timeout must be positive")
    verdicts = uvloop.run(diagnose_all(list(args.initial_peers), args.timeout))
    for verdict in verdicts:
        print(("ok    " if verdict.ok else "FAIL  ") + verdict.line())
    sys.stdout.flush()
    return 0 if all(v.ok for v in verdicts) else 2
