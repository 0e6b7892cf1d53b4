"""`linnet prepare`: stream a corpus into a token cache (see `linnet.pretrain.cache`).

    linnet prepare --config configs/pretrain-tiny-cpu.yaml
    linnet prepare --config run.yaml --set data.prepare_workers=4
    linnet prepare --verify runs/cache/shakespeare      # re-hash every shard

The steps, each in its own module: the documents are read and split into training and
validation (`linnet.data.corpus`), tokenized in batches by a pool of processes
(`linnet.pretrain.tokenize`; `data.prepare_workers`, 1 encodes in this process), and
written as checksummed shards (`linnet.pretrain.shards`), the same bytes for any worker
count. This module runs them: everything is written under a temporary directory beside
the cache and renamed into place only after success, so a failure, Ctrl-C or kill
publishes nothing, and a rerun starts clean.

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

import hashlib
import json
import os
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from linnet.config import PretrainConfig
from linnet.config.groups import CorpusConfig
from linnet.data.corpus import documents, mixture_files, source_files
from linnet.data.curation import Curation
from linnet.data.overlap import normalize
from linnet.files.atomic import check_writable, remove_stale, write_text
from linnet.pretrain import cache as cache_format
from linnet.pretrain.cache import MANIFEST, SPLITS, TOKENIZER, token_dtype
from linnet.pretrain.shards import Writers
from linnet.pretrain.tokenize import TRAINED_EOS, Batches, resolve_tokenizer, tokenize_pool, tokenize_serial
from linnet.report.progress import Progress


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
    from linnet.pretrain.recipe import make_budget, model_card

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
    dropped: dict[str, int] = field(default_factory=dict)  # documents the curation dropped, by reason

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
        if self.dropped:
            rows.append(("dropped", ", ".join(f"{n:,} {reason}" for reason, n in sorted(self.dropped.items()))))
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


def cache_settings(d: CorpusConfig, tokenizer_setting: dict[str, Any] | None = None) -> dict[str, Any]:
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
    curation = Curation.of(d)
    if curation.active:  # what it drops decides the bytes; caches prepared without compare as before
        settings["curation"] = curation.settings()
    if d.mixture:  # which corpora and their weights decide the bytes; caches without one compare as before
        settings["mixture"] = [{"source": [{"path": str(p.resolve()), "bytes": p.stat().st_size}
                                           for p in mixture_files(m)], "weight": m["weight"]} for m in d.mixture]
    if tokenizer_setting is not None:
        settings["tokenizer"] = tokenizer_setting
    return settings


def requested_settings(d: CorpusConfig) -> dict[str, Any]:
    """The cache settings `d` asks for (the tokenizer as requested, before it is built)."""
    return cache_settings(d, _tokenizer_setting_requested(d))


def _tokenizer_setting_requested(d: CorpusConfig) -> dict[str, Any]:
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


def _check_existing(path: Path, d: CorpusConfig, config: PretrainConfig | None) -> Prepared:
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


class Repeats:
    """Validation documents whose normalized text a training document has too (data.overlap):
    8-byte hashes of every document read, compared once reading ends."""

    def __init__(self):
        self.hashes: dict[str, list[int]] = {s: [] for s in SPLITS}

    def add(self, split: str, text: str) -> None:
        digest = hashlib.blake2b(normalize(text).encode(), digest_size=8).digest()
        self.hashes[split].append(int.from_bytes(digest, "little"))

    def count(self) -> int:
        train = np.array(self.hashes["train"], dtype=np.uint64)
        return int(np.isin(np.array(self.hashes["validation"], dtype=np.uint64), train).sum())


def _batches(d: CorpusConfig, capped: Callable[[], bool], curation: Curation, repeats: Repeats | None) -> Batches:
    """(split, texts, positions) batches; each split's batch flushes when full. Once the
    training split is `capped`, reading stops: the validation documents already read
    (all those before the cut) go out, and nothing more is read."""
    pending: dict[str, tuple[list[str], list[int]]] = {s: ([], []) for s in SPLITS}
    for doc in documents(d, curation=curation):
        if repeats is not None:
            repeats.add(doc.split, doc.text)
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


def check_repeats(d: CorpusConfig, repeated: int, where: str) -> None:
    """Warn about (data.overlap: warn) or refuse (refuse) a validation split holding
    documents the training split holds too: its loss would flatter the model."""
    message = (f"{d.cache}: {repeated:,} document(s) of the {where} repeat training documents (the same normalized "
               "text), so the validation loss would flatter the model; set data.dedup=exact (or near) to drop them "
               "before the split, or data.overlap=off to keep them")
    if d.overlap == "refuse":
        raise ValueError(message)
    warnings.warn(message, stacklevel=3)


def prepare(config: PretrainConfig | CorpusConfig) -> Prepared:
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


def _prepare(d: CorpusConfig, config: PretrainConfig | None) -> Prepared:
    if not d.cache:
        raise ValueError("config: data.cache is required (the directory the token cache is written to)")
    if not d.source and d.dataset is None and not d.mixture:
        raise ValueError("config: give data.source (corpus files), data.mixture (several, weighted) or data.dataset "
                         "(a datasets name)")
    target = Path(d.cache)
    check_writable(target, "data.cache")
    if target.exists():
        return _check_existing(target, d, config)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(target)
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
        curation = Curation.of(d)
        repeats = Repeats() if d.overlap != "off" else None
        batches = _batches(d, lambda: writers.full, curation, repeats)
        bar = Progress(d.train_tokens or 0, "prepare", unit="tok") if d.train_tokens else None

        def write(*batch) -> None:
            writers.write(*batch)
            if bar is not None:
                bar.update(writers.splits["train"].tokens)

        if d.prepare_workers == 1:
            tokenize_serial(batches, tok, eos, dtype, write)
        else:
            tokenize_pool(batches, d.prepare_workers, tmp / TOKENIZER, eos, dtype, write)
        if bar is not None:
            bar.close()
        splits = writers.close()
        repeated = repeats.count() if repeats is not None else 0
        if repeated:
            check_repeats(d, repeated, "validation split")
        if splits["train"]["tokens"] < 2:
            raise ValueError(f"{', '.join(d.source) or d.dataset or 'data.mixture'}: the training split holds "
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
            "validation_repeats": repeated,  # not part of the fingerprint: a finding, not a setting
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
        fingerprint=manifest["fingerprint"], need=need, dropped=dict(curation.dropped),
    )
