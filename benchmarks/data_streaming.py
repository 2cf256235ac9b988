"""Peak memory of tokenizing a dataset as it grows: the streaming reader against reading it whole.

    .venv/bin/python benchmarks/data_streaming.py     # 64 MiB, 256 MiB and 1 GiB of text: about 25 min on 2 cores

For each size a synthetic text file is written (pseudo-English from tests/helpers/tiny.py: 32
blocks of about 1 MiB, each from its own seed, laid end to end in a seeded random order), and
three fresh processes measure, each with an empty cache but the first's tokenizer:
1. **tokenizer**: the run's BPE (vocabulary 4096, as `tiny`) trained on the first 64 Mi characters;
2. **streaming**: `shoal.train.data.load_token_splits`, as a data node runs it: digest, tokenize
   in 1 MiB batches into the train/validation files, memory-map them;
3. **whole** (the baseline, up to --whole-max-mib): what `load_token_splits` did before the
   streaming reader: the whole text read into one string, every line encoded in one batch, the ids
   in one tensor, split in memory.
Each reports its peak resident memory (VmHWM) and wall time; the script asserts that streaming and
whole produce the same tokens in the same splits (a SHA-256 over both). At the smallest size the
same documents are also read as .jsonl, .parquet and a `datasets` save_to_disk folder.

Writes benchmarks/results/data_streaming.json and its section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results" / "data_streaming.json"
VOCAB = 4096
MIB = 1 << 20
BLOCKS = 32
DOCUMENT_CHARS = 4096


def peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def splits_digest(train, val) -> str:
    """SHA-256 of the train then validation ids as uint16, a few million at a time."""
    import numpy as np

    sha = hashlib.sha256()
    for tokens in (train, val):
        for start in range(0, len(tokens), 1 << 22):
            sha.update(np.ascontiguousarray(tokens[start : start + (1 << 22)].numpy().astype(np.uint16)).tobytes())
    return sha.hexdigest()


def child(stage: str, path: str, text_field: str) -> dict:
    """One measurement, in a process of its own so its peak is its own."""
    from shoal.config import DataConfig

    data = DataConfig(path=path, text_field=text_field)
    started = time.monotonic()
    if stage == "tokenizer":
        from shoal.train.data import run_tokenizer

        run_tokenizer(data, VOCAB)
        return {"wall_s": time.monotonic() - started, "peak_rss_mib": peak_rss_mib()}
    if stage == "streaming":
        from shoal.train.data import load_token_splits

        splits = load_token_splits(data, VOCAB)
        wall = time.monotonic() - started
        peak = peak_rss_mib()
        return {"wall_s": wall, "peak_rss_mib": peak, "tokens": len(splits.train) + len(splits.val),
                "digest": splits_digest(splits.train, splits.val)}  # fmt: skip
    if stage == "whole":
        import torch

        from shoal.model.documents import open_dataset
        from shoal.train.data import run_tokenizer, split_tokens

        tokenizer = run_tokenizer(data, VOCAB)  # cached by the tokenizer stage: not timed in either arm
        started = time.monotonic()
        files = open_dataset(path).files
        text = "\n\n".join(p.read_bytes().decode("utf-8", errors="replace") for p in files)
        lines = text.splitlines(keepends=True)
        ids = [i for encoding in tokenizer.encode_batch(lines, add_special_tokens=False) for i in encoding.ids]
        tokens = torch.tensor(ids, dtype=torch.int64)
        train, val = split_tokens(tokens, data.val_fraction)
        wall = time.monotonic() - started
        peak = peak_rss_mib()
        return {"wall_s": wall, "peak_rss_mib": peak, "tokens": len(tokens), "digest": splits_digest(train, val)}
    raise SystemExit(f"unknown stage {stage!r}")


def measure(stage: str, path: Path, cache: Path, text_field: str = "text") -> dict:
    env = {**os.environ, "SHOAL_CACHE": str(cache), "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, __file__, "--child", stage, str(path), text_field],
        capture_output=True, text=True, env=env, timeout=3600,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"{stage} on {path} failed: {done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    peak, wall = result["peak_rss_mib"], result["wall_s"]
    print(f"  {stage:10s} {path.name:28s} {peak:8.0f} MiB peak  {wall:7.1f} s", flush=True)
    return result


def blocks(seed: int) -> list[str]:
    from tests.helpers.tiny import sample_text

    return [sample_text(180_000, seed=seed * BLOCKS + b) + "\n" for b in range(BLOCKS)]


def write_text(path: Path, size: int, parts: list[str], seed: int) -> None:
    rng = random.Random(seed)
    written = 0
    with open(path, "w", encoding="utf-8") as f:
        while written < size:
            part = parts[rng.randrange(len(parts))][: size - written]
            f.write(part)
            written += len(part)


def documents_of(path: Path):
    text = path.read_text(encoding="utf-8")
    return [text[i : i + DOCUMENT_CHARS] for i in range(0, len(text), DOCUMENT_CHARS)]


def write_record_forms(text_file: Path, folder: Path) -> dict[str, Path]:
    """The text file's content cut into documents, as .jsonl, .parquet and a save_to_disk folder."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    documents = documents_of(text_file)
    jsonl = folder / "corpus.jsonl"
    with open(jsonl, "w", encoding="utf-8") as f:
        for document in documents:
            f.write(json.dumps({"text": document}) + "\n")
    parquet = folder / "corpus.parquet"
    pq.write_table(pa.table({"text": documents}), parquet, row_group_size=4096)
    saved = folder / "saved"
    datasets.Dataset.from_dict({"text": documents}).save_to_disk(str(saved), num_shards=4)
    return {"jsonl": jsonl, "parquet": parquet, "save_to_disk": saved}


def run(sizes_mib: list[int], whole_max_mib: int, seed: int, workdir: Path) -> dict:
    parts = blocks(seed)
    rows = []
    for size in sizes_mib:
        path = workdir / f"text-{size}mib.txt"
        write_text(path, size * MIB, parts, seed + size)
        cache = workdir / f"cache-{size}"
        cache.mkdir()
        print(f"{size} MiB", flush=True)
        row = {"size_mib": size, "file_bytes": path.stat().st_size}
        row["tokenizer"] = measure("tokenizer", path, cache)
        row["streaming"] = measure("streaming", path, cache)
        if size <= whole_max_mib:
            row["whole"] = measure("whole", path, cache)
            assert row["whole"]["digest"] == row["streaming"]["digest"], "the two arms tokenized differently"
        if size == min(sizes_mib):
            row["forms"] = {}
            for form, form_path in write_record_forms(path, workdir).items():
                row["forms"][form] = measure("streaming", form_path, cache)
        path.unlink()
        rows.append(row)
    return {"rows": rows, "vocab_size": VOCAB, "seed": seed}


def summarise(result: dict) -> dict:
    rows = result["rows"]
    streaming = [r["streaming"]["peak_rss_mib"] for r in rows]
    whole = [(r["size_mib"], r["whole"]["peak_rss_mib"] / r["streaming"]["peak_rss_mib"]) for r in rows if "whole" in r]
    return {
        "streaming_peak_spread_mib": max(streaming) - min(streaming),
        "streaming_peak_median_mib": statistics.median(streaming),
        "streaming_mib_per_s": [r["size_mib"] / r["streaming"]["wall_s"] for r in rows],
        "whole_over_streaming_peak": whole,
    }


def markdown(result: dict) -> str:
    s = result["summary"]
    lines = [
        "## Datasets: peak memory of tokenizing as the file grows",
        "",
        f"Reproduce: `{result['command']}` ({result['wall']}). Synthetic pseudo-English text, BPE vocabulary "
        f"{result['vocab_size']}; each figure is one fresh process's peak resident memory (VmHWM), which "
        "includes torch and the tokenizer library (about 300 MiB before any data). *Streaming* is "
        "`load_token_splits` (the data node's path); *whole* is what it did before the streaming reader "
        "(read the text into one string, encode every line in one batch, split in memory), measured up to "
        "the size given; both produce the same tokens in the same splits (asserted, SHA-256). The "
        "tokenizer is trained on the first 64 Mi characters, whatever the size; the synthetic text has "
        "about 40 distinct words, so its training time here is far below what real text takes (its peak "
        "is bounded by the sample either way).",
        "",
        "| text | tokenizer training: peak | streaming: peak | streaming: time | whole: peak | whole: time |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        whole = r.get("whole")
        whole_cells = f"{whole['peak_rss_mib']:,.0f} MiB | {whole['wall_s']:.0f} s" if whole else "not run | -"
        lines.append(
            f"| {r['size_mib']:,} MiB | {r['tokenizer']['peak_rss_mib']:,.0f} MiB ({r['tokenizer']['wall_s']:.0f} s) "
            f"| {r['streaming']['peak_rss_mib']:,.0f} MiB | {r['streaming']['wall_s']:.0f} s | {whole_cells} |"
        )
    lines += [
        "",
        f"Streaming peaks span {s['streaming_peak_spread_mib']:.0f} MiB across the sizes (median "
        f"{s['streaming_peak_median_mib']:.0f} MiB): flat. Reading whole takes "
        + ", ".join(f"{ratio:.1f}x the streaming peak at {size} MiB" for size, ratio in s["whole_over_streaming_peak"])
        + ", growing with the file.",
    ]
    forms = next((r for r in result["rows"] if "forms" in r), None)
    if forms:
        lines += [
            "",
            f"The {forms['size_mib']} MiB text cut into {DOCUMENT_CHARS:,}-character documents, streamed from "
            "each record form: "
            + "; ".join(
                f"{form} {m['peak_rss_mib']:,.0f} MiB peak, {m['wall_s']:.0f} s" for form, m in forms["forms"].items()
            )
            + f" (the text file: {forms['streaming']['peak_rss_mib']:,.0f} MiB, {forms['streaming']['wall_s']:.0f} s).",
        ]
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(child(*sys.argv[2:5])))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--whole-max-mib", type=int, default=256, help="the baseline up to this size (it grows)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-docs", action="store_true")
    parser.add_argument("--render", action="store_true", help="rewrite the docs section from the saved JSON only")
    args = parser.parse_args()
    from docs_section import wall_time, write_section

    if args.render:
        text = markdown(json.loads(RESULTS.read_text()))
        write_section("data-streaming", text)
        print(text)
        return 0
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="shoal-data-bench-") as workdir:
        result = run(sorted(args.sizes_mib), args.whole_max_mib, args.seed, Path(workdir))
    result.update(
        command=" ".join(["python benchmarks/data_streaming.py", *(a for a in sys.argv[1:] if a != "--no-docs")]),
        machine={"cpus": os.cpu_count(), "python": platform.python_version()},
        wall_s=time.monotonic() - started,
    )
    result["wall"] = wall_time(result["wall_s"])
    result["summary"] = summarise(result)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1))
    text = markdown(result)
    if not args.no_docs:
        write_section("data-streaming", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
