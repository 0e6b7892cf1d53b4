"""`linnet prepare`: stream a corpus into a token cache (see `linnet.pretrain.cache`).

    linnet prepare --config configs/pretrain-tiny-cpu.yaml
    linnet prepare --config run.yaml --set data.prepare_workers=4
    linnet prepare --verify runs/cache/shakespeare      # re-hash every shard

The parent process reads documents in source order (text, JSONL, Parquet files, or a
streamed `datasets` dataset), sends every `validation_every`-th one to the validation
split (kept in source order) and the rest through a seeded shuffle buffer. Batches of
documents go to a pool of tokenizer processes (fork server, else spawn) (`data.prepare_workers`; 1 encodes
in the parent) with at most two batches in flight per worker; results reach one shard
writer per split in submission order, so the bytes are the same for any worker count.
Each document is followed by the EOS token. Everything is written under a temporary
directory beside the cache and renamed into place only after success: a failure, Ctrl-C
or kill publishes nothing (Ctrl-C and failures also cancel pending tasks and wait for the
running ones), and a rerun starts clean.

How much training text is read: `data.train_tokens`, or, when it is null and the whole
config is given (as `linnet prepare --config` does), what the config's training budget
draws, rounded up through its last whole shard group (`budget.cache_tokens`); the whole
corpus when that is less. The output and the manifest say how many passes over the cache
the budget takes, and a budget that reuses the data gets a warning.

Preparing again at an existing path with the same settings re-verifies its checksums and
reuses it when it holds the training tokens asked for (or the whole corpus); with other
settings, or too few tokens, it is refused, naming the reason.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import io
import json
import os
import shutil
import sys
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from linnet.files import write_text
from linnet.pretrain import cache as cache_format
from linnet.pretrain.cache import MANIFEST, SPLITS, TOKENIZER, token_dtype
from linnet.pretrain.config import DataConfig, PretrainConfig

TEXT_SUFFIXES = (".txt", ".text", ".md")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
KNOWN = ".txt, .jsonl (or .ndjson), .parquet, each optionally .gz (not .parquet)"
TRAINED_EOS = "<|endoftext|>"
IN_FLIGHT_PER_WORKER = 2

# ---------------------------------------------------------------------------------------
# Reading documents


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


def _open_text(path: Path):
    raw = gzip.open(path, "rb") if path.suffix.lower() == ".gz" else open(path, "rb")
    return io.TextIOWrapper(raw, encoding="utf-8")


def _read_text(path: Path, split: str) -> Iterator[str]:
    with _open_text(path) as f:
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
        raise ValueError(f"{where}: field {field_name!r} holds a {type(text).__name__}, not text")
    return text


def _read_jsonl(path: Path, field_name: str) -> Iterator[str]:
    with _open_text(path) as f:
        number = 0
        try:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path} line {number}: not valid JSON ({e.msg} at column {e.colno}); "
                                     "each line must hold one JSON object") from None
                yield _text_of(record, field_name, f"{path} line {number}")
        except UnicodeDecodeError as e:
            raise ValueError(f"{path} line {number + 1}: not UTF-8 text ({e})") from None


def _read_parquet(path: Path, field_name: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"{path}: reading Parquet needs pyarrow; pip install linnet[data]") from None
    try:
        parquet = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises its own error types for corrupt files
        raise ValueError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from None
    if field_name not in parquet.schema_arrow.names:
        raise ValueError(f"{path}: no column {field_name!r} (columns: {', '.join(parquet.schema_arrow.names)}); "
                         "set data.text_field")
    row = 0
    for batch in parquet.iter_batches(columns=[field_name], batch_size=1024):
        for text in batch.column(0).to_pylist():
            if text is not None and not isinstance(text, str):
                raise ValueError(f"{path} row {row}: column {field_name!r} holds {type(text).__name__}, not text")
            yield text or ""
            row += 1


def read_documents(files: list[Path], d: DataConfig) -> Iterator[str]:
    """Every document of `files` in order (empty ones included; the caller skips them)."""
    for path in files:
        kind = _suffix(path)
        if kind in JSONL_SUFFIXES:
            yield from _read_jsonl(path, d.text_field)
        elif kind == ".parquet":
            yield from _read_parquet(path, d.text_field)
        else:
            yield from _read_text(path, d.document_split)


def _dataset_documents(d: DataConfig, split: str) -> Iterator[str]:
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


@dataclass(frozen=True)
class Document:
    split: str
    text: str
    position: int  # source documents read when it was emitted (the cut of a capped split)


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


def documents(d: DataConfig, *, for_tokenizer: bool = False) -> Iterator[Document]:
    """The corpus as split documents: validation in source order, training through the
    shuffle buffer (in source order when `for_tokenizer`: the order does not matter)."""
    separate = bool(d.validation_source) or (d.dataset is not None and d.dataset_validation_split is not None)
    every = 0 if separate else d.validation_every
    if d.dataset is not None:
        source: Iterator[str] = _dataset_documents(d, d.dataset_split)
        held: Callable[[], Iterator[str]] = lambda: _dataset_documents(d, d.dataset_validation_split)
    else:
        source = read_documents(source_files(d.source), d)
        held = lambda: read_documents(source_files(d.validation_source), d)
    validation: deque[Document] = deque()

    def numbered() -> Iterator[tuple[str, int]]:
        count = 0
        for text in source:
            count += 1
            if not text.strip():
                continue
            if every and count % every == 0:
                validation.append(Document("validation", text, count - 1))
            else:
                yield text, count

    stream = numbered() if for_tokenizer else _shuffled(numbered(), d.shuffle_buffer, d.shuffle_seed)
    for text, position in stream:
        while validation:  # interleaved validation goes out as soon as it is read
            yield validation.popleft()
        yield Document("train", text, position)
    yield from validation
    if separate and not for_tokenizer:
        for i, text in enumerate(held()):
            if text.strip():
                yield Document("validation", text, i)


# ---------------------------------------------------------------------------------------
# The tokenizer


def _train_tokenizer(d: DataConfig):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if d.dataset is not None:
        raise ValueError(f"data.dataset={d.dataset!r}: training a tokenizer on a streamed dataset is not "
                         "supported; set data.tokenizer (a tokenizer.json, a directory or a card name)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=d.vocab_size, special_tokens=[TRAINED_EOS], min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    texts = (doc.text for doc in documents(d, for_tokenizer=True) if doc.split == "train")
    tok.train_from_iterator(texts, trainer)
    return tok


def resolve_tokenizer(d: DataConfig) -> tuple[Any, int, dict[str, Any]]:
    """(tokenizers.Tokenizer, EOS id, its settings entry) from data.tokenizer, or a
    byte-level BPE trained on the training documents when it is null."""
    import tokenizers

    if d.tokenizer is None:
        raw = _train_tokenizer(d)
        setting: dict[str, Any] = {"trained": "byte-level-bpe", "vocab_size": d.vocab_size}
        eos_name = d.eos_token or TRAINED_EOS
    else:
        path = Path(d.tokenizer)
        if path.is_file():
            raw = tokenizers.Tokenizer.from_file(str(path))
            own_eos = None
        else:
            from linnet.data.tokenizer import load_tokenizer

            loaded = load_tokenizer(path if path.is_dir() else d.tokenizer, backend="tokenizers")
            raw = loaded.raw
            own_eos = loaded.eos_ids[0] if loaded.eos_ids else None
        setting = {"source": str(path.resolve()) if path.exists() else d.tokenizer}
        eos_name = d.eos_token
        if eos_name is None:
            if own_eos is not None:
                eos_name = raw.id_to_token(own_eos)
            else:
                eos_name = next((t for t in (TRAINED_EOS, "</s>", "<eos>", "<|end_of_text|>")
                                 if raw.token_to_id(t) is not None), None)
        if eos_name is None:
            raise ValueError(f"{d.tokenizer}: the tokenizer names no end-of-document token; set data.eos_token "
                             "to a token of its vocabulary")
    eos = raw.token_to_id(eos_name)
    if eos is None:
        raise ValueError(f"data.eos_token={eos_name!r} is not in the tokenizer's vocabulary")
    setting["eos_token"] = eos_name
    return raw, eos, setting


# ---------------------------------------------------------------------------------------
# Tokenizer workers (they import numpy and tokenizers, never torch)

_WORKER: dict[str, Any] = {}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed process not yet reaped by its parent is a zombie: dead to us
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def _watch_main(main: int) -> None:
    # A killed main process cannot drain its pool: exit instead of waiting for work
    # forever. (Under the fork server our parent is the server, which itself lives as
    # long as any worker holds its pipe, so the main process is what we watch.)
    while True:
        time.sleep(0.5)
        if not _alive(main):
            os._exit(1)


def _start_worker(tokenizer_path: str, eos: int, dtype: str, main: int) -> None:
    import signal
    import threading

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process handles Ctrl-C and drains us
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process, one core
    import tokenizers

    _WORKER.update(tokenizer=tokenizers.Tokenizer.from_file(tokenizer_path), eos=eos, dtype=np.dtype(dtype))
    threading.Thread(target=_watch_main, args=(main,), daemon=True).start()


def encode_documents(texts: list[str], tokenizer=None, eos: int | None = None, dtype=None) -> tuple[np.ndarray, np.ndarray]:
    """(tokens of every document each followed by EOS, per-document lengths with EOS)."""
    tokenizer = tokenizer or _WORKER["tokenizer"]
    eos = _WORKER["eos"] if eos is None else eos
    dtype = _WORKER["dtype"] if dtype is None else dtype
    encoded = [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
    lengths = np.fromiter((len(ids) + 1 for ids in encoded), np.int64, len(encoded))
    out = np.empty(int(lengths.sum()), dtype)
    ends = np.cumsum(lengths)
    for ids, end, n in zip(encoded, ends, lengths):
        out[end - n : end - 1] = ids
        out[end - 1] = eos
    return out, lengths


@contextlib.contextmanager
def _serial_tokenizers():
    """Keep the tokenizer to one thread in serial mode, as in each worker."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


# ---------------------------------------------------------------------------------------
# Writing shards


class ShardWriter:
    """Fixed-size shards of one split: tokens in, `<split>/NNNNN.bin` files out."""

    def __init__(self, root: Path, split: str, shard_tokens: int, dtype: np.dtype):
        self.root, self.split, self.dtype = root, split, dtype
        (root / split).mkdir(parents=True, exist_ok=True)
        self.buffer = np.empty(shard_tokens, dtype)
        self.fill = 0
        self.shards: list[dict[str, Any]] = []
        self.documents = 0
        self.tokens = 0

    def write(self, tokens: np.ndarray, documents: int) -> None:
        self.documents += documents
        self.tokens += len(tokens)
        done = 0
        while done < len(tokens):
            n = min(len(self.buffer) - self.fill, len(tokens) - done)
            self.buffer[self.fill : self.fill + n] = tokens[done : done + n]
            self.fill += n
            done += n
            if self.fill == len(self.buffer):
                self._flush()

    def _flush(self) -> None:
        import hashlib

        if self.fill == 0:
            return
        name = f"{self.split}/{len(self.shards):05d}.bin"
        data = memoryview(self.buffer[: self.fill]).cast("B")
        with open(self.root / name, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        self.shards.append({"file": name, "tokens": self.fill, "bytes": len(data),
                            "sha256": hashlib.sha256(data).hexdigest()})
        self.fill = 0

    def close(self) -> dict[str, Any]:
        self._flush()
        return {"documents": self.documents, "tokens": self.tokens, "shards": self.shards}


class Writers:
    """The two splits' writers, fed in submission order. With a training cap, training
    stops after the document that reaches it, and interleaved validation documents read
    after that point are dropped (held until the end, so the cut is the same for any
    worker count)."""

    def __init__(self, root: Path, d: DataConfig, dtype: np.dtype):
        self.splits = {s: ShardWriter(root, s, d.shard_tokens, dtype) for s in SPLITS}
        self.cap = d.train_tokens
        self.cut: int | None = None  # source position where training was cut
        self.held: list[tuple[np.ndarray, int]] | None = [] if self.cap is not None else None

    @property
    def full(self) -> bool:
        return self.cut is not None

    def write(self, split: str, tokens: np.ndarray, lengths: np.ndarray, positions: list[int]) -> None:
        if split == "validation":
            if self.held is None:
                self.splits[split].write(tokens, len(lengths))
            else:
                ends = np.cumsum(lengths)
                self.held.extend((tokens[e - n : e], p) for e, n, p in zip(ends, lengths, positions))
            return
        if self.full:
            return
        if self.cap is not None:
            ends = np.cumsum(lengths)
            crossing = np.searchsorted(ends, self.cap - self.splits["train"].tokens)
            if crossing < len(lengths):  # this batch reaches the cap: keep through that document
                self.cut = positions[crossing]
                tokens, lengths = tokens[: ends[crossing]], lengths[: crossing + 1]
        self.splits["train"].write(tokens, len(lengths))

    def close(self) -> dict[str, Any]:
        if self.held is not None:
            for tokens, position in self.held:
                if self.cut is None or position < self.cut:
                    self.splits["validation"].write(tokens, 1)
        return {s: w.close() for s, w in self.splits.items()}


# ---------------------------------------------------------------------------------------
# Preparing a cache


@dataclass(frozen=True)
class Need:
    """What a config's training budget draws from a cache."""

    sequences: int  # training sequences of the whole budget
    context: int
    tokens: int  # training tokens that serve them from whole shard groups

    def as_dict(self) -> dict[str, int]:
        return {"sequences": self.sequences, "context": self.context, "tokens": self.tokens}


def budget_need(config: PretrainConfig, vocab_size: int, eos_id: int) -> Need:
    """The training text `config`'s budget needs, with a tokenizer of `vocab_size`."""
    from linnet.pretrain.budget import cache_tokens
    from linnet.pretrain.config import make_budget, model_card

    t, d = config.training, config.data
    budget = make_budget(config, model_card(config, vocab_size, eos_id).params())
    return Need(budget.sequences, t.context_length,
                cache_tokens(budget.sequences, t.context_length, d.shuffle_group_size * d.shard_tokens))


@dataclass
class Prepared:
    """What `prepare` did: the cache, its sizes and the time taken, and what the
    config's budget needs from it (when the whole config was given)."""

    path: Path
    documents: dict[str, int]
    tokens: dict[str, int]
    shards: dict[str, int]
    vocab_size: int
    seconds: float
    workers: int
    reused: bool = False
    fingerprint: str = ""
    need: Need | None = None

    @property
    def passes(self) -> float | None:
        """Passes over the training split that the budget takes (above 1: data reused)."""
        if self.need is None:
            return None
        return self.need.sequences / max((self.tokens["train"] - 1) // self.need.context, 1)

    @property
    def documents_per_second(self) -> float:
        return sum(self.documents.values()) / self.seconds if self.seconds > 0 else 0.0

    @property
    def tokens_per_second(self) -> float:
        return sum(self.tokens.values()) / self.seconds if self.seconds > 0 else 0.0

    def table(self) -> list[tuple[str, str]]:
        rows = [("cache", str(self.path)), ("fingerprint", self.fingerprint)]
        if self.reused:
            rows.append(("status", "already prepared with these settings; every checksum verified"))
        for s in SPLITS:
            rows.append((f"{s}", f"{self.documents[s]:,} documents, {self.tokens[s]:,} tokens, {self.shards[s]} shards"))
        if self.need is not None:
            n = self.need
            rows += [("budget needs", f"{n.sequences:,} sequences of {n.context} tokens: {n.tokens:,} training tokens "
                                      "through its last whole shard group"),
                     ("passes over the cache", f"{self.passes:.2f}" + (" (data reused)" if self.passes > 1 else ""))]
        rows += [("vocabulary", f"{self.vocab_size:,}"), ("seconds", f"{self.seconds:.2f}")]
        if not self.reused:
            rows += [("workers", str(self.workers)),
                     ("documents / s", f"{self.documents_per_second:,.0f}"),
                     ("tokens / s", f"{self.tokens_per_second:,.0f}")]
        return rows


def cache_settings(d: DataConfig, tokenizer_setting: dict[str, Any] | None = None) -> dict[str, Any]:
    """The settings that decide a cache's bytes (worker count and batch size do not)."""
    def described(sources: list[str]) -> list[dict[str, Any]]:
        return [{"path": str(p.resolve()), "bytes": p.stat().st_size} for p in source_files(sources)] if sources else []

    settings: dict[str, Any] = {
        "source": described(d.source),
        "validation_source": described(d.validation_source),
        "validation_every": d.validation_every,
        "dataset": None if d.dataset is None else {
            "name": d.dataset, "config": d.dataset_config, "split": d.dataset_split,
            "validation_split": d.dataset_validation_split},
        "text_field": d.text_field,
        "document_split": d.document_split,
        "train_tokens": d.train_tokens,
        "shuffle_buffer": d.shuffle_buffer,
        "shuffle_seed": d.shuffle_seed,
        "shard_tokens": d.shard_tokens,
    }
    if tokenizer_setting is not None:
        settings["tokenizer"] = tokenizer_setting
    return settings


def requested_settings(d: DataConfig) -> dict[str, Any]:
    """The cache settings `d` asks for (the tokenizer as requested, before it is built)."""
    return cache_settings(d, _tokenizer_setting_requested(d))


def _tokenizer_setting_requested(d: DataConfig) -> dict[str, Any]:
    """The tokenizer settings as requested (before any tokenizer is built)."""
    if d.tokenizer is None:
        return {"trained": "byte-level-bpe", "vocab_size": d.vocab_size, "eos_token": d.eos_token or TRAINED_EOS}
    path = Path(d.tokenizer)
    return {"source": str(path.resolve()) if path.exists() else d.tokenizer, "eos_token": d.eos_token}


def settings_differences(saved: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    """'data.KEY: cache has A, config asks B' for each setting that differs, leaving out
    train_tokens: a capacity, not an identity (see `_covers`)."""
    out = []
    for key in sorted((set(saved) | set(wanted)) - {"train_tokens"}):
        a, b = saved.get(key), wanted.get(key)
        if key == "tokenizer" and isinstance(a, dict) and isinstance(b, dict):
            if b.get("eos_token") is None:  # not asked for: the tokenizer's own is fine
                a = {k: v for k, v in a.items() if k != "eos_token"}
                b = {k: v for k, v in b.items() if k != "eos_token"}
        if a != b:
            out.append(f"data.{key}: cache has {json.dumps(a)}, config asks {json.dumps(b)}")
    return out


def _covers(manifest: dict[str, Any], wanted: int | None) -> bool:
    """Whether a cache holds `wanted` training tokens (None: the whole corpus): as many,
    or the whole corpus (its reading was not cut short). Its first whole shard groups are
    then the ones a fresh preparation would write."""
    cap, tokens = manifest["settings"]["train_tokens"], manifest["splits"]["train"]["tokens"]
    whole_corpus = cap is None or tokens < cap
    return whole_corpus or (wanted is not None and tokens >= wanted)


def _check_existing(path: Path, d: DataConfig, config: PretrainConfig | None) -> Prepared:
    manifest = cache_format.read_manifest(path)
    differences = settings_differences(manifest["settings"], requested_settings(d))
    if differences:
        raise ValueError(
            f"{path}: a token cache prepared with other settings; refusing to reuse it. "
            + "; ".join(differences)
            + ". Prepare at a new data.cache path, or restore the settings above to reuse this cache"
        )
    need = None if config is None else budget_need(config, manifest["vocab_size"], manifest["eos_id"])
    wanted = d.train_tokens if d.train_tokens is not None or need is None else need.tokens
    if not _covers(manifest, wanted):
        tokens = manifest["splits"]["train"]["tokens"]
        asked = "the whole corpus" if wanted is None else f"{wanted:,}"
        raise ValueError(f"{path}: holds {tokens:,} training tokens (cut at {manifest['settings']['train_tokens']:,}) "
                         f"and this config asks for {asked}; a cache is never extended: prepare at a new data.cache "
                         "path")
    t0 = time.perf_counter()
    cache = cache_format.verify_cache(path)
    return Prepared(
        path, {s: cache.splits[s].documents for s in SPLITS}, {s: cache.splits[s].tokens for s in SPLITS},
        {s: len(cache.splits[s].shards) for s in SPLITS}, cache.vocab_size, time.perf_counter() - t0,
        d.prepare_workers, reused=True, fingerprint=cache.fingerprint, need=need,
    )


def _remove_stale(target: Path) -> None:
    """Temporary directories of preparations whose process is gone (killed runs)."""
    for tmp in target.parent.glob(f".{target.name}.tmp-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _batches(d: DataConfig, capped: Callable[[], bool]) -> Iterator[tuple[str, list[str], list[int]]]:
    """(split, texts, positions) batches; each split's batch flushes when full. Once the
    training split is `capped`, reading stops: the validation documents already read
    (all those before the cut) go out, and nothing more is read."""
    pending: dict[str, tuple[list[str], list[int]]] = {s: ([], []) for s in SPLITS}
    for doc in documents(d):
        texts, positions = pending[doc.split]
        texts.append(doc.text)
        positions.append(doc.position)
        if len(texts) == d.prepare_batch_documents:
            yield doc.split, texts, positions
            pending[doc.split] = ([], [])
            if capped():
                break
    for split in SPLITS:
        if pending[split][0] and not (split == "train" and capped()):
            yield (split, *pending[split])


def _tokenize_serial(d: DataConfig, tok, eos: int, dtype: np.dtype, writers: Writers) -> None:
    with _serial_tokenizers():
        for split, texts, positions in _batches(d, lambda: writers.full):
            tokens, lengths = encode_documents(texts, tok, eos, dtype)
            writers.write(split, tokens, lengths, positions)


def _worker_context():
    """Fork server where there is one (workers fork from a clean server that has imported
    this module once), else spawn. Never a plain fork: the parent may have imported torch
    or JAX."""
    import multiprocessing

    if "forkserver" in multiprocessing.get_all_start_methods():
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["linnet.pretrain.prepare"])
        return context
    return multiprocessing.get_context("spawn")


@contextlib.contextmanager
def _ctrl_c_held():
    """Hold a Ctrl-C until the block ends: `ProcessPoolExecutor.submit` starts workers
    under the pool's lock, and an interrupt half-way through can leave a pool that never
    shuts down. (Only the main thread receives signals; elsewhere this does nothing.)"""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


def _tokenize_pool(d: DataConfig, tokenizer_file: Path, eos: int, dtype: np.dtype, writers: Writers) -> None:
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    workers = d.prepare_workers
    with _ctrl_c_held():
        pool = ProcessPoolExecutor(workers, mp_context=_worker_context(), initializer=_start_worker,
                                   initargs=(str(tokenizer_file), eos, dtype.str, os.getpid()))
    in_flight: deque = deque()
    try:
        for split, texts, positions in _batches(d, lambda: writers.full):
            with _ctrl_c_held():
                in_flight.append((split, positions, pool.submit(encode_documents, texts)))
            while len(in_flight) >= IN_FLIGHT_PER_WORKER * workers:
                split_done, done_positions, future = in_flight.popleft()
                writers.write(split_done, *future.result(), done_positions)
        while in_flight:  # in submission order, whatever order they finish in
            split_done, done_positions, future = in_flight.popleft()
            writers.write(split_done, *future.result(), done_positions)
    except BaseException as e:
        # Failure or Ctrl-C: cancel what has not started, wait for what has.
        pool.shutdown(wait=True, cancel_futures=True)
        if isinstance(e, BrokenProcessPool):
            raise ValueError(
                f"a tokenizer worker died abruptly ({e}); nothing was published. Out of memory? Lower "
                "data.prepare_workers or data.prepare_batch_documents, or run with data.prepare_workers=1 to "
                "see the error in the main process"
            ) from None
        raise
    pool.shutdown(wait=True)


def prepare(config: PretrainConfig | DataConfig) -> Prepared:
    """Prepare the token cache at `data.cache` (see the module docstring). Given the whole
    config, a null data.train_tokens reads what its budget needs; given the data group
    alone, the whole corpus."""
    whole = config if isinstance(config, PretrainConfig) else None
    d = config.data if whole else config
    result = _prepare(d, whole)
    if result.passes is not None and result.passes > 1:
        then = ("training reuses the data (data.repeat is true)" if d.repeat else
                "training will refuse it unless data.repeat=true; or add to the corpus, or lower the budget "
                "(training.targets_per_parameter or training.total_targets)")
        warnings.warn(f"{result.path}: the budget draws {result.need.sequences:,} training sequences of "
                      f"{result.need.context} tokens, {result.passes:.2f} passes over the cache's "
                      f"{result.tokens['train']:,} training tokens: {then}", stacklevel=2)
    return result


def _prepare(d: DataConfig, config: PretrainConfig | None) -> Prepared:
    if not d.cache:
        raise ValueError("config: data.cache is required (the directory the token cache is written to)")
    if not d.source and d.dataset is None:
        raise ValueError("config: give data.source (corpus files) or data.dataset (a datasets name)")
    target = Path(d.cache)
    if target.exists():
        return _check_existing(target, d, config)
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(target)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.perf_counter()
    try:
        tmp.mkdir()
        tok, eos, tokenizer_setting = resolve_tokenizer(d)
        tok.save(str(tmp / TOKENIZER))
        vocab = tok.get_vocab_size(with_added_tokens=True)
        need = None if config is None else budget_need(config, vocab, eos)
        if need is not None and d.train_tokens is None:
            d = replace(d, train_tokens=need.tokens)  # the cap actually used is what the manifest records
        dtype = token_dtype(vocab)
        writers = Writers(tmp, d, dtype)
        if d.prepare_workers == 1:
            _tokenize_serial(d, tok, eos, dtype, writers)
        else:
            _tokenize_pool(d, tmp / TOKENIZER, eos, dtype, writers)
        splits = writers.close()
        if splits["train"]["tokens"] < 2:
            raise ValueError(f"{', '.join(d.source) or d.dataset}: the training split holds "
                             f"{splits['train']['tokens']} tokens; the corpus is empty")
        manifest = {
            "format": cache_format.FORMAT,
            "version": cache_format.VERSION,
            "settings": cache_settings(d, tokenizer_setting),
            "dtype": dtype.str,
            "eos_id": eos,
            "vocab_size": vocab,
            "tokenizer": {"file": TOKENIZER, "sha256": cache_format.sha256_file(tmp / TOKENIZER)},
            "splits": splits,
            "budget": None if need is None else need.as_dict(),
        }
        manifest["fingerprint"] = cache_format.fingerprint(manifest)
        write_text(tmp / MANIFEST, json.dumps(manifest, indent=1) + "\n")
        try:
            os.rename(tmp, target)  # the publish: all or nothing
        except OSError:
            if not (target / MANIFEST).is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another run published first: check it
            return _check_existing(target, d, config)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    seconds = time.perf_counter() - t0
    return Prepared(
        target, {s: splits[s]["documents"] for s in SPLITS}, {s: splits[s]["tokens"] for s in SPLITS},
        {s: len(splits[s]["shards"]) for s in SPLITS}, vocab, seconds, d.prepare_workers,
        fingerprint=manifest["fingerprint"], need=need,
    )


def _print_table(rows: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


def cli(argv: list[str] | None = None) -> int:
    from linnet.config import template
    from linnet.pretrain.config import load

    parser = argparse.ArgumentParser(prog="linnet prepare", description="Tokenize a corpus into a token cache.")
    parser.add_argument("--config", help="YAML config (the data group is read; see `linnet pretrain --template`)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a field, e.g. data.prepare_workers=4 (repeatable)")
    parser.add_argument("--verify", nargs="?", const=True, default=None, metavar="CACHE",
                        help="re-hash every shard of CACHE (default: the config's data.cache) and exit")
    parser.add_argument("--template", action="store_true", help="print every field with its default and help")
    args = parser.parse_args(argv)
    if args.template:
        print(template(PretrainConfig))
        return 0
    config: PretrainConfig | None = None
    if args.config is not None or args.set:
        config = load(args.config, args.set)
    if args.verify is not None:
        path = args.verify if isinstance(args.verify, str) else (config.data.cache if config else None)
        if not path:
            parser.error("--verify needs a cache path, or --config with data.cache")
        t0 = time.perf_counter()
        cache = cache_format.verify_cache(path)
        files = 1 + sum(len(s.shards) for s in cache.splits.values())
        print(f"{cache.path}: {files} files, every SHA-256 checksum matches "
              f"({time.perf_counter() - t0:.1f}s; fingerprint {cache.fingerprint})")
        return 0
    if config is None:
        parser.error("give --config FILE (and/or --set KEY=VALUE), or --verify CACHE")
    try:
        with warnings.catch_warnings(record=True) as caught:  # printed after the table, where they are seen
            warnings.simplefilter("always")
            result = prepare(config)
    except KeyboardInterrupt:
        print("linnet prepare: interrupted; workers drained, nothing was published", file=sys.stderr)
        return 130
    _print_table(result.table())
    for w in caught:
        print(f"linnet prepare: warning: {w.message}", file=sys.stderr)
    return 0
