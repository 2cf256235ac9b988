"""NodeConfig: how this peer runs (as opposed to RunConfig: what the swarm trains).

In sections, each a frozen dataclass whose fields are also the flags of `shoal node`
(`shoal.options`): a default and a help text live here and nowhere else. Each section checks its
own fields; `NodeConfig` checks what spans sections (a stage needs the worker role, an attack its role).
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field, fields
from pathlib import Path

from shoal.config import ConfigError
from shoal.device import DEVICE_HELP, check_device_spec
from shoal.options import add_option_groups, from_args, option
from shoal.planning.policy import ROUTING_POLICIES

ROLES = ("auto", "data", "worker", "rollout")
ROUTINGS = ("auto", *ROUTING_POLICIES)
RELAYED_CHOICES = ("auto", "always", "never")
STATE_IDENTITY = "identity"  # the node's key, inside --state-dir (see state/store.py)
EXIT_TIMEOUT_S = 60.0  # default: the drain, the last save and leaving the DHT take seconds, not minutes
LOOPBACK_MADDR = "/ip4/127.0.0.1/tcp/0"
LINK_SHAPE = re.compile(r"\d+(\.\d+)?(:\d+(\.\d+)?)?")  # --experiment-link; its bounds: p2p/shaper.py


def _need(ok: bool, flag: str, message: str) -> None:
    if not ok:
        raise ConfigError(flag, message)


def parse_shard(text: str) -> tuple[int, int]:
    try:
        k, n = (int(part) for part in text.split("/"))
    except ValueError:
        raise ConfigError("--data-shard", f"expected K/N, got {text!r}") from None
    return k, n


def _step_and_seconds(flag: str):
    def parse(text: str) -> tuple[int, float]:
        try:
            step, seconds = text.split(":")
            return int(step), float(seconds)
        except ValueError:
            raise ConfigError(flag, f"expected STEP:SECONDS, got {text!r}") from None

    return parse


@dataclass(frozen=True)
class NetworkOptions:
    """Network: where this peer listens, whom it dials first, who it is."""

    initial_peers: tuple[str, ...] = option(
        (), "multiaddresses of any peers of the swarm (e.g. a bootstrap peer)", flag="--initial-peers", metavar="MADDR"
    )
    swarm: str | None = option(
        None, "join the swarm of this name (`shoal swarms` lists them): its signed document gives the initial peers",
        flag="--swarm", metavar="NAME",
    )  # fmt: skip
    swarm_files: tuple[str, ...] = option(
        (), "swarm files to read besides shoal's own and ~/.config/shoal/swarms.d/", flag="--swarms", metavar="FILE"
    )
    host_maddrs: tuple[str, ...] = option(
        (LOOPBACK_MADDR,),
        "where to listen (default: loopback, a free port; use /ip4/0.0.0.0/tcp/PORT to accept peers from other "
        "machines)",
        flag="--host-maddrs",
        metavar="MADDR",
        nargs="+",
    )
    announce_maddrs: tuple[str, ...] = option(
        (), "the addresses other peers should dial (behind NAT or port forwarding)", flag="--announce-maddrs",
        metavar="MADDR",
    )  # fmt: skip
    identity: str | None = option(
        None, "identity file, created on first use; keeps the peer id across restarts", flag="--identity",
        metavar="PATH",
    )  # fmt: skip
    join_timeout_s: float = option(
        30.0, "keep trying the initial peers this long, then say what each one is and exit 2", flag="--join-timeout",
        metavar="S",
    )  # fmt: skip
    use_relay: bool = option(
        True, "do not use libp2p's relay transport at all: never reached through a relay, nor dial a relayed peer",
        flag="--no-relay", negate=True,
    )  # fmt: skip
    relayed: str = option(
        "auto", "be reached through relay peers: auto (when the reachability check at start finds that nobody can "
        "dial this node, as behind a home router), always, or never (then an unreachable node takes the data role)",
        flag="--relayed", metavar="auto|always|never",
    )  # fmt: skip
    relay_service: bool = option(
        False, "relay for nodes behind NAT (a reachable node only; bootstrap peers relay by default)",
        flag="--relay-service",
    )  # fmt: skip
    record_ttl_s: float = option(30.0, "seconds a record lives without heartbeat", flag="--record-ttl")
    rpc_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        _need(bool(self.host_maddrs), "--host-maddrs", "give at least one address to listen on")
        _need(self.relayed in RELAYED_CHOICES, "--relayed", f"must be one of {', '.join(RELAYED_CHOICES)}")
        _need(self.use_relay or self.relayed != "always", "--relayed", "always needs the relay transport: drop "
              "--no-relay")  # fmt: skip
        _need(3.0 <= self.record_ttl_s <= 3600.0, "--record-ttl", "must be between 3 and 3600 seconds")
        _need(self.rpc_timeout_s > 0, "rpc_timeout_s", "must be positive")


@dataclass(frozen=True)
class RunChoice:
    """Run: which run this node joins, and its data."""

    run_name: str | None = option(
        None, "join this run published in the swarm", flag="--run", metavar="NAME[@RUN_ID]"
    )  # read this run's config from the DHT
    run_config_path: str | None = option(None, "or the run in this TOML file", flag="--run-config", metavar="FILE")
    data_path: str | None = option(
        None, "this machine's copy of the run's data (data nodes)", flag="--data", metavar="PATH"
    )  # checked against the run's data.digest
    checkpoint_dir: str | None = option(
        None,
        "the checkpoint the run starts from, on this machine (runs imported from one; in a GRPO run, the "
        "policy this node post-trains)",
        flag="--checkpoint",
        metavar="DIR",
    )  # verified against the run's digests; without it a worker copies its stage from a live replica

    def __post_init__(self) -> None:
        _need(not (self.run_name and self.run_config_path), "--run", "give --run or --run-config, not both")


@dataclass(frozen=True)
class PlacementOptions:
    """Placement: the role this node takes, where it routes, which data it reads."""

    role: str = option("auto", "auto (default), data or worker; rollout (the only role of a GRPO run)", flag="--role")
    stage: int | None = option(None, "hold this block stage (default: the swarm's choice)", flag="--stage")
    routing: str = option(
        "auto",
        "auto (default: random replicas when the run averages with NoLoCo, else gwtf), gwtf (min-max path cost "
        "over measured links), swarm (each hop balances on its own timings), capacity, random, or fixed "
        "(replica i of each stage feeds only replica i of the next: NoLoCo's ablation baseline)",
        flag="--routing",
    )
    paths: str = option(
        "full", "data nodes: full (every block stage in order) or skippipe (SkipPipe's partial paths)", flag="--paths"
    )
    skip: float = option(0.33, "SkipPipe: share of block stages a path skips", flag="--skip")
    max_swaps: int = option(0, "SkipPipe: adjacent-stage swaps per path", flag="--max-swaps")
    data_shard: tuple[int, int] = option(
        (0, 1), "this data node's shard of the data", flag="--data-shard", metavar="K/N", parse=parse_shard
    )

    def __post_init__(self) -> None:
        _need(self.role in ROLES, "--role", f"must be one of {', '.join(ROLES)}, got {self.role!r}")
        _need(self.routing in ROUTINGS, "--routing", f"must be one of {', '.join(ROUTINGS)}, got {self.routing!r}")
        _need(self.paths in ("full", "skippipe"), "--paths", f"must be full or skippipe, got {self.paths!r}")
        _need(0.0 <= self.skip < 1.0, "--skip", f"must be in [0, 1), got {self.skip}")
        _need(self.max_swaps >= 0, "--max-swaps", "must be zero or more")
        k, n = self.data_shard
        _need(0 <= k < n, "--data-shard", f"must be K/N with 0 <= K < N, got {k}/{n}")


@dataclass(frozen=True)
class LimitOptions:
    """Limits: the cores, memory and patience this node spends."""

    threads: int | None = option(
        None,
        "torch threads for this node (default: every core it may use; give 1 when nodes share a machine)",
        flag="--threads",
    )
    device: str = option(
        "auto",
        DEVICE_HELP,
        flag="--device",
    )
    memory_limit_gib: float | None = option(
        None,
        "the most memory this node's stage may take, in GiB (default: what its device has free at start)",
        flag="--memory-limit",
        metavar="GIB",
    )
    max_inflight: int | None = option(
        None, "microbatches to hold activations for (default: from free memory)", flag="--max-inflight"
    )
    microbatch_timeout_s: float = option(
        60.0, "seconds before a data node re-sends a microbatch that has not come back", flag="--microbatch-timeout"
    )
    stage_wait_s: float = option(
        120.0,
        "seconds to wait for a stage that has no live replica before abandoning its microbatches",
        flag="--stage-wait",
    )
    exit_timeout_s: float = option(
        EXIT_TIMEOUT_S,
        "after SIGTERM or Ctrl-C, exit by then even if the clean shutdown has not finished (status 1)",
        flag="--exit-timeout",
        metavar="SECONDS",
    )
    drain_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        _need(self.threads is None or self.threads >= 1, "--threads", "must be at least 1")
        _need(check_device_spec(self.device) is None, "--device", check_device_spec(self.device) or "")
        _need(self.memory_limit_gib is None or self.memory_limit_gib > 0, "--memory-limit", "must be positive GiB")
        _need(self.max_inflight is None or self.max_inflight >= 1, "--max-inflight", "must be at least 1")
        _need(self.microbatch_timeout_s > 0, "--microbatch-timeout", "must be positive")
        _need(self.stage_wait_s >= 0, "--stage-wait", "must be zero or more seconds")
        _need(self.exit_timeout_s > 0, "--exit-timeout", "must be positive")
        _need(self.drain_timeout_s > 0, "drain_timeout_s", "must be positive")


@dataclass(frozen=True)
class StateOptions:
    """State: what this node keeps across restarts."""

    state_dir: str | None = option(
        None,
        "keep this node's identity, weights, optimizer state and counters here, and resume from them after a "
        "restart (created on first use)",
        flag="--state-dir",
        metavar="DIR",
    )
    save_every_s: float = option(
        60.0,
        "with --state-dir: save this often, and at shutdown (default: 60; a killed node loses at most that)",
        flag="--save-every-s",
        metavar="SECONDS",
    )

    def __post_init__(self) -> None:
        _need(0.1 <= self.save_every_s <= 86400, "--save-every-s",
              f"must be between 0.1 and 86400 seconds, got {self.save_every_s}")  # fmt: skip


@dataclass(frozen=True)
class OutputOptions:
    """Output: the files and endpoint where this node says what it does."""

    ready_file: str | None = option(None, "write a JSON line here once active", flag="--ready-file", metavar="PATH")
    progress_file: str | None = option(
        None, "data nodes append a JSON line per training step here", flag="--progress-file", metavar="PATH"
    )
    stats_file: str | None = option(None, "write counters here at shutdown", flag="--stats-file", metavar="PATH")
    compute_trace: str | None = option(
        None,
        "append a line per compute job here (start and end on the system's monotonic clock, the job, its thread "
        "CPU seconds): for profiling a pipeline (benchmarks/pipeline_trace.py)",
        flag="--compute-trace",
        metavar="PATH",
    )
    probe_file: str | None = option(
        None,
        "data nodes: after training, run these probes through the swarm and report how many hit (JSON: tokens, "
        "positions, target; e.g. a backdoor's trigger, see shoal.adversary.backdoor)",
        flag="--probe-file",
        metavar="PATH",
    )
    metrics_port: int | None = option(
        None,
        "serve Prometheus metrics at http://HOST:PORT/metrics (0: a free port; default: off)",
        flag="--metrics-port",
        metavar="PORT",
    )
    metrics_host: str = option(
        "127.0.0.1",
        "where the metrics endpoint listens (default: loopback only; 0.0.0.0 for every interface)",
        flag="--metrics-host",
        metavar="HOST",
    )

    def __post_init__(self) -> None:
        port = self.metrics_port
        _need(port is None or 0 <= port <= 65535, "--metrics-port", f"must be a TCP port (0: any free one), got {port}")


@dataclass(frozen=True)
class PolicyOptions:
    """GRPO rollout workers: this node's policy (declared in its record)."""

    width: int = option(48, "model width d", flag="--policy-width")
    depth: int = option(2, "decoder blocks", flag="--policy-depth")
    heads: int = option(2, "attention heads", flag="--policy-heads")
    seed: int = option(0, "initial weights and warm-up data", flag="--policy-seed")
    warmup_steps: int = option(650, "supervised steps before any GRPO", flag="--warmup-steps")
    cache: str | None = option(
        None, "warmed-up policies (default: the shoal cache)", flag="--policy-cache", metavar="DIR"
    )  # by model id

    def __post_init__(self) -> None:
        _need(8 <= self.width <= 1024, "--policy-width", f"must be in 8..1024, got {self.width}")
        _need(1 <= self.depth <= 32, "--policy-depth", f"must be in 1..32, got {self.depth}")
        heads = self.heads
        _need(heads >= 1 and not self.width % heads and not (self.width // heads) % 2, "--policy-heads",
              f"must split --policy-width into even head dims, got {heads}")  # fmt: skip
        _need(self.seed >= 0, "--policy-seed", "must be zero or more")
        _need(0 <= self.warmup_steps <= 100_000, "--warmup-steps", f"must be in 0..100000, got {self.warmup_steps}")


@dataclass(frozen=True)
class ExperimentOptions:
    """Experiments and fault injection: for tests, chaos runs and attack studies only (node/hooks.py)."""

    link: str | None = option(
        None,
        "experiments: shape every send of this node as a link of MBIT megabits per second and MS milliseconds "
        "one way would (user space: p2p/shaper.py)",
        flag="--experiment-link",
        metavar="MBIT:MS",
    )
    unreachable: bool = option(
        False,
        "fault injection for tests: take the reachability self-check as failed, as behind a NAT nobody can dial",
        flag="--inject-unreachable",
    )
    upstream_delay: tuple[int, float] | None = option(
        None,
        "fault injection for tests: hold the gradients of STEP that long before passing them upstream (so a kill "
        "can land while a hop waits for its gradient)",
        flag="--inject-upstream-delay",
        metavar="STEP:SECONDS",
        parse=_step_and_seconds("--inject-upstream-delay"),
    )
    close_stall: tuple[int, float] | None = option(
        None,
        "fault injection for tests: a worker whose handling of the data node's close of STEP is blocked that long "
        "in a thread",
        flag="--inject-close-stall",
        metavar="STEP:SECONDS",
        parse=_step_and_seconds("--inject-close-stall"),
    )
    crash_at_step: int | None = option(
        None,
        "fault injection for tests: a worker that dies as if SIGKILLed when the first forward of STEP reaches it",
        flag="--inject-crash-at-step",
        metavar="STEP",
    )
    forward_delay_s: float = option(
        0.0,
        "fault injection for tests: a worker slower than it claims, by this much per forward",
        flag="--inject-forward-delay",
        metavar="SECONDS",
    )
    copy_delay_s: float = option(
        0.0,
        "fault injection for tests and benchmarks: a replica serving its stage to a joiner holds the copy this many "
        "seconds first (as a slow uplink would)",
        flag="--inject-copy-delay",
        metavar="SECONDS",
    )
    close_delay_s: float = option(
        0.0,
        "fault injection for tests: a data node that sends each step close this much later",
        flag="--inject-close-delay",
        metavar="SECONDS",
    )
    adversary: str | None = option(
        None,
        "EXPERIMENT ONLY: with --role rollout, share poisoned rollouts (trigger, wrong-step, reward-lie, "
        "vertical-trick, length); with --role worker, be a hostile stage replica (backdoor, garbage, scaled)",
        flag="--experiment-adversary",
        metavar="ATTACK",
    )
    undefended: bool = option(
        False,
        "EXPERIMENT ONLY: with --role rollout, run none of the checks on peers' rollouts whatever the run config "
        "says (one node's defenses are its own: an undefended and a defended node can share one swarm)",
        flag="--experiment-undefended",
    )

    def __post_init__(self) -> None:
        _need(self.forward_delay_s >= 0, "--inject-forward-delay", "must be zero or more")
        _need(self.crash_at_step is None or self.crash_at_step >= 0, "--inject-crash-at-step", "must be zero or more")
        _need(self.close_delay_s >= 0, "--inject-close-delay", "must be zero or more")
        _need(0 <= self.copy_delay_s <= 600, "--inject-copy-delay", "must be 0 to 600 seconds")
        _need(self.link is None or LINK_SHAPE.fullmatch(self.link) is not None, "--experiment-link",
              f"expected MBIT:MS (e.g. 100:30), got {self.link!r}")  # fmt: skip


SECTIONS = (
    NetworkOptions,
    RunChoice,
    PlacementOptions,
    LimitOptions,
    StateOptions,
    OutputOptions,
    PolicyOptions,
    ExperimentOptions,
)


@dataclass(frozen=True)
class NodeConfig:
    network: NetworkOptions = field(default_factory=NetworkOptions)
    run: RunChoice = field(default_factory=RunChoice)
    placement: PlacementOptions = field(default_factory=PlacementOptions)
    limits: LimitOptions = field(default_factory=LimitOptions)
    state: StateOptions = field(default_factory=StateOptions)
    output: OutputOptions = field(default_factory=OutputOptions)
    policy: PolicyOptions = field(default_factory=PolicyOptions)
    experiment: ExperimentOptions = field(default_factory=ExperimentOptions)

    def __post_init__(self) -> None:
        role = self.placement.role
        stage = self.placement.stage
        _need(stage is None or (stage >= 1 and role != "data"), "--stage",
              "must be a block stage (1 or more), for a worker")  # fmt: skip
        if self.experiment.adversary is not None:
            self._check_adversary()
        _need(not self.experiment.undefended or role == "rollout", "--experiment-undefended",
              "it turns off a rollout worker's checks: use --role rollout")  # fmt: skip

    def _check_adversary(self) -> None:
        """Rollout attacks need --role rollout; hostile stage replicas (shoal.adversary.stage) --role worker."""
        from shoal.adversary.attacks import ATTACKS
        from shoal.adversary.stage import STAGE_ATTACKS

        name, role = self.experiment.adversary, self.placement.role
        if name not in ATTACKS and name not in STAGE_ATTACKS:
            known = ", ".join([*ATTACKS, *STAGE_ATTACKS])
            raise ConfigError("--experiment-adversary", f"must be one of {known}, got {name!r}")
        if name in STAGE_ATTACKS and role != "worker":
            raise ConfigError("--experiment-adversary", f"{name} is a stage replica's attack: it needs --role worker")
        if name in ATTACKS and role != "rollout":
            raise ConfigError("--experiment-adversary", f"{name} is a rollout attack: it needs --role rollout")

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Every section's flags, one help group per section."""
        add_option_groups(parser, SECTIONS)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> NodeConfig:
        """The config the flags of `add_arguments` describe; a bad value raises `ConfigError` naming its flag."""
        return cls(**{name: from_args(section, args) for name, section in _SECTION_OF.items()})

    @property
    def heartbeat_s(self) -> float:
        """Re-announce at a third of the record's lifetime, so two lost heartbeats do not expire it."""
        return self.network.record_ttl_s / 3

    @property
    def identity_file(self) -> str | None:
        """--identity, else the identity kept in --state-dir, else None (a fresh identity)."""
        if self.network.identity is None and self.state.state_dir is not None:
            return str(Path(self.state.state_dir) / STATE_IDENTITY)
        return self.network.identity


_SECTION_OF = {f.name: section for f, section in zip(fields(NodeConfig), SECTIONS, strict=True)}
