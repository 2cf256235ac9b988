"""A GGUF file in: a tiny LLaMA written here with the `gguf` package (its q and k rows in llama.cpp's
rotary order, one tensor Q8_0-quantized), imported through `[model] from`, computes the logits that
`transformers`' own reading of the same file computes; the converted folder is the same bytes each
time; an architecture shoal does not compute is refused in one line."""

from __future__ import annotations

import json
import os

import pytest
import torch

from shoal.config import ConfigError
from shoal.model.checkpoint import CheckpointError, read_checkpoint, verify
from shoal.model.gguf import SOURCE_NOTE, converted_folder
from shoal.run_files import load_run_source
from shoal.train.data import load_token_splits
from shoal.train.reference import ReferenceTrainer
from tests.test_model_hf_import import VOCAB, _tokens, write_checkpoint, write_run

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def _llama_cpp_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """q or k rows as llama.cpp's converter stores them: each head's rotary halves interleaved."""
    rows, cols = weight.shape
    return weight.reshape(heads, 2, rows // heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def write_gguf(path, model, tokenizer_file, architecture: str = "llama", quantize: str | None = None) -> None:
    """`model` (a transformers LLaMA) and its byte-level BPE tokenizer as llama.cpp's converter writes them."""
    import gguf

    cfg = model.config
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("tiny")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    spec = json.loads(tokenizer_file.read_text())
    vocab = sorted(spec["model"]["vocab"].items(), key=lambda item: item[1])
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types([gguf.TokenType.NORMAL] * len(vocab))
    writer.add_token_merges(merges)
    writer.add_eos_token_id(0)
    writer.add_chat_template(CHAT_TEMPLATE)
    state = {name: tensor.detach().float() for name, tensor in model.state_dict().items()}
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}  # fmt: skip
    parts = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}  # fmt: skip
    for i in range(cfg.num_hidden_layers):
        for hf, ours in parts.items():
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{ours}.weight"
    for hf, ours in names.items():
        tensor = state[hf]
        if ours.endswith("attn_q.weight"):
            tensor = _llama_cpp_rows(tensor, cfg.num_attention_heads)
        elif ours.endswith("attn_k.weight"):
            tensor = _llama_cpp_rows(tensor, cfg.num_key_value_heads)
        array = tensor.numpy()
        if quantize and ours == quantize:
            writer.add_tensor(ours, gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)  # fmt: skip
        else:
            writer.add_tensor(ours, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture
def tiny_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("SHOAL_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "hf"
    model = write_checkpoint(folder, "llama-gqa")
    path = tmp_path / "tiny.gguf"
    write_gguf(path, model, folder / "tokenizer.json", quantize="blk.1.ffn_up.weight")
    return path, model


def test_a_gguf_run_computes_transformers_reading_of_the_same_file(tmp_path, tiny_gguf):
    from transformers import AutoModelForCausalLM

    path, original = tiny_gguf
    source = load_run_source(str(write_run(tmp_path, path)))
    run = source.config
    checkpoint = verify(source.checkpoint_dir, run.model)
    assert source.checkpoint_dir == path and checkpoint.path.parent == tmp_path / "cache" / "gguf"
    assert (run.model.n_layers, run.model.n_kv_heads, run.model.tie_embeddings) == (4, 2, False)
    note = json.loads((checkpoint.path / SOURCE_NOTE).read_text())
    assert note["dequantized"] == ["Q8_0"] and note["file"] == "tiny.gguf"
    assert (checkpoint.path / "chat_template.jinja").read_text().strip() == CHAT_TEMPLATE

    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    trainer = ReferenceTrainer(run, load_token_splits(run.data, VOCAB, checkpoint.tokenizer_file), checkpoint)
    with torch.no_grad():
        expected, unquantized = theirs(input_ids=_tokens()).logits, original(input_ids=_tokens()).logits
    assert (trainer.logits(_tokens()) - expected).abs().max().item() < 1e-5
    # the q and k rows came back from llama.cpp's order: only the one Q8_0 tensor's rounding is left
    assert 0 < (trainer.logits(_tokens()) - unquantized).abs().max().item() < 0.05


def test_a_gguf_converts_to_the_same_bytes_on_every_machine(tmp_path, tiny_gguf):
    path, _ = tiny_gguf
    first = read_checkpoint(path)
    other = converted_folder(path, cache=tmp_path / "another machine")
    assert other != first.path
    assert read_checkpoint(other).model == first.model  # weights' and tokenizer's digests included
    renamed = path.rename(tmp_path / "renamed.gguf")
    assert read_checkpoint(renamed).path == first.path  # identified by content, not by its name


def test_a_gguf_of_an_architecture_shoal_does_not_compute_is_refused_in_one_line(tmp_path, tiny_gguf, monkeypatch):
    _, model = tiny_gguf
    folder = tmp_path / "hf"
    odd = tmp_path / "odd.gguf"
    write_gguf(odd, model, folder / "tokenizer.json", architecture="gpt2")
    with pytest.raises(CheckpointError, match=r"GGUF architecture 'gpt2' is not supported \(supported: llama"):
        read_checkpoint(odd)
    with pytest.raises(ConfigError, match="model.from"):
        load_run_source(str(write_run(tmp_path, odd)))
    assert not [p for p in (tmp_path / "cache" / "gguf").iterdir() if p.is_dir()]  # nothing left behind
    (tmp_path / "junk.gguf").write_bytes(b"GGUF but not really")
    with pytest.raises(CheckpointError, match="not a readable GGUF file"):
        read_checkpoint(tmp_path / "junk.gguf")


def test_the_bundled_pretrained_run_without_its_file_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # `make smollm2` has not run on this machine
    missing = r"^model.from: checkpoint .*/SmolLM2-135M-Instruct.Q4_1.gguf: no such GGUF file$"
    with pytest.raises(ConfigError, match=missing):
        load_run_source("smollm2")
