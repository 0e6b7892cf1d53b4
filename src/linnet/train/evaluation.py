"""Held-out loss: the one measure every PyTorch command reports on held-out rows."""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import numpy as np
import torch

from linnet.torch.distributed import matched, sum_across
from linnet.torch.sharding import is_sharded


def held_out_loss(model, rows: Iterable, *, share: int = 0, shares: int = 1) -> float:
    """Mean loss per learned token over packed rows, without gradients. Under several
    processes (or copies of a split model) each takes every `shares`-th row from its
    `share`, and the sums over every process give the mean; rows stream unless the
    model is sharded, whose processes must each make as many passes."""
    mine: Iterable = itertools.islice(rows, share, None, shares)
    if is_sharded(model):
        mine = matched(list(mine), model)
    total = count = 0.0
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for row in mine:
            loss, n = model.loss_packed(row)
            total, count = total + float(loss), count + float(n)
    model.train(was_training)
    total, count = sum_across([total, count])  # the processes of a split count alike: the ratio stands
    return total / max(count, 1.0)


def example_losses(model, rows: Iterable) -> tuple[np.ndarray, np.ndarray]:
    """(loss per learned token of each example, its learned tokens), in the order the
    rows hold them (`pack` keeps its input's order; an example with nothing learned has
    no entry): what a comparison of models resamples. One process, no gradients."""
    losses, counts = [], []
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for row in rows:
            weights = np.asarray(row.weights, dtype=np.float64)
            logp = model.log_probs_packed(row).double().cpu().numpy()[:len(weights)]
            starts = np.asarray(row.bounds)[:-1]
            learned = np.add.reduceat(weights, starts)
            nll = -np.add.reduceat(logp * weights, starts)
            kept = learned > 0
            losses.extend(nll[kept] / learned[kept])
            counts.extend(learned[kept])
    model.train(was_training)
    return np.array(losses), np.array(counts)
