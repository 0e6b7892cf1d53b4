"""Supervised training of the JAX decoder with an optax optimizer.

    params, history = train(model, pack(examples, tokens=4096), optimizer=optax.adamw(1e-5),
                            steps=1000, accumulate=8)

One compiled step takes `accumulate` packed rows as a lax.scan, sums their gradients,
divides by the step's count of learned positions (every learned token weighs the same,
whatever row it sits in), clips the global norm to `clip`, and applies the optimizer.
`trainable` picks the parameters that train (True, or glob patterns over paths): they are
kept in float32 and cast to the compute dtype on use; the others do not change.
"""

from __future__ import annotations

import fnmatch
import itertools
import time
from collections.abc import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from linnet.jax.lora import ADAPTERS, save_peft
from linnet.jax.model import JaxModel, Params, loss_packed, row_arrays, save_weights
from linnet.train.loop import History, Step


def split_trainable(params: Params, trainable: bool | str | Sequence[str]) -> tuple[Params, Params]:
    """(trained, frozen) by True or glob patterns; a pattern matching nothing is an error."""
    if trainable is True:
        return dict(params), {}
    patterns = [trainable] if isinstance(trainable, str) else list(trainable)
    chosen: set[str] = set()
    for pattern in patterns:
        hits = fnmatch.filter(params, pattern)
        if not hits:
            raise ValueError(f"trainable pattern {pattern!r} matches no parameter; paths look like "
                             f"{next(iter(params))!r}")
        chosen.update(hits)
    return {k: v for k, v in params.items() if k in chosen}, {k: v for k, v in params.items() if k not in chosen}


def _make_step(model: JaxModel, optimizer, clip: float | None):
    card, dtype, lora_scale = model.card, model.dtype, model.lora_scale

    def step(trained, frozen, opt_state, rows):
        learned = rows["weights"].sum()

        def micro(grads, row):
            loss, g = jax.value_and_grad(lambda t: loss_packed({**frozen, **t}, card, row, dtype, lora_scale)[0])(
                trained)
            return jax.tree.map(jnp.add, grads, g), loss

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), trained)
        grads, losses = jax.lax.scan(micro, zeros, rows)
        grads = jax.tree.map(lambda g: g / learned, grads)
        norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)))
        if clip is not None:
            scale = jnp.minimum(1.0, clip / (norm + 1e-6))
            grads = jax.tree.map(lambda g: g * scale, grads)
        updates, opt_state = optimizer.update(grads, opt_state, trained)
        trained = jax.tree.map(lambda p, u: p + u.astype(p.dtype), trained, updates)
        return trained, opt_state, losses.sum() / learned, norm

    return jax.jit(step, donate_argnums=(0, 2))


def _learning_rate(opt_state) -> float:
    """The rate the step used, when the optimizer exposes it (optax.inject_hyperparams); else NaN."""
    hyper = getattr(opt_state, "hyperparams", None)
    return float(hyper["learning_rate"]) if hyper and "learning_rate" in hyper else float("nan")


def train(model: JaxModel, batches: Iterable, *, optimizer, steps: int, accumulate: int = 1,
          clip: float | None = 1.0, trainable: bool | str | Sequence[str] | None = None,
          save_to=None, on_step: Callable[[Step], None] | None = None) -> tuple[Params, History]:
    """Train for `steps` optimizer steps of `accumulate` packed rows each (see the
    module docstring); returns (the parameters, path -> array; the history). Stops
    early when the batches run out. trainable: default every parameter, or the adapters
    alone after add_lora. `save_to` writes the result: the weights as safetensors, or
    the adapters as a PEFT directory."""
    if accumulate < 1 or steps < 0:
        raise ValueError("train: accumulate must be >= 1 and steps >= 0")
    if trainable is None:
        trainable = list(ADAPTERS) if model.lora else True
    trained, frozen = split_trainable(model.params, trainable)
    # copies: each step donates its input buffers, and the model's own arrays must survive
    trained = {k: jnp.array(v, jnp.float32, copy=True) for k, v in trained.items()}
    opt_state = optimizer.init(trained)
    step_fn = _make_step(model, optimizer, clip)
    history = History()
    stream = iter(batches)
    for step in range(1, steps + 1):
        chunk = list(itertools.islice(stream, accumulate))
        if len(chunk) < accumulate:
            break
        t0 = time.perf_counter()
        arrays = [row_arrays(b) for b in chunk]
        rows = {k: np.stack([a[k] for a in arrays]) for k in arrays[0]}
        learned = float(rows["weights"].sum())
        if learned == 0:
            raise ValueError(f"step {step}: its {accumulate} batches hold no learned position")
        trained, opt_state, loss, norm = step_fn(trained, frozen, opt_state, rows)
        loss, norm = float(loss), float(norm)
        if not (np.isfinite(loss) and np.isfinite(norm)):
            raise FloatingPointError(f"step {step}: loss {loss} and gradient norm {norm}; lower the learning "
                                     "rate or check the data")
        record = Step(step, loss, int(learned), int(sum(b.real for b in chunk)), norm, _learning_rate(opt_state),
                      time.perf_counter() - t0)
        history.steps.append(record)
        if on_step is not None:
            on_step(record)
    params = {**frozen, **trained}
    if save_to is not None and model.lora:
        save_peft(model, save_to, params)
    elif save_to is not None:
        save_weights(model.card, params, save_to)
    return params, history
