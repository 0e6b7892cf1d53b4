"""A mixture of sources sampled in proportion to their weights, epoch after epoch, in an
order fixed by the seed alone (so a resumed run, which replays the stream to its step,
sees the same examples).

An epoch holds as many items as all the sources together; source k gives round(w_k / sum(w)
x that) of them (largest remainders, so the counts add up), read from its own endless
stream: its items in a seeded order, then in another, and so on. A source smaller than its
share repeats within the epoch; a larger one continues where it stopped in the next, so
every item is seen before any is seen twice. The epoch's items are then interleaved in a
seeded order.

    order = mixture_epoch(sizes=[1000, 50], weights=[0.9, 0.1], seed=0, epoch=0)   # indices
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def shares(weights: Sequence[float], total: int) -> np.ndarray:
    """`total` split in proportion to `weights`, as whole numbers that add up to it."""
    w = np.asarray(weights, dtype=np.float64)
    if len(w) == 0 or (w <= 0).any() or not np.isfinite(w).all():
        raise ValueError(f"mixture: weights {list(weights)}; give each source a positive weight")
    exact = w / w.sum() * total
    counts = np.floor(exact).astype(np.int64)
    counts[np.argsort(-(exact - counts), kind="stable")[:total - counts.sum()]] += 1
    return counts


def _stream(size: int, start: int, n: int, seed: int, source: int) -> np.ndarray:
    """Items start..start+n of a source's endless stream (a fresh seeded order each pass)."""
    passes = range(start // size, (start + n - 1) // size + 1)
    stream = np.concatenate([np.random.default_rng([seed, source, p]).permutation(size) for p in passes])
    offset = start - passes[0] * size
    return stream[offset:offset + n]


def mixture_epoch(sizes: Sequence[int], weights: Sequence[float], *, seed: int, epoch: int) -> np.ndarray:
    """The indices (into the sources laid end to end) of epoch `epoch`, interleaved."""
    if any(s <= 0 for s in sizes):
        raise ValueError(f"mixture: source sizes {list(sizes)}; every source needs items")
    counts = shares(weights, int(sum(sizes)))
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    picked = [start + _stream(size, epoch * int(n), int(n), seed, k)
              for k, (size, n, start) in enumerate(zip(sizes, counts, starts)) if n]
    order = np.concatenate(picked)
    return order[np.random.default_rng([seed, 1 << 20, epoch]).permutation(len(order))]
