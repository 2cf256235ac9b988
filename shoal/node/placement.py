"""Which stage this node holds: the one `--stage` names, else the swarm's choice (the router's, over the
last view) among the stages its memory holds, and the data role for a node nobody can dial back.

It keeps what a choice leaves behind: why memory kept the node off the stage it would have taken
(published in its record, so `shoal status` shows it), and whether it may only dial out.
"""

from __future__ import annotations

import logging

from shoal.config import RunConfig
from shoal.errors import UsageError
from shoal.node import capacity
from shoal.node.config import PlacementOptions
from shoal.node.machine import Machine
from shoal.planning.assignment import Candidate
from shoal.planning.memory import fits
from shoal.planning.memory import refusal as memory_refusal
from shoal.planning.peer_router import PeerRouter
from shoal.planning.swarm_view import ROLE_DATA, ROLE_WORKER, StageIndex, SwarmView

logger = logging.getLogger(__name__)


class Placement:
    def __init__(
        self,
        run: RunConfig,
        options: PlacementOptions,
        max_inflight: int | None,
        machine: Machine,
        router: PeerRouter,
        peer_id: str,
        started_at: float,
    ) -> None:
        self.run, self.options, self.machine, self.router = run, options, machine, router
        self.max_inflight = max_inflight  # --max-inflight (None: what the memory allows)
        self.peer_id, self.started_at = peer_id, started_at
        self.note: str | None = None  # why memory kept this node off the stage it would have taken
        self.client_only = False  # nobody could dial it back: it holds the data role, which dials out only

    @property
    def short_id(self) -> str:
        return self.peer_id[-8:]

    def choose_stage(self, view: SwarmView | None, current: StageIndex | None, inflight: int) -> StageIndex:
        """The stage to hold now: the one given by --stage, else the swarm's choice among the stages that
        fit this node's memory (none: 0, for rollouts). `current`: the stage it holds (or resumes), with
        `inflight` microbatches at once."""
        if self.run.mode == "grpo":
            return 0
        fitting = self.stages_that_fit()
        if self.client_only:
            if 0 not in fitting:
                raise UsageError(f"not reachable, so it can take only the data role, and {self.refusal(0)}")
            return 0
        if self.options.stage is not None:
            stage = self.options.stage
            if stage >= self.run.pipeline.stages:
                last = self.run.pipeline.stages - 1
                raise UsageError(f"--stage {stage}: run {self.run.name} has block stages 1..{last}")
            if stage not in fitting:
                raise UsageError(f"--stage {stage}: {self.refusal(stage)}")
            return stage
        assert view is not None
        blocks = max(1, view.blocks_per_stage[1]) if view.stages > 1 else 1
        throughput = self.machine.block_throughput
        forward_s = blocks / max(throughput, 1e-9) / (1.0 + self.router.cost.backward_factor)
        if fitting == self.stages_for_role():  # memory rules nothing out: the swarm's choice, unchanged
            self.note = None
            return self.router.place(view, self.candidate(current), forward_s, inflight)
        chosen = self.router.place(view, self.candidate(current, fitting), forward_s, inflight)
        wanted = self.router.place(view, self.candidate(current), forward_s, inflight)
        note = f"{self.refusal(wanted)}: taking stage {chosen}" if wanted not in fitting else None
        if note is not None and note != self.note:
            logger.warning("[%s] %s", self.short_id, note)
        self.note = note
        return chosen

    def inflight(self, stage: StageIndex) -> int:
        """The microbatches this node holds at once on `stage`: --max-inflight, else what its memory allows."""
        return self.max_inflight or capacity.inflight_budget(self.run, stage, self.machine.memory_bytes)

    def stages_that_fit(self) -> frozenset[StageIndex]:
        """The stages this node's memory holds (with --max-inflight microbatches, else one), or exit 2
        naming the smallest one's need when none does."""
        inflight = self.max_inflight or 1
        candidates = sorted(self.stages_for_role())
        need = {s: capacity.stage_need(self.run, s) for s in candidates}
        fitting = frozenset(s for s in candidates if fits(need[s], self.machine.memory_bytes, inflight))
        if not fitting:
            smallest = min(candidates, key=lambda s: need[s].total(inflight))
            raise UsageError(
                f"no stage of run {self.run.name} fits this node: {self.refusal(smallest)}{self.machine.limited}"
            )
        return fitting

    def stages_for_role(self) -> frozenset[StageIndex]:
        """The stages `--role` lets this node take: 0 for a data node, the block stages for a worker."""
        role = self.options.role
        if role == ROLE_DATA:
            return frozenset({0})
        return frozenset(range(1 if role == ROLE_WORKER else 0, self.run.pipeline.stages))

    def refusal(self, stage: StageIndex) -> str:
        return memory_refusal(capacity.stage_need(self.run, stage), self.machine.memory_bytes)

    def candidate(self, current: StageIndex | None, fitting: frozenset[StageIndex] | None = None) -> Candidate:
        return Candidate(
            peer_id=self.peer_id,
            block_throughput=self.machine.block_throughput,
            started_at=self.started_at,
            role=self.options.role,
            current_stage=current,
            stages_that_fit=fitting,
        )

    def seen(self, view: SwarmView | None) -> str:
        """What a stage choice rested on, for the log: this node's speed and the holders it saw."""
        seen = f"own speed {self.machine.block_throughput:.1f} blocks/s"
        if view is None or view.stages < 2:
            return seen
        me = self.peer_id
        speeds = {s: [f"{n.block_throughput:.1f}" for n in view.replicas(s, me)] for s in range(1, view.stages)}
        holders = ", ".join(f"stage {s}: {' '.join(v) or 'none'}" for s, v in speeds.items())
        return f"{seen}; others seen, by speed: {holders}"

    def take_client_role_if_unreachable(self, reachable: bool | None, relays: tuple[str, ...]) -> None:
        """A node nobody could dial back takes the data role: it opens every stream itself (a hop's answer
        comes back over the connection it dialed), where a stage worker waits to be dialed. Reached
        through `relays` (shoal/p2p/relay.py) it keeps the swarm's choice like any node."""
        if reachable is not False:
            return
        if relays:
            logger.info("[%s] not reachable directly: reached through relay(s) %s, it takes the swarm's choice of "
                        "stage", self.short_id, ", ".join(r[-8:] for r in relays))  # fmt: skip
            return
        options = self.options
        if options.role == ROLE_WORKER or options.stage is not None:
            flag = "--role worker" if options.role == ROLE_WORKER else f"--stage {options.stage}"
            raise UsageError(f"{flag}: peers could not open a connection to this node, and a stage worker must be "
                             "dialed by its peers; forward its port (see the warning above), let it be reached "
                             "through a relay (--relayed auto, the default, with a relay peer in the swarm), or let it "
                             "take the data role (--role auto)")  # fmt: skip
        logger.warning("[%s] not reachable: taking the data role, which dials every peer itself and needs no "
                       "inbound connection (a stage worker would never be sent work)", self.short_id)  # fmt: skip
        self.client_only = True
