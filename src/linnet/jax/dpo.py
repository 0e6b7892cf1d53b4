"""Direct preference optimization of the JAX decoder and its relatives over the same pairs,
as `linnet.train.dpo.dpo` does them in PyTorch and with the same options:

    params, history = dpo(model, pairs, optimizer=optax.adamw(1e-6), steps=100, pairs_per_step=32,
                          loss_type="sigmoid", rpo_alpha=0.0, reference_cache="cache/")

A pair's two answers share a packed row and one copy of its prompt; each answer's summed
log-probability goes to the pair loss (`loss_type`, `linnet.jax.preference_loss`: the
formulas of linnet.train.preference_loss in jnp), averaged over the step's pairs, plus
`rpo_alpha` times the chosen answers' NLL. `reference` is a dict of parameters
(path -> array); without it the model's own log-probabilities before training are computed
for every pair first (or read from `reference_cache`, which PyTorch's dpo shares).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import numpy as np

from linnet.config.groups import REFERENCE_FREE, DPOSettings
from linnet.files import reference_cache as cache
from linnet.jax.loop import State, Update, apply_gradients, fit, place_rows
from linnet.jax.lora import Params, dropout_keys
from linnet.jax.model import JaxModel, row_arrays, rows_log_probs
from linnet.jax.preference_loss import pair_losses
from linnet.jax.sharding import check_mesh, context_rows, in_force
from linnet.packing import Pair, check_pairs, pack_prompted
from linnet.run import History, Run, run_and_options


def _rows(pairs: Sequence[Pair], tokens: int, mesh=None):
    """(stacked row arrays [R, P], [pairs, 2, 2] (row, document) of each chosen and
    rejected answer, real positions): each prompt once, both answers attending to it;
    the answers are the documents with learned tokens, in row order. Over a mesh's
    "context" axis each row laid out for it (`context_rows`: its sums by document are
    the same in any order)."""
    rows = list(pack_prompted(((p.prompt, (p.chosen, p.rejected)) for p in pairs), tokens))
    where = [(r, d) for r, row in enumerate(rows)
             for d in np.flatnonzero(np.add.reduceat(np.asarray(row.weights), np.asarray(row.bounds)[:-1]) > 0)]
    arrays = [context_rows(row_arrays(row), mesh) for row in rows]
    stacked = {k: np.stack([a[k] for a in arrays]) for k in arrays[0]}
    return stacked, np.asarray(where, np.int32).reshape(len(pairs), 2, 2), sum(row.real for row in rows)


def _answer_log_probs(params: Params, card, rows, where, dtype, lora_scale: float, remat: bool = False,
                      lora_dropout: float = 0.0):
    """[pairs, 2] summed log-probabilities of each pair's chosen and rejected answer."""
    logp = rows_log_probs(params, card, rows, dtype, lora_scale, remat, lora_dropout)
    P = logp.shape[1]
    sums = jax.vmap(lambda x, s: jax.ops.segment_sum(x, s, num_segments=P))(logp * rows["weights"], rows["segments"])
    return sums[where[..., 0], where[..., 1]]


class Objective(NamedTuple):
    """What the compiled step computes: the pair loss and its hyperparameters, and the
    weight of the chosen answers' NLL (rpo_alpha; 1 for orpo)."""

    loss_type: str
    beta: float
    label_smoothing: float
    simpo_gamma: float
    nll: float


@functools.lru_cache(maxsize=8)
def _make_step(card, dtype, lora_scale: float, optimizer, clip: float | None, objective: Objective, remat: bool,
               lora_dropout: float):
    o = objective

    def loss_fn(trained, frozen, rows, where, ref, lengths):
        logp = _answer_log_probs({**frozen, **trained}, card, rows, where, dtype, lora_scale, remat, lora_dropout)
        losses, good, bad = pair_losses(o.loss_type, logp[:, 0], logp[:, 1], None if ref is None else ref[:, 0],
                                        None if ref is None else ref[:, 1], beta=o.beta,
                                        chosen_tokens=lengths[:, 0], rejected_tokens=lengths[:, 1],
                                        label_smoothing=o.label_smoothing, simpo_gamma=o.simpo_gamma)
        loss = losses.mean()
        if o.nll:  # the chosen answers' NLL, a mean over the step's chosen tokens (as PyTorch's)
            loss = loss - o.nll * logp[:, 0].sum() / lengths[:, 0].sum()
        margins = good - bad
        return loss, {"rewards/chosen": good.mean(), "rewards/rejected": bad.mean(),
                      "rewards/margins": margins.mean(), "rewards/accuracies": (margins > 0).mean(),
                      "logps/chosen": logp[:, 0].mean(), "logps/rejected": logp[:, 1].mean()}

    def step(trained, frozen, opt_state, rows, where, ref, lengths):
        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(trained, frozen, rows, where, ref, lengths)
        trained, opt_state, norm = apply_gradients(grads, trained, opt_state, optimizer, clip)
        return trained, opt_state, loss, norm, stats

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


def cached_reference_log_probs(model: JaxModel, pairs: Sequence[Pair], cache_dir, *, params: Params | None = None,
                               tokens: int = 4096) -> np.ndarray:
    """reference_log_probs, read from or written to `cache_dir` in the layout PyTorch's
    dpo keeps (linnet.files.reference_cache): the same weights and pairs give the same
    file, whichever backend wrote it."""
    params = model.params if params is None else params
    path = cache.cache_file(cache_dir, cache.cache_key(cache.weights_digest(params), pairs))
    values = cache.read(path, len(pairs))
    if values is None:
        values = reference_log_probs(model, pairs, params=params, tokens=tokens)
        cache.write(path, values)
    return values


def dpo(model: JaxModel, pairs: Sequence[Pair], run: Run | None = None, *, settings: DPOSettings | None = None,
        reference: Params | None = None, tokens: int = 4096, trainable=None, mesh=None, remat: bool = False,
        seed: int = 0, **options) -> tuple[Params, History]:
    """Train on preference pairs for `run.steps` steps of `pairs_per_step` pairs (the
    sequence repeated as epochs); returns (parameters, history). `run`: a linnet.run.Run,
    or its fields as keywords (a schedule goes in the optax optimizer: Run.schedule is
    PyTorch's). options: the fields of linnet.config.groups.DPOSettings (or `settings=`), as
    linnet.train.dpo.dpo takes them: pairs_per_step, beta, label_smoothing, loss_type
    (sigmoid, robust, hinge, ipo, and the reference-free simpo and orpo, for which no
    reference is computed or taken), simpo_gamma, rpo_alpha (the chosen answers' NLL, a
    mean over the step's chosen tokens, times alpha; orpo adds it at 1), reference_cache
    (a directory where the reference log-probabilities are kept across runs, in PyTorch's
    layout: either backend reads what the other wrote). KTO (loss_type="kto",
    desirable_weight, undesirable_weight) trains on unpaired answers: linnet.train.kto.kto,
    PyTorch's alone. Each Step's metrics hold TRL's rewards/chosen, rewards/rejected,
    rewards/margins, rewards/accuracies (share of pairs ranked right), logps/chosen,
    logps/rejected, and pairs. `mesh`, `remat` and `seed` (the adapters' dropout masks)
    work as for `linnet.jax.train.train` (a step's rows split over the devices, filled out
    with rows that learn nothing); the reference log-probabilities take no dropout."""
    run, s = run_and_options("dpo", run, options, DPOSettings, settings)
    if s.online:
        raise ValueError("dpo (JAX): online=True (pairs sampled each step) is not supported by the JAX backend yet; "
                         "use linnet.train.online_dpo.online_dpo (PyTorch), or pairs you have with online=False")
    mesh = check_mesh(mesh)
    if s.loss_type == "kto" or (s.desirable_weight, s.undesirable_weight) != (1.0, 1.0):
        raise ValueError("dpo (JAX): loss_type='kto', desirable_weight and undesirable_weight are KTO's, which "
                         "trains on unpaired answers: use linnet.train.kto.kto (the PyTorch backend's; JAX has no "
                         "KTO trainer yet)")
    if run.schedule is not None:  # linnet.jax.loop.fit refuses it too, but after the reference pass
        raise ValueError("dpo (JAX): Run.schedule is a PyTorch LR scheduler; give the optax optimizer a schedule "
                         "(e.g. optax.adamw(optax.warmup_cosine_decay_schedule(...)))")
    free = s.loss_type in REFERENCE_FREE
    if free and (reference is not None or s.reference_cache is not None):
        raise ValueError(f"dpo: loss_type={s.loss_type!r} is reference-free; pass no reference or reference_cache")
    pairs = list(pairs)
    check_pairs(pairs)
    fixed = None
    if not free:
        fixed = (cached_reference_log_probs(model, pairs, s.reference_cache, params=reference, tokens=tokens)
                 if s.reference_cache is not None else
                 reference_log_probs(model, pairs, params=reference, tokens=tokens))
    rate = model.lora_dropout
    objective = Objective(s.loss_type, s.beta, s.label_smoothing, s.simpo_gamma,
                          1.0 if s.loss_type == "orpo" else s.rpo_alpha)
    compiled = _make_step(model.card, model.dtype, model.lora_scale, run.optimizer, run.clip, objective, remat, rate)

    def step(number: int, chunk: list, state: State) -> Update:
        batch = [p for _, p in chunk]
        rows, where, real = _rows(batch, tokens, mesh)
        if rate:  # each row its own masks
            rows["lora_key"] = dropout_keys(seed, number, len(rows["weights"]))
        ref = None if fixed is None else fixed[[i for i, _ in chunk]].astype(np.float32)
        lengths = np.array([[len(p.chosen), len(p.rejected)] for p in batch], np.float32)
        with in_force(mesh):
            state.trained, state.opt_state, loss, norm, stats = compiled(
                state.trained, state.frozen, state.opt_state, place_rows(rows, mesh), where, ref, lengths)
        return Update(loss, norm, int(rows["weights"].sum()), real,
                      {"pairs": len(chunk), **{k: float(v) for k, v in stats.items()}})

    return fit(model, itertools.cycle(enumerate(pairs)), step, run, per_step=s.pairs_per_step, trainable=trainable,
               mesh=mesh, what="dpo: the pairs")
