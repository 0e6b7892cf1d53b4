"""Direct preference optimization of the JAX decoder, as `linnet.train.dpo.dpo` does it in
PyTorch and with the same options:

    params, history = dpo(model, pairs, optimizer=optax.adamw(1e-6), steps=100, pairs_per_step=32)

A pair's two answers share a packed row and one copy of its prompt;
the loss is -log sigmoid(beta * ((chosen - ref_chosen) - (rejected - ref_rejected)))
averaged over the step's pairs, with `label_smoothing` of them taken as labelled the
wrong way round. `reference` is a dict of parameters (path -> array); without it the
model's own log-probabilities before training are computed for every pair first.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Sequence

import jax
import numpy as np

from linnet.config.groups import DPOSettings
from linnet.jax.loop import State, Update, apply_gradients, fit, place_rows
from linnet.jax.lora import Params, dropout_keys
from linnet.jax.model import JaxModel, row_arrays, rows_log_probs
from linnet.packing import Pair, check_pairs, pack_prompted
from linnet.run import History, Run, run_and_options


def _rows(pairs: Sequence[Pair], tokens: int):
    """(stacked row arrays [R, P], [pairs, 2, 2] (row, document) of each chosen and
    rejected answer, real positions): each prompt once, both answers attending to it;
    the answers are the documents with learned tokens, in row order."""
    rows = list(pack_prompted(((p.prompt, (p.chosen, p.rejected)) for p in pairs), tokens))
    where = [(r, d) for r, row in enumerate(rows)
             for d in np.flatnonzero(np.add.reduceat(np.asarray(row.weights), np.asarray(row.bounds)[:-1]) > 0)]
    arrays = [row_arrays(row) for row in rows]
    stacked = {k: np.stack([a[k] for a in arrays]) for k in arrays[0]}
    return stacked, np.asarray(where, np.int32).reshape(len(pairs), 2, 2), sum(row.real for row in rows)


def _answer_log_probs(params: Params, card, rows, where, dtype, lora_scale: float, remat: bool = False,
                      lora_dropout: float = 0.0):
    """[pairs, 2] summed log-probabilities of each pair's chosen and rejected answer."""
    logp = rows_log_probs(params, card, rows, dtype, lora_scale, remat, lora_dropout)
    P = logp.shape[1]
    sums = jax.vmap(lambda x, s: jax.ops.segment_sum(x, s, num_segments=P))(logp * rows["weights"], rows["segments"])
    return sums[where[..., 0], where[..., 1]]


def dpo_sigmoid(chosen, rejected, ref_chosen, ref_rejected, *, beta: float, label_smoothing: float = 0.0):
    """Per-pair DPO loss (linnet.train.preference_loss's sigmoid)."""
    margin = beta * ((chosen - ref_chosen) - (rejected - ref_rejected))
    return -(1 - label_smoothing) * jax.nn.log_sigmoid(margin) - label_smoothing * jax.nn.log_sigmoid(-margin)


@functools.lru_cache(maxsize=8)
def _make_step(card, dtype, lora_scale: float, optimizer, clip: float | None, beta: float, label_smoothing: float,
               remat: bool, lora_dropout: float):
    def loss_fn(trained, frozen, rows, where, ref):
        logp = _answer_log_probs({**frozen, **trained}, card, rows, where, dtype, lora_scale, remat, lora_dropout)
        losses = dpo_sigmoid(logp[:, 0], logp[:, 1], ref[:, 0], ref[:, 1], beta=beta, label_smoothing=label_smoothing)
        return losses.mean(), beta * (logp - ref)

    def step(trained, frozen, opt_state, rows, where, ref):
        (loss, rewards), grads = jax.value_and_grad(loss_fn, has_aux=True)(trained, frozen, rows, where, ref)
        trained, opt_state, norm = apply_gradients(grads, trained, opt_state, optimizer, clip)
        margins = rewards[:, 0] - rewards[:, 1]
        return trained, opt_state, loss, norm, (margins > 0).mean(), margins.mean()

    return jax.jit(step, donate_argnums=(0, 2))


def reference_log_probs(model: JaxModel, pairs: Sequence[Pair], *, params: Params | None = None,
                        tokens: int = 4096, chunk: int = 32) -> np.ndarray:
    """[pairs, 2] (chosen, rejected) summed log-probabilities under `params` (default the
    model's), `chunk` pairs at a time."""
    params = model.params if params is None else params
    score = jax.jit(_answer_log_probs, static_argnums=(1, 4, 5))
    out = [np.asarray(score(params, model.card, *_rows(pairs[i : i + chunk], tokens)[:2], model.dtype,
                            model.lora_scale)) for i in range(0, len(pairs), chunk)]
    return np.concatenate(out) if out else np.zeros((0, 2))


def dpo(model: JaxModel, pairs: Sequence[Pair], run: Run | None = None, *, settings: DPOSettings | None = None,
        reference: Params | None = None, tokens: int = 4096, trainable=None, mesh=None, remat: bool = False,
        seed: int = 0, **options) -> tuple[Params, History]:
    """Train on preference pairs for `run.steps` steps of `pairs_per_step` pairs (the
    sequence repeated as epochs); returns (parameters, history). `run`: a linnet.run.Run,
    or its fields as keywords. options: the fields of linnet.config.DPOSettings (or
    `settings=`) the JAX backend has: pairs_per_step, beta, label_smoothing (the sigmoid
    loss). Each Step's metrics
    hold rewards/accuracies (share of pairs ranked right) and rewards/margins (mean reward
    margin), as TRL names them. `mesh`, `remat` and `seed` (the adapters' dropout masks)
    work as for `linnet.jax.train.train` (a step's rows split over the devices, filled out
    with rows that learn nothing); the reference log-probabilities take no dropout."""
    run, s = run_and_options("dpo", run, options, DPOSettings, settings)
    supported = dataclasses.replace(DPOSettings(), beta=s.beta, label_smoothing=s.label_smoothing,
                                    pairs_per_step=s.pairs_per_step)
    if s != supported:
        raise ValueError(f"dpo (JAX): {s}; the JAX backend trains the sigmoid loss with beta, label_smoothing and "
                         "pairs_per_step: the other options are PyTorch's (linnet.train.dpo)")
    beta, label_smoothing, pairs_per_step = s.beta, s.label_smoothing, s.pairs_per_step
    pairs = list(pairs)
    check_pairs(pairs)
    fixed = reference_log_probs(model, pairs, params=reference, tokens=tokens)
    rate = model.lora_dropout
    compiled = _make_step(model.card, model.dtype, model.lora_scale, run.optimizer, run.clip, beta, label_smoothing, remat,
                          rate)

    def step(number: int, chunk: list, state: State) -> Update:
        rows, where, real = _rows([p for _, p in chunk], tokens)
        if rate:  # each row its own masks
            rows["lora_key"] = dropout_keys(seed, number, len(rows["weights"]))
        ref = fixed[[i for i, _ in chunk]].astype(np.float32)
        state.trained, state.opt_state, loss, norm, accuracy, margin = compiled(
            state.trained, state.frozen, state.opt_state, place_rows(rows, mesh), where, ref)
        return Update(loss, norm, int(rows["weights"].sum()), real,
                      {"pairs": len(chunk), "rewards/accuracies": float(accuracy), "rewards/margins": float(margin)})

    return fit(model, itertools.cycle(enumerate(pairs)), step, run, per_step=pairs_per_step, trainable=trainable,
               mesh=mesh, what="dpo: the pairs")
