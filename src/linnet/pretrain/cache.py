"""A token cache on disk, as `linnet prepare` writes it and the loader reads it.

    cache/
      manifest.json          format, settings, tokenizer, splits, shard sizes and SHA-256s
      tokenizer.json         the resolved tokenizer the tokens came from
      train/00000.bin …      fixed-size shards of raw little-endian uint16 (uint32 when the
      validation/00000.bin …   vocabulary needs it); only a split's last shard is shorter

Each split is one token stream: documents end to end, the EOS token after each. A cache is
immutable once published. `open_cache` checks the manifest and every shard's size (cheap,
at every training start); `verify_cache` re-hashes every byte (`linnet prepare --verify`).

numpy only: no torch here.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from linnet.files.atomic import sha256_file

FORMAT = "linnet-token-cache"
VERSION = 1
SPLITS = ("train", "validation")
MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.json"


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab <= 65,536), else uint32."""
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def fingerprint(manifest: dict[str, Any]) -> str:
    """The data identity: a hash of the settings, tokenizer and every shard's checksum
    (not of where the cache lives)."""
    body = {
        "settings": manifest["settings"],
        "dtype": manifest["dtype"],
        "eos_id": manifest["eos_id"],
        "tokenizer": manifest["tokenizer"]["sha256"],
        "splits": {name: [s["sha256"] for s in split["shards"]] for name, split in manifest["splits"].items()},
    }
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Shard:
    path: Path
    tokens: int
    sha256: str


class Split:
    """One split's token stream over its shards; `read(start, stop)` crosses shards."""

    def __init__(self, name: str, shards: list[Shard], dtype: np.dtype, documents: int):
        self.name = name
        self.shards = shards
        self.dtype = dtype
        self.documents = documents
        self.offsets = np.cumsum([0] + [s.tokens for s in shards])  # [n_shards + 1]

    @property
    def tokens(self) -> int:
        return int(self.offsets[-1])

    def sequences(self, context: int) -> int:
        """Whole sequences of `context` tokens that have a next-token target for every
        position (the one token after a sequence is its last target)."""
        return max(0, (self.tokens - 1) // context)

    def read(self, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        """Tokens [start, stop) of the stream, in the cache's dtype."""
        if not 0 <= start <= stop <= self.tokens:
            raise IndexError(f"{self.name}: tokens [{start}, {stop}) outside the split's {self.tokens}")
        out = np.empty(stop - start, self.dtype) if out is None else out
        first = int(np.searchsorted(self.offsets, start, side="right")) - 1
        filled, i = 0, max(first, 0)
        while filled < stop - start:
            shard, base = self.shards[i], int(self.offsets[i])
            lo = start + filled - base
            n = min(shard.tokens - lo, stop - start - filled)
            # np.fromfile releases the GIL during the read: the prefetch thread overlaps it.
            out[filled : filled + n] = np.fromfile(shard.path, self.dtype, count=n, offset=lo * self.dtype.itemsize)
            filled += n
            i += 1
        return out


class TokenCache:
    """A published cache whose manifest and shard sizes have been checked."""

    def __init__(self, path: Path, manifest: dict[str, Any]):
        self.path = path
        self.manifest = manifest
        self.dtype = np.dtype(manifest["dtype"])
        self.eos_id: int = manifest["eos_id"]
        self.vocab_size: int = manifest["vocab_size"]
        self.fingerprint: str = manifest["fingerprint"]
        self.settings: dict[str, Any] = manifest["settings"]
        self.splits = {
            name: Split(name, [Shard(path / s["file"], s["tokens"], s["sha256"]) for s in split["shards"]],
                        self.dtype, split["documents"])
            for name, split in manifest["splits"].items()
        }

    @property
    def train(self) -> Split:
        return self.splits["train"]

    @property
    def validation(self) -> Split:
        return self.splits["validation"]

    @property
    def tokenizer_path(self) -> Path:
        return self.path / self.manifest["tokenizer"]["file"]


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    root = Path(path)
    file = root / MANIFEST
    if not file.is_file():
        if root.is_dir():
            raise ValueError(f"{root}: not a token cache (no {MANIFEST}); prepare one with `linnet prepare --config …`")
        raise FileNotFoundError(f"{root}: no token cache there; prepare it with `linnet prepare --config …`")
    try:
        manifest = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: not valid JSON ({e}); the cache is damaged: prepare it anew at a new path") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise ValueError(
            f"{file}: format {manifest.get('format')!r} version {manifest.get('version')!r}; this linnet reads "
            f"{FORMAT} version {VERSION}: prepare the cache anew with this version"
        )
    return manifest


def open_cache(path: str | os.PathLike) -> TokenCache:
    """Open a published cache, checking its manifest and that every shard has the size
    the manifest gives (no hashing: caches are immutable; `verify_cache` hashes)."""
    root = Path(path)
    manifest = read_manifest(root)
    cache = TokenCache(root, manifest)
    if fingerprint(manifest) != cache.fingerprint:
        raise ValueError(f"{root / MANIFEST}: its fingerprint does not match its contents; the manifest was edited "
                         "or damaged: prepare the cache anew")
    for split in cache.splits.values():
        for shard in split.shards:
            want = shard.tokens * cache.dtype.itemsize
            have = shard.path.stat().st_size if shard.path.is_file() else None
            if have != want:
                state = "is missing" if have is None else f"has {have} bytes"
                raise ValueError(
                    f"{shard.path}: {state}, the manifest says {want}; the cache is damaged: run "
                    f"`linnet prepare --verify {root}` and prepare it anew at a new path"
                )
    if not cache.tokenizer_path.is_file():
        raise ValueError(f"{cache.tokenizer_path}: missing; the cache is damaged: prepare it anew")
    return cache


def verify_cache(path: str | os.PathLike) -> TokenCache:
    """Re-hash the tokenizer and every shard against the manifest; raise naming each
    file that differs."""
    cache = open_cache(path)
    bad = []
    files = [(cache.tokenizer_path, cache.manifest["tokenizer"]["sha256"])]
    files += [(s.path, s.sha256) for split in cache.splits.values() for s in split.shards]
    for file, want in files:
        if sha256_file(file) != want:
            bad.append(str(file))
    if bad:
        raise ValueError(
            f"{cache.path}: {len(bad)} file(s) fail their SHA-256 checksum: {', '.join(bad[:5])}"
            f"{' …' if len(bad) > 5 else ''}; the cache is corrupt: delete it and prepare it anew"
        )
    return cache
