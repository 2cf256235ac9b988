"""NodeConfig: how this peer runs (as opposed to RunConfig: what the swarm trains)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shoal.config import ConfigError

ROLES = ("auto", "data", "worker", "rollout")
STATE_IDENTITY = "identity"  # the node's key, inside --state-dir (see state/store.py)
EXIT_TIMEOUT_S = 60.0  # default: the drain, the last save and leaving the DHT take seconds, not minutes


@dataclass(frozen=True)
class NodeConfig:
    initial_peers: tuple[str, ...] = ()
    identity: str | None = None  # path of the identity file; None = a fresh identity each start
    state_dir: str | None = None  # identity, weights, optimizer state and counters across restarts
    save_every_s: float = 60.0  # how often a node with a state dir saves (and a kill loses at most)
    host_maddrs: tuple[str, ...] = ("/ip4/127.0.0.1/tcp/0",)
    announce_maddrs: tuple[str, ...] = ()
    use_relay: bool = True  # libp2p's circuit relay transport (hivemind's default)
    use_auto_relay: bool = False  # behind NAT: find relays and be reachable through them
    run_name: str | None = None  # read this run's config from the DHT
    run_config_path: str | None = None  # or from this file
    data_path: str | None = None  # overrides the run's data.path for this node
    role: str = "auto"
    routing: str = "auto"  # auto (random with NoLoCo averaging, else gwtf), gwtf, swarm, capacity or random
    stage: int | None = None  # hold this block stage and never move (None: the swarm's choice)
    paths: str = "full"  # data nodes: "full" (every block stage in order) or "skippipe" (partial paths)
    skip: float = 0.33  # SkipPipe: share of block stages a path skips
    max_swaps: int = 0  # SkipPipe: adjacent-stage swaps a path may make
    threads: int | None = None  # torch threads; None: torch's default, every core this process may use
    max_inflight: int | None = None  # None: derived from free memory
    record_ttl_s: float = 30.0
    rpc_timeout_s: float = 30.0
    drain_timeout_s: float = 5.0
    exit_timeout_s: float = EXIT_TIMEOUT_S  # after a stop signal, exit by then even if the shutdown is stuck
    microbatch_timeout_s: float = 60.0  # a data node re-sends a microbatch that has not come back by then
    stage_wait_s: float = 120.0  # how long to wait for a stage with no live replica before abandoning (stage_lost)
    data_shard: int = 0  # this data node's shard of the training windows, of `data_shards`
    data_shards: int = 1
    ready_file: str | None = None
    progress_file: str | None = None  # data nodes append one JSON line per step here
    stats_file: str | None = None  # written at shutdown: counters, traffic, memory
    compute_trace: str | None = None  # append a line per compute job: start, end, job, thread CPU seconds
    metrics_port: int | None = None  # serve Prometheus metrics here (0: a free port; None: off)
    metrics_host: str = "127.0.0.1"
    # fault injection for tests and chaos runs: (step, seconds) to hold the gradients of that step
    # before passing them upstream, so that a kill can land while a hop waits for its gradient
    inject_upstream_delay: tuple[int, float] | None = None
    # fault injection for tests: a worker that computes this much slower than it claims (every forward)
    inject_forward_delay_s: float = 0.0
    # fault injection for tests: a data node whose step closes reach the workers this much later, after
    # the next step's forwards
    inject_close_delay_s: float = 0.0
    # fault injection for tests: (step, seconds) a worker's handling of that step's close is blocked in a
    # thread, as an outer step stuck in its all-reduce's lock was
    inject_close_stall: tuple[int, float] | None = None
    # fault injection for tests: a worker that dies as if SIGKILLed (no goodbye, nothing saved) when the
    # first forward of this training step reaches it, so that a wipe lands on a known step
    inject_crash_at_step: int | None = None
    # GRPO rollout workers: this node's own policy (its model id goes into the node record)
    policy_width: int = 48
    policy_depth: int = 2
    policy_heads: int = 2
    policy_seed: int = 0
    warmup_steps: int = 650
    policy_cache: str | None = None  # warmed-up policies by model id (default: the shoal cache)
    experiment_adversary: str | None = None  # an EXPERIMENT: poisoned rollouts or a hostile stage (shoal.adversary)
    experiment_undefended: bool = False  # an EXPERIMENT: a rollout worker that checks no peer's rollouts
    probe_file: str | None = None  # data nodes: after training, probe the swarm's model with these (see data_driver.py)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError("--role", f"must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.stage is not None and (self.stage < 1 or self.role == "data"):
            raise ConfigError("--stage", "must be a block stage (1 or more), for a worker")
        if self.routing not in ("auto", "gwtf", "swarm", "capacity", "random"):
            raise ConfigError("--routing", f"must be auto, gwtf, swarm, capacity or random, got {self.routing!r}")
        if self.paths not in ("full", "skippipe"):
            raise ConfigError("--paths", f"must be full or skippipe, got {self.paths!r}")
        if not 0.0 <= self.skip < 1.0:
            raise ConfigError("--skip", f"must be in [0, 1), got {self.skip}")
        if self.max_swaps < 0:
            raise ConfigError("--max-swaps", "must be zero or more")
        if self.threads is not None and self.threads < 1:
            raise ConfigError("--threads", "must be at least 1")
        if self.inject_forward_delay_s < 0:
            raise ConfigError("--inject-forward-delay", "must be zero or more")
        if self.inject_crash_at_step is not None and self.inject_crash_at_step < 0:
            raise ConfigError("--inject-crash-at-step", "must be zero or more")
        if self.inject_close_delay_s < 0:
            raise ConfigError("--inject-close-delay", "must be zero or more")
        if self.use_auto_relay and not self.use_relay:
            raise ConfigError("--use-auto-relay", "needs the relay transport: drop --no-relay")
        if self.max_inflight is not None and self.max_inflight < 1:
            raise ConfigError("--max-inflight", "must be at least 1")
        if not 3.0 <= self.record_ttl_s <= 3600.0:
            raise ConfigError("--record-ttl", "must be between 3 and 3600 seconds")
        if not 0 <= self.data_shard < self.data_shards:
            raise ConfigError("--data-shard", f"must be K/N with 0 <= K < N, got {self.data_shard}/{self.data_shards}")
        if self.microbatch_timeout_s <= 0:
            raise ConfigError("--microbatch-timeout", "must be positive")
        if not self.exit_timeout_s > 0:
            raise ConfigError("--exit-timeout", "must be positive")
        if self.stage_wait_s < 0:
            raise ConfigError("--stage-wait", "must be zero or more seconds")
        if not (8 <= self.policy_width <= 1024):
            raise ConfigError("--policy-width", f"must be in 8..1024, got {self.policy_width}")
        if not (1 <= self.policy_depth <= 32):
            raise ConfigError("--policy-depth", f"must be in 1..32, got {self.policy_depth}")
        heads = self.policy_heads
        if heads < 1 or self.policy_width % heads or (self.policy_width // heads) % 2:
            raise ConfigError("--policy-heads", f"must split --policy-width into even head dims, got {heads}")
        if self.policy_seed < 0:
            raise ConfigError("--policy-seed", "must be zero or more")
        if not (0 <= self.warmup_steps <= 100_000):
            raise ConfigError("--warmup-steps", f"must be in 0..100000, got {self.warmup_steps}")
        if self.experiment_adversary is not None:
            self._check_adversary()
        if self.experiment_undefended and self.role != "rollout":
            raise ConfigError("--experiment-undefended", "it turns off a rollout worker's checks: use --role rollout")
        if self.run_name and self.run_config_path:
            raise ConfigError("--run", "give --run or --run-config, not both")
        if not 0.1 <= self.save_every_s <= 86400:
            raise ConfigError("--save-every-s", f"must be between 0.1 and 86400 seconds, got {self.save_every_s}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError("--metrics-port", f"must be a TCP port (0: any free one), got {self.metrics_port}")

    def _check_adversary(self) -> None:
        """Rollout attacks need --role rollout; hostile stage replicas (shoal.adversary.stage) --role worker."""
        from shoal.adversary.attacks import ATTACKS
        from shoal.adversary.stage import STAGE_ATTACKS

        name = self.experiment_adversary
        if name not in ATTACKS and name not in STAGE_ATTACKS:
            known = ", ".join([*ATTACKS, *STAGE_ATTACKS])
            raise ConfigError("--experiment-adversary", f"must be one of {known}, got {name!r}")
        if name in STAGE_ATTACKS and self.role != "worker":
            raise ConfigError("--experiment-adversary", f"{name} is a stage replica's attack: it needs --role worker")
        if name in ATTACKS and self.role != "rollout":
            raise ConfigError("--experiment-adversary", f"{name} is a rollout attack: it needs --role rollout")

    @property
    def heartbeat_s(self) -> float:
        """Re-announce at a third of the record's lifetime, so two lost heartbeats do not expire it."""
        return self.record_ttl_s / 3

    @property
    def identity_file(self) -> str | None:
        """--identity, else the identity kept in --state-dir, else None (a fresh identity)."""
        if self.identity is None and self.state_dir is not None:
            return str(Path(self.state_dir) / STATE_IDENTITY)
        return self.identity
