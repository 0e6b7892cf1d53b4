"""Records from JSON Lines, JSON, Parquet or a `datasets` dataset, each kept with where
it came from so that any later error can name the file and the line or row to fix.

    for record in iter_records("corpus.jsonl.gz", columns=["text"]):   # one at a time
        record.where, record.data          # "corpus.jsonl.gz line 7", {"text": ...}
    records = read_records("train.jsonl")  # all of them, or an error naming the line

`iter_records` is the one reader of JSONL and Parquet files in linnet: JSONL line by
line (`.gz` too), Parquet batch by batch, so a corpus larger than memory streams
(`linnet.data.corpus` takes its documents' text from it). `read_records`, for
fine-tuning, reads every record before anything is tokenized: a bad line stops the run
before training starts, not hours into it.
"""

from __future__ import annotations

import gzip
import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

FORMATS = ".jsonl (or .ndjson; optionally .gz), .json, .parquet, or a directory saved by datasets' save_to_disk"
JSONL_SUFFIXES = (".jsonl", ".ndjson")
# What a fine-tuning record looks like, for the error on a value that is not an object.
RECORD_SHAPE = '{"prompt": ..., "completion": ...} or {"messages": [...]}'

# Files that datasets' save_to_disk writes (a Dataset; a DatasetDict).
_DATASET_MARKERS = ("state.json", "dataset_dict.json")


class Record(NamedTuple):
    """One record and where it came from: "train.jsonl line 7" (lines count from 1, as
    editors do), "train.json record 6", "train.parquet row 6" (from 0, as indexed)."""

    where: str
    data: dict


# How an error names a reader's keyword to a Python caller, where not as `keyword=`.
PYTHON_NAMES = {"truncate": "truncate=True", "chat_template": "load_tokenizer(chat_template=)"}


def kind_of(value: Any) -> str:
    """A JSON value's kind, as an error says it: 'null', 'a list', 'an int'."""
    if value is None:
        return "null"
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def option_name(names: Mapping[str, str] | None, option: str) -> str:
    """How an error names the keyword `option`: as `names` spells it (a command passes its
    users' spelling: `linnet sft` the YAML's, training.context_length for tokens), else as
    Python does (`tokens=`)."""
    if names and option in names:
        return names[option]
    return PYTHON_NAMES.get(option, f"{option}=")


class MissingColumn(ValueError):
    """A Parquet file lacks a column asked for. The message names the file and the
    columns it has; the caller adds the setting that names the column."""


def read_records(source: str | os.PathLike | Any, *, split: str | None = None,
                 names: Mapping[str, str] | None = None, field: str = "data.path") -> list[Record]:
    """All records of a file, a saved `datasets` directory, a `datasets.Dataset`, or a
    dataset on the Hugging Face Hub named as there (`tatsu-lab/alpaca`, read through
    `datasets.load_dataset` and its cache). `split`: the split of a DatasetDict or of a
    hub dataset (default "train" for a hub name); `names`: how errors name data.split;
    `field`: the setting that named `source`, which errors name."""
    if not isinstance(source, (str, os.PathLike)):
        return _dataset_rows(source, "dataset", split, names)
    path = Path(source)
    if path.is_dir():
        records = _dataset_directory(path, split, names)
    elif path.is_file():
        records = list(iter_records(path))
    elif _hub_name(os.fspath(source)):
        records = _hub_dataset(os.fspath(source), split)
    else:
        raise FileNotFoundError(f"{path}: no such file; {field} should name {FORMATS}, or a dataset on the "
                                "Hugging Face Hub by its name (org/name)")
    if not records:
        raise ValueError(f"{path}: holds no records (empty); point {field} at a file with records")
    return records


def iter_records(path: str | os.PathLike, *, columns: Sequence[str] | None = None,
                 shape: str = RECORD_SHAPE) -> Iterator[Record]:
    """The records of a JSONL (`.jsonl`, `.ndjson`, either optionally `.gz`), JSON or
    Parquet file, read as they are asked for; an empty file yields none. `columns`: read
    only these Parquet columns (`MissingColumn` when the file lacks one); JSON records are
    read whole. `shape`: an example record, for the error on a value that is not an
    object."""
    path = Path(path)
    suffix = path.suffix.lower()
    compressed = suffix == ".gz"
    if compressed:
        suffix = Path(path.stem).suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return _jsonl(path, _lines(path, compressed), shape)
    if suffix == ".json" and not compressed:
        return _json(path, shape)
    if suffix == ".parquet" and not compressed:
        return _parquet(path, columns)
    raise ValueError(f"{path}: unknown data format {path.suffix!r}; use {FORMATS}")


def _text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8-sig")  # a byte-order mark is not part of the JSON
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e}); save the file as UTF-8") from None


def _lines(path: Path, compressed: bool) -> Iterator[tuple[int, str]]:
    """(number from 1, text) of each line, decoded one at a time so that a byte that is
    not UTF-8 is reported at its line."""
    with (gzip.open(path, "rb") if compressed else open(path, "rb")) as f:
        for number, raw in enumerate(f, start=1):
            try:  # a byte-order mark (Windows editors write one) is not part of the first record
                yield number, raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path} line {number}: not UTF-8 text ({e}); save the file as UTF-8") from None


def _object(value: Any, where: str, shape: str) -> dict:
    if not isinstance(value, dict):
        raise ValueError(
            f"{where}: a JSON {type(value).__name__}, not an object; each record must be an "
            f"object such as {shape}"
        )
    return value


def _jsonl(path: Path, lines: Iterable[tuple[int, str]], shape: str) -> Iterator[Record]:
    for number, line in lines:
        if not line.strip():
            continue
        where = f"{path} line {number}"
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{where}: not valid JSON ({e.msg} at column {e.colno}); each line must hold "
                "one whole JSON object"
            ) from None
        yield Record(where, _object(value, where, shape))


def _json(path: Path, shape: str) -> Iterator[Record]:
    text = _text(path)
    if not text.strip():
        return
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # one object a line under a .json name
            yield from _jsonl(path, _lines(path, compressed=False), shape)
            return
        where = f"{path} line {e.lineno} column {e.colno}"
        raise ValueError(f"{where}: not valid JSON ({e.msg}); fix the file") from None
    if not isinstance(value, list):
        keys = ", ".join(map(repr, value)) if isinstance(value, dict) else type(value).__name__
        raise ValueError(
            f"{path}: holds one JSON value ({keys}), not a list of records; write a list "
            "[{...}, {...}] or one object a line (.jsonl)"
        )
    for i, v in enumerate(value):
        yield Record(f"{path} record {i}", _object(v, f"{path} record {i}", shape))


def _parquet(path: Path, columns: Sequence[str] | None) -> Iterator[Record]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"{path}: reading Parquet needs pyarrow; pip install linnet[data]") from None
    unreadable = f"{path}: not a readable Parquet file"
    try:
        parquet = pq.ParquetFile(path)
        names = parquet.schema_arrow.names
    except Exception as e:  # pyarrow raises its own error types for corrupt files
        raise ValueError(f"{unreadable} ({type(e).__name__}: {e})") from None
    missing = [c for c in columns or () if c not in names]
    if missing:
        raise MissingColumn(f"{path}: no column {missing[0]!r} (columns: {', '.join(names)})")
    batches = parquet.iter_batches(columns=None if columns is None else list(columns), batch_size=1024)
    row = 0
    while True:
        try:
            batch = next(batches, None)
        except Exception as e:  # a corrupt page shows only when it is read
            raise ValueError(f"{unreadable} ({type(e).__name__}: {e})") from None
        if batch is None:
            return
        for data in batch.to_pylist():
            yield Record(f"{path} row {row}", data)
            row += 1


def _hub_name(text: str) -> bool:
    """Whether `text`, which is no local path, reads as a hub dataset's name (org/name or
    name, no file suffix) rather than a mistyped file."""
    return re.fullmatch(r"[\w.-]+(/[\w.-]+)?", text) is not None and Path(text).suffix.lower() not in \
        (*JSONL_SUFFIXES, ".json", ".parquet", ".gz", ".csv", ".txt")


def _hub_dataset(name: str, split: str | None) -> list[Record]:
    """A hub dataset's split through `datasets.load_dataset` (its cache first; offline with
    HF_DATASETS_OFFLINE=1)."""
    try:
        import datasets
    except ImportError:
        raise ValueError(f"{name}: a dataset on the hub needs datasets; pip install 'linnet[data]'") from None
    try:
        dataset = datasets.load_dataset(name, split=split or "train")
    except Exception as e:  # not found, offline with no cache, no such split: datasets says which
        raise ValueError(f"{name}: no such local file, and datasets.load_dataset could not load it as a hub "
                         f"dataset ({type(e).__name__}: {e}); name a local file ({FORMATS}) or a hub dataset "
                         "and its split (data.split)") from None
    return _dataset_rows(dataset, f"{name}[{split or 'train'}]", None, None)


def _dataset_directory(path: Path, split: str | None, names: Mapping[str, str] | None) -> list[Record]:
    if not any((path / marker).is_file() for marker in _DATASET_MARKERS):
        raise ValueError(
            f"{path}: a directory not written by datasets' save_to_disk; data.path should name {FORMATS}"
        )
    try:
        import datasets
    except ImportError:
        raise ValueError(
            f"{path}: reading a saved datasets directory needs datasets; pip install linnet[data]"
        ) from None
    return _dataset_rows(datasets.load_from_disk(str(path)), str(path), split, names)


def _dataset_rows(dataset: Any, name: str, split: str | None, names: Mapping[str, str] | None) -> list[Record]:
    try:
        import datasets
    except ImportError:
        datasets = None
    if datasets is not None and isinstance(dataset, datasets.DatasetDict):
        if split is None or split not in dataset:
            first = next(iter(dataset), "train")
            asked = f" has no split {split!r}" if split is not None else ""
            raise ValueError(f"{name}: a DatasetDict{asked} with the splits {', '.join(dataset)}; pass one split: "
                             f"{option_name(names, 'split')} (e.g. {first})")
        dataset, name = dataset[split], f"{name}[{split}]"
    elif split is not None and datasets is not None and isinstance(dataset, datasets.Dataset):
        raise ValueError(f"{name}: one dataset with no splits; remove {option_name(names, 'split')}")
    if datasets is None or not isinstance(dataset, datasets.Dataset):
        raise TypeError(
            f"read_records: expected a path or a datasets.Dataset, got {type(dataset).__name__}; "
            f"data.path should name {FORMATS}"
        )
    return [Record(f"{name} row {i}", row) for i, row in enumerate(dataset)]
