"""The rollout worker: a node's GRPO duty (DESIGN §6), one round after another, no global barrier.

Each round r the worker derives its prompts (horizontal: the run's prompts of round r, the same on
every node; vertical: its own, seeded also by its peer id), samples its completions, sends its
`RolloutBundle` to up to k live rollout peers over libp2p streams (`rpc_rollouts`, reply `Ack`), and
collects theirs until every expected peer has sent or `round_deadline_s` has passed: a straggler or
a dead peer costs at most the deadline, never more. Then `shoal.grpo.round.learn` validates the
bundles again, recomputes every reward and takes one step. The DHT carries only node records.

Rounds are per node. A bundle for a round this node has closed is refused as late; one for a later
round is kept (a few per peer) and, when it comes from a listed rollout peer, lets a node that fell
behind (or just joined) jump to the swarm's round, which is how nodes started apart fall into step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from shoal.config import GRPORunConfig
from shoal.dht.records import MAX_EXCLUDED
from shoal.grpo.defenses import DefenseConfig, LengthMemory, Strikes
from shoal.grpo.evaluate import accuracy, heldout_prompts
from shoal.grpo.loss import GRPOConfig
from shoal.grpo.policy import PolicySpec
from shoal.grpo.round import RoundConfig, learn, make_bundle, make_optimizer, rollout_limits
from shoal.grpo.tasks import Prompt, get_task, task_seed
from shoal.grpo.warmup import cached_warm_up
from shoal.logs import printable
from shoal.node.context import NodeContext
from shoal.node.engine import Handler, Progress, TrainedState
from shoal.node.rpcs import EngineRpcs
from shoal.p2p.rpc import Rpc
from shoal.planning.observed import Trip
from shoal.planning.swarm_view import SwarmView
from shoal.protocol.pipeline import Ack
from shoal.protocol.rollout import BadRollout, RolloutBundle, validate_bundle

logger = logging.getLogger(__name__)

MAX_PENDING_PER_PEER = 3  # bundles a peer may have waiting here for rounds this node has not reached


@dataclass
class RolloutTraffic:
    bundles_sent: int = 0
    bundles_refused_by_peers: int = 0
    send_failures: int = 0
    bundles_received: int = 0
    bundles_refused: int = 0


def round_config(grpo: GRPORunConfig, run_id: str, peer_id: str) -> RoundConfig:
    """This node's `RoundConfig`: the run's, with its own prompt seed in the vertical layout."""
    return RoundConfig(
        task=grpo.task,
        run_seed=prompt_seed(grpo, peer_id),
        prompts_per_round=grpo.prompts_per_round,
        completions_per_prompt=grpo.group_size,
        max_foreign_per_prompt=grpo.group_size,  # every peer samples the run's group size, no more
        lr=grpo.lr,
        grpo=GRPOConfig(mode=grpo.mode, is_cap=grpo.is_cap, kl_threshold=grpo.kl_threshold),  # type: ignore[arg-type]
        run_id=run_id,
        sample_top_k=grpo.sample_top_k,
        defense=DefenseConfig(
            enabled=grpo.defenses,
            top_k=grpo.top_k,
            judge=grpo.judge,
            length_rule=grpo.length_rule,
            length_excess=grpo.length_excess,
            length_memory=grpo.length_memory,
            max_strikes=grpo.max_strikes,
        ),
    )


def prompt_seed(grpo: GRPORunConfig, peer_id: str) -> int:
    return grpo.seed if grpo.layout == "horizontal" else task_seed(grpo.seed, "vertical", peer_id)


def prompts_of(grpo: GRPORunConfig, peer_id: str, round: int) -> list[Prompt]:
    """The prompts `peer_id` answers in `round`: what any node can recompute, so no prompt travels."""
    task = get_task(grpo.task)
    return [task.prompt(prompt_seed(grpo, peer_id), round, i) for i in range(grpo.prompts_per_round)]


class RolloutWorker:
    """The engine of a `--role rollout` node: holds a whole policy and runs GRPO rounds."""

    movable = False

    def __init__(self, ctx: NodeContext, spec: PolicySpec, cache_dir: Path):
        assert ctx.run.grpo is not None, "a rollout worker needs a GRPO run"
        self.ctx, self.spec, self.cache_dir = ctx, spec, cache_dir
        self.grpo: GRPORunConfig = ctx.run.grpo
        self.cfg = round_config(self.grpo, ctx.run.run_id, ctx.peer_id)
        if ctx.config.experiment.undefended:  # this node's defenses are its own; the run's config is the default
            self.cfg = dataclasses.replace(self.cfg, defense=dataclasses.replace(self.cfg.defense, enabled=False))
            logger.warning("[%s] EXPERIMENT: this node checks no peer's rollouts", ctx.short_id)
        self.traffic = RolloutTraffic()
        self.round = 0  # the round this node is collecting (or about to)
        self.closed = -1  # rounds up to this one take no more bundles
        self._in_round = False
        self.summary: dict = {}
        self.accuracy: list[list[float]] = []
        self._inbox: dict[int, dict[str, RolloutBundle]] = {}
        self._arrived = asyncio.Event()
        self._sends: set[asyncio.Task] = set()
        self._progress = Path(ctx.config.output.progress_file) if ctx.config.output.progress_file else None
        self.strikes = Strikes(self.cfg.defense.max_strikes, self.cfg.defense.strike_share)
        self.length_memory = LengthMemory(self.cfg.defense.length_memory)
        self.adversary = None
        if ctx.hooks.adversary is not None:
            from shoal.adversary.attacks import get_attack

            self.adversary = get_attack(ctx.hooks.adversary)
            logger.warning(
                "[%s] EXPERIMENT: this node shares poisoned rollouts (%s)", ctx.short_id, self.adversary.name
            )

    @property
    def busy(self) -> bool:
        """A round is under way: shutdown lets it finish (bounded by the drain timeout)."""
        return self._in_round

    @property
    def dropped(self) -> tuple[str, ...]:
        """Peers this node no longer takes rollouts from (their bundles kept failing the checks)."""
        return tuple(self.strikes.dropped)

    @property
    def excluded(self) -> list[dict[str, str]]:
        """The dropped sources and why, as the node record lists them (`shoal status` shows them)."""
        dropped = list(self.strikes.dropped.items())[:MAX_EXCLUDED]
        return [{"peer_id": peer, "reason": printable(reason, 200)} for peer, reason in dropped]

    @property
    def model_id(self) -> str:
        return self.spec.model_id

    # ---- what the node asks of its engine (engine.py) ------------------------------------------------

    def handlers(self) -> Mapping[Rpc, Handler]:
        return {EngineRpcs.rollouts: self.on_rollouts}

    def progress(self) -> Progress:
        return Progress(model_id=self.model_id, excluded=tuple(self.excluded))

    def traffic_counts(self) -> dict[str, int]:
        return dataclasses.asdict(self.traffic)

    def trips(self) -> Sequence[Trip]:
        return ()

    def on_peer_restarted(self, restarted: set[str], live: set[str]) -> None:
        """Rounds are per node and bundles self-contained: nothing was in flight through a peer."""

    async def state_dict(self) -> TrainedState | None:
        """Rollout workers keep only their identity (the policy is warmed up again, or cached)."""
        return None

    async def load_state_dict(self, state: TrainedState) -> None:
        raise NotImplementedError("a rollout worker resumes from no saved state")

    async def join_by_copy(self) -> str | None:
        return None

    async def work(self) -> dict | None:
        await self.train()
        return self.summary

    async def start(self) -> None:
        """Warm the policy up (or load it from the cache) before the node announces itself."""
        loop = asyncio.get_running_loop()
        # warmed up on the CPU, so that one model id is one set of weights whatever device a node has
        policy, report = await loop.run_in_executor(None, cached_warm_up, self.spec, self.cache_dir)
        self.policy = policy.place(self.ctx.device, self.ctx.compute_dtype)
        self.optimizer = make_optimizer(self.policy, self.cfg)
        self.generator = torch.Generator().manual_seed(task_seed(self.ctx.peer_id, "sampling") % 2**63)
        self.tokenizer = self.spec.tokenizer()
        self.heldout = heldout_prompts(get_task(self.grpo.task), self.grpo.seed, self.grpo.eval_prompts)
        logger.info("[%s] policy %s ready (%s)", self.ctx.short_id, self.model_id,
                    "cached" if report.get("cached") else f"warmed up in {report['seconds']:.1f} s")  # fmt: skip

    def on_view(self, view: SwarmView) -> None:
        """Views arrive with the heartbeat; the worker reads `ctx.view` when it needs one."""

    # -- receiving ------------------------------------------------------------------------------

    async def on_rollouts(self, bundle: RolloutBundle, peer: str) -> Ack:
        """Keep a peer's bundle for its round, or refuse it with the reason; nothing else changes."""
        reason = self._refusal(bundle, peer)
        if reason is not None:
            self.traffic.bundles_refused += 1
            logger.warning("[%s] refused rollouts from %s: %s", self.ctx.short_id, peer[-8:], reason)
            return Ack(accepted=False, reason=reason[:200])
        self._inbox.setdefault(bundle.round, {})[peer] = bundle
        self.traffic.bundles_received += 1
        self._arrived.set()
        return Ack(accepted=True)

    def _refusal(self, bundle: RolloutBundle, peer: str) -> str | None:
        if self.strikes.is_dropped(peer):
            return f"dropped as a source: {self.strikes.dropped[peer]}"[:200]
        if bundle.round <= self.closed:
            return f"round {bundle.round} is closed here (this node is at round {self.round})"
        if bundle.round >= self.grpo.rounds:
            return f"round {bundle.round} is past the run's last round ({self.grpo.rounds - 1})"
        if peer in self._inbox.get(bundle.round, {}):
            return f"a bundle for round {bundle.round} from this peer is already here"
        if sum(peer in by_peer for by_peer in self._inbox.values()) >= MAX_PENDING_PER_PEER:
            return f"{MAX_PENDING_PER_PEER} bundles from this peer already wait here"
        try:
            validate_bundle(bundle, rollout_limits(self.cfg, self.tokenizer, bundle.round))
        except BadRollout as error:
            return error.message
        return None

    # -- the rounds ----------------------------------------------------------------------------

    async def train(self) -> None:
        """Run the run's rounds; write one progress line per round and a `done` line at the end."""
        started, loop = time.monotonic(), asyncio.get_running_loop()
        acc = await loop.run_in_executor(None, self._evaluate)
        self.accuracy.append([0, acc])
        self._emit({"event": "eval", "round": 0, "accuracy": acc, "model_id": self.model_id})
        rounds_run = 0
        while self.round < self.grpo.rounds:
            skipped = self._catch_up()
            await self._one_round(skipped)
            rounds_run += 1
            self.round += 1
        self.summary = {
            "rounds": rounds_run,
            "last_round": self.round - 1,
            "accuracy": self.accuracy,
            "seconds": time.monotonic() - started,
            **vars(self.traffic),
        }
        self._emit({"event": "done", **self.summary, "model_id": self.model_id})

    def _catch_up(self) -> int:
        """Jump to the latest round a listed rollout peer has already sent us; returns rounds skipped."""
        view = self.ctx.view
        listed = {n.peer_id for n in view.rollout_peers(self.ctx.peer_id)} if view is not None else set()
        ahead = [r for r, by_peer in self._inbox.items() if r > self.round and listed & set(by_peer)]
        if not ahead:
            return 0
        target = max(ahead)
        logger.info("[%s] peers are at round %d: jumping there from %d", self.ctx.short_id, target, self.round)
        skipped, self.round, self.closed = target - self.round, target, target - 1
        self._inbox = {r: b for r, b in self._inbox.items() if r >= target}
        return skipped

    async def _one_round(self, skipped: int) -> None:
        r, loop, began = self.round, asyncio.get_running_loop(), time.monotonic()
        self._in_round = True
        prompts = prompts_of(self.grpo, self.ctx.peer_id, r)
        own = await loop.run_in_executor(None, make_bundle, self.policy, self.cfg, prompts, self.generator)
        generation_s = time.monotonic() - began
        shared = own
        if self.adversary is not None:
            forgery = await loop.run_in_executor(
                None, self.adversary.forge, self.policy, self.cfg, prompts, self.generator
            )
            shared = forgery.bundle
        peers = self._peers()
        targets = random.Random(task_seed(self.ctx.peer_id, r)).sample(peers, min(self.grpo.max_peers, len(peers)))
        for peer in targets:
            task = asyncio.create_task(self._send(peer, shared), name=f"rollouts-{r}")
            self._sends.add(task)
            task.add_done_callback(self._sends.discard)
        expected = min(self.grpo.max_peers, len(peers))
        deadline = time.monotonic() + self.grpo.round_deadline_s
        while (remaining := deadline - time.monotonic()) > 0:
            if expected and len(self._inbox.get(r, {})) >= expected:
                break  # everyone we wait for has sent; with nobody listed, wait the deadline out
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), remaining)
            except TimeoutError:
                break
        self.closed = r
        received = self._inbox.pop(r, {})
        collected_s = time.monotonic() - began
        senders, foreign = list(received), list(received.values())
        theirs = [prompts_of(self.grpo, peer, r) for peer in senders] if self.grpo.layout == "vertical" else None
        if self.adversary is not None:
            foreign, theirs = [], None  # the attacker shares only what it forges and does not train
        report = await loop.run_in_executor(
            None,
            lambda: learn(
                self.policy,
                self.optimizer,
                self.cfg,
                prompts,
                own,
                foreign,
                foreign_prompts=theirs,
                memory=self.length_memory,
            ),  # fmt: skip
        )
        for peer, (completions, rejected, reason) in zip(senders, report.checks, strict=False):
            if self.cfg.defense.enabled and self.strikes.record(peer, completions, rejected, reason):
                logger.warning("[%s] dropped %s as a source: %s", self.ctx.short_id, peer[-8:], reason)
        event = {
            "event": "round",
            "round": r,
            "mean_reward": report.own_reward,
            "own_correct": report.own_correct,
            "foreign_reward": None if report.foreign_reward != report.foreign_reward else report.foreign_reward,
            "foreign_bundles": len(foreign),
            "foreign_used": report.loss.foreign_used,
            "foreign_dropped": report.loss.foreign_dropped,
            "refused": list(report.refused),
            "rejected": [rejected for _, rejected, _ in report.checks],
            "foreign_rejected": report.foreign_rejected,
            "length_cut": report.length_cut,
            "generation_s": round(generation_s, 3),
            "score_s": round(report.score_s, 4),
            "defense_s": round(report.defense_s, 4),
            "update_s": round(report.update_s, 3),
            "dropped": list(self.dropped),
            "adversary": None if self.adversary is None else self.adversary.name,
            "marks": self._marks(prompts, own),
            "peers": len(peers),
            "sent_to": len(targets),
            "skipped_rounds": skipped,
            "collect_s": round(collected_s, 3),
            "round_s": round(time.monotonic() - began, 3),
            "model_id": self.model_id,
        }
        if (r + 1) % self.grpo.eval_every == 0 or r + 1 == self.grpo.rounds:
            event["accuracy"] = await loop.run_in_executor(None, self._evaluate)
            self.accuracy.append([r + 1, event["accuracy"]])
        self._in_round = False
        self._emit(event)
        logger.info("[%s] round %d: reward %.3f, %d foreign bundles, %d refused%s", self.ctx.short_id, r,
                    report.own_reward, len(foreign), len(report.refused),
                    f", accuracy {event['accuracy']:.3f}" if "accuracy" in event else "")  # fmt: skip

    def _peers(self) -> list[str]:
        view = self.ctx.view
        listed = [] if view is None else [n.peer_id for n in view.rollout_peers(self.ctx.peer_id)]
        return [peer for peer in listed if not self.strikes.is_dropped(peer)]

    def _marks(self, prompts: list[Prompt], own: RolloutBundle) -> dict[str, float]:
        """Share of this round's own completions carrying each attack's payload: attack success, measured
        where it matters (tasks with visible working only; the payload detectors live with the attacks)."""
        task = get_task(self.grpo.task)
        if getattr(task, "steps", None) is None:
            return {}
        from shoal.adversary.attacks import ATTACKS

        by_index = {p.index: p.text for p in prompts}
        texts = [by_index[c.prompt_index] for c in own.completions]
        outs = [self.tokenizer.decode(c.tokens) for c in own.completions]
        return {name: round(attack.success(task, texts, outs), 4) for name, attack in ATTACKS.items()}

    async def _send(self, peer: str, bundle: RolloutBundle) -> None:
        try:
            ack = await self.ctx.rpc.rollouts(peer, bundle, self.grpo.round_deadline_s)
        except Exception as error:  # a dead, slow or refusing peer: the round goes on without it
            self.traffic.send_failures += 1
            logger.info("[%s] rollouts to %s failed: %s", self.ctx.short_id, peer[-8:], type(error).__name__)
            return
        if ack.accepted:
            self.traffic.bundles_sent += 1
        else:
            self.traffic.bundles_refused_by_peers += 1
            logger.info("[%s] %s refused our round %d: %s", self.ctx.short_id, peer[-8:], bundle.round, ack.reason)

    def _evaluate(self) -> float:
        return accuracy(self.policy, get_task(self.grpo.task), self.heldout)

    def _emit(self, event: dict) -> None:
        if self._progress is None:
            return
        with open(self._progress, "a") as f:
            f.write(json.dumps({**event, "peer_id": self.ctx.peer_id, "t": time.time()}) + "\n")

    def stats(self) -> dict:
        return {
            "round": self.round,
            "model_id": self.model_id,
            "accuracy": self.accuracy,
            "dropped": list(self.dropped),
            **vars(self.traffic),
        }

    async def stop(self) -> None:
        for task in list(self._sends):
            task.cancel()
        await asyncio.gather(*self._sends, return_exceptions=True)
