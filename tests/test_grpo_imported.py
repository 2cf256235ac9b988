"""GRPO on an imported policy: rollout workers post-train a Hugging Face checkpoint (a tiny random
one written by `transformers` in the test) over its own tokenizer, and F-TIS weighs the bundles of a
peer that started from another checkpoint in the same tokenizer. Learning is not asserted here (a
random checkpoint has nothing to build on); the loop, the bundle format and the refusals are."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from shoal.config import ConfigError
from shoal.grpo.loss import GRPOConfig
from shoal.grpo.policy import CheckpointPolicySpec, Policy, PolicySpec, check_policy_checkpoint
from shoal.grpo.round import RoundConfig, learn, make_bundle, make_optimizer, round_prompts
from shoal.grpo.warmup import warm_up
from shoal.model.checkpoint import read_checkpoint
from shoal.run_files import load_run_source
from tests.helpers.processes import done_event, progress_events, wait_until
from tests.test_model_hf_import import VOCAB, write_checkpoint

TASK = "add2r"


def _two_checkpoints(tmp_path):
    """Two different checkpoints (LLaMA with grouped-query attention; Qwen2, tied) in one tokenizer."""
    first, second = tmp_path / "llama", tmp_path / "qwen"
    models = write_checkpoint(first), write_checkpoint(second, "qwen2-bias-tied")
    shutil.copy(first / "tokenizer.json", second / "tokenizer.json")
    return (first, second), models


def _write_grpo_run(tmp_path, policy_dir, **grpo) -> object:
    values = {"rounds": 3, "prompts_per_round": 4, "group_size": 2, "eval_prompts": 8, "eval_every": 3,
              "round_deadline_s": 3.0, **grpo}  # fmt: skip
    lines = "".join(f"{key} = {json.dumps(value)}\n" for key, value in values.items())
    path = tmp_path / "grpo.toml"
    path.write_text(f'name = "imported-grpo"\n[grpo]\n{lines}[grpo.policy]\nfrom = {json.dumps(policy_dir.name)}\n')
    return path


def test_an_imported_policy_computes_transformers_logits_and_writes_task_text(tmp_path):
    (folder, _), (theirs, _) = _two_checkpoints(tmp_path)
    spec = CheckpointPolicySpec(TASK, read_checkpoint(folder), warmup_steps=0)
    check_policy_checkpoint(spec)
    policy = Policy(spec).eval()
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, expected = policy(tokens), theirs(input_ids=tokens).logits
    assert torch.allclose(ours, expected, atol=1e-5, rtol=0), float((ours - expected).abs().max())
    tokenizer = spec.tokenizer()
    assert tokenizer.tokenizer_id.startswith("hf-") and tokenizer.first_id == 0
    assert (
        tokenizer.encode("58$")[-1] == tokenizer.eos_id
        and tokenizer.decode(tokenizer.encode("47+38=58$")) == "47+38=58$"
    )
    assert spec.model_id != CheckpointPolicySpec(TASK, read_checkpoint(tmp_path / "qwen"), warmup_steps=0).model_id


def test_a_round_over_two_checkpoints_weighs_the_other_bundle_and_refuses_another_tokenizer(tmp_path):
    (first, second), _ = _two_checkpoints(tmp_path)
    specs = [CheckpointPolicySpec(TASK, read_checkpoint(f), warmup_steps=3, warmup_batch=8) for f in (first, second)]
    policies = [warm_up(spec)[0] for spec in specs]
    cfg = RoundConfig(task=TASK, prompts_per_round=4, completions_per_prompt=2, max_foreign_per_prompt=2,
                      grpo=GRPOConfig(mode="ftis"), run_id="r" * 16)  # fmt: skip
    prompts = round_prompts(cfg, 0)
    generator = torch.Generator().manual_seed(0)
    own, theirs = (make_bundle(p, cfg, prompts, generator) for p in policies)
    assert own.tokenizer_id == theirs.tokenizer_id and own.model_id != theirs.model_id
    char_bundle = make_bundle(Policy(PolicySpec(task=TASK, d_model=16, n_layers=1, n_heads=2)), cfg, prompts, generator)
    report = learn(policies[0], make_optimizer(policies[0], cfg), cfg, prompts, own, [theirs, char_bundle])
    assert len(report.refused) == 1 and "tokenizer 'char-" in report.refused[0]
    assert report.checks[0][0] == len(theirs.completions) and report.checks[0][2] != "refused"
    weighed = report.loss.foreign_used + report.loss.foreign_dropped  # F-TIS saw every foreign completion kept
    assert weighed == len(theirs.completions) - report.foreign_rejected > 0
    assert torch.isfinite(torch.tensor(report.loss.loss))


def test_a_run_file_names_the_policy_by_digest_and_refuses_what_it_cannot_use(tmp_path):
    (first, second), _ = _two_checkpoints(tmp_path)
    source = load_run_source(str(_write_grpo_run(tmp_path, first)))
    grpo = source.config.grpo
    checkpoint = read_checkpoint(first).model
    assert source.checkpoint_dir == first
    assert (grpo.policy_checkpoint, grpo.policy_tokenizer) == (checkpoint.checkpoint, checkpoint.tokenizer)
    moved = tmp_path / "moved"
    moved.mkdir()
    shutil.copytree(first, moved / first.name)
    assert load_run_source(str(_write_grpo_run(moved, moved / first.name))).config.run_id == source.config.run_id
    assert load_run_source(str(_write_grpo_run(tmp_path, second))).config.run_id != source.config.run_id
    path = _write_grpo_run(tmp_path, first)
    path.write_text(path.read_text() + "seed = 3\n")
    with pytest.raises(ConfigError, match='grpo.policy: takes one key: from = "DIR"'):
        load_run_source(str(path))
    (first / "config.json").write_text(json.dumps({**json.loads((first / "config.json").read_text()),
                                                   "architectures": ["GPT2LMHeadModel"]}))  # fmt: skip
    with pytest.raises(ConfigError, match="grpo.policy.from: .*architecture 'GPT2LMHeadModel' is not supp"):
        load_run_source(str(_write_grpo_run(tmp_path, first)))


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_rollout_daemons_post_train_two_checkpoints_in_one_tokenizer(swarm, tmp_path):
    """Real daemons: one rollout worker post-trains the run's checkpoint (from the run file), one its
    own (`--checkpoint` of the other architecture, same tokenizer); each uses the other's bundles.
    A worker that has no checkpoint, and one whose checkpoint has another tokenizer, refuse to start."""
    (first, second), _ = _two_checkpoints(tmp_path)
    other_tokenizer = tmp_path / "other"
    write_checkpoint(other_tokenizer, tokenizer_vocab=VOCAB - 20)
    run_file = _write_grpo_run(tmp_path, first)
    entry = swarm.start_bootstrap("--run-config", str(run_file)).maddrs[0]
    common = ("--record-ttl", "6", "--role", "rollout", "--warmup-steps", "3", "--policy-cache", str(tmp_path / "c"))
    refused = [swarm.start_node([entry], *common, "--run", "imported-grpo", *extra, wait=False, name=f"refused{i}")
               for i, extra in enumerate([(), ("--checkpoint", str(other_tokenizer))])]  # fmt: skip
    progress = [tmp_path / f"progress-{i}.jsonl" for i in range(2)]
    nodes = [
        swarm.start_node([entry], *common, "--run-config", str(run_file), "--progress-file", str(progress[0]),
                         wait=False, name="runs-own"),
        swarm.start_node([entry], *common, "--run", "imported-grpo", "--checkpoint", str(second),
                         "--progress-file", str(progress[1]), wait=False, name="its-own"),
    ]  # fmt: skip
    for node in nodes:
        swarm.wait_ready(node)
    done = [wait_until(lambda p=p: done_event(p), 240, f"rollout worker {p.stem}") for p in progress]
    for node in refused:
        wait_until(lambda n=node: not n.alive, 60, "a worker it cannot serve to refuse")
    assert refused[0].process.returncode == 2 and "give --checkpoint DIR" in refused[0].log()
    assert refused[1].process.returncode == 2 and "is not the run's" in refused[1].log()
    assert "post-training the run's checkpoint" in nodes[0].log() and "post-training its own" in nodes[1].log()
    assert done[0]["model_id"] != done[1]["model_id"]
    for end, path in zip(done, progress, strict=True):
        assert end["rounds"] == 3 and end["bundles_refused"] == 0 and end["bundles_received"] >= 1, end
        rounds = [e for e in progress_events(path) if e["event"] == "round"]
        assert any(r["foreign_used"] + r["foreign_dropped"] > 0 for r in rounds), rounds


def test_a_checkpoint_whose_tokenizer_cannot_write_the_task_is_refused(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path / "hf"
    write_checkpoint(folder)
    words = Tokenizer(models.WordLevel({"[UNK]": 0, "the": 1}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.save(str(folder / "tokenizer.json"))
    spec = CheckpointPolicySpec(TASK, read_checkpoint(folder), warmup_steps=0)
    with pytest.raises(ValueError, match="'\\$' is not a single token|reads"):
        check_policy_checkpoint(dataclasses.replace(spec))
