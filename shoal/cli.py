"""The `shoal` command: one sub-command per thing a user does.

Each sub-command lives in its own module exposing `add_arguments(parser)` and `run(args) -> int`;
those modules keep heavy imports (torch, hivemind) inside `run` so `shoal --help` stays quick.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from shoal.config import ConfigError
from shoal.errors import UsageError
from shoal.logs import configure

COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("shoal.train.command", "train the whole model in one process (the reference trainer)"),
    "sim": ("shoal.sim.command", "simulate a swarm's scheduling in virtual time"),
    "bootstrap": ("shoal.bootstrap.command", "host a bootstrap peer and print its addresses"),
    "node": ("shoal.node.cli.node", "join a swarm and work"),
    "status": ("shoal.node.cli.status", "show the swarm at a glance"),
    "export": ("shoal.node.cli.export", "write the swarm's model as a Hugging Face checkpoint"),
    "health": ("shoal.node.cli.health", "ping one node with its health RPC: exit 0 if it answers"),
    "doctor": ("shoal.node.cli.doctor", "say what each initial peer is, and why a join through it fails"),
    "swarms": ("shoal.node.cli.swarms", "list the swarms this machine knows by name"),
    "dashboard": ("shoal.dashboard.command", "watch a swarm in a local web page"),
    "demo": ("shoal.demo.command", "run a whole swarm on this machine and train the bundled model"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shoal", description="peer-to-peer training of language models")
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING or ERROR")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(module_name)
        command = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(command)
        command.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure(getattr(logging, str(args.log_level).upper(), logging.WARNING))
    try:
        return int(args._module.run(args) or 0)
    except (ConfigError, UsageError) as e:
        print(f"shoal {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"shoal {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `shoal sim --json | head`: the reader left, nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
