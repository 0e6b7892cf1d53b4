"""The documents of a pretraining corpus, as `linnet prepare` reads them.

    for doc in documents(config.data):   # Document(split, text, position)
        ...

Sources (`data.source`, `data.validation_source`) are files, or directories walked in
sorted order: plain text (`.txt`, `.text`, `.md`; split into documents by
`data.document_split`: blank-line paragraphs, lines, or whole files), JSON Lines and
Parquet (the text in field `data.text_field`, read through `linnet.data.readers`), each
optionally `.gz` (not Parquet). Or `data.dataset`: a `datasets` dataset streamed from
the hub.

Documents are read in source order. Every `validation_every`-th one goes to the
validation split, kept in source order; the rest pass through a seeded shuffle buffer
(`data.shuffle_buffer`, `data.shuffle_seed`). With a separate validation source, that
source is the validation split and nothing is held out of training. Empty documents
are skipped (they still count for `validation_every`).
"""

from __future__ import annotations

import gzip
import io
import json
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from linnet.data.curation import Curation
from linnet.data.readers import JSONL_SUFFIXES, MissingColumn, iter_records, kind_of

if TYPE_CHECKING:
    from linnet.config.groups import CorpusConfig

TEXT_SUFFIXES = (".txt", ".text", ".md")
KNOWN = ".txt, .jsonl (or .ndjson), .parquet, each optionally .gz (not .parquet)"


@dataclass(frozen=True)
class Document:
    split: str
    text: str
    position: int  # source documents read when it was emitted (the cut of a capped split)


def _suffix(path: Path) -> str:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes = suffixes[:-1]
    return suffixes[-1] if suffixes else ""


def source_files(sources: list[str]) -> list[Path]:
    """The corpus files named by `sources` (files, or directories walked in sorted order)."""
    files: list[Path] = []
    for source in sources:
        path = Path(source)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")
                           and _suffix(p) in (*TEXT_SUFFIXES, *JSONL_SUFFIXES, ".parquet"))
            if not found:
                raise ValueError(f"{path}: a directory with no corpus files ({KNOWN})")
            files.extend(found)
        elif path.exists():
            if _suffix(path) not in (*TEXT_SUFFIXES, *JSONL_SUFFIXES, ".parquet"):
                raise ValueError(f"{path}: unknown corpus format {path.suffix!r}; use {KNOWN}")
            files.append(path)
        else:
            raise FileNotFoundError(f"{path}: no such corpus file or directory (data.source)")
    return files


def _read_text(path: Path, split: str) -> Iterator[str]:
    raw = gzip.open(path, "rb") if path.suffix.lower() == ".gz" else open(path, "rb")
    with io.TextIOWrapper(raw, encoding="utf-8") as f:
        try:
            if split == "file":
                yield f.read()
                return
            if split == "line":
                for line in f:
                    yield line.rstrip("\n")
                return
            lines: list[str] = []
            for line in f:
                if line.strip():
                    lines.append(line)
                elif lines:
                    yield "".join(lines).rstrip("\n")
                    lines = []
            if lines:
                yield "".join(lines).rstrip("\n")
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: not UTF-8 text ({e}); save the corpus as UTF-8") from None


def _text_of(record: Any, field_name: str, where: str) -> str:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a JSON {type(record).__name__}, not an object with a {field_name!r} field")
    if field_name not in record:
        raise ValueError(f"{where}: no field {field_name!r} (fields: {', '.join(map(str, record))}); "
                         "set data.text_field to the field holding the text")
    text = record[field_name]
    if not isinstance(text, str):
        raise ValueError(f"{where}: field {field_name!r} holds {kind_of(text)}, not text")
    return text


def _read_records(path: Path, field_name: str) -> Iterator[str]:
    """The text field of each record of a JSONL or Parquet file (a Parquet null: empty)."""
    parquet = _suffix(path) == ".parquet"
    try:
        for record in iter_records(path, columns=[field_name], shape=f"{{{json.dumps(field_name)}: ...}}"):
            if parquet and record.data.get(field_name, "") is None:
                yield ""
            else:
                yield _text_of(record.data, field_name, record.where)
    except MissingColumn as e:
        raise ValueError(f"{e}; set data.text_field") from None


def read_documents(files: list[Path], d: CorpusConfig) -> Iterator[str]:
    """Every document of `files` in order (empty ones included; the caller skips them)."""
    for path in files:
        if _suffix(path) in (*JSONL_SUFFIXES, ".parquet"):
            yield from _read_records(path, d.text_field)
        else:
            yield from _read_text(path, d.document_split)


def _dataset_documents(d: CorpusConfig, split: str) -> Iterator[str]:
    try:
        import datasets
    except ImportError:
        raise ValueError(f"data.dataset={d.dataset!r} needs the datasets library: pip install linnet[data]; "
                         "or point data.source at local files") from None
    try:
        stream = datasets.load_dataset(d.dataset, d.dataset_config, split=split, streaming=True)
    except Exception as e:  # network, unknown name or split: datasets raises many types
        raise ValueError(f"data.dataset={d.dataset!r} (config {d.dataset_config!r}, split {split!r}) is not "
                         f"reachable: {type(e).__name__}: {e}") from None
    for i, record in enumerate(stream):
        yield _text_of(record, d.text_field, f"{d.dataset} {split} row {i}")


def _shuffled(docs: Iterator[tuple[str, int]], size: int, seed: int) -> Iterator[tuple[str, int]]:
    """A seeded shuffle buffer of `size` documents (1 keeps the order)."""
    rng = np.random.default_rng(seed)
    buffer: list[str] = []
    position = 0
    for text, position in docs:
        if len(buffer) < size:
            buffer.append(text)
            continue
        j = int(rng.integers(size))
        out, buffer[j] = buffer[j], text
        yield out, position
    for j in rng.permutation(len(buffer)):
        yield buffer[j], position


def documents(d: CorpusConfig, *, for_tokenizer: bool = False, curation: Curation | None = None) -> Iterator[Document]:
    """The corpus as split documents: validation in source order, training through the
    shuffle buffer (in source order when `for_tokenizer`: the order does not matter).
    `curation` (default the config's, linnet.data.curation) drops duplicates and the
    documents the quality filters reject, before the split; they count for
    validation_every as empty documents do."""
    curation = curation or Curation.of(d)
    separate = bool(d.validation_source) or (d.dataset is not None and d.dataset_validation_split is not None)
    every = 0 if separate else d.validation_every
    validation: deque[Document] = deque()
    if d.mixture:
        source: Iterator[str] = iter(())
        held: Callable[[], Iterator[str]] = lambda: read_documents(source_files(d.validation_source), d)
    elif d.dataset is not None:
        source = _dataset_documents(d, d.dataset_split)
        held = lambda: _dataset_documents(d, d.dataset_validation_split)
    else:
        source = read_documents(source_files(d.source), d)
        held = lambda: read_documents(source_files(d.validation_source), d)

    def numbered() -> Iterator[tuple[str, int]]:
        count = 0
        for text in source:
            count += 1
            if not text.strip() or not curation.keep(text):
                continue
            if every and count % every == 0:
                validation.append(Document("validation", text, count - 1))
            else:
                yield text, count

    train = _mixed(d, every, validation, curation) if d.mixture else numbered()
    stream = train if for_tokenizer else _shuffled(train, d.shuffle_buffer, d.shuffle_seed)
    for text, position in stream:
        while validation:  # interleaved validation goes out as soon as it is read
            yield validation.popleft()
        yield Document("train", text, position)
    yield from validation
    if separate and not for_tokenizer:
        for i, text in enumerate(held()):
            if text.strip() and curation.keep(text):
                yield Document("validation", text, i)


def mixture_files(entry: dict) -> list[Path]:
    """The corpus files of one data.mixture entry (its source: a path or a list of them)."""
    paths = entry["source"]
    return source_files([paths] if isinstance(paths, str) else list(paths))


def _mixed(d: CorpusConfig, every: int, validation: deque[Document], curation: Curation) -> Iterator[tuple[str, int]]:
    """data.mixture's training documents (linnet.data.mixture's rule, by documents): as
    many as its sources hold together, each source giving its weight's share of them in
    its own order, repeated from the start when its share is larger than it is, stopped
    when smaller; the sources interleaved in a seeded order. Every `every`-th document of
    each source (by its own count) goes to `validation`, never to training. `curation`
    decides once, in a first pass that counts, which documents stay."""
    from linnet.data.mixture import shares

    parts = [mixture_files(m) for m in d.mixture]
    stays = [[bool(text.strip()) and curation.keep(text) for text in read_documents(files, d)] for files in parts]

    def kept(k: int, into: deque[Document] | None) -> Iterator[str]:
        for count, (text, stay) in enumerate(zip(read_documents(parts[k], d), stays[k], strict=True), 1):
            if not stay:
                continue
            if every and count % every == 0:
                if into is not None:
                    into.append(Document("validation", text, count - 1))
                continue
            yield text

    sizes = [sum(1 for i, stay in enumerate(flags, 1) if stay and not (every and i % every == 0)) for flags in stays]
    for i, size in enumerate(sizes):
        if not size:
            raise ValueError(f"data.mixture[{i}]: {', '.join(map(str, parts[i]))} hold no training documents")

    first = [kept(k, validation) for k in range(len(parts))]  # the pass that holds validation documents out

    def endless(k: int) -> Iterator[str]:
        yield from first[k]
        while True:
            yield from kept(k, None)

    order = np.repeat(np.arange(len(parts)), shares([m["weight"] for m in d.mixture], sum(sizes)))
    np.random.default_rng([d.shuffle_seed, len(parts)]).shuffle(order)
    streams = [endless(k) for k in range(len(parts))]
    for position, k in enumerate(order, 1):
        yield next(streams[k]), position
    for rest in first:  # a corpus cut short still gives all of its validation documents
        for _ in rest:
            pass
