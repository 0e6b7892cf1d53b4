"""How sure a comparison of models on one eval set is: a bootstrap over examples for
each model's mean, and a paired test between two models on the same examples (each
example's difference, so the examples' own difficulty cancels)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

DRAWS = 2000  # bootstrap resamples (and sign flips): the 95% bounds move by under a tenth of their width


def interval(values, *, level: float = 0.95, draws: int = DRAWS, seed: int = 0) -> tuple[float, float]:
    """The percentile bootstrap interval of the mean of `values` (one per example)."""
    x = np.asarray(values, dtype=np.float64)
    if len(x) == 0:
        return float("nan"), float("nan")
    picks = np.random.default_rng(seed).integers(0, len(x), size=(draws, len(x)))
    means = x[picks].mean(axis=1)
    tail = (1 - level) / 2
    return float(np.quantile(means, tail)), float(np.quantile(means, 1 - tail))


def paired(a, b, *, level: float = 0.95, draws: int = DRAWS, seed: int = 0) -> dict[str, float]:
    """b against a on the same examples: the mean difference b - a, its bootstrap
    interval, and the two-sided p-value of a sign-flip permutation test (under "no
    difference" each example's difference is as likely negated)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"paired: {len(a)} and {len(b)} examples; a paired test needs the same examples")
    d = b - a
    low, high = interval(d, level=level, draws=draws, seed=seed)
    observed = abs(d.mean()) if len(d) else 0.0
    signs = np.random.default_rng(seed + 1).choice((-1.0, 1.0), size=(draws, len(d)))
    flipped = np.abs((signs * d).mean(axis=1))
    p = (1 + np.count_nonzero(flipped >= observed - 1e-12)) / (draws + 1)  # the observed split counts as one
    return {"difference": float(d.mean()) if len(d) else float("nan"), "low": low, "high": high,
            "p": float(min(p, 1.0))}


def compare(columns: Mapping[str, Mapping[str, Sequence[float]]], *, seed: int = 0) -> dict[str, dict]:
    """Every column's (model's) mean and interval of each metric, and each column after
    the first against the first: {column: {metric: {mean, low, high[, difference, ...,
    p]}}}. A metric a column lacks (the first, or this one) gets no paired entry."""
    names = list(columns)
    out: dict[str, dict] = {}
    for name in names:
        out[name] = {}
        for metric, values in columns[name].items():
            low, high = interval(values, seed=seed)
            entry = {"mean": float(np.mean(values)), "low": low, "high": high}
            first = columns[names[0]].get(metric)
            if name != names[0] and first is not None:
                versus = paired(first, values, seed=seed)
                entry.update({"difference": versus["difference"], "difference_low": versus["low"],
                              "difference_high": versus["high"], "p": versus["p"]})
            out[name][metric] = entry
    return out
