"""Datasets on disk in the ecosystem's forms (text, .jsonl, .parquet, a `datasets` save_to_disk
folder) tokenized as a stream into memory-mapped splits, named in the run by their content's
digest, and refused in one line when they are not what the run says."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from shoal.config import ConfigError, DataConfig
from shoal.model import documents
from shoal.model.documents import DataError, open_dataset
from shoal.run_files import load_run_source
from shoal.train import data as data_module
from shoal.train.data import encode_lines, load_token_splits, run_tokenizer, split_tokens, with_local_data
from tests.helpers.tiny import sample_text, tiny_run, write_tiny_run

VOCAB = 300
DOCUMENTS = [sample_text(400, seed=i) for i in range(40)]


def _write_forms(tmp_path) -> dict[str, object]:
    """The same documents in every form shoal reads, and as the one text file they amount to."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    text = tmp_path / "corpus.txt"
    text.write_text("\n\n".join(DOCUMENTS))
    jsonl = tmp_path / "corpus.jsonl"
    jsonl.write_text("".join(json.dumps({"id": i, "body": d}) + "\n" for i, d in enumerate(DOCUMENTS)))
    parquet = tmp_path / "corpus.parquet"
    pq.write_table(pa.table({"id": list(range(len(DOCUMENTS))), "body": DOCUMENTS}), parquet, row_group_size=7)
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"body": DOCUMENTS}).save_to_disk(str(saved), num_shards=3)
    return {"text": text, "jsonl": jsonl, "parquet": parquet, "arrow": saved}


def test_every_form_reads_as_the_text_file_it_amounts_to_and_tokenizes_the_same(tmp_path):
    forms = _write_forms(tmp_path)
    reference = load_token_splits(DataConfig(path=str(forms["text"])), VOCAB)
    for form, path in forms.items():
        dataset = open_dataset(path, "body")
        assert dataset.form == form
        assert "".join(dataset.texts()) == "\n\n".join(DOCUMENTS), form
        splits = load_token_splits(DataConfig(path=str(path), text_field="body"), VOCAB)
        assert torch.equal(splits.train, reference.train) and torch.equal(splits.val, reference.val), form
        assert splits.text_bytes == reference.text_bytes


def test_a_folder_mixes_text_and_record_files_in_sorted_order(tmp_path):
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "a.txt").write_text(DOCUMENTS[0])
    (folder / "b.jsonl").write_text(json.dumps({"text": DOCUMENTS[1]}) + "\n\n" + json.dumps({"text": DOCUMENTS[2]}))
    (folder / ".hidden").write_text("never read")
    dataset = open_dataset(folder)
    assert dataset.form == "folder" and [p.name for p in dataset.files] == ["a.txt", "b.jsonl"]
    assert "".join(dataset.texts()) == "\n\n".join(DOCUMENTS[:3])


def test_streamed_tokens_and_split_equal_the_whole_text_tokenized_at_once(tmp_path, monkeypatch):
    """Pieces of a few bytes: lines, \\r\\n pairs and multi-byte characters are cut across reads, and
    the split files are written in many small batches; the result is the in-memory split's."""
    text = sample_text(6000).replace(" one ", " \u00e9t\u00e9 \u2014 one ").replace(".\n", ".\r\n")
    path = tmp_path / "corpus.txt"
    path.write_bytes(text.encode("utf-8"))
    monkeypatch.setattr(documents, "READ_CHUNK_BYTES", 7)
    monkeypatch.setattr(data_module, "ENCODE_BATCH_CHARS", 301)
    monkeypatch.setattr(data_module, "HOLDOUT_BLOCK_TOKENS", 256)
    data = DataConfig(path=str(path), val_fraction=0.1)
    assert "".join(open_dataset(path).texts()) == text
    tokenizer = run_tokenizer(data, VOCAB)
    whole = encode_lines(tokenizer, text)
    train, val = split_tokens(whole, 0.1)
    splits = load_token_splits(data, VOCAB)
    assert len(val) > 0 and torch.equal(splits.train.long(), train) and torch.equal(splits.val.long(), val)
    assert splits.train.dtype == torch.uint16  # memory-mapped as written, widened per batch


def test_a_short_text_holds_out_its_tail_as_the_in_memory_split_does(tmp_path):
    path = tmp_path / "short.txt"
    path.write_text(sample_text(600))
    data = DataConfig(path=str(path), val_fraction=0.1)
    train, val = split_tokens(encode_lines(run_tokenizer(data, VOCAB), path.read_text()), 0.1)
    splits = load_token_splits(data, VOCAB)
    assert torch.equal(splits.train.long(), train) and torch.equal(splits.val.long(), val) and len(val) > 0


@pytest.mark.parametrize(
    ("write", "message"),
    [
        (lambda p: p.with_suffix(".jsonl").write_text('{"text": "fine"}\nnot json\n'), "corpus.jsonl:2: not a JSON"),
        (lambda p: p.with_suffix(".jsonl").write_text('{"text": "a"}\n{"body": "b"}\n'), "'text' .* is missing"),
        (lambda p: p.with_suffix(".jsonl").write_text('[1, 2]\n'), "corpus.jsonl:1: not a JSON object"),
        (lambda p: p.with_suffix(".parquet").write_bytes(b"PAR1 truncated"), "not a readable parquet file"),
    ],
)  # fmt: skip
def test_a_malformed_dataset_is_refused_in_one_line_and_caches_nothing(tmp_path, write, message):
    path = tmp_path / "corpus"
    write(path)
    target = next(tmp_path.glob("corpus.*"))
    cache = data_module.cache_dir()
    before = set(cache.glob("tokens-*"))
    with pytest.raises(DataError, match=message) as refused:
        load_token_splits(DataConfig(path=str(target)), VOCAB)
    assert "\n" not in str(refused.value)
    assert set(cache.glob("tokens-*")) == before


def test_a_missing_column_names_the_columns_there_and_a_dataset_dict_names_its_splits(tmp_path):
    forms = _write_forms(tmp_path)
    with pytest.raises(DataError, match="no column 'text' .*it has id, body"):
        list(open_dataset(forms["parquet"]).texts())
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": DOCUMENTS[:2]})}).save_to_disk(
        str(tmp_path / "dict")
    )
    with pytest.raises(DataError, match=r"a DatasetDict; point it at one split's folder \(train\)"):
        open_dataset(tmp_path / "dict")


def test_the_run_id_names_the_data_by_content_not_by_path(tmp_path):
    first = write_tiny_run(tmp_path)
    corpus = tmp_path / "corpus.txt"
    elsewhere = tmp_path / "copy" / "books.txt"
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(corpus.read_bytes())
    run = load_run_source(str(first)).config
    assert run.data.digest == open_dataset(corpus).digest()
    moved = with_local_data(run, elsewhere)
    assert moved.data.path == str(elsewhere) and moved.run_id == run.run_id
    other = tmp_path / "other.txt"
    other.write_text(sample_text(30000, seed=5))
    with pytest.raises(DataError, match="holds other data .* than run 'test-tiny' trains"):
        with_local_data(run, other)
    assert with_local_data(tiny_run(), other).run_id != run.run_id  # a run with no digest takes this data's
    assert tiny_run().run_id == tiny_run(**{"data.text_field": "text"}).run_id  # defaults leave ids as they were


def test_a_run_file_checks_its_digest_and_needs_one_where_the_data_is_not_here(tmp_path):
    run_file = write_tiny_run(tmp_path)
    digest = load_run_source(str(run_file)).config.data.digest
    text = run_file.read_text()
    run_file.write_text(text.replace('digest = ""', f'digest = "{"0" * 64}"'))
    with pytest.raises(ConfigError, match="data.digest: is 000000000000…, but the data at"):
        load_run_source(str(run_file))
    (tmp_path / "corpus.txt").unlink()
    run_file.write_text(text)
    with pytest.raises(ConfigError, match="data.path: .* is not on this machine; a run file for machines without"):
        load_run_source(str(run_file))
    run_file.write_text(text.replace('digest = ""', f'digest = "{digest}"'))
    assert load_run_source(str(run_file)).config.data.digest == digest  # a stage worker's copy of the file
    with pytest.raises(DataError, match="give this node its copy with --data PATH"):
        load_token_splits(load_run_source(str(run_file)).config.data, VOCAB)


def test_shoal_train_on_a_jsonl_field_and_refuses_a_bad_one_in_one_line(tmp_path):
    forms = _write_forms(tmp_path)
    run_file = tmp_path / "run.toml"
    run_file.write_text(tiny_run(**{"train.steps": 2, "data.text_field": "body"}).to_toml())
    common = [sys.executable, "-m", "shoal.cli", "train", "--local", "--run-config", str(run_file), "--quiet"]
    done = subprocess.run(
        [*common, "--data", str(forms["jsonl"]), "--report", str(tmp_path / "report")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["data"]["source"] == str(forms["jsonl"]) and report["data"]["train_tokens"] > 0
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": 3}\n')
    refused = subprocess.run(
        [*common, "--data", str(bad), "--report", str(tmp_path / "bad-report")], capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    expected = f"{bad}:1: field 'body' (data.text_field) is of type int, not a string"
    assert refused.stderr.strip() == f"shoal train: error: {expected}"
    assert not (tmp_path / "bad-report").exists()


def test_the_token_files_are_memory_mapped_not_read(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(sample_text(20000))
    splits = load_token_splits(DataConfig(path=str(path)), VOCAB)
    address = splits.train.data_ptr()
    for line in open("/proc/self/maps"):
        span, *_, name = line.split(maxsplit=5)
        low, high = (int(x, 16) for x in span.split("-"))
        if low <= address < high:
            assert name.strip().endswith(".train.bin"), line
            break
    else:
        raise AssertionError("the train split's memory is in no mapping")
