"""GRPO on a chat model: a tiny random checkpoint written here with a ChatML template and end-of-turn
token. Prompts go through the template as a user turn, the reply ends at the template's end token
(`$` in task text), answers are read from free text by the last-number rule, a bundle in another
tokenizer is refused, sampling's key/value cache computes the full forward's logits, only the last
blocks train where asked, and a round reports where its time went."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from shoal.config import ConfigError, run_config_from_dict
from shoal.grpo.loss import GRPOConfig
from shoal.grpo.policy import CheckpointPolicySpec, Policy, check_policy_checkpoint, completion_logprobs
from shoal.grpo.round import RoundConfig, learn, make_bundle, make_optimizer, round_prompts
from shoal.grpo.tasks import CORRECT_REWARD, FORMAT_REWARD, get_task, read_last_number
from shoal.model.checkpoint import read_checkpoint
from tests.test_model_hf_import import VOCAB, write_checkpoint

TASK = "chat-add2"
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def write_chat_checkpoint(folder, architecture: str = "llama-gqa"):
    """A random checkpoint whose tokenizer has ChatML's two special tokens, and its chat template."""
    from tokenizers import AddedToken, Tokenizer

    model = write_checkpoint(folder, architecture, tokenizer_vocab=VOCAB - 2)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}))
    (folder / "chat_template.jinja").write_text(CHATML)
    config = json.loads((folder / "config.json").read_text())  # a templated prompt takes ~80 positions here
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 160}))
    return model


@pytest.fixture
def chat_checkpoint(tmp_path):
    write_chat_checkpoint(tmp_path / "chat")
    return read_checkpoint(tmp_path / "chat")


def test_a_chat_prompt_goes_through_the_template_and_the_reply_ends_at_its_end_token(chat_checkpoint):
    spec = CheckpointPolicySpec(TASK, chat_checkpoint, warmup_steps=0)
    check_policy_checkpoint(spec)
    tokenizer = spec.tokenizer()
    prompt = get_task(TASK).prompt(0, 0, 0).text
    assert prompt.startswith("What is ") and prompt.endswith("? Answer with the number.")
    ids = tokenizer.encode_prompt(prompt)
    raw = tokenizer._tokenizer.decode(ids, skip_special_tokens=False)
    assert raw == f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_id == tokenizer._tokenizer.token_to_id("<|im_end|>") == tokenizer.pad_id
    assert tokenizer.decode(tokenizer.encode("The sum is 85.$")) == "The sum is 85.$"
    assert tokenizer.encode("85$")[-1] == tokenizer.eos_id
    plain = CheckpointPolicySpec("add2r", chat_checkpoint, warmup_steps=0).tokenizer()
    assert tokenizer.tokenizer_id.startswith(plain.tokenizer_id + "-chat")  # another end token: another id


@pytest.mark.parametrize(
    ("reply", "number"),
    [("The sum is 85.$", 85), ("47 + 38 = 85$", 85), ("It is 1,234$", 1234), ("85", None), ("none$", None)],
)
def test_the_answer_is_the_last_number_of_a_reply_that_ended(reply, number):
    assert read_last_number(reply) == number
    task = get_task(TASK)
    expected = 0.0 if number is None else (CORRECT_REWARD if number == 85 else FORMAT_REWARD)
    assert task.reward("What is 47 + 38? Answer with the number.", reply) == expected


@pytest.mark.parametrize("architecture", ["llama-gqa", "qwen2-bias-tied"])
def test_sampling_with_a_key_value_cache_computes_the_full_forwards_logits(tmp_path, architecture):
    write_chat_checkpoint(tmp_path / "m", architecture)
    policy = Policy(CheckpointPolicySpec(TASK, read_checkpoint(tmp_path / "m"), warmup_steps=0)).eval()
    tokens = torch.randint(0, VOCAB, (3, 14), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = policy(tokens)
        cache = policy.new_cache()
        parts = [policy(tokens[:, :6], cache), policy(tokens[:, 6:10], cache)]
        parts += [policy(tokens[:, t : t + 1], cache) for t in range(10, 14)]
    assert cache.length == 14
    assert (torch.cat(parts, dim=1) - full).abs().max().item() < 1e-5


def test_a_round_trains_the_last_blocks_reports_its_time_and_refuses_another_tokenizer(chat_checkpoint):
    spec = CheckpointPolicySpec(TASK, chat_checkpoint, warmup_steps=0, train_last=1)
    policy = Policy(spec)
    trained = {name for name, p in policy.named_parameters() if p.requires_grad}
    assert trained == {"head.norm.weight"} | {n for n, _ in policy.named_parameters() if n.startswith("body.blocks.3.")}
    before = {name: p.detach().clone() for name, p in policy.named_parameters()}
    cfg = RoundConfig(task=TASK, prompts_per_round=3, completions_per_prompt=2, max_foreign_per_prompt=2,
                      grpo=GRPOConfig(mode="ftis"), sample_top_k=0)  # fmt: skip
    prompts = round_prompts(cfg, 0)
    generator = torch.Generator().manual_seed(0)
    own = make_bundle(policy, cfg, prompts, generator)
    plain = CheckpointPolicySpec("add2r", chat_checkpoint, warmup_steps=0).tokenizer()  # its `$` is no end of turn
    foreign = dataclasses.replace(make_bundle(policy, cfg, prompts, generator), tokenizer_id=plain.tokenizer_id)
    report = learn(policy, make_optimizer(policy, cfg), cfg, prompts, own, [foreign])
    assert len(report.refused) == 1 and "tokenizer" in report.refused[0]
    assert report.score_s > 0 and report.update_s > 0 and report.defense_s >= 0
    moved = {name for name, p in policy.named_parameters() if not torch.equal(p.detach(), before[name])}
    assert moved <= trained
    policy.zero_grad(set_to_none=True)
    logp, _ = completion_logprobs(policy, [[1, 2, 3]], [[4, 5, 6]])
    logp.sum().backward()
    assert {name for name, p in policy.named_parameters() if p.grad is not None} == trained


def test_a_chat_task_needs_an_imported_policy():
    with pytest.raises(ConfigError, match="grpo.task: 'chat-add2' is a chat task"):
        run_config_from_dict({"name": "g", "grpo": {"task": TASK}})
