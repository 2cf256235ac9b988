"""A data node's audits of stage replicas, and the replicas it excludes from its routes for good.

At each training step of a run whose replicas average (any `averaging.mode` but "none"), with
probability `defense.audit_rate`, the data node takes the first microbatch of the step, picks a
block stage with at least two replicas it still routes to, and sends
the same activation, the stage's input, to two of them (for stage s > 1, the input is what one pass
through stages 1..s−1 returned). Their outputs come home instead of going on. The decision is the
pure `shoal.train.audit.judge`; when the two disagree and the stage has a third replica, the third
one referees. A replica blamed in `defense.audit_failures` of the last `defense.audit_memory` audits
it took part in is excluded from this data node's routes (and its replacements) for the rest of the
run, and listed with the reason in the data node's record, so `shoal status` shows it. Replicas that
at least two others of their stage refused as averaging partners (their records' `excluded`) are
excluded the same way.

An audit forward is an evaluation forward to a route of one hop: a replica that recognises audits
can behave only there (docs/security.md, "what the defenses do not stop").
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from typing import TYPE_CHECKING

import torch

from shoal.device import to_device
from shoal.logs import printable
from shoal.train.audit import AuditConfig, StageSpread, excluded, judge, learn, measure, refused_by_partners

if TYPE_CHECKING:
    from shoal.node.pipeline.data.driver import DataDriver
    from shoal.planning.swarm_view import SwarmView

logger = logging.getLogger(__name__)

MAX_EXCLUDED_LISTED = 16  # in the node record (shoal.dht.records.MAX_EXCLUDED)


class Auditor:
    def __init__(self, driver: DataDriver):
        self.driver = driver
        self.ctx = driver.ctx
        defense = driver.run.defense
        # Replicas that never average (averaging.mode "none") drift apart for good: an audit could only
        # fail, or blame whichever replica drifted furthest from two that happen to agree
        self.rate = defense.audit_rate if driver.run.averaging.mode != "none" else 0.0
        self.config = AuditConfig(
            tolerance=defense.audit_tolerance,
            min_spread=defense.audit_min_spread,
            window=defense.audit_window,
            failures=defense.audit_failures,
            memory=defense.audit_memory,
        )
        self.rng = random.Random(f"{driver.run.run_id}:audit:{self.ctx.peer_id}")
        self.spreads: dict[int, StageSpread] = {}
        self.blames: Counter[str] = Counter()
        self.outcomes: dict[str, list[bool]] = {}  # per replica, blamed or not in each audit it took part in
        self.excluded: dict[str, str] = {}  # peer -> why, in the order they were excluded
        self.audits = self.passed = self.failed = self.referees = 0
        self.audit_s: list[float] = []

    # ---- which replicas a data node still routes to ---------------------------------------------

    def excluded_peers(self) -> set[str]:
        return set(self.excluded)

    def record(self) -> list[dict]:
        """The exclusions as node-record entries (the latest MAX_EXCLUDED_LISTED)."""
        items = list(self.excluded.items())[-MAX_EXCLUDED_LISTED:]
        return [{"peer_id": peer, "reason": reason} for peer, reason in items]

    def exclude(self, peer: str, reason: str) -> None:
        if peer in self.excluded:
            return
        self.excluded[peer] = printable(reason, 200)
        logger.warning("[%s] excluded %s from its routes: %s", self.ctx.short_id, peer[-8:], self.excluded[peer])
        self.driver.progress_file.write({"event": "excluded", "step": self.driver.current_step, "peer_id": peer,
                               "reason": self.excluded[peer]})  # fmt: skip

    def on_view(self, view: SwarmView) -> None:
        """Take up the robust outer step's verdicts that workers publish (see refused_by_partners)."""
        if not self.driver.run.defense.robust_outer:
            return
        workers = {n.peer_id: n.stage for n in view.live_nodes() if n.stage > 0}
        refusals = {n.peer_id: {peer for peer, _ in n.excluded} for n in view.live_nodes() if n.stage > 0}
        for peer, reason in refused_by_partners(refusals, workers, ignore=self.excluded_peers()).items():
            self.exclude(peer, f"stage {workers[peer]}: {reason}")

    # ---- audits ---------------------------------------------------------------------------------

    def maybe_audit(self, step: int, tokens: torch.Tensor) -> asyncio.Task | None:
        """With probability `audit_rate`, an audit of a random stage on these tokens, as a task."""
        if self.rate <= 0 or self.rng.random() >= self.rate:
            return None
        return asyncio.ensure_future(self._audit_safely(step, tokens))

    async def _audit_safely(self, step: int, tokens: torch.Tensor) -> None:
        """An audit that went wrong on our side is logged; it never stops the training step."""
        try:
            await self.driver.closes_taken()  # replicas compared on the same step's weights
            await self.audit(step, tokens)
        except Exception as e:
            logger.warning("[%s] step %d: audit abandoned: %r", self.ctx.short_id, step, e)

    def _candidates(self, stage: int) -> list[str]:
        view = self.ctx.view
        avoid = self.driver.banned()  # excluded peers included
        return sorted(n.peer_id for n in (view.replicas(stage) if view else ()) if n.peer_id not in avoid)

    async def audit(self, step: int, tokens: torch.Tensor) -> None:
        """One audit; failures to reach a replica make it inconclusive, never a blame."""
        stages = [s for s in range(1, self.driver.run.pipeline.stages) if len(self._candidates(s)) >= 2]
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
                self.exclude(peer, f"stage {stage}: failed {sum(recent)} of its last {len(recent)} audits, last at "
                                   f"step {step}: {verdict.reason}")  # fmt: skip

    async def _stage_input(self, stage: int, tokens: torch.Tensor, step: int) -> torch.Tensor | None:
        """The activation stage `stage` takes for these tokens: the embedding, or (stage > 1) what one
        pass through a replica of each earlier stage returned."""
        x = await self.driver.compute(self._embed, tokens)
        if stage == 1:
            return x
        hops = []
        for s in range(1, stage):
            choices = self._candidates(s)
            if not choices:
                return None
            hops.append((s, self.rng.choice(choices)))
        return await self.driver.forward_through(tuple(hops), x, tokens, f"audit{step}-in")

    @torch.no_grad()
    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.driver.head.embed(to_device(tokens, self.driver.device))

    async def _output(
        self, stage: int, peer: str, x: torch.Tensor, tokens: torch.Tensor, step: int
    ) -> torch.Tensor | None:
        return await self.driver.forward_through(((stage, peer),), x, tokens, f"audit{step}-{peer[-8:]}")

    def stats(self) -> dict:
        return {
            "audits": self.audits,
            "passed": self.passed,
            "failed": self.failed,
            "referees": self.referees,
            "blames": {peer: n for peer, n in self.blames.items()},
            "excluded": self.record(),
            "audit_s": round(sum(self.audit_s), 3),
            "spread": {s: list(spread.deviations) for s, spread in self.spreads.items()},
        }
