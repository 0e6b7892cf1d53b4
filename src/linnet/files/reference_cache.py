"""DPO's reference cache, one layout for both backends: the reference's summed
log-probabilities of each pair's chosen and rejected answer, `[pairs, 2]` float64, in
`<cache>/dpo-reference-<key>.npy`, so a later run (either backend) needs no reference
model in memory.

    key = cache_key(weights_digest(params), pairs)            # params: name -> array
    values = read(cache_file(cache, key), len(pairs))         # None when absent

The key hashes the reference's parameters in name order (each name, then its values as
float32: the same weights give the same key whatever the backend, the order its modules
list them in, or the dtype it holds them in) and the pairs' token ids (which already carry
the data and the chat template that rendered them). A pipelined PyTorch model hashes its
stages' digests in stage order instead (linnet.train.dpo.cache_key): its own key.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np


def weights_digest(weights: Mapping[str, Any], array: Callable[[Any], Any] = np.asarray):
    """A sha256 object over `weights` (name -> tensor) in name order: each name, then
    `array(tensor)`'s values as C-ordered float32 bytes. `array` turns one tensor into a
    numpy array, one at a time (a sharded one gathered there), so the whole model is never
    copied to the host at once."""
    h = hashlib.sha256()
    for name in sorted(weights):
        h.update(name.encode())
        h.update(np.ascontiguousarray(array(weights[name]), np.float32).tobytes())
    return h


def cache_key(digest, pairs: Sequence) -> str:
    """The cache key of the reference whose weights gave `digest` (left unchanged) and of
    `pairs` (linnet.packing.Pair: their prompt, chosen and rejected token ids)."""
    h = digest.copy()
    for pair in pairs:
        for part in (pair.prompt, pair.chosen, pair.rejected):
            h.update(np.asarray(part, np.int64).tobytes())
            h.update(b"|")
    return h.hexdigest()[:32]


def cache_file(cache: str | os.PathLike, key: str) -> Path:
    return Path(cache) / f"dpo-reference-{key}.npy"


def read(path: Path, pairs: int) -> np.ndarray | None:
    """The cached [pairs, 2] values, or None when `path` is absent; a file of another
    shape is refused by name."""
    if not path.is_file():
        return None
    values = np.load(path)
    if values.shape != (pairs, 2):
        raise ValueError(f"{path}: holds {values.shape} values where the reference cache keeps [{pairs}, 2] "
                         "(chosen, rejected) log-probabilities for these pairs; delete it to compute them again")
    return values


def write(path: Path, values) -> None:
    """`values` ([pairs, 2]) to `path` as float64, atomically (a full disk names the file)."""
    from linnet.files.atomic import atomic_path, writing

    with writing(path), atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            np.save(f, np.asarray(values, np.float64))
