"""Records for supervised fine-tuning from JSON Lines, JSON, Parquet or a `datasets`
dataset, each kept with where it came from so that any later error can name the file
and the line or row to fix.

Every record is read before anything is tokenized: a bad line stops the run before
training starts, not hours into it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, NamedTuple

FORMATS = ".jsonl (or .ndjson), .json, .parquet, or a directory saved by datasets' save_to_disk"

# Files that datasets' save_to_disk writes (a Dataset; a DatasetDict).
_DATASET_MARKERS = ("state.json", "dataset_dict.json")


class Record(NamedTuple):
    """One record and where it came from: "train.jsonl line 7" (lines count from 1, as
    editors do), "train.json record 6", "train.parquet row 6" (from 0, as indexed)."""

    where: str
    data: dict


def read_records(source: str | os.PathLike | Any) -> list[Record]:
    """All records of a file, a saved `datasets` directory, or a `datasets.Dataset`."""
    if not isinstance(source, (str, os.PathLike)):
        return _dataset_rows(source, "dataset")
    path = Path(source)
    if path.is_dir():
        records = _dataset_directory(path)
    elif not path.is_file():
        raise FileNotFoundError(f"{path}: no such file; data.path should name {FORMATS}")
    elif path.suffix.lower() in (".jsonl", ".ndjson"):
        records = _jsonl(path, _text(path))
    elif path.suffix.lower() == ".json":
        records = _json(path)
    elif path.suffix.lower() == ".parquet":
        records = _parquet(path)
    else:
        raise ValueError(f"{path}: unknown data format {path.suffix!r}; use {FORMATS}")
    if not records:
        raise ValueError(f"{path}: holds no records (empty); point data.path at a file with records")
    return records


def _text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e}); save the file as UTF-8") from None


def _object(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise ValueError(
            f"{where}: a JSON {type(value).__name__}, not an object; each record must be an "
            'object such as {"prompt": ..., "completion": ...} or {"messages": [...]}'
        )
    return value


def _jsonl(path: Path, text: str) -> list[Record]:
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
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
        records.append(Record(where, _object(value, where)))
    return records


def _json(path: Path) -> list[Record]:
    text = _text(path)
    if not text.strip():
        return []
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # one object a line under a .json name
            return _jsonl(path, text)
        where = f"{path} line {e.lineno} column {e.colno}"
        raise ValueError(f"{where}: not valid JSON ({e.msg}); fix the file") from None
    if not isinstance(value, list):
        keys = ", ".join(map(repr, value)) if isinstance(value, dict) else type(value).__name__
        raise ValueError(
            f"{path}: holds one JSON value ({keys}), not a list of records; write a list "
            "[{...}, {...}] or one object a line (.jsonl)"
        )
    return [Record(f"{path} record {i}", _object(v, f"{path} record {i}")) for i, v in enumerate(value)]


def _parquet(path: Path) -> list[Record]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"{path}: reading Parquet needs pyarrow; pip install linnet[data]") from None
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow raises its own error types for corrupt files
        raise ValueError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from None
    return [Record(f"{path} row {i}", row) for i, row in enumerate(rows)]


def _dataset_directory(path: Path) -> list[Record]:
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
    return _dataset_rows(datasets.load_from_disk(str(path)), str(path))


def _dataset_rows(dataset: Any, name: str) -> list[Record]:
    try:
        import datasets
    except ImportError:
        datasets = None
    if datasets is not None and isinstance(dataset, datasets.DatasetDict):
        first = next(iter(dataset), "train")
        raise ValueError(
            f"{name}: a DatasetDict with the splits {', '.join(dataset)}; pass one split "
            f"(dataset[{first!r}], or the directory {first}/ inside a saved one)"
        )
    if datasets is None or not isinstance(dataset, datasets.Dataset):
        raise TypeError(
            f"read_records: expected a path or a datasets.Dataset, got {type(dataset).__name__}; "
            f"data.path should name {FORMATS}"
        )
    return [Record(f"{name} row {i}", row) for i, row in enumerate(dataset)]
