"""Verifiable tasks, policies, sampling and rollout bundles: determinism, parsing, rewards, validation.

Run: .venv/bin/python -m pytest -q tests/test_grpo_tasks.py
"""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.grpo.loss import GRPOConfig
from shoal.grpo.policy import Policy, PolicySpec, completion_logprobs
from shoal.grpo.rollout import build_batch
from shoal.grpo.round import RoundConfig, learn, make_bundle, make_optimizer, rollout_limits, round_prompts
from shoal.grpo.sampling import sample
from shoal.grpo.tasks import EVAL, TRAIN, get_task, parse_reversed_answer
from shoal.grpo.tokenizer import EOS, PAD_ID, CharTokenizer
from shoal.grpo.warmup import cached_warm_up, save_warm_up, warm_up, warm_up_stages
from shoal.protocol import ProtocolError, decode, encode
from shoal.protocol.rollout import BadRollout, Completion, RolloutBundle, validate_bundle

TASK = get_task("add2r")
TINY = PolicySpec(d_model=16, n_layers=1, n_heads=2, warmup_steps=3, warmup_batch=8)
CFG = RoundConfig(prompts_per_round=4, completions_per_prompt=3, max_foreign_per_prompt=3)
LIMITS = rollout_limits(CFG, TINY.tokenizer(), 0)

# ---------------------------------------------------------------- tasks


def test_prompts_are_a_function_of_seed_round_and_index() -> None:
    a = [TASK.prompt(7, r, i).text for r in range(3) for i in range(20)]
    assert a == [TASK.prompt(7, r, i).text for r in range(3) for i in range(20)]
    assert a != [TASK.prompt(8, r, i).text for r in range(3) for i in range(20)]
    assert len(set(a)) > 50  # rounds and indices draw different problems
    assert TASK.prompt(7, 2, 5) == get_task("add2r").prompt(7, 2, 5)
    assert all(len(p) == 6 and p[2] == "+" and p[5] == "=" for p in a)


def test_held_out_operands_never_appear_in_training_prompts() -> None:
    train = {TASK.prompt(0, r, i, TRAIN).text for r in range(20) for i in range(50)}
    held_out = {TASK.prompt(0, 0, i, EVAL).text for i in range(300)}
    assert not train & held_out
    assert all(TASK.split_of(*TASK.operands(p)) == EVAL for p in held_out)


@pytest.mark.parametrize(
    ("completion", "answer"),
    [("58$", 85), ("1$", 1), ("891$", 198), ("580$", 85), ("58", None), ("5a$", None), ("$", None), ("", None)],
)
def test_the_parser_reads_reversed_digits_ending_in_eos(completion: str, answer: int | None) -> None:
    assert parse_reversed_answer(completion, max_digits=3) == answer
    assert parse_reversed_answer("1234$", max_digits=3) is None


def test_reward_is_correctness_plus_format_from_the_prompt_alone() -> None:
    assert TASK.demonstration("47+38=") == "58" + EOS
    assert TASK.reward("47+38=", "58$") == 1.0
    assert TASK.reward("47+38=", "59$") == 0.1  # well formed, wrong
    assert TASK.reward("47+38=", "580$") == 0.1  # right number, not the canonical answer
    assert TASK.reward("47+38=", "58") == 0.0  # never ended
    assert TASK.reward("47+38=", "58$$") == 0.0
    assert get_task("add3r").reward("999+999=", "8991$") == 1.0
    with pytest.raises(ValueError, match="not a add2r prompt"):
        TASK.reward("4+38=", "24$")


def test_an_unknown_task_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="add2r"):
        get_task("gsm8k")


def test_the_tokenizer_round_trips_and_refuses_foreign_characters() -> None:
    tok = CharTokenizer(TASK.alphabet)
    ids = tok.encode("47+38=58$")
    assert PAD_ID not in ids and tok.decode(ids + [PAD_ID]) == "47+38=58$" and ids[-1] == tok.eos_id
    assert tok.vocab_size == len(TASK.alphabet) + 1
    assert tok.tokenizer_id == CharTokenizer(TASK.alphabet).tokenizer_id != CharTokenizer("01$").tokenizer_id
    with pytest.raises(ValueError, match="not in the alphabet"):
        tok.encode("4*3")


# ---------------------------------------------------------------- policies and sampling


def test_model_ids_are_stable_and_name_every_field() -> None:
    assert TINY.model_id == dataclasses.replace(TINY).model_id
    assert TINY.model_id.startswith("add2r-d16l1-w3-s0-")
    others = {
        dataclasses.replace(TINY, **{f: v}).model_id for f, v in [("seed", 1), ("warmup_lr", 1e-3), ("d_model", 32)]
    }
    assert len(others | {TINY.model_id}) == 4


def test_the_warm_up_is_cached_under_the_model_id(tmp_path) -> None:
    first, report = cached_warm_up(TINY, tmp_path)
    again, cached = cached_warm_up(TINY, tmp_path)
    assert not report["cached"] and cached["cached"]
    assert list(tmp_path.iterdir()) == [tmp_path / f"policy-{TINY.model_id}.pt"]  # no temporary left over
    for a, b in zip(first.state_dict().values(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(first.head.lm_head.weight, Policy(TINY).head.lm_head.weight)  # it did train


def test_a_staged_warm_up_hands_out_what_each_shorter_warm_up_would_and_caches_it(tmp_path) -> None:
    longer = dataclasses.replace(TINY, warmup_steps=5)
    for spec, policy, report in warm_up_stages(longer, [2, 5]):
        alone, _ = warm_up(spec)
        assert report["model_id"] == spec.model_id and spec.warmup_steps in (2, 5)
        for a, b in zip(policy.state_dict().values(), alone.state_dict().values(), strict=True):
            assert torch.equal(a, b)
        save_warm_up(spec, policy, report, tmp_path)
        loaded, cached = cached_warm_up(spec, tmp_path)
        assert cached["cached"] and torch.equal(loaded.head.lm_head.weight, policy.head.lm_head.weight)


def test_sampled_log_probs_match_a_teacher_forced_pass() -> None:
    policy, tok = Policy(TINY), TINY.tokenizer()
    prompts = [tok.encode(TASK.prompt(0, 0, i).text) for i in range(3)]
    samples = sample(policy, prompts, 4, TASK.max_new_tokens, tok.eos_id, torch.Generator().manual_seed(0))
    assert samples.prompt_rows == [r for r in range(3) for _ in range(4)]
    for c, lp in zip(samples.completions, samples.logprobs, strict=True):
        assert 1 <= len(c) <= TASK.max_new_tokens and len(lp) == len(c) and PAD_ID not in c
        assert tok.eos_id not in c[:-1] and all(x <= 0 for x in lp)
    logp, mask = completion_logprobs(policy, [prompts[r] for r in samples.prompt_rows], samples.completions)
    for i, lp in enumerate(samples.logprobs):
        assert mask[i].sum() == len(lp)
        torch.testing.assert_close(logp[i, : len(lp)], torch.tensor(lp), atol=1e-5, rtol=0)


def test_greedy_sampling_is_deterministic_and_prompts_of_other_lengths_batch_apart() -> None:
    policy, tok = Policy(TINY), TINY.tokenizer()
    prompts = [tok.encode("12+34="), tok.encode("123+456="), tok.encode("99+01=")]
    a = sample(policy, prompts, 2, 5, tok.eos_id, greedy=True)
    b = sample(policy, prompts, 2, 5, tok.eos_id, greedy=True)
    assert a.completions == b.completions and sorted(a.prompt_rows) == [0, 0, 1, 1, 2, 2]


# ---------------------------------------------------------------- bundles


def _bundle(round: int = 0) -> tuple[Policy, RolloutBundle]:
    policy = Policy(TINY)
    prompts = round_prompts(CFG, round)
    return policy, make_bundle(policy, CFG, prompts, torch.Generator().manual_seed(round))


def test_an_honest_bundle_passes_and_round_trips_on_the_wire() -> None:
    policy, bundle = _bundle(round=3)
    validate_bundle(bundle, rollout_limits(CFG, TINY.tokenizer(), 3))
    assert len(bundle.completions) == CFG.prompts_per_round * CFG.completions_per_prompt
    assert bundle.model_id == TINY.model_id and bundle.tokenizer_id == TINY.tokenizer().tokenizer_id
    assert decode(encode(bundle), expected=RolloutBundle) == bundle
    prompts = round_prompts(CFG, 3)  # an honest node claims exactly the rewards it computed
    tok = TINY.tokenizer()
    assert bundle.claimed_rewards == tuple(
        TASK.reward(prompts[c.prompt_index].text, tok.decode(c.tokens)) for c in bundle.completions
    )


def test_a_bundle_without_claims_still_decodes_and_passes() -> None:
    """Backward compatible one way: an older sender's bundle (no `claimed_rewards` key) is a bundle with
    no claims. The other way is not: an older decoder refuses the field as unknown."""
    _, bundle = _bundle(round=3)
    body = msgpack.unpackb(encode(bundle), raw=False)
    del body["b"]["claimed_rewards"]
    old = decode(msgpack.packb(body), expected=RolloutBundle)
    assert old.claimed_rewards == () and old == dataclasses.replace(bundle, claimed_rewards=())
    validate_bundle(old, rollout_limits(CFG, TINY.tokenizer(), 3))


def _replace_completion(bundle: RolloutBundle, i: int, **changes) -> RolloutBundle:
    completions = list(bundle.completions)
    completions[i] = dataclasses.replace(completions[i], **changes)
    return dataclasses.replace(bundle, completions=tuple(completions))


def _bad_bundles(bundle: RolloutBundle, vocab: int, eos: int) -> dict[str, RolloutBundle]:
    first = bundle.completions[0]
    return {
        "round": dataclasses.replace(bundle, round=4),
        "task": dataclasses.replace(bundle, task="add3r"),
        "tokenizer": dataclasses.replace(bundle, tokenizer_id="char-000000000000"),
        "outside the vocabulary": _replace_completion(bundle, 0, tokens=(vocab,) + first.tokens[1:]),
        "outside the vocabulary ": _replace_completion(bundle, 0, tokens=(PAD_ID,) + first.tokens[1:]),
        "log-probs for": _replace_completion(bundle, 0, logprobs=first.logprobs + (-1.0,)),
        "not a finite number": _replace_completion(bundle, 0, logprobs=(0.5,) + first.logprobs[1:]),
        "not a finite number ": _replace_completion(bundle, 0, logprobs=(float("nan"),) + first.logprobs[1:]),
        "not a finite number  ": _replace_completion(bundle, 0, logprobs=(float("-inf"),) + first.logprobs[1:]),
        "expected 1..": _replace_completion(bundle, 0, tokens=(), logprobs=()),
        "expected 1.. ": _replace_completion(bundle, 0, tokens=(2,) * 9, logprobs=(-1.0,) * 9),
        "after the end": _replace_completion(bundle, 0, tokens=(eos, 2), logprobs=(-1.0, -1.0)),
        "prompt index": _replace_completion(bundle, 0, prompt_index=CFG.prompts_per_round),
        "prompt index ": _replace_completion(bundle, 0, prompt_index=-1),
        "completions for prompt": dataclasses.replace(bundle, completions=bundle.completions + (first,)),
        "claimed rewards for": dataclasses.replace(bundle, claimed_rewards=bundle.claimed_rewards[1:]),
        "claimed reward 7.0": dataclasses.replace(bundle, claimed_rewards=(7.0,) + bundle.claimed_rewards[1:]),
        "claimed reward -0.5": dataclasses.replace(bundle, claimed_rewards=(-0.5,) + bundle.claimed_rewards[1:]),
        "claimed reward nan": dataclasses.replace(bundle, claimed_rewards=(float("nan"),) + bundle.claimed_rewards[1:]),
    }


def test_malformed_bundles_are_refused_with_a_reason() -> None:
    policy, bundle = _bundle(round=3)
    limits = rollout_limits(CFG, TINY.tokenizer(), 3)
    tok = TINY.tokenizer()
    for reason, bad in _bad_bundles(bundle, tok.vocab_size, tok.eos_id).items():
        with pytest.raises(BadRollout, match=reason.strip()):
            validate_bundle(bad, limits)
    many = dataclasses.replace(limits, max_completions=5)
    with pytest.raises(BadRollout, match="over the limit of 5"):
        validate_bundle(bundle, many)
    few_tokens = dataclasses.replace(limits, max_tokens=4)
    with pytest.raises(BadRollout, match="tokens in the bundle"):
        validate_bundle(bundle, few_tokens)


def test_the_decoder_refuses_oversized_and_non_finite_bundles() -> None:
    _, bundle = _bundle()
    body = msgpack.unpackb(encode(bundle), raw=False)
    body["b"]["completions"][0]["logprobs"][0] = float("nan")
    with pytest.raises(ProtocolError, match="finite"):
        decode(msgpack.packb(body), expected=RolloutBundle)
    body = msgpack.unpackb(encode(bundle), raw=False)
    body["b"]["claimed_rewards"][0] = float("inf")  # a claim is a float like any other: finite on the wire
    with pytest.raises(ProtocolError, match="claimed_rewards.*finite"):
        decode(msgpack.packb(body), expected=RolloutBundle)
    huge = Completion(0, tuple([2] * 32), tuple([-1.5] * 32))
    with pytest.raises(ProtocolError):
        encode(dataclasses.replace(bundle, completions=(huge,) * 256))  # over 64 KiB: refused both ways


completion_st = st.builds(
    Completion,
    prompt_index=st.integers(-3, 20),
    tokens=st.lists(st.integers(-2, 20), max_size=10).map(tuple),
    logprobs=st.lists(st.floats(-50, 1, allow_nan=False), max_size=10).map(tuple),
)
bundle_st = st.builds(
    RolloutBundle,
    task=st.sampled_from(["add2r", "add3r", ""]),
    round=st.integers(-1, 5),
    model_id=st.text(max_size=20),
    tokenizer_id=st.sampled_from([TINY.tokenizer().tokenizer_id, "other"]),
    completions=st.lists(completion_st, max_size=16).map(tuple),
    claimed_rewards=st.lists(st.floats(-1, 2, allow_nan=False), max_size=16).map(tuple),
)


@settings(max_examples=150, deadline=None)
@given(bundle=bundle_st)
def test_any_bundle_round_trips_and_is_either_valid_or_refused_cleanly(bundle: RolloutBundle) -> None:
    assert decode(encode(bundle), expected=RolloutBundle) == bundle
    try:
        validate_bundle(bundle, LIMITS)
    except BadRollout:
        return
    for c in bundle.completions:  # what passes is safe to put into tensors
        assert all(1 <= t < LIMITS.vocab_size for t in c.tokens) and all(x <= 0 for x in c.logprobs)
        assert len(c.tokens) == len(c.logprobs) and 0 <= c.prompt_index < CFG.prompts_per_round
    assert len(bundle.claimed_rewards) in (0, len(bundle.completions))
    assert all(0.0 <= r <= LIMITS.max_reward for r in bundle.claimed_rewards)


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=200) | bundle_st.map(encode).map(lambda b: b[: len(b) // 2]))
def test_the_bundle_decoder_raises_only_protocol_errors(data: bytes) -> None:
    try:
        decode(data, expected=RolloutBundle)
    except ProtocolError:
        pass


# ---------------------------------------------------------------- one round


def test_learn_scores_rewards_itself_and_skips_refused_bundles() -> None:
    torch.manual_seed(0)
    policy, own = _bundle(round=0)
    _, peer = _bundle(round=0)
    prompts = round_prompts(CFG, 0)
    bad = dataclasses.replace(peer, round=1, model_id="liar")
    batch = build_batch(TASK, TINY.tokenizer(), prompts, own, [peer])
    tok = TINY.tokenizer()
    expected = [
        TASK.reward(prompts[c.prompt_index].text, tok.decode(c.tokens)) for c in own.completions + peer.completions
    ]
    assert batch.rewards.tolist() == pytest.approx(expected)
    assert batch.foreign.tolist() == [False] * len(own.completions) + [True] * len(peer.completions)
    before = [p.detach().clone() for p in policy.parameters()]
    report = learn(policy, make_optimizer(policy, CFG), CFG, prompts, own, [peer, bad])
    assert report.refused == ("liar: bundle is for round 1, this is round 0",)
    # the peer sampled the whole vocabulary, so the top-k check may keep some of its completions out
    assert report.checks[0][1] == report.foreign_rejected and report.checks[1][2] == "refused"
    assert report.loss.used == len(own.completions) + len(peer.completions) - report.foreign_rejected
    assert any(not torch.equal(a, b) for a, b in zip(before, policy.parameters(), strict=True))


def test_a_positive_sample_becomes_more_likely_after_one_round() -> None:
    policy, tok = Policy(TINY), TINY.tokenizer()
    cfg = dataclasses.replace(CFG, prompts_per_round=1, lr=1e-2, grpo=GRPOConfig(mode="alone"))
    prompts = round_prompts(cfg, 0)
    right, wrong = tok.encode(TASK.demonstration(prompts[0].text)), tok.encode("0$")
    with torch.no_grad():
        logp, _ = completion_logprobs(policy, [tok.encode(prompts[0].text)] * 2, [right, wrong])
    own = RolloutBundle(
        "add2r",
        0,
        TINY.model_id,
        tok.tokenizer_id,
        tuple(
            Completion(0, tuple(c), tuple(lp[: len(c)].tolist())) for c, lp in zip([right, wrong], logp, strict=True)
        ),
    )
    learn(policy, make_optimizer(policy, cfg), cfg, prompts, own)
    with torch.no_grad():
        after, _ = completion_logprobs(policy, [tok.encode(prompts[0].text)] * 2, [right, wrong])
    assert after[0].sum() > logp[0].sum() and after[1].sum() < logp[1].sum()
