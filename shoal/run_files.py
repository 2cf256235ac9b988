"""Run files: a bundled run by name or a TOML file by path, read into the `RunConfig` every peer shares
(shoal/config.py), with what it points to on this machine: `[model] from` and `[grpo.policy] from` a
checkpoint folder, `[data] path` a dataset whose digest names it."""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from shoal.config import SET_WITH_FROM, ConfigError, RunConfig, run_config_from_dict


def bundled_runs() -> list[str]:
    return sorted(
        p.name.removesuffix(".toml") for p in resources.files("shoal.runs").iterdir() if p.name.endswith(".toml")
    )


@dataclass(frozen=True)
class RunSource:
    """A run as this machine read it: the config every peer shares, and the folder here that holds
    the checkpoint it starts from, where its file names one (`[model] from`, or `[grpo.policy] from`).
    The folder never goes into the config: the run id hashes the checkpoint's digest, so the same
    files anywhere are one run."""

    config: RunConfig
    checkpoint_dir: Path | None = None


def _import_checkpoint(data: dict[str, Any], base: Path) -> Path | None:
    """`[model] from = "DIR"`: the model section becomes the checkpoint's architecture and digests
    (shoal/model/checkpoint.py); only `max_seq_len` may be given beside it, to train shorter."""
    model = data.get("model")
    if not isinstance(model, dict) or "from" not in model:
        return None
    source = model.pop("from")
    if not isinstance(source, str) or not source.strip():
        raise ConfigError("model.from", "must be the path of a checkpoint folder")
    given = sorted(set(model) - set(SET_WITH_FROM))
    if given:
        raise ConfigError(f"model.{given[0]}", "comes from the checkpoint (model.from); remove it")
    max_seq_len = model.get("max_seq_len")
    if max_seq_len is not None and (isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int)):
        raise ConfigError("model.max_seq_len", f"must be an integer, got {max_seq_len!r}")
    from shoal.model.checkpoint import CheckpointError, read_checkpoint

    path = Path(source).expanduser()
    path = path if path.is_absolute() else base / path
    try:
        checkpoint = read_checkpoint(path, max_seq_len)
    except CheckpointError as e:
        raise ConfigError("model.from", str(e)) from None
    data["model"] = dataclasses.asdict(checkpoint.model)
    return path


def _import_policy(data: dict[str, Any], base: Path) -> Path | None:
    """`[grpo.policy] from = "DIR"`: the checkpoint's weights and tokenizer digests go into the run."""
    grpo = data.get("grpo")
    if not isinstance(grpo, dict) or "policy" not in grpo:
        return None
    policy = grpo.pop("policy")
    if not isinstance(policy, dict) or set(policy) != {"from"}:
        raise ConfigError("grpo.policy", 'takes one key: from = "DIR" (a Hugging Face checkpoint folder)')
    source = policy["from"]
    if not isinstance(source, str) or not source.strip():
        raise ConfigError("grpo.policy.from", "must be the path of a checkpoint folder")
    from shoal.model.checkpoint import CheckpointError, read_checkpoint

    path = Path(source).expanduser()
    path = path if path.is_absolute() else base / path
    try:
        model = read_checkpoint(path).model
    except CheckpointError as e:
        raise ConfigError("grpo.policy.from", str(e)) from None
    grpo.update(policy_checkpoint=model.checkpoint, policy_tokenizer=model.tokenizer)
    return path


def _import_data(data: dict[str, Any]) -> None:
    """`[data] path` in a run file: the digest of the files there goes into the run (checked
    against a `digest` the file gives). A machine without them needs the file to give the digest."""
    section = data.get("data")
    if not isinstance(section, dict) or not isinstance(section.get("path"), str) or not section["path"]:
        return
    from shoal.model.documents import DataError, open_dataset

    path, given = section["path"], section.get("digest", "")
    if not Path(path).expanduser().exists():
        if not given:
            raise ConfigError(
                "data.path",
                f"{path!r} is not on this machine; a run file for machines without the data gives its "
                "data.digest (or join the published run by name)",
            )
        return
    try:
        digest = open_dataset(Path(path).expanduser(), section.get("text_field", "text")).digest()
    except DataError as e:
        raise ConfigError("data.path", str(e)) from None
    if given and given != digest:
        raise ConfigError("data.digest", f"is {given[:12]}…, but the data at {path!r} is {digest[:12]}…")
    section["digest"] = digest


def load_run_source(name_or_path: str) -> RunSource:
    """A bundled run by name (`tiny`) or a TOML file path, with the checkpoint folder its file names."""
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists():
        try:
            text = path.read_text()
        except OSError as e:
            raise ConfigError("", f"cannot read run config {name_or_path}: {e.strerror}") from None
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError("", f"{path}: not valid TOML ({e})") from None
        checkpoint_dir = _import_checkpoint(data, path.parent)
        policy_dir = _import_policy(data, path.parent)
        if checkpoint_dir is not None and policy_dir is not None:
            raise ConfigError("grpo.policy.from", "a run starts from one checkpoint: model.from or grpo.policy.from")
        checkpoint_dir = checkpoint_dir or policy_dir
        _import_data(data)
        return RunSource(run_config_from_dict(data), checkpoint_dir)
    if name_or_path not in bundled_runs():
        raise ConfigError("", f"no bundled run named {name_or_path!r} (bundled: {', '.join(bundled_runs())})")
    text = resources.files("shoal.runs").joinpath(f"{name_or_path}.toml").read_text()
    data = tomllib.loads(text)
    checkpoint_dir = _import_checkpoint(data, Path.home())  # a bundled run of a pretrained model names it under ~
    return RunSource(run_config_from_dict(data), checkpoint_dir)


def load_run_config(name_or_path: str) -> RunConfig:
    """A bundled run by name (`tiny`) or a TOML file path."""
    return load_run_source(name_or_path).config


DEFAULT_RUN = "tiny"
# Overrides for a run that sends everything as float32: the bundled runs compress (int8 rows, int8
# outer exchanges); benchmarks that measure something else pin this, so their numbers stay comparable
# with the ones recorded before the bundled runs compressed.
FULL_PRECISION = {"pipeline.wire_dtype": "float32", "averaging.codec": "float32"}
