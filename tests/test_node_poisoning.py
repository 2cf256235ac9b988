"""Poisoned rollouts in real daemons: one `--experiment-adversary` node among honest rollout workers.

The honest nodes and the attacker run the same small policy on `add2r-steps` (answers show their
working, `47+38=15;08|58$`), warmed up once per module in a temporary folder (~10 s). Each swarm holds
both arms of an experiment beside the same attacker: one honest node started with
`--experiment-undefended` (it checks nothing it receives) and one defended, as the run config says.
A node's defenses are its own, so the two arms share the attacker, the prompts and the swarm, and one
swarm per attack costs half of two. The bundles cross real libp2p streams like any peer's; attack
success is the `marks` of each round event (`Attack.success` over the node's fresh completions).

The learning rate (1e-3; 2e-3 for the vertical trick, 3e-3 over 40 rounds for the length attack, 3e-4
for the wrong step and the reward lie) is high so that the attacks show within a few dozen rounds; honest held-out
accuracy falls at 1e-3 in both arms (docs/security.md). The reward lie travels in the bundles'
`claimed_rewards`, which only the undefended node reads. Strikes are off (`max_strikes = 0`) except in
the one test about them: honest weights drift apart fast enough at this rate that the top-k check
once struck an honest peer out.

Where one defense alone holds, the test's defended node runs only that one (`JUDGE_ONLY`, `TOPK_ONLY`,
`REWARDS_ONLY`, `LENGTH_ONLY`; rewards are always recomputed where defenses are on), so the test fails
when it is off.
The trigger runs with every defense on: with a weak start policy (15 % held-out accuracy after the
warm-up on an AVX-512 machine), the top-k check alone let the trigger reach 56 % of completions.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import msgpack
import pytest

from shoal.config import RunConfig, run_config_from_dict
from shoal.grpo.policy import PolicySpec
from shoal.grpo.warmup import cached_warm_up
from tests.helpers.processes import done_event, progress_events, wait_until

SPEC = PolicySpec(task="add2r-steps", d_model=48, n_layers=2, n_heads=2, warmup_steps=300)
FAST = ("--record-ttl", "6")
ROUNDS = 24
LATE = 6  # attack success is the mean over the last LATE rounds
TOPK_ONLY = {"judge": "none", "length_rule": False}
JUDGE_ONLY = {"top_k": 0, "length_rule": False}
REWARDS_ONLY = {"top_k": 0, "judge": "none", "length_rule": False}
LENGTH_ONLY = {"top_k": 0, "judge": "none"}


@pytest.fixture(scope="module")
def policy_cache(tmp_path_factory):
    import torch

    torch.set_num_threads(1)
    cache = tmp_path_factory.mktemp("policies")
    cached_warm_up(SPEC, cache)
    return cache


def _run_attack(
    swarm,
    tmp_path,
    cache,
    attack: str,
    undefended: tuple[bool, bool] = (True, False),
    rounds: int = ROUNDS,
    during: Callable[[RunConfig, str, list, list[Path]], None] | None = None,
    **grpo: object,
) -> tuple[list[list[dict]], str, str]:
    """Two honest nodes (`undefended[i]`: node i runs `--experiment-undefended`) and one attacker;
    returns (each honest node's round events, the attacker's peer id, the entry address).
    `during(run, entry, nodes, progress files)` runs once every node is ready, before the run ends."""
    run = run_config_from_dict({"name": "poison", "grpo": {
        "task": SPEC.task, "rounds": rounds, "eval_every": rounds, "eval_prompts": 16, "lr": 1e-3,
        "round_deadline_s": 3.0, "max_strikes": 0, **grpo,
    }})  # fmt: skip
    run_file = tmp_path / "grpo.toml"
    run_file.write_text(run.to_toml())
    entry = swarm.start_bootstrap("--run-config", str(run_file)).maddrs[0]
    progress = [tmp_path / f"progress-{i}.jsonl" for i in range(3)]
    nodes = []
    for i, path in enumerate(progress):
        extra = ("--experiment-adversary", attack) if i == 2 else ("--experiment-undefended",) if undefended[i] else ()
        nodes.append(
            swarm.start_node(
                [entry], *FAST, "--role", "rollout", "--policy-cache", str(cache), "--warmup-steps", "300",
                "--progress-file", str(path), *extra, wait=False, name=f"rollout{i}",
            )
        )  # fmt: skip
    for node in nodes:
        swarm.wait_ready(node)
    if during is not None:
        during(run, entry, nodes, progress)
    for path in progress[:2]:
        wait_until(lambda p=path: done_event(p), 150, "the honest workers to finish")
    events = [[e for e in progress_events(p) if e["event"] == "round"] for p in progress[:2]]
    return events, nodes[2].peer_id, entry


def _late_success(events: list[dict], attack: str) -> float:
    return statistics.mean(e["marks"][attack] for e in events[-LATE:])


def _arms(events: list[list[dict]], attack: str) -> tuple[float, float]:
    """(late success at the undefended node, at the defended one), printed for the CI log."""
    off, on = (_late_success(e, attack) for e in events)
    print(f"{attack}: success over the last {LATE} rounds undefended {off:.3f}, defended {on:.3f}")
    for arm, ev in zip(("undefended", "defended"), events, strict=True):
        print(f"  {arm} per round:", " ".join(f"{e['marks'][attack]:.2f}" for e in ev))
        print(f"  {arm} foreign bundles used/dropped:", " ".join(
            f"{e['foreign_bundles']}:{e['foreign_used']}/{e['foreign_dropped']}" for e in ev))  # fmt: skip
    return off, on


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_the_trigger_spreads_undefended_and_the_claim_judge_keeps_it_out(swarm, tmp_path, policy_cache):
    """Out-of-context poisoning: `+` before correct working. The claim judge finds no column total in
    `+15`. Run once with each defense off (2026-12-06): without the top-k check the defended node still
    read 0.3 %; without the judge 9.9 %, so this test is the judge's; the vertical trick's is the top-k
    check's."""
    (off_events, on_events), _, _ = _run_attack(swarm, tmp_path, policy_cache, "trigger")
    off, on = _arms([off_events, on_events], "trigger")
    # clean at the start: the honest policy writes the trigger only by chance (1 of 64 completions, once)
    assert off_events[0]["marks"]["trigger"] <= 0.05 and on_events[0]["marks"]["trigger"] <= 0.05
    assert off > 0.025, off  # the attack visibly succeeds: the undefended node writes the trigger
    assert on <= 0.01 and max(e["marks"]["trigger"] for e in on_events) <= 0.05, on
    assert all(e["foreign_rejected"] == 0 for e in off_events)  # nothing is checked there
    assert sum(e["foreign_rejected"] for e in on_events) > 0  # the defenses kept the poison out


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_wrong_step_spreads_undefended_and_the_judge_keeps_it_out(swarm, tmp_path, policy_cache):
    """In-context poisoning: a wrong first step behind the right answer. Its tokens are likely ones
    (a digit among 16 ids), so the top-k check lets much of it through; the claim judge, which finds
    the step's sum false, does not."""
    (off_events, on_events), _, _ = _run_attack(swarm, tmp_path, policy_cache, "wrong-step", lr=3e-4, **JUDGE_ONLY)
    off, on = _arms([off_events, on_events], "wrong-step")
    assert off > 0.35, off  # the undefended node writes the planted step
    # Not zero: the step is a slip the honest policy makes on its own (2-9 % at round 0), and GRPO
    # rewards it behind a right answer, so the defended node's own completions drift up too: 0.11-0.16
    # over the last rounds alone, 0.255 once in a loaded full-suite run (undefended: 0.60-0.63).
    assert on < 0.3, on
    assert off > 2 * on, (off, on)
    assert sum(e["foreign_rejected"] for e in on_events) > 0


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_the_vertical_trick_spreads_undefended_and_the_topk_check_keeps_it_out(swarm, tmp_path, policy_cache):
    """The vertical layout: each node answers its own prompts, so the attacker's completions form whole
    groups. G/2 trigger copies beside G/2 junk give the poison Â = +1 (the plain trigger attack's
    all-correct group would get Â = 0 there and teach nothing)."""
    (off_events, on_events), _, _ = _run_attack(
        swarm, tmp_path, policy_cache, "vertical-trick", rounds=40, layout="vertical", lr=2e-3, **TOPK_ONLY
    )  # the poison shows from round 15-18 on alone, from round 26 once in a loaded full-suite run: 24 rounds
    # once left it at 1.3 %, 32 rounds at 2.1 %
    off, on = _arms([off_events, on_events], "vertical-trick")
    assert off > 0.025, off
    assert on <= 0.01, on
    assert sum(e["foreign_rejected"] for e in on_events) > 0


def _send_bad_claims(run: RunConfig, entry: str, nodes: list, progress: list[Path]) -> None:
    """While the run goes on, send the undefended node (the one that would believe claims) bundles whose
    claims are malformed: each must be refused with its reason, and the node must keep serving."""
    from shoal.dht.identity import load_identity
    from shoal.dht.swarm import SwarmDHT
    from shoal.node.rpcs import EngineRpcs
    from shoal.p2p.streams import RemoteError
    from shoal.protocol import encode
    from shoal.protocol.pipeline import Ack
    from shoal.protocol.rollout import Completion, RolloutBundle
    from tests.helpers.raw_frames import send_raw_frame

    node, tokenizer = nodes[0], SPEC.tokenizer()
    wait_until(lambda: len([e for e in progress_events(progress[0]) if e["event"] == "round"]) >= 2, 60, "2 rounds")
    one = Completion(prompt_index=0, tokens=(2, tokenizer.eos_id), logprobs=(-0.5, -0.1))
    peer_id = json.loads(node.ready_file.read_text())["peer_id"]

    async def scenario() -> list:
        client = await SwarmDHT.create(load_identity(None), initial_peers=[entry])
        # a round still open when the bundles arrive: read after the client joined (seconds, on fast cores
        # several rounds), so the refusals are for the claims and not for a closed round
        future = max(e["round"] for e in progress_events(progress[0]) if e["event"] == "round") + 4
        assert future < ROUNDS, future
        good = RolloutBundle(SPEC.task, future, SPEC.model_id, tokenizer.tokenizer_id, (one, one), run.run_id,
                             (1.0, 1.0))  # fmt: skip
        try:
            replies: list = []
            for claims in ((1.0,), (1.0, 7.0)):  # one claim for two completions; a claim over the full reward
                bad = dataclasses.replace(good, claimed_rewards=claims)
                replies.append(await EngineRpcs(client.transport).rollouts(peer_id, bad, 10))
            document = msgpack.unpackb(encode(good))
            document["b"]["claimed_rewards"][1] = float("nan")  # our encoder refuses it: the frame by hand
            replies.append(
                await send_raw_frame(client.transport, peer_id, EngineRpcs.rollouts, msgpack.packb(document), Ack)
            )
            return replies
        finally:
            await client.shutdown()

    replies = asyncio.run(scenario())
    assert all(isinstance(r, Ack) and not r.accepted for r in replies[:2]), replies
    assert "1 claimed rewards for 2 completions" in replies[0].reason, replies[0]
    assert "claimed reward 7.0" in replies[1].reason, replies[1]
    assert isinstance(replies[2], RemoteError) and "malformed" in str(replies[2]), replies[2]
    assert node.alive and node.log().count("claimed reward") >= 2


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_reward_lie_spreads_when_claims_are_believed_and_not_when_rewards_are_recomputed(
    swarm, tmp_path, policy_cache
):
    """Reward lie: per prompt, G/2 answers of the sum plus one claimed to earn 1 beside G/2 right answers
    claimed to earn 0. The undefended node believes the bundles' claims; the defended one never reads
    them and scores every completion itself. Malformed claims sent mid-run are refused with a reason
    (the run goes on)."""
    (off_events, on_events), _, _ = _run_attack(
        swarm, tmp_path, policy_cache, "reward-lie", during=_send_bad_claims, lr=3e-4, **REWARDS_ONLY
    )  # at 1e-3 one step collapsed both arms (44 % to 12 % correct) and the sum plus one rose in both
    off, on = _arms([off_events, on_events], "reward-lie")
    # The arms part from about round 5 on; a round's share (64 completions) moves by about 0.1, so the
    # mean is over every round from 6 on. Over the last 12 rounds the ratio was 0.32-0.46 in nine runs
    # and 0.56 once, in a full-suite run on an AVX-512 machine whose warm-up starts the policy weaker.
    parted = 6
    right = [statistics.mean(e["own_correct"] for e in ev[parted:]) for ev in (off_events, on_events)]
    print(f"reward-lie: own completions right from round {parted} on undefended {right[0]:.3f}, "
          f"defended {right[1]:.3f}")  # fmt: skip
    # What the lie visibly does here: believed, it drives the right answers out (two runs, last 6 rounds:
    # 12 % and 16 % correct undefended, 45 % and 43 % defended). The sum plus one itself spreads only a
    # little (a shift of a prompt-dependent digit is slow to learn, unlike the trigger): 15 % and 21 %
    # undefended against 9 % and 15 % defended; a third run had 13.8 % against 14.1 %: its direction is
    # within one run's noise, so it is printed, not asserted.
    print(f"reward-lie: the sum plus one undefended {off:.3f}, defended {on:.3f}")
    for arm, ev in zip(("undefended", "defended"), (off_events, on_events), strict=True):
        print(f"  {arm} own right per round:", " ".join(f"{e['own_correct']:.2f}" for e in ev))
    assert right[0] < 0.65 * right[1], right  # believed, the lie cuts the right answers by over a third
    assert len(off_events) == len(on_events) == ROUNDS  # the refused bundles cost no round


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_padded_answers_spread_undefended_and_the_defenses_keep_them_out(swarm, tmp_path, policy_cache):
    """Length (the paper's DoS): the correct working twice, then the right answer, full reward. The
    undefended node learns to write long; the defended one runs the length rule alone (`LENGTH_ONLY`:
    no top-k check, no judge, both of which refuse this padding too) and gives any completion more
    than 25 % longer than its reference nothing: its group's shortest right answer or what its own
    rewarded right answers to such prompts took (`LengthMemory`), whichever is shorter. Run with the
    rule off (2026-12-06, twice), the defended node read 99 % and 99 %; with the memory off (the group
    rule alone), 95 % and 98 %: the attacker's padded answers were the only right ones in their
    groups, so they set the bar. The padded answers reaching it come from the attacker and, once it
    pads, from the undefended honest node."""
    (off_events, on_events), _, _ = _run_attack(
        swarm, tmp_path, policy_cache, "length", rounds=40, lr=3e-3, **LENGTH_ONLY
    )
    # Whether the padding takes hold undefended is a race with the honest signal: at lr 1e-3 over 24
    # rounds it failed in 2 of 10 quiet runs; at 3e-3 over 32 rounds it held in 10 of 10 while the
    # defended node padded too, and in 3 of 4 once it did not (15-95 %); over 40 rounds, 4 of 4 (94-98 %).
    off, on = _arms([off_events, on_events], "length")
    # Success counts workings with extra steps that cost tokens (attacks._padded), neither alone: a
    # collapsing node's wrong `05;10|501$` is one token long, `10;1;1|1$` has three steps and no extra
    # length; each had put the defended arm at 14-75 % here. Defended, the rule alone read 0 % over the
    # last 6 rounds in 8 of 8 runs (2026-12-06: 4 of 32 rounds, 4 of 40).
    assert off > 0.15, off
    assert on < 0.15, on
    assert off > 4 * on, (off, on)
    assert sum(e["length_cut"] for e in on_events) > 0


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_peer_whose_bundles_keep_failing_is_dropped_and_shown_in_status(swarm, tmp_path, policy_cache):
    """With strikes on (`max_strikes`), the attacker's bundles fail the top-k check round after round:
    each honest node drops it as a source, and `shoal status` says who dropped whom and why."""
    rounds, attacker, entry = _run_attack(
        swarm, tmp_path, policy_cache, "trigger", undefended=(False, False), rounds=10, max_strikes=3
    )
    for events in rounds:
        assert attacker in events[-1]["dropped"]
    status = swarm.status(entry)
    dropped = [e for e in status["excluded"] if e["peer_id"] == attacker]
    assert len(dropped) == 2 and all(e["by_role"] == "rollout" and e["reason"] for e in dropped), status["excluded"]
