"""Stage repair without checkpoints: CheckFree and CheckFree+ against copying a neighbour, random
re-initialisation, roll-back to periodic checkpoints (issue 10, papers/checkfree.md) and the live
daemons' stage backups held by a neighbour (issue 56).

    .venv/bin/python benchmarks/repair.py                 # 300 steps, seed 0: 20 min (1203 s) on one thread
    .venv/bin/python benchmarks/repair.py --seeds 0 1     # medians and spread over two seeds: 36 min (2176 s)
    .venv/bin/python benchmarks/repair.py --quick         # 24 steps, a 2-minute smoke run; writes nothing
    .venv/bin/python benchmarks/repair.py --render        # rewrite the docs section from the saved JSON
    .venv/bin/python benchmarks/repair.py --setting post-training   # trained-size weights (init std 0.2, lr 3e-3)

(Times measured on 2 cores shared with other jobs; about a quarter less on an idle machine.)

One process simulates the pipeline with the project's parts: the bundled `tiny` run cut into six
one-layer block stages plus stage 0 (embedding and head, which never fails: every data node holds
it, as in the paper), the project's data and sampler, one `InnerOptimizer` per stage as in the
reference trainer, and the repair rules of `shoal.train.repair` (`plan_repair` + `rebuild`). A failure
of stage s at step k happens before step k's forward passes: the stage's weights are wiped (NaN), the
rule rebuilds them from the neighbours' current weights and last gradient norms, and the stage gets a
fresh inner optimizer at `repair.lr_scale` x the schedule, its step count continuing. "random"
draws a fresh initialisation. CheckFree+ runs route every other microbatch through `swapped_order`
(`swap_variant`, the data node's rule).

"backup" is the daemons' rule beyond the papers (`repair.backup_every`, shoal/planning/backups.py,
shoal/node/stage/kept_copies.py): the workers of one neighbouring block stage keep a copy of each block
stage (stage s kept by stage s+1, the last by the first), taken at the end of every inner step that brings
the count to a multiple of `backup_every` (every run takes them: training is untouched; only "backup" uses
them). A stage lost at step k comes back as its keeper's copy was then (at most `backup_every` steps old),
with a fresh inner optimizer at the schedule (lr_scale 1.0, its step count continuing), as
`restore_from_backup` does. The simulation has no outer step and so no φ: the copy is θ only (the cost
below counts θ and φ, as the daemons keep them). Where no copy is left (its keeper lost in the same
failure, or none taken yet) the stage is rebuilt by the run's CheckFree rule, from the stages alive or
already restored; a lost keeper, back, copies its stage at once, as a starting keeper does.

Every strategy of an experiment trains the same steps on the same batches from the same seed under
the same failure schedule. Runs are identical until their first failure, so each strategy branches
from a copy of the no-failure run taken there (checked: a copy trains on bit-identically). The
checkpoint baseline's loss curve *is* the no-failure curve, replayed: a real roll-back run (weights
and optimizer states restored after a NaN wipe) is checked bit-for-bit against it, and the cost of
the roll-backs under each schedule is then counted by `shoal.train.failures.checkpoint_timeline`.

Writes benchmarks/results/repair.json and the CheckFree section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from docs_section import write_section

from shoal.config import RunConfig
from shoal.errors import UsageError
from shoal.model.stages import build_all_stages, forward_route
from shoal.planning.backups import CHANGE_BYTES_PER_VALUE, backed_up_stage, backup_keepers
from shoal.run_files import FULL_PRECISION, load_run_config
from shoal.train.data import BatchSampler, TokenSplits, load_token_splits, validation_batches
from shoal.train.failures import Failure, by_slot, checkpoint_timeline, rate_failures, single_wipes, step_probability
from shoal.train.inner import InnerOptimizer
from shoal.train.repair import (
    Neighbour,
    fresh_weights,
    neighbour_weights,
    plan_repair,
    rebuild,
    swap_variant,
    swapped_order,
)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = {  # --setting -> where its results go, and its section of docs/benchmarks.md
    "tiny": (ROOT / "benchmarks" / "results" / "repair.json", "checkfree"),
    "post-training": (ROOT / "benchmarks" / "results" / "repair_post_training.json", "checkfree-post-training"),
}
# The tiny run's own init (std 0.02) leaves a fresh block close to the identity, so that a lost interior
# stage is worth little and re-initialising it costs almost nothing; in the post-training setting (as
# tests/helpers/hostile.py and the live repair test) the blocks have a trained model's size and the
# learning rate is small, so a lost stage is worth something and slow to learn back.
SETTINGS = {"tiny": {}, "post-training": {"model.init_std": 0.2, "optim.lr": 3e-3}}

# The modelled clock (papers/checkfree.md §3, 500M model). One iteration of this run stands for one
# of the paper's; the failure rates per hour map onto iterations through it.
T_ITER_S = 91.35  # the paper's iteration time for checkpointing (CheckFree's 91.32 s: the same)
T_RECOVER_S = 30.0  # the paper: recovering a stage takes about 30 s
T_RELOAD_S = 30.0  # assumed: every stage fetches its checkpoint at once, the same transfer as a repair
T_SAVE_S = 3.0  # (91.35 - 91.32) s x 100: the paper's per-iteration checkpointing overhead at its interval
REDUNDANT_FACTOR = 151.04 / 91.35  # redundant computation's iteration time over the base (paper: 1.65)
# The paper's no-failure run to its target: redundant computation is that curve at 151.04 s an iteration,
# and took 419.6 h. `--paper-length` lets one step here stand for PAPER_ITERATIONS / (our steps to the
# target) of the paper's iterations, so that failures land as densely in the run as in the paper's.
PAPER_ITERATIONS = 419.6 * 3600 / 151.04
PAPER_HOURS = {  # wall-clock to validation loss 2.85 (500M), by failure rate
    0.05: {"checkpointing": 558.2, "redundant": 419.6, "checkfree": 367.8, "checkfree_plus": 355.1},
    0.10: {"checkpointing": 621.7, "redundant": 419.6, "checkfree": 405.9, "checkfree_plus": 367.8},
    0.16: {"checkpointing": 634.4, "redundant": 419.6, "checkfree": 563.0, "checkfree_plus": 460.6},
}
RATES = (0.05, 0.10, 0.16)
INTERVALS = (10, 50, 100)
SMOOTH = 10  # steps averaged before a failure (the "smoothed pre-failure loss") and after it (--quick: 4)
EPSILON = 0.02  # nats: "back" once the next SMOOTH steps average within this of the pre-failure gap
# (the per-step gap between two runs that share their batches but not their weights has a spread of ~0.017)
MIDDLE = 3  # the block stage wiped in the interior experiment (of 1..6), alternating with MIDDLE + 1

# Strategies: the repair section each runs under, and the no-failure run it branches from.
STRATEGIES = {
    "checkfree": ({"repair.rule": "checkfree", "repair.weights_from": "unclipped"}, "none"),
    "checkfree_clipped": ({"repair.rule": "checkfree", "repair.weights_from": "clipped"}, "none"),
    "uniform": ({"repair.rule": "uniform"}, "none"),
    "copy": ({"repair.rule": "copy"}, "none"),
    "random": ({"repair.rule": "random"}, "none"),
    "checkfree_plus": ({"repair.rule": "checkfree_plus"}, "none_swaps"),
    "backup": ({"repair.rule": "checkfree", "repair.weights_from": "unclipped"}, "none"),  # + RESTORES
}
RESTORES = {"backup"}  # strategies that restore a lost block stage from its keeper's copy first
# a keeper pulls each snapshot as its int8 change (shoal/train/backup_stream.py) and holds one snapshot
BACKUP_BYTES_PER_PARAMETER = CHANGE_BYTES_PER_VALUE
HELD_BYTES_PER_PARAMETER = 4
BASES = {"none": {"repair.rule": "checkfree"}, "none_swaps": {"repair.rule": "checkfree_plus"}}


def bench_run(steps: int, seed: int, setting: str = "tiny") -> RunConfig:
    """The bundled tiny run, with six equal one-layer block stages and a smaller batch (to fit the time)."""
    return load_run_config("tiny").replace(
        {
            **FULL_PRECISION,
            **SETTINGS[setting],
            "model.n_layers": 6,
            "pipeline.stages": 7,
            "train.steps": steps,
            "train.seq_len": 64,
            "train.batch_size": 8,
            "train.microbatch_size": 2,
            "train.eval_batches": 4,
            "train.seed": seed,
        }
    )


def load_data(run: RunConfig) -> tuple[TokenSplits, str]:
    """The default corpus (Debian texts); without it, the tests' pseudo-English (say which in the JSON)."""
    try:
        return load_token_splits(run.data, run.model.vocab_size), "default corpus (bible-kjv, fortunes, jargon-text)"
    except UsageError:
        sys.path.insert(0, str(ROOT))
        from tests.helpers.tiny import sample_text

        path = Path(tempfile.mkdtemp(prefix="shoal-repair-")) / "corpus.txt"
        path.write_text(sample_text(300000))
        data = run.replace({"data.path": str(path)}).data
        return load_token_splits(data, run.model.vocab_size), "tests/helpers/tiny.py sample_text(300000): no corpus"


class Pipeline:
    """The whole pipeline in one process: stage 0 and the block stages, each with its inner optimizer."""

    def __init__(self, run: RunConfig):
        self.run = run
        self.stages = run.pipeline.stages
        self.head, self.blocks = build_all_stages(run.model, self.stages, run.train.seed)
        self.optimizers = [InnerOptimizer(m, run.optim, run.train.steps) for m in [self.head, *self.blocks]]
        self.norms = [float("nan")] * self.stages  # each stage's last unclipped gradient norm
        # CheckFree+: stage 0's neighbours copy it every `repair.edge_copy_every` steps (node/stage/edge_copy.py)
        self.stage0_copy: tuple[int, list[torch.Tensor]] | None = None  # (steps trained, weights)
        # Stage backups (`repair.backup_every`): block stage -> (steps trained, weights, gradient norm) of the
        # copy its keeper holds; taken in every run, used only where `restores` (the "backup" strategy)
        self.backups: dict[int, tuple[int, list[torch.Tensor], float]] = {}
        self.restores = False

    def branch(self, run: RunConfig) -> Pipeline:
        """A copy to train on under another repair config (only the repair section may differ)."""
        assert _without_repair(run) == _without_repair(self.run), "a branch must train the same run"
        other = copy.deepcopy(self)  # modules and optimizers in one copy keep sharing their parameters
        other.run = run
        return other

    def train_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        inputs, targets = batch
        n = self.run.microbatches_per_step
        natural = list(range(1, self.stages))
        total = 0.0
        step = self.optimizers[0].step_count  # stage 0's count is the run's (a repair of it keeps the count)
        for j, (x, y) in enumerate(zip(inputs.chunk(n), targets.chunk(n), strict=True)):
            variant = swap_variant(step, j, n, self.run.repair.swaps)  # the data node's rule
            order = natural if variant is None else swapped_order(natural, self.stages, variant)
            loss = forward_route(self.head, [self.blocks[s - 1] for s in order], x, y)
            (loss / n).backward()
            total += float(loss.detach())
        for stage, optimizer in enumerate(self.optimizers):
            self.norms[stage] = optimizer.step().grad_norm
        every = self.run.repair.edge_copy_every
        if self.run.repair.rule == "checkfree_plus" and (step + 1) % every == 0:
            self.stage0_copy = (step + 1, [p.detach().clone() for p in self.head.parameters()])
        every = self.run.repair.backup_every
        if every and (step + 1) % every == 0:  # each keeper copies at the end of its inner step
            for stage in range(1, self.stages):
                self._keep_backup(stage, step + 1)
        return total / n

    def _keep_backup(self, stage: int, steps_trained: int) -> None:
        if backup_keepers(self.stages, stage):
            weights = [p.detach().clone() for p in self.blocks[stage - 1].parameters()]
            self.backups[stage] = (steps_trained, weights, self.norms[stage])

    @torch.no_grad()
    def evaluate(self, splits: TokenSplits, skip: list[int] = ()) -> float:
        """Validation loss through every block stage in order (or without the stages in `skip`)."""
        t = self.run.train
        batches = validation_batches(splits.val, t.seq_len, t.batch_size, t.eval_batches)
        route = [block for stage, block in enumerate(self.blocks, start=1) if stage not in skip]
        losses = [float(forward_route(self.head, route, x, y)) for x, y in batches]
        return statistics.fmean(losses)

    def module(self, stage: int) -> torch.nn.Module:
        return self.head if stage == 0 else self.blocks[stage - 1]

    def wipe(self, stage: int) -> None:
        with torch.no_grad():
            for p in self.module(stage).parameters():
                p.fill_(float("nan"))
        self.norms[stage] = float("nan")

    def _repair_stage0(self, slot: int) -> dict:
        """Stage 0 back from the copy its neighbours keep under CheckFree+ (up to `edge_copy_every` steps
        old), else a fresh initialisation: what a data node that starts with nothing gets. Either way a
        fresh AdamW at the schedule (a new data node's, as in the daemon), its step count going on."""
        step = self.optimizers[0].step_count
        if self.run.repair.rule == "checkfree_plus" and self.stage0_copy is not None:
            copied_at, weights = self.stage0_copy
            rule, note = "edge_copy", f"copy of step {copied_at}, {step - copied_at} step(s) old"
        else:
            weights, rule, note = fresh_weights(self.run, 0, slot), "random", "no copy of stage 0: fresh weights"
        with torch.no_grad():
            for p, w in zip(self.head.parameters(), weights, strict=True):
                p.copy_(w)
        self.optimizers[0] = InnerOptimizer(self.head, self.run.optim, self.run.train.steps)
        self.optimizers[0].step_count = step
        return {"slot": slot, "stage": 0, "rule": rule, "sources": [], "mix": [], "note": note, "norms": []}

    def _restore(self, stage: int, lost: list[int], slot: int) -> tuple[dict | None, str]:
        """The "backup" strategy: `stage` back as the copy its keeper holds, with a fresh inner optimizer at
        the schedule (lr_scale 1.0, its step count going on), as `restore_from_backup` does; (None, why)
        where no copy is left."""
        keepers = backup_keepers(self.stages, stage)
        if not keepers:
            return None, "no keeper"
        if all(k in lost for k in keepers):
            return None, "keeper lost in the same failure"
        if stage not in self.backups:
            return None, f"no copy taken yet: the first is at step {self.run.repair.backup_every}"
        copied_at, weights, norm = self.backups[stage]
        module = self.blocks[stage - 1]
        with torch.no_grad():
            for p, w in zip(module.parameters(), weights, strict=True):
                p.copy_(w)
        optimizer = InnerOptimizer(module, self.run.optim, self.run.train.steps)
        optimizer.step_count = self.optimizers[stage].step_count  # the schedule goes on
        self.optimizers[stage] = optimizer
        self.norms[stage] = norm  # the live copy carries its gradient norms too
        age = slot - copied_at
        record = {
            "slot": slot,
            "stage": stage,
            "rule": "backup",
            "sources": [k for k in keepers if k not in lost],
            "mix": [],
            "note": f"the copy kept at step {copied_at}, {age} step(s) old",
            "norms": [],
            "backup_age": age,
        }
        return record, ""

    def repair(self, lost: list[int], slot: int) -> list[dict]:
        """Wipe the lost stages, then rebuild each by the run's rule from the stages still alive (under
        "backup", first restore those whose keeper still holds a copy, and rebuild only the rest)."""
        for stage in lost:
            self.wipe(stage)
        available = set(range(1, self.stages)) - set(lost)
        clip, rule = self.run.optim.grad_clip, self.run.repair.rule
        records = [self._repair_stage0(slot)] if 0 in lost else []
        fallbacks: dict[int, str] = {}
        if self.restores:
            for stage in (s for s in lost if s > 0):
                record, why = self._restore(stage, lost, slot)
                if record is None:
                    fallbacks[stage] = why
                else:
                    records.append(record)
                    available.add(stage)  # restored before the rest are rebuilt from what is alive
        for stage in (s for s in lost if s > 0 and s not in available):
            plan = plan_repair(stage, self.stages, available, rule)
            neighbours = [
                Neighbour(
                    s, [p.detach() for p in self.blocks[s - 1].parameters()], self.norms[s], min(self.norms[s], clip)
                )
                for s in plan.sources
            ]
            repaired = rebuild(plan, neighbours, fresh_weights(self.run, stage, slot), self.run.repair.weights_from)
            module = self.blocks[stage - 1]
            with torch.no_grad():
                for p, w in zip(module.parameters(), repaired.weights, strict=True):
                    p.copy_(w)
            optimizer = InnerOptimizer(module, self.run.optim, self.run.train.steps, self.run.repair.lr_scale)
            optimizer.step_count = self.optimizers[stage].step_count  # the schedule goes on
            self.optimizers[stage] = optimizer
            record = {
                "slot": slot,
                "stage": stage,
                "rule": repaired.rule,
                "sources": list(repaired.sources),
                "mix": [round(m, 4) for m in repaired.mix],
                "note": repaired.note,
                "norms": [round(n.grad_norm, 4) for n in neighbours],
            }
            if stage in fallbacks:
                record["backup_fallback"] = fallbacks[stage]
            if len(neighbours) == 2:  # what each weighting would have given, whichever this run uses
                mixes = {source: neighbour_weights(neighbours, source) for source in ("unclipped", "clipped")}
                for source, mix in mixes.items():
                    record[f"mix_{source}"] = [round(w, 4) for w in mix]
                record["weightings_agree"] = mixes["unclipped"] == mixes["clipped"]  # exactly
            records.append(record)
        if self.restores:  # a lost keeper's copy went with it; back, it copies its stage at once
            for keeper in (s for s in lost if s > 0):
                kept = backed_up_stage(self.stages, keeper)
                self.backups.pop(kept, None)
                if kept is not None and self.run.repair.backup_every:
                    self._keep_backup(kept, slot)
        return records

    def state(self) -> dict:
        """A checkpoint: every stage's weights and optimizer state, as the baseline would save them."""
        modules = [self.head, *self.blocks]
        return copy.deepcopy(
            {
                "modules": [m.state_dict() for m in modules],
                "optimizers": [(o.adamw.state_dict(), o.step_count) for o in self.optimizers],
                "norms": list(self.norms),
            }
        )

    def load(self, state: dict) -> None:
        state = copy.deepcopy(state)  # the saved copy must survive for the next roll-back to it
        for module, weights in zip([self.head, *self.blocks], state["modules"], strict=True):
            module.load_state_dict(weights)
        for optimizer, (adamw, step_count) in zip(self.optimizers, state["optimizers"], strict=True):
            optimizer.adamw.load_state_dict(adamw)
            optimizer.step_count = step_count
        self.norms = state["norms"]


def _without_repair(run: RunConfig) -> dict:
    return {k: v for k, v in run.to_dict().items() if k != "repair"}


@dataclass
class Trace:
    """One strategy's run: the training loss of every step, validation losses, and the repairs."""

    strategy: str
    losses: list[float]
    val: dict[int, float]  # steps trained -> validation loss
    repairs: list[dict] = field(default_factory=list)
    trained_steps: int = 0  # steps this strategy trained itself (the rest is the shared prefix)


class Experiment:
    """One seed: the data, the no-failure runs (with and without swaps) and their copies to branch from."""

    def __init__(self, steps: int, seed: int, eval_every: int, setting: str = "tiny"):
        self.steps, self.seed, self.eval_every = steps, seed, eval_every
        self.base = bench_run(steps, seed, setting)
        self.splits, self.data_source = load_data(self.base)
        t = self.base.train
        self.sampler = BatchSampler(self.splits.train, t.seq_len, t.batch_size, t.seed)
        self.batches = [self.sampler.batch(step) for step in range(steps)]  # every strategy, every step
        self.references: dict[str, Trace] = {}
        self.copies: dict[str, dict[int, Pipeline]] = {}
        self.norm_log: dict[str, list[list[float]]] = {}
        self.step_s: list[float] = []

    def config(self, overrides: dict) -> RunConfig:
        return self.base.replace(overrides)

    def run_reference(self, name: str, branch_at: set[int]) -> Trace:
        """A no-failure run, keeping a copy of its state before each step in `branch_at`."""
        pipe = Pipeline(self.config(BASES[name]))
        losses, val, copies, norms = [], {}, {}, []
        for step in range(self.steps):
            if step in branch_at:
                copies[step] = pipe.branch(pipe.run)
            started = time.process_time()
            losses.append(pipe.train_step(self.batches[step]))
            self.step_s.append(time.process_time() - started)
            norms.append([round(x, 4) for x in pipe.norms])
            if (step + 1) % self.eval_every == 0:
                val[step + 1] = pipe.evaluate(self.splits)
        self.references[name], self.copies[name], self.norm_log[name] = (
            Trace(name, losses, val, [], self.steps),
            copies,
            norms,
        )
        return self.references[name]

    def check_branching(self, name: str) -> None:
        """A copy taken before step k must train step k exactly as the run it was copied from."""
        step, pipe = min(self.copies[name].items())
        loss = pipe.branch(pipe.run).train_step(self.batches[step])
        assert loss == self.references[name].losses[step], f"a copy of {name} trained step {step} differently"

    def run_strategy(self, strategy: str, failures: list[Failure]) -> Trace:
        overrides, base = STRATEGIES[strategy]
        reference = self.references[base]
        lost_at = {slot: stages for slot, stages in by_slot(failures).items() if slot < self.steps}
        if not lost_at:
            return Trace(strategy, list(reference.losses), dict(reference.val), [], 0)
        start = min(lost_at)
        pipe = self.copies[base][start].branch(self.config(overrides))
        pipe.restores = strategy in RESTORES
        losses = reference.losses[:start]
        val = {k: v for k, v in reference.val.items() if k <= start}
        repairs = []
        for step in range(start, self.steps):
            if step in lost_at:
                before = pipe.evaluate(self.splits)
                blocks = [s for s in lost_at[step] if s > 0]  # stage 0 cannot be left out of a route
                skipped = pipe.evaluate(self.splits, skip=blocks) if blocks else None  # what the lost stages were worth
                records = pipe.repair(lost_at[step], step)
                after = pipe.evaluate(self.splits)
                for record in records:
                    worth = None if skipped is None else round(skipped, 4)
                    record.update(val_before=round(before, 4), val_after=round(after, 4), val_skipped=worth)
                repairs += records
            losses.append(pipe.train_step(self.batches[step]))
            if (step + 1) % self.eval_every == 0:
                val[step + 1] = pipe.evaluate(self.splits)
        assert len(losses) == self.steps and set(val) == set(reference.val), "every strategy trains every step"
        return Trace(strategy, losses, val, repairs, self.steps - start)

    def check_checkpoint_replay(self, interval: int, steps: int, failures: list[Failure]) -> dict:
        """Roll back to real checkpoints after NaN wipes: the replay must retrace the no-failure run
        bit for bit and take exactly the slots `checkpoint_timeline` counts."""
        pipe = Pipeline(self.config(BASES["none"]))
        reference = self.references["none"].losses
        saved, saved_at = pipe.state(), 0
        lost_at = by_slot(failures)
        progress = slot = 0
        while progress < steps:
            if slot in lost_at:
                for stage in lost_at[slot]:
                    pipe.wipe(stage)
                pipe.load(saved)
                progress = saved_at
            loss = pipe.train_step(self.batches[progress])
            assert loss == reference[progress], f"replayed step {progress} differs from the no-failure run"
            progress += 1
            slot += 1
            if progress % interval == 0 and progress > saved_at:
                saved, saved_at = pipe.state(), progress
        timeline = checkpoint_timeline(failures, interval, steps, max_slots=10 * steps)
        assert slot == timeline.slots, f"replay took {slot} slots, the timeline counts {timeline.slots}"
        return {
            "interval": interval,
            "steps": steps,
            "failures": [[f.slot, f.stage] for f in failures],
            "slots": slot,
            "lost_steps": timeline.lost_steps,
            "identical_to_no_failure": True,
        }


# ---- measures -------------------------------------------------------------------------------------


def steps_to(val: dict[int, float], target: float) -> float | None:
    """Steps until the validation loss first reaches `target`, interpolated between evaluations."""
    previous = (0, float("inf"))
    for k in sorted(val):
        if val[k] <= target:
            k0, v0 = previous
            if v0 == float("inf"):
                return float(k)
            return k0 + (k - k0) * (v0 - target) / (v0 - val[k])
        previous = (k, val[k])
    return None


def failure_measures(
    trace: Trace, reference: Trace, failures: list[Failure], steps: int, smooth: int = SMOOTH
) -> list[dict]:
    """Per failure slot: the loss spike (loss of the first step after it minus the mean of the `smooth`
    steps before), the same paired with the no-failure run on the same batches, the jump of the
    validation loss across the repair, and the steps until the gap to the no-failure run is back."""
    slots = sorted(by_slot(failures))
    out = []
    for i, k in enumerate(slots):
        end = slots[i + 1] if i + 1 < len(slots) else steps  # the next failure or the end of the run
        if k < smooth:
            continue  # too early to say what the loss was before it
        gap = [a - b for a, b in zip(trace.losses, reference.losses, strict=True)]
        pre_gap = statistics.fmean(gap[k - smooth : k])
        recovered = next(
            (
                j
                for j in range(0, end - k - smooth + 1)
                if statistics.fmean(gap[k + j : k + j + smooth]) <= pre_gap + EPSILON
            ),
            None,
        )
        repairs = [r for r in trace.repairs if r["slot"] == k]
        event = {
            "slot": k,
            "stages": [r["stage"] for r in repairs],
            "rules": [r["rule"] for r in repairs],
            "spike": trace.losses[k] - statistics.fmean(trace.losses[k - smooth : k]),
            "spike_paired": gap[k] - pre_gap,
            "val_jump": repairs[0]["val_after"] - repairs[0]["val_before"],
            "stage_worth": None
            if repairs[0]["val_skipped"] is None
            else repairs[0]["val_skipped"] - repairs[0]["val_before"],
            "recover_steps": recovered,
            "recover_window": end - k - smooth,
        }
        if trace.strategy in RESTORES:
            event["backup_ages"] = [r["backup_age"] for r in repairs if r["rule"] == "backup"]
            event["backup_fallbacks"] = [r["backup_fallback"] for r in repairs if "backup_fallback" in r]
        out.append(event)
    return out


def backup_counts(repairs: list[dict]) -> dict:
    """A "backup" run's restores, how old their copies were, and its fallbacks to the run's rule, by why."""
    fallbacks: dict[str, int] = {}
    for r in repairs:
        if "backup_fallback" in r:
            fallbacks[r["backup_fallback"]] = fallbacks.get(r["backup_fallback"], 0) + 1
    ages = [r["backup_age"] for r in repairs if r["rule"] == "backup"]
    return {"restored": len(ages), "ages": ages, "fallbacks": fallbacks, "fallen_back": sum(fallbacks.values())}


def backup_cost(run: RunConfig) -> dict:
    """What the daemons' backups cost in this run: each snapshot of the kept block stage travels as its
    int8 change (1.06 bytes a parameter) once every `backup_every` of the keeper's steps (in a run with an
    outer optimizer: every outer step), and the keeper holds one float32 snapshot (4 bytes a parameter);
    measured on live daemons by benchmarks/backup_cost.py."""
    _, blocks = build_all_stages(run.model, run.pipeline.stages, run.train.seed)
    params = [sum(p.numel() for p in block.parameters()) for block in blocks]
    every = run.repair.backup_every
    per_backup = [BACKUP_BYTES_PER_PARAMETER * n for n in params]
    return {
        "backup_every": every,
        "bytes_per_parameter": BACKUP_BYTES_PER_PARAMETER,
        "parameters_by_block_stage": params,
        "bytes_per_backup": per_backup,
        "bytes_per_step_per_keeper": [b / every for b in per_backup] if every else None,
        "bytes_per_step_all_keepers": sum(per_backup) / every if every else None,
        "memory_per_keeper_node_bytes": [HELD_BYTES_PER_PARAMETER * n for n in params],
    }


def modelled_hours(
    steps_to_target: float | None, failures: list[Failure], steps: int, step_s: float = T_ITER_S
) -> tuple[float, bool]:
    """A run that repairs in place: its iterations (`step_s` each) plus T_RECOVER_S per slot that lost a
    stage. A run that never reached the target gives a lower bound, its whole length (and False)."""
    reached = steps_to_target is not None
    iterations = steps_to_target if reached else float(steps)
    slots = {f.slot for f in failures if f.slot < iterations}
    return (iterations * step_s + len(slots) * T_RECOVER_S) / 3600, reached


def interval_steps(paper_interval: int, step_s: float) -> int:
    """The paper's checkpoint interval (in its iterations) in this run's steps, at least one."""
    return max(1, round(paper_interval * T_ITER_S / step_s))


def checkpoint_hours(steps_to_target: float, failures: list[Failure], interval: int, step_s: float = T_ITER_S) -> dict:
    every = interval_steps(interval, step_s)
    run = checkpoint_timeline(failures, every, math.ceil(steps_to_target), max_slots=10**6)
    seconds = (steps_to_target + run.lost_steps) * step_s + run.rollbacks * T_RELOAD_S + run.saves * T_SAVE_S
    return {
        "hours": seconds / 3600,
        "every_steps": every,
        "lost_steps": run.lost_steps,
        "rollbacks": run.rollbacks,
        "saves": run.saves,
    }


# ---- one seed -------------------------------------------------------------------------------------


def plan(steps: int, seed: int, rate_scale: float, rate_baselines: list[str], step_s: float = T_ITER_S) -> dict:
    """The failure schedules of one seed (shared by every strategy) and who trains under each."""
    q = steps // 4
    third = steps // 3
    horizon = 40 * steps  # checkpointing may need many more slots than the run has steps
    schedules = {
        "interior": (
            single_wipes([(q, MIDDLE), (2 * q, MIDDLE + 1), (3 * q, MIDDLE)]),
            ["checkfree", "checkfree_clipped", "uniform", "copy", "random", "backup"],
        ),
        "edge": (single_wipes([(third, 1), (2 * third, 6)]), ["checkfree_plus", "checkfree", "backup"]),
        "stage0": (single_wipes([(q, 0), (3 * q, 0)]), ["checkfree_plus", "checkfree"]),
    }
    for rate in RATES:
        failures = rate_failures(rate, step_s, range(1, 7), horizon, seed, rate_scale)
        strategies = ["checkfree", "checkfree_plus", "backup"] + (rate_baselines if rate == RATES[-1] else [])
        schedules[f"rate_{round(rate * 100)}"] = (failures, strategies)
    return schedules


def run_seed(args, seed: int) -> dict:
    started = time.monotonic()
    experiment = Experiment(args.steps, seed, args.eval_every, args.setting)
    schedules = plan(args.steps, seed, args.rate_scale, args.rate_baselines, args.step_s)
    branch_at: dict[str, set[int]] = {"none": set(), "none_swaps": set()}
    for failures, strategies in schedules.values():
        first = [f.slot for f in failures if f.slot < args.steps]
        for strategy in strategies:
            if first:
                branch_at[STRATEGIES[strategy][1]].add(min(first))
    for name in ("none", "none_swaps"):
        print(f"seed {seed}: no failures ({name}) ...", file=sys.stderr, flush=True)
        experiment.run_reference(name, branch_at[name] or {0})
        experiment.check_branching(name)
    references = experiment.references
    target_step = round(args.target_at * args.steps / args.eval_every) * args.eval_every
    target = references["none"].val[target_step]
    result = {
        "seed": seed,
        "data": experiment.data_source,
        "target_val_loss": target,
        "target_step": target_step,
        "reference": {},
        "experiments": {},
    }
    for name, trace in references.items():
        result["reference"][name] = {
            "final_val": trace.val[args.steps],
            "steps_to_target": steps_to(trace.val, target),
            "losses": [round(x, 4) for x in trace.losses],
            "val": {str(k): round(v, 4) for k, v in trace.val.items()},
        }
    norms = experiment.norm_log["none"]
    clip = experiment.base.optim.grad_clip
    both_above = [sum(1 for row in norms if min(row[s - 1], row[s + 1]) >= clip) / len(norms) for s in range(2, 6)]
    result["grad_norms"] = {
        "median_by_stage": [round(statistics.median(row[s] for row in norms), 4) for s in range(7)],
        "share_of_steps_both_neighbours_clipped": [round(x, 3) for x in both_above],  # interior stages 2..5
        "last_step_both_neighbours_clipped": max(
            (k for k, row in enumerate(norms) for s in range(2, 6) if min(row[s - 1], row[s + 1]) >= clip), default=None
        ),
        "by_step": norms,
    }
    for name, (failures, strategies) in schedules.items():
        in_run = [f for f in failures if f.slot < args.steps]
        section = {"failures_in_run": [[f.slot, f.stage] for f in in_run], "strategies": {}}
        if name.startswith("rate_"):
            rate = int(name.removeprefix("rate_")) / 100
            section.update(
                rate_per_hour=rate,
                p_step=min(1.0, args.rate_scale * step_probability(rate, args.step_s)),
                failures_in_horizon=len(failures),
            )
        traces: dict[str, Trace] = {}
        for strategy in strategies:
            print(f"seed {seed}: {name}, {strategy} ...", file=sys.stderr, flush=True)
            same = traces.get("checkfree")
            if strategy == "checkfree_clipped" and same and all(r.get("weightings_agree", True) for r in same.repairs):
                # clipped and unclipped ω gave the same weights at every repair: the same run, bit for bit
                trace = Trace(strategy, same.losses, same.val, same.repairs, 0)
                section["clipped_same_as_unclipped"] = True
            else:
                trace = experiment.run_strategy(strategy, failures)
            traces[strategy] = trace
            reference = references[STRATEGIES[strategy][1]]
            entry = {
                "final_val": trace.val[args.steps],
                "steps_to_target": steps_to(trace.val, target),
                "trained_steps": trace.trained_steps,
                "repairs": trace.repairs,
                "losses": [round(x, 4) for x in trace.losses],
                "val": {str(k): round(v, 4) for k, v in trace.val.items()},
            }
            if strategy in RESTORES:
                entry["backup"] = backup_counts(trace.repairs)
            if in_run:
                entry["failures"] = failure_measures(trace, reference, in_run, args.steps, args.smooth)
            entry["hours"], entry["reached"] = modelled_hours(
                entry["steps_to_target"], failures, args.steps, args.step_s
            )
            section["strategies"][strategy] = entry
        if name.startswith("rate_"):
            ideal = result["reference"]["none"]["steps_to_target"]
            section["no_failure_hours"] = ideal * args.step_s / 3600
            section["redundant_hours"] = ideal * REDUNDANT_FACTOR * args.step_s / 3600
            section["checkpointing"] = {str(k): checkpoint_hours(ideal, failures, k, args.step_s) for k in INTERVALS}
        result["experiments"][name] = section
    replay = single_wipes([(args.replay_steps // 2 - 3, MIDDLE), (args.replay_steps - 7, MIDDLE + 1)])
    result["checkpoint_replay_check"] = experiment.check_checkpoint_replay(10, args.replay_steps, replay)
    result["step_cpu_s_median"] = statistics.median(experiment.step_s)
    result["wall_s"] = time.monotonic() - started
    return result


# ---- summary across seeds -------------------------------------------------------------------------


def spread(values: list[float | None], digits: int = 3, reached: list[bool] | None = None) -> str:
    """median (min–max) of the known values ("not reached" for None); with `reached`, the values of
    runs that never reached the target are lower bounds, marked "≥"."""
    known = [v for v in values if v is not None]
    missing = len(values) - len(known)
    if not known:
        return "not reached"
    fmt = f"{{:.{digits}f}}"
    text = fmt.format(statistics.median(known))
    if len(known) > 1:
        text += f" ({fmt.format(min(known))}–{fmt.format(max(known))})"
    if missing:
        text += f", {missing} of {len(values)} not reached"
    bounds = sum(1 for r in reached or [] if not r)
    if bounds == len(values):
        text = "≥ " + text + " (not reached)"
    elif bounds:
        text += f" ({bounds} of {len(values)} lower bounds: not reached)"
    return text


def summarise(seeds: list[dict]) -> dict:
    """Medians over seeds (and, for per-failure measures, over a seed's failures too)."""
    out: dict = {"per_failure": {}, "rates": {}, "swap_cost": {}}
    for experiment in ("interior", "edge", "stage0"):
        rows = {}
        for strategy in seeds[0]["experiments"][experiment]["strategies"]:
            events = [e for r in seeds for e in r["experiments"][experiment]["strategies"][strategy]["failures"]]
            rows[strategy] = {
                "spike": [e["spike"] for e in events],
                "spike_paired": [e["spike_paired"] for e in events],
                "val_jump": [e["val_jump"] for e in events],
                "stage_worth": [e["stage_worth"] for e in events],
                "recover_steps": [e["recover_steps"] for e in events],
                "recover_window": min(e["recover_window"] for e in events),
                "final_val": [r["experiments"][experiment]["strategies"][strategy]["final_val"] for r in seeds],
                "rules": sorted({rule for e in events for rule in e["rules"]}),
            }
            if strategy in RESTORES:
                rows[strategy]["backup_ages"] = [a for e in events for a in e["backup_ages"]]
                rows[strategy]["backup_fallbacks"] = [f for e in events for f in e["backup_fallbacks"]]
        out["per_failure"][experiment] = rows
    for name in (f"rate_{round(r * 100)}" for r in RATES):
        sections = [r["experiments"][name] for r in seeds]
        rate = sections[0]["rate_per_hour"]
        row: dict = {
            "rate_per_hour": rate,
            "p_step": sections[0]["p_step"],
            "failures_in_run": [len(s["failures_in_run"]) for s in sections],
            "no_failure_hours": [s["no_failure_hours"] for s in sections],
            "redundant_hours": [s["redundant_hours"] for s in sections],
            "strategies": {},
        }
        for strategy in sections[0]["strategies"]:
            entries = [s["strategies"][strategy] for s in sections]
            row["strategies"][strategy] = {
                "final_val": [e["final_val"] for e in entries],
                "steps_to_target": [e["steps_to_target"] for e in entries],
                "hours": [e["hours"] for e in entries],
                "reached": [e["reached"] for e in entries],
            }
            if strategy in RESTORES:
                row["strategies"][strategy]["backup"] = [e["backup"] for e in entries]
        row["checkpointing"] = {
            k: {
                "every_steps": sections[0]["checkpointing"][k]["every_steps"],
                "hours": [s["checkpointing"][k]["hours"] for s in sections],
                "lost_steps": [s["checkpointing"][k]["lost_steps"] for s in sections],
                "rollbacks": [s["checkpointing"][k]["rollbacks"] for s in sections],
            }
            for k in sections[0]["checkpointing"]
        }
        ratios = {}
        for strategy in (s for s in ("checkfree", "checkfree_plus", "backup") if s in sections[0]["strategies"]):
            for k in sections[0]["checkpointing"]:
                ratios[f"{strategy}/checkpoint_{k}"] = [
                    s["strategies"][strategy]["hours"] / s["checkpointing"][k]["hours"] for s in sections
                ]
            ratios[f"{strategy}/reached"] = [s["strategies"][strategy]["reached"] for s in sections]
        row["ratios"] = ratios
        paper = PAPER_HOURS[rate]
        row["paper_ratios"] = {s: paper[s] / paper["checkpointing"] for s in ("checkfree", "checkfree_plus")}
        out["rates"][name] = row
    for name in ("none", "none_swaps"):
        out["swap_cost"][name] = {
            "final_val": [r["reference"][name]["final_val"] for r in seeds],
            "steps_to_target": [r["reference"][name]["steps_to_target"] for r in seeds],
        }
    return out


# ---- report ---------------------------------------------------------------------------------------

LABELS = {
    "checkfree": "CheckFree (gradient-weighted, unclipped ω)",
    "checkfree_clipped": "CheckFree, clipped ω (authors' code)",
    "uniform": "uniform average",
    "copy": "copy one neighbour",
    "random": "random re-initialisation",
    "checkfree_plus": "CheckFree+",
    "backup": "backup held by the neighbour (else CheckFree)",
}


def _median(values: list) -> float:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else float("inf")  # never reached sorts as the worst


def _order(rows: dict, key: str, names: list[str], digits: int = 2) -> str:
    ranked = sorted(names, key=lambda n: -_median(rows[n][key]))
    return " > ".join(f"{n} {_median(rows[n][key]):.{digits}f}" for n in ranked)


def reading(result: dict) -> str:
    """What the run says about each of the paper's expectations, from the numbers (not written by hand)."""
    s = result["summary"]
    interior, edge = s["per_failure"]["interior"], s["per_failure"]["edge"]
    rules = [n for n in ("random", "copy", "uniform", "checkfree") if n in interior]
    expected = ["random", "copy", "uniform", "checkfree"]
    lines = []
    for key, what in (("val_jump", "val-loss jump"), ("spike_paired", "spike vs no-failure"), ("spike", "loss spike")):
        ranked = sorted(rules, key=lambda n: -_median(interior[n][key]))
        medians = [_median(interior[n][key]) for n in rules]
        if max(medians) - min(medians) < EPSILON:
            verdict = f"all within {EPSILON} nats of each other, so no order can be read"
        else:
            verdict = "as expected" if ranked == expected else "not the expected order"
        lines.append(f"- Interior wipes, {what} (median): {_order(interior, key, rules)}; {verdict}.")
    ranked = sorted(rules, key=lambda n: -_median(interior[n]["recover_steps"]))
    lines.append(
        f"- Interior wipes, steps to recover (median; inf = not reached): "
        f"{_order(interior, 'recover_steps', rules, 0)}; final val loss: {_order(interior, 'final_val', rules, 3)}."
    )
    worth = [w for n in rules for w in interior[n]["stage_worth"]]
    lines.append(
        f"- What an interior stage was worth when it was lost (validation loss without it minus with it): median "
        f"{statistics.median(worth):.3f}, at most {max(worth):.3f} nats; the first block stage was worth "
        f"{_median(edge['checkfree']['stage_worth']):.2f} (median of the edge wipes). A rule can only lose what the "
        f"stage was worth{', so the interior rules differ by hundredths of a nat here' if max(worth) < 0.1 else ''}."
    )
    cf, cp = edge["checkfree_plus"], edge["checkfree"]
    lines.append(
        f"- Edge wipes, CheckFree+ vs copy without swaps: val-loss jump {_median(cf['val_jump']):.2f} vs "
        f"{_median(cp['val_jump']):.2f}, spike vs no-failure {_median(cf['spike_paired']):.2f} vs "
        f"{_median(cp['spike_paired']):.2f}, steps to recover {_median(cf['recover_steps']):.0f} vs "
        f"{_median(cp['recover_steps']):.0f} (paper: CheckFree+ far below)."
    )
    plus, fresh = s["per_failure"]["stage0"]["checkfree_plus"], s["per_failure"]["stage0"]["checkfree"]
    lines.append(
        f"- Stage-0 wipes, CheckFree+'s copy vs fresh weights: val-loss jump {_median(plus['val_jump']):.2f} vs "
        f"{_median(fresh['val_jump']):.2f}, spike vs no-failure {_median(plus['spike_paired']):.2f} vs "
        f"{_median(fresh['spike_paired']):.2f}, steps to recover {_median(plus['recover_steps']):.0f} vs "
        f"{_median(fresh['recover_steps']):.0f}, final val loss {_median(plus['final_val']):.3f} vs "
        f"{_median(fresh['final_val']):.3f} (paper: E and E⁻¹ recovered exactly)."
    )
    if "backup" in interior:
        b, c = interior["backup"], interior["checkfree"]
        lines.append(
            f"- Interior wipes, backup vs CheckFree: val-loss jump {_median(b['val_jump']):.3f} vs "
            f"{_median(c['val_jump']):.3f}, spike vs no-failure {_median(b['spike_paired']):.3f} vs "
            f"{_median(c['spike_paired']):.3f}, steps to recover {_median(b['recover_steps']):.0f} vs "
            f"{_median(c['recover_steps']):.0f}, final val loss {_median(b['final_val']):.3f} vs "
            f"{_median(c['final_val']):.3f}."
        )
    if "backup" in edge:
        b = edge["backup"]
        lines.append(
            f"- Edge wipes, backup vs CheckFree+ vs copy without swaps: val-loss jump {_median(b['val_jump']):.2f} vs "
            f"{_median(cf['val_jump']):.2f} vs {_median(cp['val_jump']):.2f}, steps to recover "
            f"{_median(b['recover_steps']):.0f} vs {_median(cf['recover_steps']):.0f} vs "
            f"{_median(cp['recover_steps']):.0f}, final val loss {_median(b['final_val']):.3f} vs "
            f"{_median(cf['final_val']):.3f} vs {_median(cp['final_val']):.3f}."
        )
    swap = s["swap_cost"]
    lines.append(
        f"- No failures, swaps cost: steps to the target {_median(swap['none_swaps']['steps_to_target']):.0f} with "
        f"swaps vs {_median(swap['none']['steps_to_target']):.0f} without; final val loss "
        f"{_median(swap['none_swaps']['final_val']):.3f} vs {_median(swap['none']['final_val']):.3f} "
        "(paper: CheckFree+ slightly slower)."
    )
    for r in s["rates"].values():
        pct = round(r["rate_per_hour"] * 100)
        cells = []
        for strategy, label in (("checkfree", "CheckFree"), ("checkfree_plus", "CheckFree+")):
            ours = spread(r["ratios"][f"{strategy}/checkpoint_100"], 2, r["ratios"][f"{strategy}/reached"])
            cells.append(f"{label} {ours} (paper {r['paper_ratios'][strategy]:.2f})")
        if "backup/checkpoint_100" in r["ratios"]:
            ours = spread(r["ratios"]["backup/checkpoint_100"], 2, r["ratios"]["backup/reached"])
            cells.append(f"backup {ours} (no paper figure; {backup_rate_cell(r['strategies']['backup']['backup'])})")
        lines.append(
            f"- {pct} %/h, time to target over checkpointing every 100 iterations: {'; '.join(cells)}; "
            f"{_median(r['failures_in_run']):.0f} failures in the run."
        )
    same = [r["experiments"]["interior"].get("clipped_same_as_unclipped", False) for r in result["seeds"]]
    shares = [x for r in result["seeds"] for x in r["grad_norms"]["share_of_steps_both_neighbours_clipped"]]
    lasts = [x for r in result["seeds"] if (x := r["grad_norms"].get("last_step_both_neighbours_clipped")) is not None]
    if all(same):
        lines.append(
            "- Clipped and unclipped ω gave exactly the same weights at every interior repair (so the same run): "
            f"block stages' gradient norms sit below the clip, both neighbours above it in at most "
            f"{max(shares):.1%} of steps, the last at step {max(lasts) if lasts else '-'}."
        )
    else:
        lines.append(
            f"- Clipped and unclipped ω differed at some repairs (seeds: {same}); both neighbours at or above the "
            f"clip in up to {max(shares):.1%} of steps."
        )
    return "\n".join(lines)


def rules_cell(r: dict) -> str:
    """The rules a strategy applied; under "backup", how old its copies were and why it fell back."""
    if "backup_ages" not in r:
        return ", ".join(r["rules"])
    ages, whys = r["backup_ages"], r["backup_fallbacks"]
    text = f"backup x{len(ages)}" + (f", copies {spread(ages, 0)} step(s) old" if ages else "")
    for why in sorted(set(whys)):
        text += f"; CheckFree x{whys.count(why)} ({why})"
    return text


def backup_rate_cell(counts: list[dict]) -> str:
    restored = [c["restored"] for c in counts]
    fallen = [c["fallen_back"] for c in counts]
    return f"restored {spread(restored, 0)}, CheckFree {spread(fallen, 0)}"


def backup_section(result: dict) -> str:
    """The stage-backup rule (issue 56): what it does here and what it costs."""
    cost, s = result["backup_cost"], result["summary"]
    every, per_backup = cost["backup_every"], cost["bytes_per_backup"][0]
    fallbacks: dict[str, int] = {}
    restored = 0
    for seed in result["seeds"]:
        for section in seed["experiments"].values():
            counts = section["strategies"].get("backup", {}).get("backup")
            if counts:
                restored += counts["restored"]
                for why, n in counts["fallbacks"].items():
                    fallbacks[why] = fallbacks.get(why, 0) + n
    whys = "; ".join(f"{n} x {why}" for why, n in sorted(fallbacks.items())) or "none"
    ages = s["per_failure"]["interior"]["backup"]["backup_ages"] + s["per_failure"]["edge"]["backup"]["backup_ages"]
    per_step, ring = cost["bytes_per_step_per_keeper"][0], cost["bytes_per_step_all_keepers"]
    keepers, held = len(cost["bytes_per_backup"]), cost["memory_per_keeper_node_bytes"][0]
    return f"""## Stage backups held by a neighbour (the daemons' rule beyond the papers)

Row "backup" in the tables above and below: the live daemons' `repair.backup_every` ({every}): the workers of
block stage s+1 keep a copy of block stage s (block stage 1 keeps the last), taken here at the end of every
inner step that brings the count to a multiple of {every}, so a copy is 0 to {every - 1} steps old (the single
wipes' copies: {", ".join(str(x) for x in ages)} steps). A lost block stage comes back as its keeper's copy,
with a fresh AdamW at 1.0 x the schedule, its step count going on (`restore_from_backup`); where no copy is
left (its keeper lost in the same failure, or none taken yet) it is rebuilt by the run's CheckFree rule from
the stages alive or already restored, and a keeper that was lost copies its stage again at once. This
simulation has no outer step, so no φ: the copy restores θ only. The modelled clock charges a restore the
same {T_RECOVER_S:.0f} s as a rebuild; the copies' transfers are not charged (they run beside training).
Restores over {"the seed" if len(result["seeds"]) == 1 else "the seeds"}: {restored}; fallbacks to CheckFree: {whys}.

**Cost** (each snapshot as its int8 change, {cost["bytes_per_parameter"]:.2f} bytes a parameter; one block stage is
{cost["parameters_by_block_stage"][0]:,} parameters): {per_backup / 1e6:.2f} MB per backup, {per_step / 1e3:.1f} kB
per step per keeper (every {every} steps), {ring / 1e6:.2f} MB per step over the {keepers} keepers of the ring,
and {held / 1e6:.2f} MB of host memory on every keeper node (one float32 snapshot of the stage it keeps)."""


def markdown(result: dict) -> str:
    s, a = result["summary"], result["args"]
    seeds = result["seeds"]
    n_seeds = len(seeds)
    first = seeds[0]

    def per_failure_table(experiment: str, labels: dict[str, str]) -> str:
        rows = []
        for strategy, r in s["per_failure"][experiment].items():
            rows.append(
                f"| {labels.get(strategy, strategy)} | {rules_cell(r)} | {spread(r['spike'], 2)} "
                f"| {spread(r['spike_paired'], 2)} | {spread(r['val_jump'], 2)} | {spread(r['stage_worth'], 2)} "
                f"| {spread(r['recover_steps'], 0)} | {spread(r['final_val'], 3)} |"
            )
        return (
            "| strategy | rule applied | loss spike | spike vs no-failure, same batch | val-loss jump "
            "| skipping the stage instead | steps to recover | final val loss |\n|---|---|---|---|---|---|---|---|\n"
            + "\n".join(rows)
        )

    def repairs_line(seed: dict, name: str) -> str:
        section = seed["experiments"][name]
        pct = round(section["rate_per_hour"] * 100)
        cells = []
        for strategy, entry in section["strategies"].items():
            jumps = {}
            for record in entry["repairs"]:
                jumps.setdefault(record["slot"], (record["val_after"] - record["val_before"], []))[1].append(
                    f"{record['stage']}{'' if record['rule'] in ('checkfree', 'uniform') else ' ' + record['rule']}"
                )
            if len(jumps) > 12:  # a dense schedule: how many, and how the jumps spread
                values = [jump for jump, _ in jumps.values()]
                text = (f"{len(jumps)} steps lost {len(entry['repairs'])} stages; val-loss jump per step "
                        f"{spread(values, 2)}, largest {max(values):+.2f}")  # fmt: skip
            else:
                text = ", ".join(f"{slot}: {'+'.join(st)} {jump:+.2f}" for slot, (jump, st) in jumps.items())
            cells.append(f"{LABELS[strategy]}: {text or 'none'}")
        return f"- seed {seed['seed']}, {pct} %/h: " + "; ".join(cells)

    edge_labels = {
        "checkfree_plus": "CheckFree+ (swaps, copy the partner)",
        "checkfree": "copy neighbour, no swaps",
        "backup": "backup held by the neighbour, no swaps",
    }
    stage0_labels = {"checkfree_plus": "CheckFree+ (the neighbours' copy)", "checkfree": "no copy: fresh weights"}
    rate_rows = []
    for r in s["rates"].values():
        pct = f"{round(r['rate_per_hour'] * 100)} %"
        base = f"| {pct} | {r['p_step']:.4f} | {spread(r['failures_in_run'], 0)} "
        for strategy, e in r["strategies"].items():
            label = LABELS[strategy] + (f" ({backup_rate_cell(e['backup'])})" if "backup" in e else "")
            rate_rows.append(
                base + f"| {label} | {spread(e['final_val'])} | "
                f"{spread(e['steps_to_target'], 0)} | {spread(e['hours'], 1, e['reached'])} |"
            )
        for k, c in r["checkpointing"].items():
            every = (
                k if str(c.get("every_steps", k)) == k else f"{k} of the paper's iterations = {c['every_steps']} steps"
            )
            rate_rows.append(
                base + f"| checkpoint every {every} (no-failure curve; replayed steps {spread(c['lost_steps'], 0)}, "
                f"roll-backs {spread(c['rollbacks'], 0)}) | – | – | {spread(c['hours'], 1)} |"
            )
        rate_rows.append(
            base + f"| redundant computation (no-failure curve, x{REDUNDANT_FACTOR:.2f} per iteration) "
            f"| – | – | {spread(r['redundant_hours'], 1)} |"
        )
    ratio_rows = []
    for r in s["rates"].values():
        pct = f"{round(r['rate_per_hour'] * 100)} %"
        cells = []
        for strategy in ("checkfree", "checkfree_plus"):
            reached = r["ratios"][f"{strategy}/reached"]
            cells += [spread(r["ratios"][f"{strategy}/checkpoint_{k}"], 2, reached) for k in map(str, INTERVALS)]
            cells.append(f"{r['paper_ratios'][strategy]:.2f}")
        ratio_rows.append(f"| {pct} | " + " | ".join(cells) + " |")
    rate_details = "\n".join(repairs_line(seed, name) for seed in seeds for name in s["rates"])
    swap = s["swap_cost"]
    check = first["checkpoint_replay_check"]
    norms = first["grad_norms"]
    window = s["per_failure"]["interior"]["checkfree"]["recover_window"]
    steps, smooth = a["steps"], a["smooth"]
    wipes = (
        f"Stage {MIDDLE} at step {steps // 4}, stage {MIDDLE + 1} at {steps // 2}, stage {MIDDLE} at {3 * (steps // 4)}"
    )
    no_swaps = f"{spread(swap['none']['final_val'])} / {spread(swap['none_swaps']['final_val'])}"
    no_swaps_steps = (
        f"{spread(swap['none']['steps_to_target'], 0)} / {spread(swap['none_swaps']['steps_to_target'], 0)}"
    )
    scale = f"x{a['rate_scale']}" + (" (no scaling)" if a["rate_scale"] == 1 else " (scaled up)")
    interval_unit = "of the paper's iterations" if a.get("paper_length") else "steps"
    if a.get("paper_length"):
        mapping = (
            f"scaled to the run's length: the paper's no-failure run reached its target in {PAPER_ITERATIONS:,.0f} "
            f"iterations (419.6 h of redundant computation at 151.04 s), ours in {first['target_step']} steps, so one "
            f"step here stands for {PAPER_ITERATIONS / first['target_step']:.1f} of its iterations: t_step = "
            f"{a['step_s']:.0f} s, and failures fall as densely over the run to the target as in the paper's. The "
            f"paper's checkpoint intervals of 10, 50 and 100 iterations become the steps they span here (at least one)"
        )
    else:
        mapping = f"at the paper's t_iter = {T_ITER_S} s (500M), {scale}"
    failures_of = "the run's failures" if n_seeds == 1 else f"the failures of {n_seeds} seeds"
    over_seeds = "the seed" if n_seeds == 1 else f"the {n_seeds} seeds"
    per_iteration_16 = 6 * a["rate_scale"] * step_probability(RATES[-1], T_ITER_S)
    same_chance = "the same" if a["rate_scale"] == 1 else f"{a['rate_scale']} x the"
    if a.get("paper_length"):
        length_caveat = (
            f"- Scaled to the run's length, each step here stands for {a['step_s'] / T_ITER_S:.0f} of the paper's "
            "iterations of training, but a repaired stage still needs its own steps to recover: a failure costs "
            "this run as many steps as it would cost a long one, so the scaling is harsh on every rebuilding rule.\n"
            "- Several stages, neighbours included, can fail in one step (as in the authors' simulation); a stage "
            "whose neighbours are both lost falls back to the next rule the plan allows (`shoal.train.repair`).\n"
            f"- A save costs {T_SAVE_S:.0f} s here (the paper's overhead at its interval) however often it comes, so "
            "checkpointing every step or two, which the paper's intervals become at this scale, is all but free in "
            "this model; a real save of every stage that often would cost more."
        )
    else:
        length_caveat = (
            f"- The paper's runs are about 22,000 iterations; this one is {a['steps']}, with {same_chance} "
            "per-iteration failure chance, so a failure here costs a larger share of the run and falls in a shorter "
            "learning-rate schedule.\n"
            "- Checkpointing every 100 steps at 16 %/h rarely gets 100 steps without a failure (six stages: about "
            f"{per_iteration_16:.3f} failures per iteration), which is why its time explodes here; the paper's 634 h "
            "at 16 % implies far fewer roll-backs than this per-stage mapping gives."
        )
    ratio_header = (
        "| rate /h | CheckFree ÷ ckpt 10 | ÷ ckpt 50 | ÷ ckpt 100 | paper "
        "| CheckFree+ ÷ ckpt 10 | ÷ ckpt 50 | ÷ ckpt 100 | paper |"
    )
    setting = a.get("setting", "tiny")
    title = "" if setting == "tiny" else ", post-training setting (init std 0.2, lr 3e-3)"
    init = "" if setting == "tiny" else ", but init std 0.2 and lr 3e-3 (`--setting post-training`)"
    identity = (
        " (a fresh block starts close to the identity, its residual projections drawn small, so random "
        "re-initialisation costs about this much)"
        if setting == "tiny"
        else ""
    )
    restore_note = '; "backup" restores it from a copy, at 1.0 x' if "backup_cost" in result else ""
    backups = backup_section(result) + "\n\n" if "backup_cost" in result else ""
    return f"""# CheckFree: rebuilding a lost stage from its neighbours{title}

`{result["command"]}` ({a["steps"]} steps, seeds {", ".join(str(x["seed"]) for x in seeds)}; {result["wall_s"]:.0f} s on
one torch thread, 2 shared cores). The bundled `tiny` model with `n_layers` 6 cut into 7 stages (stage 0 =
embedding, final norm and head, held by the data nodes, which fails only where its table says; six one-layer
block stages), batch 8 x 64 tokens in 4 microbatches,
the tiny run's optimizer (AdamW, cosine schedule, per-stage clipping at 1.0){init}, data: {first["data"]}. One
process, the project's stages, inner optimizers and repair rules; every strategy trains the same steps on
the same batches from the same seed under the same failure schedule. A failure of stage s at step k wipes
it before step k; the rule rebuilds it and it gets a fresh AdamW at 1.1 x the schedule (every rule alike{restore_note}).
Cells: median (min–max) over {failures_of} (per-failure columns) or over {over_seeds} (final val
loss, the rate tables).

- **loss spike**: training loss of step k minus the mean of the {a["smooth"]} steps before (the issue's measure;
  batch-to-batch noise included). **spike vs no-failure**: the same on the gap to the no-failure run on
  the same batches, so the batch noise cancels. **val-loss jump**: validation loss just after the repair
  minus just before. **steps to recover**: steps after the failure until the mean gap to the no-failure
  run over the next {smooth} steps is within {EPSILON} nats of its mean over the {smooth} steps before; "not
  reached" within the steps left before the next failure (at least {window}). **skipping the stage
  instead**: validation loss with the lost stage left out of the route minus with it, just before the
  failure: what the stage was worth then{identity}.

## Single wipes of a middle stage

{wipes}.

{per_failure_table("interior", LABELS)}

Expected (paper): spikes random ≫ copy > uniform > gradient-weighted; recovery in the same order.

## Single wipes of an edge stage

Stage 1 at step {a["steps"] // 3}, stage 6 at {2 * (a["steps"] // 3)}. CheckFree+ trains with half of every step's
microbatches through the swapped order (1↔2, 5↔6) from the start and rebuilds an edge stage as a copy of its
partner; "no swaps" is plain CheckFree, which copies the one block neighbour. Each is compared with the
no-failure run of its own kind.

{per_failure_table("edge", edge_labels)}

No failures, without / with swaps: final val loss {no_swaps}, steps to the target {no_swaps_steps}
(paper: CheckFree+ slightly slower without failures).

## Single wipes of stage 0

Stage 0 (embedding, final norm, LM head: what a data node holds) at steps {a["steps"] // 4} and
{3 * (a["steps"] // 4)}. Under CheckFree+ stages 1 and 6 keep a copy of it, refreshed every
{result["run"]["repair"]["edge_copy_every"]} steps (`repair.edge_copy_every`; the paper copies E and E⁻¹ at
every step), and the lost stage 0 comes back from the freshest copy (up to that many steps old); without
it a data node that starts with nothing starts from fresh weights. Either way with a fresh AdamW at the
schedule, as a new data node's, its step count going on. Each is compared with the no-failure run of its
own kind; "skipping the stage" does not apply (no route leaves stage 0 out).

{per_failure_table("stage0", stage0_labels)}

{backups}## Failure rates: modelled wall-clock to a target validation loss

Failures per block stage per hour mapped onto steps with p = 1 − (1 − p_h)^(t_step/3600), {mapping}; each of
the six block stages draws independently
in every iteration, seeded, and the same draws serve every strategy. Target: the no-failure run's validation
loss at step {first["target_step"]} ({first["target_val_loss"]:.3f} for seed {first["seed"]}). Modelled time =
steps x {a["step_s"]:.0f} s + {T_RECOVER_S:.0f} s per step that lost a stage (the paper's recovery time) for
the rebuilding strategies; checkpointing = (steps to the target on the no-failure curve + replayed steps) x
{a["step_s"]:.0f} s + {T_RELOAD_S:.0f} s per roll-back (assumed: every stage fetches its checkpoint at once) +
{T_SAVE_S:.0f} s per save ((91.35 − 91.32) s x 100, the paper's overhead at its interval); redundant computation =
the no-failure curve at {REDUNDANT_FACTOR:.2f} x t_step (151.04 / 91.35 s).

| rate /h | p / step | failures in the run | strategy | final val loss | steps to target | modelled hours |
|---|---|---|---|---|---|---|
{chr(10).join(rate_rows)}

Modelled time of CheckFree and CheckFree+ over checkpointing every 10 / 50 / 100 {interval_unit}, beside the paper's
(500M, checkpoints every 100 iterations: 367.8 / 558.2 and 355.1 / 558.2 h at 5 %):

{ratio_header}
|---|---|---|---|---|---|---|---|---|
{chr(10).join(ratio_rows)}

Each failure in the rate runs (step: stage, the rule where it is not the averaging one, and the jump of the
validation loss across the repair):

{rate_details}

## Reading, against the paper's expectations

{reading(result)}

## Checks and caveats

- Roll-back checked for real: checkpoints every {check["interval"]} steps, NaN wipes at {check["failures"]},
  {check["steps"]} steps took {check["slots"]} iterations ({check["lost_steps"]} replayed), every step bit-identical
  to the no-failure run, as `checkpoint_timeline` counts. Branching from a copy of a run was checked the same way.
- Gradient norms (seed {first["seed"]}, no failures): median per stage {norms["median_by_stage"]} (stage 0 first);
  both neighbours of interior stages 2–5 at or above the clip (1.0), where clipped ω is exactly uniform, in
  {norms["share_of_steps_both_neighbours_clipped"]} of steps.
{length_caveat}
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--target-at", type=float, default=0.6, help="target = no-failure val loss at this share")
    parser.add_argument("--rate-scale", type=float, default=1.0, help="multiplies the per-iteration failure chance")
    parser.add_argument(
        "--paper-length",
        action="store_true",
        help="one step stands for (the paper's no-failure iterations to its target) / (ours) of its iterations",
    )
    parser.add_argument(
        "--rate-baselines",
        nargs="*",
        default=[],
        choices=["checkfree_clipped", "uniform", "copy", "random"],
        help="also trained at the highest rate",
    )
    parser.add_argument("--replay-steps", type=int, default=60)
    parser.add_argument("--smooth", type=int, default=SMOOTH)
    parser.add_argument("--quick", action="store_true", help="24 steps, failures x10: a smoke run that writes nothing")
    parser.add_argument("--setting", choices=list(SETTINGS), default="tiny", help="the model's init and lr")
    parser.add_argument("--no-docs", action="store_true")
    parser.add_argument("--render", action="store_true", help="rewrite the docs section from the saved JSON only")
    args = parser.parse_args()
    results, section = RESULTS[args.setting]
    if args.render:
        text = markdown(json.loads(results.read_text()))
        write_section(section, text)
        print(text)
        return 0
    if args.quick:
        args.steps, args.eval_every, args.rate_scale, args.replay_steps, args.smooth = 24, 6, 10.0, 20, 4
    target_step = round(args.target_at * args.steps / args.eval_every) * args.eval_every
    args.step_s = T_ITER_S * (PAPER_ITERATIONS / target_step if args.paper_length else 1.0)
    torch.set_num_threads(1)
    started = time.monotonic()
    seeds = [run_seed(args, seed) for seed in args.seeds]
    assert len({r["target_step"] for r in seeds}) == 1, "every seed must use the same target step"
    result = {
        "command": " ".join(["python benchmarks/repair.py", *(a for a in sys.argv[1:] if a != "--no-docs")]),
        "args": {k: v for k, v in vars(args).items()},
        "run": json.loads(bench_run(args.steps, args.seeds[0], args.setting).to_json()),
        "constants": {
            "t_iter_s": T_ITER_S,
            "step_s": args.step_s,
            "paper_iterations": PAPER_ITERATIONS,
            "t_recover_s": T_RECOVER_S,
            "t_reload_s": T_RELOAD_S,
            "t_save_s": T_SAVE_S,
            "redundant_factor": REDUNDANT_FACTOR,
            "smooth": args.smooth,
            "epsilon": EPSILON,
            "paper_hours": {str(k): v for k, v in PAPER_HOURS.items()},
        },
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
        "backup_cost": backup_cost(bench_run(args.steps, args.seeds[0], args.setting)),
        "wall_s": time.monotonic() - started,
        "seeds": seeds,
    }
    result["summary"] = summarise(seeds)
    text = markdown(result)
    if not args.quick:
        results.parent.mkdir(parents=True, exist_ok=True)
        results.write_text(json.dumps(result, indent=1))
        if not args.no_docs:
            write_section(section, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
