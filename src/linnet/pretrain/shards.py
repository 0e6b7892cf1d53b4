"""Writing a token cache's shards (the format: `linnet.pretrain.cache`).

    writers = Writers(tmp, config.data, dtype)
    writers.write("train", tokens, lengths, positions)   # in submission order
    splits = writers.close()                             # the manifest's "splits"

A `ShardWriter` cuts one split's tokens into fixed-size `<split>/NNNNN.bin` files
(`data.shard_tokens`; the last one shorter), each fsynced and hashed (SHA-256) as it is
written. `Writers` holds both splits' and applies the training cap
(`data.train_tokens`) at the same document for any worker count.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from linnet.pretrain.cache import SPLITS

if TYPE_CHECKING:
    from linnet.config.groups import CorpusConfig


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

    def __init__(self, root: Path, d: CorpusConfig, dtype: np.dtype):
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
