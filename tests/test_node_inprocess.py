"""The pipeline's protocols in one process (tests/helpers/inprocess.py): the real engines and every
byte of their RPCs, over the in-memory transport, with faults scripted at the moment one node opens a
stream to another. What only real peers show (libp2p, the DHT, a process's death, the CLI) stays in
the multi-process tests; the logic of a hop, its redo and a step's close is checked here, in seconds."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from shoal.node.config import ExperimentOptions, NodeConfig
from shoal.node.hooks import Hooks
from shoal.planning.swarm_view import BackupNote
from shoal.train.backup_stream import snapshot_digest
from shoal.train.data import load_token_splits
from shoal.train.reference import ReferenceTrainer
from tests.helpers.inprocess import InProcessSwarm, corpus_run, worker_id
from tests.helpers.tiny import tiny_run

pytestmark = [pytest.mark.timeout(180)]
PARITY_RUN = {"train.steps": 8, "averaging.mode": "none", "train.eval_every": 3}
FAULT_RUN = {"train.steps": 6, "averaging.mode": "none", "defense.audit_rate": 0.0, "train.eval_every": 0}


def train(swarm: InProcessSwarm, data_config: NodeConfig | None = None, during=None) -> dict:
    """Start the swarm, train the run's steps (with `during(swarm)` beside them), stop it; the summary."""

    async def main() -> dict:
        driver = await swarm.start(data_config)
        try:
            work = asyncio.ensure_future(driver.work())
            if during is not None:
                await during(swarm)
            return await asyncio.wait_for(work, 150)
        finally:
            await swarm.close()

    return asyncio.run(main())


def ledger(swarm: InProcessSwarm) -> dict:
    assert swarm.data is not None
    return swarm.data.ledger.summary()


def delayed_closes(delay_s: float) -> NodeConfig:
    return dataclasses.replace(NodeConfig(), experiment=ExperimentOptions(close_delay_s=delay_s))


@pytest.mark.parametrize(
    ("close_delay", "changed"),
    [
        (0.3, {}),
        (0.0, {"pipeline.wire_dtype": "bfloat16"}),
        (0.0, {"pipeline.wire_dtype": "int8"}),
        (0.0, {"pipeline.compute_dtype": "bfloat16"}),
        (0.0, {"pipeline.wire_dtype": "int8", "model.subspace_rank": 8}),
    ],
    ids=["closes-overtaken-by-forwards", "bfloat16-wire", "int8-wire", "bf16-autocast", "subspace-int8-wire"],
)
def test_the_swarm_in_one_process_matches_the_local_trainer_step_for_step(tmp_path, close_delay, changed) -> None:
    """As tests/test_node_pipeline.py's parity test over real daemons (which keeps the plain float32
    case): with every close delayed past the next step's forwards, the workers hold those forwards
    until they have stepped; over a bfloat16 or int8 wire, under bf16 autocast and in a Subspace
    Network's run the local trainer does as the peers do and the losses agree."""
    run = corpus_run(tmp_path, tiny_run(**PARITY_RUN, **changed))
    swarm = InProcessSwarm(run, {1: 1, 2: 1})
    done = train(swarm, delayed_closes(close_delay))
    reference = ReferenceTrainer(run, load_token_splits(run.data, run.model.vocab_size)).train()
    assert swarm.data is not None
    swarm_losses = [r.loss for r in swarm.data.steps.history]
    tolerance = 2e-3 if "pipeline.compute_dtype" in changed else 2e-4
    assert swarm_losses == pytest.approx([r.loss for r in reference.history], rel=tolerance, abs=tolerance)
    if changed:  # and a local trainer in float32 throughout would not have kept it
        fp32 = dataclasses.replace(run.pipeline, wire_dtype="float32", compute_dtype="float32")
        splits = load_token_splits(run.data, run.model.vocab_size)
        plain = ReferenceTrainer(dataclasses.replace(run, pipeline=fp32), splits).train()
        gap, plain_gap = (max(abs(a - r.loss) for a, r in zip(swarm_losses, h, strict=True))
                          for h in (reference.history, plain.history))  # fmt: skip
        assert plain_gap > 4 * gap, (gap, plain_gap)
    assert done["val_loss"] == pytest.approx(reference.val_loss, rel=tolerance)
    assert ledger(swarm)["microbatches_abandoned"] == 0
    workers = [swarm.engine(p) for s in (1, 2) for p in swarm.workers(s)]
    assert [w.progress().inner_step for w in workers] == [run.train.steps] * 2  # once per step, never twice
    assert swarm_losses[-1] < swarm_losses[0]


class Scripted(Hooks):
    """A worker's faults, scripted in the engine itself: at the first forward of `crash_at_step` it
    dies after taking it (as `--inject-crash-at-step`: acknowledged, never passed on), and at the first
    gradient of `kill_upstream_at` it has the hop it passes the gradient to (and `also`) killed first."""

    def __init__(self, swarm: InProcessSwarm, me: str, crash_at_step: int | None = None,
                 kill_upstream_at: int | None = None, also: tuple[str, ...] = ()):  # fmt: skip
        super().__init__()
        self.swarm, self.me = swarm, me
        self.crash_at_step, self.kill_upstream_at, self.also = crash_at_step, kill_upstream_at, also
        self.killed: list[str] = []

    def before_forward(self, step: int, short_id: str) -> None:
        if self.crash_at_step is not None and step >= self.crash_at_step and self.swarm.members[self.me].alive:
            for peer in (self.me, *self.also):
                self.swarm.kill_soon(peer)
                self.killed.append(peer)
        if not self.swarm.members[self.me].alive:
            raise asyncio.CancelledError  # gone: what it took dies with it

    async def before_upstream(self, step: int, hop: int, microbatch_id: str, upstream: str, short_id: str) -> None:
        if step == self.kill_upstream_at and not self.killed and hop > 0:
            for peer in (upstream, *self.also):
                await self.swarm.kill(peer)
                self.killed.append(peer)


class DiesInItsBackward(Hooks):
    """A replica that dies at step `at_step` as it is about to pass a gradient upstream (the gradient
    goes with it), while fewer than `up_to` of a test's `deaths` (shared by its hooks) have died."""

    def __init__(self, swarm: InProcessSwarm, me: str, deaths: list[str], up_to: int, at_step: int = 2) -> None:
        super().__init__()
        self.swarm, self.me, self.deaths, self.up_to, self.at_step = swarm, me, deaths, up_to, at_step

    async def before_upstream(self, step: int, hop: int, microbatch_id: str, upstream: str, short_id: str) -> None:
        if step == self.at_step and len(self.deaths) < self.up_to and self.me not in self.deaths:
            self.deaths.append(self.me)
            self.swarm.kill_soon(self.me)
            raise asyncio.CancelledError


def trained_through(swarm: InProcessSwarm, deaths: list[str]) -> dict:
    """Train the run through the two deaths its hooks script; every microbatch completes. The ledger."""
    done = train(swarm)
    assert len(deaths) == 2
    summary = ledger(swarm)
    assert summary["microbatches_abandoned"] == 0, summary["abandoned_details"]
    assert summary["microbatches_completed"] == summary["microbatches_injected"]
    assert done["steps"] == swarm.run.train.steps
    return summary


def random_routing() -> NodeConfig:
    return dataclasses.replace(NodeConfig(), placement=dataclasses.replace(NodeConfig().placement, routing="random"))


def _simulated_crash_in_forward() -> dict:
    """The same fault in the simulator: one microbatch through a data node, a stage-1 node and one of
    two stage-2 replicas, which crashes while it computes the microbatch's forward (3.2-5.2 s). The
    sender notices after its failure timeout, and the forward resumes from the stage-1 node, which
    kept its output (`shoal.sim.faults`: the nearest upstream holder)."""
    import random

    from shoal.planning.costs import CostModel
    from shoal.planning.policy import make_policy
    from shoal.planning.swarm import PlanNode, Swarm
    from shoal.sim.engine import SimConfig, Simulator

    cost = CostModel(activation_bytes=50, per_hop_overhead_s=0.05)
    nodes = (PlanNode(0, 0, 0, 1.0, 1), PlanNode(1, 1, 1, 2.0, 1), PlanNode(2, 2, 1, 2.0, 1), PlanNode(3, 2, 1, 2.0, 1))
    swarm = Swarm(nodes, 3, ((0.0, 0.1), (0.1, 0.0)), ((1e12, 100.0), (100.0, 1e12)))
    for victim in (2, 3):  # the policy routes through one of the two; crash each in turn, keep the hit
        config = SimConfig(microbatches=1, failure_timeout_s=5.0, scripted=((4.0, "crash", victim),))
        sim = Simulator(swarm, cost, make_policy("gwtf", cost, random.Random(0)), config, random.Random(0))
        result = sim.run()
        if sim.stats["detected_losses"]:
            return {"sent again": result.restarted, "resumed": sim.stats["detected_losses"],
                    "abandoned": result.abandoned, "completed": result.completed}  # fmt: skip
    raise AssertionError("neither crash hit the microbatch")


def test_the_simulator_and_the_engines_resume_a_forward_lost_after_its_hop_took_it(tmp_path) -> None:
    """A stage-2 replica takes a microbatch's activation and dies before passing it on: the data node
    has the stage-1 hop, which kept its output, pass it on to the other stage-2 replica (the forward is
    resumed there, not sent again), and nothing is lost; the simulator counts the same. Random replicas
    everywhere, one microbatch a step: 12 steps miss the victim with probability 2^-12."""
    run = corpus_run(tmp_path, tiny_run(**{**FAULT_RUN, "train.steps": 12, "train.batch_size": 2}))
    victim = worker_id(2, 0)
    swarm = InProcessSwarm(run, {1: 1, 2: 2}, random_routing())
    swarm.hooks[victim] = hooks = Scripted(swarm, victim, crash_at_step=0)
    done = train(swarm)
    assert hooks.killed == [victim]
    assert done["steps"] == 12
    summary = ledger(swarm)
    real = {"sent again": summary["microbatches_resent"], "resumed": summary["microbatches_resumed"],
            "abandoned": summary["microbatches_abandoned"], "completed": 1}  # fmt: skip
    assert real == _simulated_crash_in_forward() == {"sent again": 0, "resumed": 1, "abandoned": 0, "completed": 1}
    assert swarm.engine(worker_id(1, 0)).stats()["forwards_resumed"] == 1


def test_a_hop_killed_mid_backward_is_redone_by_another_replica_and_nothing_else_is(tmp_path) -> None:
    """Stage 2 is about to pass step 3's gradient to the stage-1 replica that holds the microbatch's
    graph, and that replica dies: stage 2 has the other stage-1 replica redo only that hop, from the
    input the data node kept, and the backward goes on; no forward is sent again. One microbatch a
    step, so that none is still on its way forward through the replica that dies (with four a step,
    one was, under load, and was sent again, as it should be)."""
    run = corpus_run(tmp_path, tiny_run(**{**FAULT_RUN, "train.batch_size": 2}))
    holder = worker_id(2, 0)
    swarm = InProcessSwarm(run, {1: 2, 2: 1}, random_routing())
    swarm.hooks[holder] = hooks = Scripted(swarm, holder, kill_upstream_at=3)
    done = train(swarm)
    (victim,) = hooks.killed
    (survivor,) = swarm.workers(1)
    summary = ledger(swarm)
    assert summary["microbatches_abandoned"] == 0, summary["abandoned_reasons"]
    assert summary["microbatches_completed"] == summary["microbatches_injected"] and summary["microbatches_resent"] == 0
    delegated = swarm.engine(holder).stats()["recomputes_delegated"]
    assert delegated >= 1 and swarm.engine(survivor).stats()["recomputed"] == delegated
    assert done["steps"] == run.train.steps


def test_a_forward_whose_hop_and_the_hop_before_both_died_is_sent_again_and_nothing_is_lost(tmp_path) -> None:
    """A stage-2 replica dies after taking a forward, and so does the stage-1 replica that kept its
    input: there is nobody to resume from, so the data node sends the microbatch again, whole, through
    the replicas left."""
    run = corpus_run(tmp_path, tiny_run(**{**FAULT_RUN, "train.steps": 8, "train.batch_size": 2}))
    victim, upstream = worker_id(2, 0), worker_id(1, 0)
    swarm = InProcessSwarm(run, {1: 2, 2: 2}, random_routing())
    swarm.hooks[victim] = hooks = Scripted(swarm, victim, crash_at_step=0, also=(upstream,))
    done = train(swarm)
    assert hooks.killed == [victim, upstream]
    summary = ledger(swarm)
    assert summary["microbatches_abandoned"] == 0, summary["abandoned_reasons"]
    assert summary["microbatches_completed"] == summary["microbatches_injected"]
    assert summary["microbatches_resent"] >= 1
    assert done["steps"] == run.train.steps


def _simulated_two_hops_lost_in_backward() -> dict:
    """The same fault in the simulator: one microbatch through a data node, one of two replicas of
    stages 1 and 2 each, and a stage-3 node; the stage-1 and stage-2 hops of its path crash together
    while stage 3 computes its backward. Stage 3's gradient finds stage 2 gone, and the nearest
    upstream holder of the microbatch is the data node (`shoal.sim.faults`): both hops are redone."""
    import itertools
    import random

    from shoal.planning.costs import CostModel
    from shoal.planning.policy import make_policy
    from shoal.planning.swarm import PlanNode, Swarm
    from shoal.sim.engine import SimConfig, Simulator

    cost = CostModel(activation_bytes=50, per_hop_overhead_s=0.05)
    nodes = (PlanNode(0, 0, 0, 1.0, 1), PlanNode(1, 1, 1, 2.0, 1), PlanNode(2, 1, 1, 2.0, 1),
             PlanNode(3, 2, 1, 2.0, 1), PlanNode(4, 2, 1, 2.0, 1), PlanNode(5, 3, 1, 2.0, 1))  # fmt: skip
    swarm = Swarm(nodes, 4, ((0.0, 0.1), (0.1, 0.0)), ((1e12, 100.0), (100.0, 1e12)))
    for pair in itertools.product((1, 2), (3, 4)):  # the policy routes through one of each; keep the hit
        crashes = tuple((11.0, "crash", victim) for victim in pair)
        config = SimConfig(microbatches=1, failure_timeout_s=5.0, scripted=crashes)
        result = Simulator(swarm, cost, make_policy("gwtf", cost, random.Random(0)), config, random.Random(0)).run()
        if result.recomputed_hops == 2 or result.restarted or result.abandoned:
            return {"sent again": result.restarted, "hops redone": result.recomputed_hops,
                    "abandoned": result.abandoned, "completed": result.completed}  # fmt: skip
    raise AssertionError("no pair of crashes hit both hops of the microbatch")


def test_two_hops_of_one_path_lost_at_once_in_backward_are_redone_from_upstream_as_the_simulator_counts(
    tmp_path,
) -> None:
    """Stage 3 is about to pass a gradient upstream when the stage-2 and the stage-1 replicas of that
    microbatch's path both die. The stage-2 redo finds its input gone with the stage-1 hop, and has a
    live stage-1 replica compute it again from the data node's own input (the walk upstream); its
    backward then finds stage 1 gone and has it recomputed as any lost hop. Two hops redone, nothing
    sent again, nothing lost: as the simulator counts the same fault."""
    run = corpus_run(tmp_path, tiny_run(**{**FAULT_RUN, "model.n_layers": 3, "pipeline.stages": 4,
                                           "train.batch_size": 2}))  # fmt: skip
    holder = worker_id(3, 0)
    swarm = InProcessSwarm(run, {1: 2, 2: 2, 3: 1}, random_routing())
    killed: list[str] = []

    class KillThePath(Hooks):
        async def before_upstream(self, step: int, hop: int, microbatch_id: str, upstream: str, short_id: str) -> None:
            if step == 2 and not killed:
                assert swarm.data is not None
                path = swarm.data.attempts.in_flight[microbatch_id].route_peers  # (stage 1, stage 2, stage 3)
                killed.extend(path[:2])
                for peer in path[:2]:
                    await swarm.kill(peer)

    swarm.hooks[holder] = KillThePath()
    done = train(swarm)
    assert len(killed) == 2
    summary = ledger(swarm)
    assert summary["microbatches_abandoned"] == 0, summary["abandoned_details"]
    assert summary["microbatches_completed"] == summary["microbatches_injected"]
    survivors = [swarm.engine(p) for s in (1, 2) for p in swarm.workers(s)]
    redone = sum(w.stats()["recomputed"] for w in survivors)
    assert sum(w.stats()["outputs_redone"] for w in survivors) == 1  # stage 1's output, for the stage-2 redo
    real = {"sent again": summary["microbatches_resent"], "hops redone": redone, "abandoned": 0, "completed": 1}
    assert real == _simulated_two_hops_lost_in_backward() == {"sent again": 0, "hops redone": 2, "abandoned": 0,
                                                             "completed": 1}  # fmt: skip
    assert done["steps"] == run.train.steps


def test_a_joiner_takes_over_the_backup_the_replica_it_copies_keeps(tmp_path) -> None:
    """Stage 1's workers keep the backup of stage 2 (the first block stage keeps the last). A second
    stage-1 worker joining by copy takes its donor's backup along, so the backup outlives the keepers'
    restarts even while stage 2 has no replica to copy from (the paired kills of the churn benchmark)."""
    run = corpus_run(tmp_path, tiny_run(**{**FAULT_RUN, "repair.backup_every": 1}))
    swarm = InProcessSwarm(run, {1: 1, 2: 1})

    async def main() -> None:
        driver = await swarm.start()
        try:
            await asyncio.wait_for(driver.work(), 150)
            kept = swarm.engine(worker_id(1, 0)).backup_keeper
            for _ in range(100):  # the keeper looks every 0.5 s
                if kept.snapshot is not None:
                    break
                await asyncio.sleep(0.1)
            assert kept.snapshot is not None and kept.snapshot.inner_step >= 1 and kept.source == worker_id(2, 0)
            await swarm.kill(worker_id(2, 0))  # stage 2 has nobody left to copy from
            joiner = await swarm.add_joiner(1, "QmJoiner")
            taken = joiner.backup_keeper
            # the same snapshot, still named as stage 2's replica's, so a restore can hold it to that record
            assert taken.snapshot is not None and taken.source == worker_id(2, 0)
            assert (taken.snapshot.version, taken.snapshot.digest) == (kept.snapshot.version, kept.snapshot.digest)
            assert all(torch.equal(a, b) for a, b in zip(taken.snapshot.tensors, kept.snapshot.tensors, strict=True))
        finally:
            await swarm.close()

    asyncio.run(main())


@pytest.mark.parametrize("keeper", ["honest", "forges"])
def test_a_restore_takes_the_backup_the_stage_announced_and_refuses_a_forged_one(tmp_path, keeper, caplog) -> None:
    """Stage 3's worker keeps stage 2's snapshots. Stage 2's only replica dies, its record still listed
    (as a DHT keeps it until its TTL ends), and a newcomer takes stage 2: it restores the kept snapshot,
    checked against the digest stage 2 announced. A keeper that hands back other weights under a
    digest of their own (self-consistent, not what the stage announced) is refused, and the stage is
    rebuilt by CheckFree's rule instead."""
    shape = {"pipeline.stages": 4, "model.n_layers": 3, "repair.backup_every": 1}
    run = corpus_run(tmp_path, tiny_run(**{**FAULT_RUN, **shape}))
    swarm = InProcessSwarm(run, {1: 1, 2: 1, 3: 1})

    async def main() -> None:
        driver = await swarm.start()
        try:
            await asyncio.wait_for(driver.work(), 150)
            holder = swarm.engine(worker_id(2, 0))
            kept = swarm.engine(worker_id(3, 0)).backup_keeper

            async def caught_up() -> BackupNote:
                for _ in range(100):  # the keeper looks every 0.5 s
                    announced = holder.backup_source.note()
                    if kept.snapshot is not None and announced is not None and kept.snapshot.digest == announced.digest:
                        return announced
                    await asyncio.sleep(0.1)
                raise AssertionError("the keeper never caught up with the snapshot stage 2 announced")

            first = await caught_up()
            await holder.backup_source.take(holder.optimizer.step_count, 0)  # one more backup point
            assert (await caught_up()).version == first.version + 1 and kept.changes >= 1  # came as a change
            if keeper == "forges":  # and keeps what it forged (an honest keeper drops a snapshot not announced)

                async def keeps_its_forgery() -> bool:
                    return False

                kept.refresh = keeps_its_forgery
                held = kept.snapshot
                forged = [t + 0.5 for t in held.tensors]
                digest = snapshot_digest(forged, held.inner_step, held.outer_epoch, held.version)
                kept.snapshot = dataclasses.replace(held, tensors=tuple(forged), digest=digest)
            await swarm.kill(worker_id(2, 0), record_lingers=True)
            newcomer = await swarm.add_joiner(2, "QmNewcomer")
            repair = await newcomer.repair_if_lost()
            assert repair is not None
            if keeper == "honest":
                assert repair.rule == "backup" and repair.inner_step == kept.snapshot.inner_step
                assert f"checked against the digest {worker_id(2, 0)[-8:]} announced" in caplog.text
                params = [p.detach() for p in newcomer.module.parameters()]
                assert all(torch.equal(a, b) for a, b in zip(params, kept.snapshot.tensors, strict=True))
            else:
                assert f"not the snapshot {worker_id(2, 0)[-8:]} announced" in caplog.text
                assert "no backup of it left" in caplog.text and repair.rule != "backup"
        finally:
            await swarm.close()

    with caplog.at_level("INFO"):
        asyncio.run(main())


def test_a_last_hop_redone_for_the_data_node_and_lost_again_is_redone_again(tmp_path) -> None:
    """The last block stage's replica that holds a microbatch's graph dies in its backward; the data
    node has another replica redo the hop from the gradient it keeps, and that stand-in dies in its
    backward too. The stand-in took the lost hop's place on the data node's route, so its death is
    seen like the first and a third replica redoes the hop: nothing lost (it waited out its timeout)."""
    run = corpus_run(tmp_path, tiny_run(**{**FAULT_RUN, "train.batch_size": 2, "defense.step_audit_rate": 1.0}))
    swarm = InProcessSwarm(run, {1: 1, 2: 3}, random_routing())
    deaths: list[str] = []
    for replica in range(3):
        swarm.hooks[worker_id(2, replica)] = DiesInItsBackward(swarm, worker_id(2, replica), deaths, up_to=2)
    assert trained_through(swarm, deaths)["backward_recoveries"] >= 2
    # every step audited: the output that came home is the dead holder's, and the stand-in is not held to it
    assert swarm.data is not None and swarm.data.exclusions.peers() == set()


def test_a_middle_hop_redone_by_a_stand_in_that_dies_too_is_redone_again(tmp_path) -> None:
    """Stage 3 is about to pass a gradient to the stage-2 replica holding the microbatch's graph, which
    dies; stage 3 has another stage-2 replica redo the hop and tells the data node so (a route note in
    backward). That stand-in dies in its backward too: the data node sees it leave, asks stage 3 to
    recover the hop again, and the third stage-2 replica redoes it. Nothing lost."""
    run = corpus_run(tmp_path, tiny_run(**{**FAULT_RUN, "model.n_layers": 3, "pipeline.stages": 4,
                                           "train.batch_size": 2}))  # fmt: skip
    swarm = InProcessSwarm(run, {1: 1, 2: 3, 3: 1}, random_routing())
    deaths: list[str] = []

    class KillsUpstream(Hooks):  # stage 3: the first holder of stage 2 dies before its gradient arrives
        async def before_upstream(self, step: int, hop: int, microbatch_id: str, upstream: str, short_id: str) -> None:
            if step == 2 and not deaths:
                deaths.append(upstream)
                await swarm.kill(upstream)

    swarm.hooks[worker_id(3, 0)] = KillsUpstream()
    for replica in range(3):  # the stand-in that redoes the hop dies before passing it on
        swarm.hooks[worker_id(2, replica)] = DiesInItsBackward(swarm, worker_id(2, replica), deaths, up_to=2)
    trained_through(swarm, deaths)
    assert swarm.engine(worker_id(3, 0)).stats()["recomputes_delegated"] == 2
