"""A data node's audits of stage replicas: the same activation through two replicas of a stage.

At each training step of a run whose replicas average (any `averaging.mode` but "none"), with
probability `defense.audit_rate`, the data node takes the first microbatch of the step, picks a
block stage with at least two replicas it still routes to, and sends
the same activation, the stage's input, to two of them (for stage s > 1, the input is what one pass
through stages 1..s−1 returned). Their outputs come home instead of going on. The decision is the
pure `shoal.train.audit.judge`; when the two disagree and the stage has a third replica, the third
one referees. A replica blamed in `defense.audit_failures` of the last `defense.audit_memory` audits
it took part in is excluded from this data node's routes (and its replacements) for the rest of the
run (exclusions.py).

An audit forward is an evaluation forward to a route of one hop: a replica that recognises audits
can behave only there (docs/security.md, "what the defenses do not stop").
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable

import torch

from shoal.node.context import NodeContext
from shoal.node.pipeline.data.captures import Captures
from shoal.node.pipeline.data.exclusions import Exclusions
from shoal.train.audit import AuditConfig, StageSpread, excluded, judge, learn, measure

logger = logging.getLogger(__name__)


class Auditor:
    """`captures`: forwards whose output comes home as it is; `exclusions`: where a replica blamed too
    often goes; `banned`: peers not to audit (those that just failed us, and those excluded);
    `closes_taken`: waits until the workers have answered the last step close."""

    def __init__(
        self,
        ctx: NodeContext,
        captures: Captures,
        exclusions: Exclusions,
        banned: Callable[[], set[str]],
        closes_taken: Callable[[], Awaitable[None]],
    ):
        self.ctx, self.captures, self.exclusions = ctx, captures, exclusions
        self.banned, self.closes_taken = banned, closes_taken
        run, defense = ctx.run, ctx.run.defense
        # Replicas that never average (averaging.mode "none") drift apart for good: an audit could only
        # fail, or blame whichever replica drifted furthest from two that happen to agree
        self.rate = defense.audit_rate if run.averaging.mode != "none" else 0.0
        self.config = AuditConfig(
            tolerance=defense.audit_tolerance,
            min_spread=defense.audit_min_spread,
            window=defense.audit_window,
            failures=defense.audit_failures,
            memory=defense.audit_memory,
        )
        self.rng = random.Random(f"{run.run_id}:audit:{ctx.peer_id}")
        self.spreads: dict[int, StageSpread] = {}
        self.blames: Counter[str] = Counter()
        self.outcomes: dict[str, list[bool]] = {}  # per replica, blamed or not in each audit it took part in
        self.audits = self.passed = self.failed = self.referees = 0
        self.audit_s: list[float] = []

    def maybe_audit(self, step: int, tokens: torch.Tensor) -> asyncio.Task | None:
        """With probability `audit_rate`, an audit of a random stage on these tokens, as a task."""
        if self.rate <= 0 or self.rng.random() >= self.rate:
            return None
        return asyncio.ensure_future(self._audit_safely(step, tokens))

    async def _audit_safely(self, step: int, tokens: torch.Tensor) -> None:
        """An audit that went wrong on our side is logged; it never stops the training step."""
        try:
            await self.closes_taken()  # replicas compared on the same step's weights
            await self.audit(step, tokens)
        except Exception as e:
            logger.warning("[%s] step %d: audit abandoned: %r", self.ctx.short_id, step, e)

    def _candidates(self, stage: int) -> list[str]:
        view = self.ctx.view
        avoid = self.banned()  # excluded peers included
        return sorted(n.peer_id for n in (view.replicas(stage) if view else ()) if n.peer_id not in avoid)

    async def audit(self, step: int, tokens: torch.Tensor) -> None:
        """One audit; failures to reach a replica make it inconclusive, never a blame."""
        stages = [s for s in range(1, self.ctx.run.pipeline.stages) if len(self._candidates(s)) >= 2]
        if not stages:
            return
        started = time.monotonic()
        stage = self.rng.choice(stages)
        replicas = self._candidates(stage)
        self.rng.shuffle(replicas)
        try:
            x = await self._stage_input(stage, tokens, step)
            if x is None:
                return
            first, second = replicas[0], replicas[1]
            ya, yb = await asyncio.gather(*(self._output(stage, p, x, tokens, step) for p in (first, second)))
            if ya is None or yb is None:
                return
            outputs = {first: ya, second: yb}
            spread = self.spreads.get(stage, StageSpread())
            result = measure(x, outputs)
            verdict = judge(result, spread, self.config, referee_available=len(replicas) > 2)
            if verdict.needs_referee:
                referee = await self._output(stage, replicas[2], x, tokens, step)
                if referee is None:
                    return
                self.referees += 1
                outputs[replicas[2]] = referee
                result = measure(x, outputs)
                verdict = judge(result, spread, self.config, referee_available=False)
            self.audits += 1
            self.spreads[stage] = learn(spread, result, verdict, self.config)
            self._act(step, stage, result, verdict)
        finally:
            self.audit_s.append(time.monotonic() - started)

    def _act(self, step: int, stage: int, result, verdict) -> None:
        deviations = {p[-8:]: round(d, 3) for p, d in zip(result.peers, result.deviations, strict=True)}
        for peer in result.peers:
            self.outcomes.setdefault(peer, []).append(peer in verdict.blamed)
            del self.outcomes[peer][: -self.config.memory]
        if verdict.passed:
            self.passed += 1
            logger.info("[%s] step %d: audit of stage %d passed %s (threshold %.3g)", self.ctx.short_id, step,
                        stage, deviations, verdict.threshold)  # fmt: skip
            return
        self.failed += 1
        logger.warning("[%s] step %d: audit of stage %d failed %s: %s; blamed %s", self.ctx.short_id, step, stage,
                       deviations, verdict.reason, [p[-8:] for p in verdict.blamed])  # fmt: skip
        for peer in verdict.blamed:
            self.blames[peer] += 1
            recent = self.outcomes[peer]
            if excluded(recent, self.config):
                self.exclusions.exclude(peer, f"stage {stage}: failed {sum(recent)} of its last {len(recent)} audits, "
                                              f"last at step {step}: {verdict.reason}")  # fmt: skip

    async def _stage_input(self, stage: int, tokens: torch.Tensor, step: int) -> torch.Tensor | None:
        """The activation stage `stage` takes for these tokens: the embedding, or (stage > 1) what one
        pass through a replica of each earlier stage returned."""
        x = await self.captures.embed(tokens)
        if stage == 1:
            return x
        hops = []
        for s in range(1, stage):
            choices = self._candidates(s)
            if not choices:
                return None
            hops.append((s, self.rng.choice(choices)))
        return await self.captures.forward_through(tuple(hops), x, tokens, f"audit{step}-in")

    async def _output(
        self, stage: int, peer: str, x: torch.Tensor, tokens: torch.Tensor, step: int
    ) -> torch.Tensor | None:
        return await self.captures.forward_through(((stage, peer),), x, tokens, f"audit{step}-{peer[-8:]}")

    def stats(self) -> dict:
        return {
            "audits": self.audits,
            "passed": self.passed,
            "failed": self.failed,
            "referees": self.referees,
            "blames": {peer: n for peer, n in self.blames.items()},
            "excluded": self.exclusions.record(),
            "audit_s": round(sum(self.audit_s), 3),
            "spread": {s: list(spread.deviations) for s, spread in self.spreads.items()},
        }
