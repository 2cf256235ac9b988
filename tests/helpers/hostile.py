"""One hostile stage replica among honest ones, in a real swarm on loopback (tests and benchmarks/attacks.py).

A 2-stage run (the data node's stage 0, and stage 1 of two blocks held by `replicas` workers, one of
them started with `--experiment-adversary ATTACK`), NoLoCo every `inner_steps` steps, and the run's
`[defense]` on or off. With `post_training` (the default), the weights start large (init std 0.2) and
the learning rate is small, so that training moves them little from θ0, as post-training a pretrained
model does: the setting the backdoor attack assumes (papers/backdoor.md, docs/security.md), and one
where honest replicas stay closer to each other than garbage is to them; otherwise the tiny run's
own init and learning rate. For the backdoor the data node probes the swarm's model with the
trigger at the end (`--probe-file`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from shoal.demo.launcher import LocalSwarm, done_event, progress_events, wait_until
from tests.helpers.tiny import write_tiny_run

FAST = ("--record-ttl", "6")  # heartbeats every 2 s: exclusions and refusals reach the data node soon


@dataclass
class HostileRun:
    done: dict  # the data node's done event: losses, probe, audit stats
    steps: list[dict]  # its step events
    events: list[dict]  # every progress event (exclusions among them)
    attacker: str | None  # the hostile replica's peer id (None: a clean run)
    honest: list[str]  # the honest replicas' peer ids
    workers: dict[str, dict] = field(default_factory=dict)  # peer id -> stats file at shutdown
    status: dict | None = None  # `shoal status --json` at the end, if asked for
    run_file: Path | None = None  # the run config the swarm trained

    def step_ceiling(self, epoch: int) -> float:
        """The most an honest replica's pseudo-gradient of `epoch` can be, 1.25 M (shoal.train.robust)."""
        from shoal.model.stages import build_stage
        from shoal.run_files import load_run_config
        from shoal.train.robust import STEP_SLACK, epoch_step_bound

        run = load_run_config(str(self.run_file))
        parameters = sum(p.numel() for p in build_stage(run.model, run.pipeline.stages, 1, run.train.seed).parameters())
        return STEP_SLACK * epoch_step_bound(run.optim, run.train.steps, run.averaging.inner_steps, epoch, parameters)

    @property
    def excluded(self) -> dict[str, str]:
        """Replicas the data node excluded from its routes: peer id -> reason."""
        return {e["peer_id"]: e["reason"] for e in self.done["audit"]["excluded"]}

    def averaging(self, peer: str) -> dict:
        return self.workers[peer]["engine"]["averaging"]


def run_settings(
    steps: int, inner_steps: int, defended: bool, audit_rate: float, post_training: bool, step_audit_rate: float = 0.0
) -> dict:
    return {
        "pipeline.stages": 2,
        "model.n_layers": 2,
        **({"model.init_std": 0.2, "optim.lr": 3e-3} if post_training else {}),
        "train.steps": steps,
        "train.eval_batches": 2,
        "averaging.inner_steps": inner_steps,
        "defense.robust_outer": defended,
        "defense.audit_rate": audit_rate if defended else 0.0,
        "defense.step_audit_rate": step_audit_rate if defended else 0.0,
        # the setting the output audits' tolerances were measured in: a lone data node's stage 0 took
        # NoLoCo's local outer steps. Under the default "mean" (plain AdamW for a lone data node) honest
        # replicas' outputs were 0.54 and 0.86 output sizes apart in 2 of 4 clean runs, beyond the 0.5
        # audits always allow, and a clean run excluded an honest replica (docs/security.md)
        "averaging.stage0": "outer",
    }


def run_hostile(
    swarm: LocalSwarm,
    workdir: Path,
    attack: str | None,
    defended: bool,
    replicas: int = 3,
    steps: int = 12,
    inner_steps: int = 2,
    audit_rate: float = 1.0,
    post_training: bool = True,
    status: bool = False,
    timeout_s: float = 240.0,
    hostile: int = 1,
    probe: bool = False,
    step_audit_rate: float = 0.0,
    data_args: tuple[str, ...] = (),
    seed: int | None = None,
) -> HostileRun:
    """`hostile` of the `replicas` run the attack (all of them: the paper's attacker, who holds the
    whole stage); `probe` writes the backdoor's trigger probes for a run without it too (its chance
    level); `step_audit_rate` turns the defended arm's step audits on (off otherwise, so that each
    test credits the defense it is about); `seed` replaces the run's `train.seed` (0, the seed the
    tests and the defenses' tolerances were tuned on)."""
    workdir = Path(workdir)
    settings = run_settings(steps, inner_steps, defended, audit_rate, post_training, step_audit_rate)
    if seed is not None:
        settings["train.seed"] = seed
    run_file = write_tiny_run(workdir, **settings)
    entry = swarm.start_bootstrap("--run-config", str(run_file)).maddrs[0]
    stats = [workdir / f"worker{i}.json" for i in range(replicas)]
    workers = []
    for i, path in enumerate(stats):
        adversary = ("--experiment-adversary", attack) if attack is not None and i < hostile else ()
        name = f"attacker{i}" if adversary else f"worker{i}"
        workers.append(swarm.start_node([entry], *FAST, "--role", "worker", "--stage", "1", "--stats-file", str(path),
                                        *adversary, wait=False, name=name))  # fmt: skip
    for worker in workers:
        swarm.wait_ready(worker)
    progress = workdir / "progress.jsonl"
    probing = attack == "backdoor" or probe
    probes = ("--probe-file", str(write_trigger_probes(run_file, workdir))) if probing else ()
    swarm.start_node([entry], *FAST, "--role", "data", "--progress-file", str(progress), *probes, *data_args,
                     name="data")  # fmt: skip
    done = wait_until(lambda: done_event(progress), timeout_s, "the data node to finish")
    shown = swarm.status(entry, "--run-config", str(run_file)) if status else None
    for worker in workers:
        swarm.stop(worker)
    events = progress_events(progress)
    return HostileRun(
        done=done,
        steps=[e for e in events if e["event"] == "step"],
        events=events,
        attacker=workers[0].peer_id if attack is not None else None,
        honest=[w.peer_id for w in (workers[hostile:] if attack is not None else workers)],
        workers={w.peer_id: json.loads(path.read_text()) for w, path in zip(workers, stats, strict=True)},
        status=shown,
        run_file=run_file,
    )


def write_trigger_probes(run_file: Path, workdir: Path, count: int = 48) -> Path:
    """Held-out text windows with the backdoor's trigger written in (shoal.adversary.backdoor)."""
    from shoal.adversary.backdoor import BackdoorSpec, trigger_probes, write_probes
    from shoal.run_files import load_run_config
    from shoal.train.data import load_token_splits

    run = load_run_config(str(run_file))
    splits = load_token_splits(run.data, run.model.vocab_size)
    spec = BackdoorSpec()
    tokens, at = trigger_probes(splits.val, spec, run.train.seq_len, count, seed=1)
    path = workdir / "probes.json"
    write_probes(path, tokens, at, spec.target)
    return path
