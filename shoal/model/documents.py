"""A dataset on disk as one stream of text, read a piece at a time, and the digest of what is read.

`[data] path` may name
- a text file, or a folder: every regular file under it in sorted order (hidden files skipped);
  inside a folder a `.jsonl` or `.parquet` file is read as records, like the forms below;
- a `.jsonl` file: one JSON object per line, its text in the field `[data] text_field` names;
- a `.parquet` file: the `text_field` column, read a row group's batch at a time (pyarrow);
- a folder written by `datasets.Dataset.save_to_disk`: its Arrow shards in the order its
  `state.json` lists them (the Arrow stream format `datasets` writes).

Files are joined by a blank line, and so are records, so the stream is what one text file of the
same content would be. Nothing is ever held whole: text files are decoded in 1 MiB chunks, records
arrive a batch at a time. The digest is the SHA-256 of the bytes of every file read (each framed by
its length), so it names the content, not where this machine keeps it.
"""

from __future__ import annotations

import codecs
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from shoal.errors import UsageError

READ_CHUNK_BYTES = 1 << 20
RECORD_BATCH_ROWS = 1024
SEPARATOR = "\n\n"
RECORD_SUFFIXES = (".jsonl", ".parquet")


class DataError(UsageError):
    """A dataset this machine cannot read as the run says: named by its path, and by line or column."""


@dataclass(frozen=True)
class Dataset:
    """The files a `[data] path` names, in reading order, and the form they are read in."""

    path: Path
    form: str  # text, jsonl, parquet, arrow (a save_to_disk folder), folder
    files: tuple[Path, ...]
    text_field: str

    def digest(self) -> str:
        sha = hashlib.sha256()
        for file in self.files:
            sha.update(file.stat().st_size.to_bytes(8, "little"))
            with open(file, "rb") as f:
                while chunk := f.read(READ_CHUNK_BYTES):
                    sha.update(chunk)
        return sha.hexdigest()

    def texts(self) -> Iterator[str]:
        """The dataset's text in pieces; their concatenation is the whole text."""
        for index, file in enumerate(self.files):
            if index:
                yield SEPARATOR
            yield from _file_texts(file, self.text_field, arrow=self.form == "arrow")


def open_dataset(path: str | Path, text_field: str = "text") -> Dataset:
    """The dataset at `path`, checked only as far as finding its files (reading checks the rest)."""
    path = Path(path)
    if path.is_file():
        form = path.suffix.lstrip(".") if path.suffix in RECORD_SUFFIXES else "text"
        return Dataset(path, form, (path,), text_field)
    if not path.is_dir():
        raise DataError(f"data path {str(path)!r} does not exist")
    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if (p / "state.json").is_file())
        raise DataError(
            f"data path {str(path)!r} is a DatasetDict; point it at one split's folder ({', '.join(splits)})"
        )
    if (path / "state.json").is_file() and (path / "dataset_info.json").is_file():
        return Dataset(path, "arrow", _arrow_shards(path), text_field)
    files = tuple(sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")))
    if not files:
        raise DataError(f"data path {str(path)!r} is an empty folder")
    return Dataset(path, "folder", files, text_field)


def _arrow_shards(folder: Path) -> tuple[Path, ...]:
    try:
        state = json.loads((folder / "state.json").read_text(encoding="utf-8"))
        names = [entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError):
        raise DataError(f"{folder / 'state.json'}: not a datasets save_to_disk state file") from None
    for name in names:
        if not isinstance(name, str) or Path(name).name != name or not (folder / name).is_file():
            raise DataError(f"{folder / 'state.json'} lists {name!r}, which is not a file in {folder}")
    if not names:
        raise DataError(f"{folder / 'state.json'} lists no data files")
    return tuple(folder / name for name in names)


def _file_texts(file: Path, text_field: str, arrow: bool = False) -> Iterator[str]:
    if arrow:
        yield from _records(_arrow_texts(file, text_field))
    elif file.suffix == ".jsonl":
        yield from _records(_jsonl_texts(file, text_field))
    elif file.suffix == ".parquet":
        yield from _records(_parquet_texts(file, text_field))
    else:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        with open(file, "rb") as f:
            while chunk := f.read(READ_CHUNK_BYTES):
                yield decoder.decode(chunk)
        yield decoder.decode(b"", final=True)


def _records(texts: Iterator[str]) -> Iterator[str]:
    for index, text in enumerate(texts):
        if index:
            yield SEPARATOR
        yield text


def _jsonl_texts(file: Path, text_field: str) -> Iterator[str]:
    with open(file, "rb") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                raise DataError(f"{file}:{number}: not a JSON object") from None
            if not isinstance(record, dict):
                raise DataError(f"{file}:{number}: not a JSON object")
            text = record.get(text_field)
            if not isinstance(text, str):
                found = "missing" if text_field not in record else f"of type {type(text).__name__}"
                raise DataError(f"{file}:{number}: field {text_field!r} (data.text_field) is {found}, not a string")
            yield text


def _column_texts(batches, file: Path, text_field: str) -> Iterator[str]:
    import pyarrow as pa

    try:
        for batch in batches:
            column = batch.column(text_field)
            if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
                raise DataError(f"{file}: column {text_field!r} (data.text_field) holds {column.type}, not strings")
            for text in column.to_pylist():
                yield text if text is not None else ""
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as e:
        raise DataError(f"{file}: unreadable ({str(e).splitlines()[0]})") from None


def _parquet_texts(file: Path, text_field: str) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(file)
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{file}: not a readable parquet file ({str(e).splitlines()[0]})") from None
    _need_column(parquet.schema_arrow.names, file, text_field)
    yield from _column_texts(parquet.iter_batches(batch_size=RECORD_BATCH_ROWS, columns=[text_field]), file, text_field)


def _arrow_texts(file: Path, text_field: str) -> Iterator[str]:
    import pyarrow as pa

    with pa.OSFile(str(file)) as source:
        try:
            reader = pa.ipc.open_stream(source)
        except (pa.ArrowInvalid, OSError) as e:
            raise DataError(f"{file}: not an Arrow stream ({str(e).splitlines()[0]})") from None
        _need_column(reader.schema.names, file, text_field)
        yield from _column_texts(reader, file, text_field)


def _need_column(names: list[str], file: Path, text_field: str) -> None:
    if text_field not in names:
        raise DataError(f"{file}: no column {text_field!r} (data.text_field); it has {', '.join(names)}")
