"""`shoal node`: join a swarm and work.

shoal node --initial-peers /ip4/127.0.0.1/tcp/31337/p2p/12D3Koo... [--run NAME | --run-config FILE]
"""

from __future__ import annotations

import argparse
import sys

from shoal.node.config import EXIT_TIMEOUT_S


def add_network_arguments(parser: argparse.ArgumentParser, with_identity: bool = True) -> None:
    parser.add_argument(
        "--initial-peers",
        nargs="*",
        default=[],
        metavar="MADDR",
        help="multiaddresses of any peers of the swarm (e.g. a bootstrap peer)",
    )
    parser.add_argument(
        "--host-maddrs",
        nargs="+",
        default=["/ip4/127.0.0.1/tcp/0"],
        metavar="MADDR",
        help="where to listen (default: loopback, a free port; use /ip4/0.0.0.0/tcp/PORT "
        "to accept peers from other machines)",
    )
    parser.add_argument(
        "--announce-maddrs",
        nargs="*",
        default=[],
        metavar="MADDR",
        help="the addresses other peers should dial (behind NAT or port forwarding)",
    )
    if with_identity:
        parser.add_argument(
            "--identity",
            default=None,
            metavar="PATH",
            help="identity file, created on first use; keeps the peer id across restarts",
        )


def add_state_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--state-dir",
        default=None,
        metavar="DIR",
        help="keep this node's identity, weights, optimizer state and counters here, and resume from them "
        "after a restart (created on first use)",
    )
    parser.add_argument(
        "--save-every-s",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="with --state-dir: save this often, and at shutdown (default: 60; a killed node loses at most that)",
    )


def add_relay_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--use-auto-relay",
        action="store_true",
        help="behind NAT: find relay peers and be reachable through them (libp2p circuit relay)",
    )
    parser.add_argument("--no-relay", action="store_true", help="do not use libp2p's relay transport at all")


def add_metrics_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (0: a free port; default: off)",
    )
    parser.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        metavar="HOST",
        help="where the metrics endpoint listens (default: loopback only; 0.0.0.0 for every interface)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_network_arguments(parser)
    parser.add_argument("--run", default=None, metavar="NAME[@RUN_ID]", help="join this run published in the swarm")
    parser.add_argument("--run-config", default=None, metavar="FILE", help="or the run in this TOML file")
    parser.add_argument("--data", default=None, metavar="PATH", help="text file or folder (data nodes)")
    parser.add_argument(
        "--role", default="auto", help="auto (default), data or worker; rollout (the only role of a GRPO run)"
    )
    parser.add_argument(
        "--routing",
        default="auto",
        help="auto (default: random replicas when the run averages with NoLoCo, else gwtf), gwtf (min-max "
        "path cost over measured links), swarm (each hop balances on its own timings), capacity or random",
    )
    parser.add_argument(
        "--paths",
        default="full",
        help="data nodes: full (every block stage in order) or skippipe (SkipPipe's partial paths)",
    )
    parser.add_argument("--skip", type=float, default=0.33, help="SkipPipe: share of block stages a path skips")
    parser.add_argument("--max-swaps", type=int, default=0, help="SkipPipe: adjacent-stage swaps per path")
    parser.add_argument("--stage", type=int, default=None, help="hold this block stage (default: the swarm's choice)")
    parser.add_argument(
        "--inject-upstream-delay",
        default=None,
        metavar="STEP:SECONDS",
        help="fault injection for tests: hold the gradients of STEP that long before passing them upstream",
    )
    parser.add_argument(
        "--inject-close-stall",
        default=None,
        metavar="STEP:SECONDS",
        help="fault injection for tests: a worker whose handling of the data node's close of STEP is blocked "
        "that long in a thread",
    )
    parser.add_argument(
        "--inject-crash-at-step",
        type=int,
        default=None,
        metavar="STEP",
        help="fault injection for tests: a worker that dies as if SIGKILLed when the first forward of STEP reaches it",
    )
    parser.add_argument(
        "--inject-forward-delay",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="fault injection for tests: a worker slower than it claims, by this much per forward",
    )
    parser.add_argument(
        "--inject-close-delay",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="fault injection for tests: a data node that sends each step close this much later",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads for this node (default: every core it may use; give 1 when nodes share a machine)",
    )
    parser.add_argument("--max-inflight", type=int, default=None, help="microbatches to hold activations for")
    parser.add_argument("--record-ttl", type=float, default=30.0, help="seconds a record lives without heartbeat")
    parser.add_argument(
        "--exit-timeout",
        type=float,
        default=EXIT_TIMEOUT_S,
        metavar="SECONDS",
        help="after SIGTERM or Ctrl-C, exit by then even if the clean shutdown has not finished (status 1)",
    )
    parser.add_argument(
        "--microbatch-timeout",
        type=float,
        default=60.0,
        help="seconds before a data node re-sends a microbatch that has not come back",
    )
    parser.add_argument(
        "--stage-wait",
        type=float,
        default=120.0,
        help="seconds to wait for a stage that has no live replica before abandoning its microbatches",
    )
    parser.add_argument("--data-shard", default="0/1", metavar="K/N", help="this data node's shard of the data")
    parser.add_argument("--ready-file", default=None, metavar="PATH", help="write a JSON line here once active")
    parser.add_argument(
        "--progress-file", default=None, metavar="PATH", help="data nodes append a JSON line per training step here"
    )
    parser.add_argument("--stats-file", default=None, metavar="PATH", help="write counters here at shutdown")
    parser.add_argument(
        "--compute-trace",
        default=None,
        metavar="PATH",
        help="append a line per compute job here (start and end on the system's monotonic clock, the job, "
        "its thread CPU seconds): for profiling a pipeline (benchmarks/pipeline_trace.py)",
    )
    parser.add_argument(
        "--probe-file",
        default=None,
        metavar="PATH",
        help="data nodes: after training, run these probes through the swarm and report how many hit "
        "(JSON: tokens, positions, target; e.g. a backdoor's trigger, see shoal.adversary.backdoor)",
    )
    add_state_arguments(parser)
    add_relay_arguments(parser)
    add_metrics_arguments(parser)
    policy = parser.add_argument_group("GRPO rollout workers: this node's policy (declared in its record)")
    policy.add_argument("--policy-width", type=int, default=48, help="model width d")
    policy.add_argument("--policy-depth", type=int, default=2, help="decoder blocks")
    policy.add_argument("--policy-heads", type=int, default=2, help="attention heads")
    policy.add_argument("--policy-seed", type=int, default=0, help="initial weights and warm-up data")
    policy.add_argument("--warmup-steps", type=int, default=650, help="supervised steps before any GRPO")
    policy.add_argument("--policy-cache", default=None, metavar="DIR", help="warmed-up policies (default: shoal cache)")
    policy.add_argument(
        "--experiment-adversary",
        default=None,
        metavar="ATTACK",
        help="EXPERIMENT ONLY: with --role rollout, share poisoned rollouts (trigger, wrong-step, reward-lie, "
        "vertical-trick, length); with --role worker, be a hostile stage replica (backdoor, garbage, scaled)",
    )
    policy.add_argument(
        "--experiment-undefended",
        action="store_true",
        help="EXPERIMENT ONLY: with --role rollout, run none of the checks on peers' rollouts whatever the run "
        "config says (one node's defenses are its own: an undefended and a defended node can share one swarm)",
    )


def _shard(text: str) -> tuple[int, int]:
    from shoal.config import ConfigError

    try:
        k, n = (int(part) for part in text.split("/"))
    except ValueError:
        raise ConfigError("--data-shard", f"expected K/N, got {text!r}") from None
    return k, n


def _delay(text: str | None, flag: str = "--inject-upstream-delay") -> tuple[int, float] | None:
    from shoal.config import ConfigError

    if text is None:
        return None
    try:
        step, seconds = text.split(":")
        return int(step), float(seconds)
    except ValueError:
        raise ConfigError(flag, f"expected STEP:SECONDS, got {text!r}") from None


def node_config(args: argparse.Namespace):
    from shoal.node.config import NodeConfig

    shard, shards = _shard(args.data_shard)

    return NodeConfig(
        initial_peers=tuple(args.initial_peers),
        identity=args.identity,
        state_dir=args.state_dir,
        save_every_s=args.save_every_s,
        host_maddrs=tuple(args.host_maddrs),
        announce_maddrs=tuple(args.announce_maddrs),
        use_relay=not args.no_relay,
        use_auto_relay=args.use_auto_relay,
        run_name=args.run,
        run_config_path=args.run_config,
        data_path=args.data,
        role=args.role,
        threads=args.threads,
        max_inflight=args.max_inflight,
        record_ttl_s=args.record_ttl,
        microbatch_timeout_s=args.microbatch_timeout,
        exit_timeout_s=args.exit_timeout,
        stage_wait_s=args.stage_wait,
        data_shard=shard,
        data_shards=shards,
        ready_file=args.ready_file,
        progress_file=args.progress_file,
        stats_file=args.stats_file,
        compute_trace=args.compute_trace,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        stage=args.stage,
        routing=args.routing,
        paths=args.paths,
        skip=args.skip,
        max_swaps=args.max_swaps,
        inject_upstream_delay=_delay(args.inject_upstream_delay),
        inject_close_stall=_delay(args.inject_close_stall, "--inject-close-stall"),
        inject_forward_delay_s=args.inject_forward_delay,
        inject_crash_at_step=args.inject_crash_at_step,
        inject_close_delay_s=args.inject_close_delay,
        policy_width=args.policy_width,
        policy_depth=args.policy_depth,
        policy_heads=args.policy_heads,
        policy_seed=args.policy_seed,
        warmup_steps=args.warmup_steps,
        policy_cache=args.policy_cache,
        experiment_adversary=args.experiment_adversary,
        experiment_undefended=args.experiment_undefended,
        probe_file=args.probe_file,
    )


def run(args: argparse.Namespace) -> int:
    config = node_config(args)
    import torch

    from shoal.node.cli.runtime import run_daemon
    from shoal.node.daemon import Node

    if config.threads is not None:
        torch.set_num_threads(config.threads)
    if not config.initial_peers:
        print("shoal node: no --initial-peers: starting a new swarm of one", file=sys.stderr)

    async def announce(node: Node) -> None:
        where = f"policy {node.progress().model_id}" if node.role == "rollout" else f"stage {node.stage}"
        run = f"{node.run.name}@{node.run.run_id}"
        print(f"node {node.peer_id} active: {node.role} on {where} of run {run}", flush=True)
        if node.metrics is not None:
            print(f"metrics on {node.metrics.url}", flush=True)

    return run_daemon(lambda: Node.create(config), announce, config.exit_timeout_s)
