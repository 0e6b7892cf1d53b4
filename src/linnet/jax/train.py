"""Supervised training of the JAX decoder with an optax optimizer.

    params, history = train(model, pack(examples, tokens=4096), optimizer=optax.adamw(1e-5),
                            steps=1000, accumulate=8)

One compiled step takes `accumulate` packed rows as a lax.scan, sums their gradients,
divides by the step's count of learned positions (every learned token weighs the same,
whatever row it sits in), clips the global norm to `clip`, and applies the optimizer.
`trainable` picks the parameters that train (True, or glob patterns over paths): they are
kept in float32 and cast to the compute dtype on use; the others do not change. The loop
around the step is `linnet.jax.loop.fit`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from linnet.jax.loop import State, Update, apply_gradients, fit
from linnet.jax.lora import Params, dropout_keys
from linnet.jax.model import JaxModel, loss_packed, row_arrays
from linnet.jax.sharding import check_mesh, context_rows, in_force, row_axis, rows_shardings
from linnet.run import History, Run, run_and_options


@functools.lru_cache(maxsize=8)
def _make_step(card, dtype, lora_scale: float, optimizer, clip: float | None, remat: bool, lora_dropout: float):
    """The compiled step, cached: another run with the same model and optimizer object
    (a resumed one) does not compile again."""

    def rows_loss(trained, frozen, rows):
        """Summed loss of [n, P] rows (one a device over a mesh: GSPMD splits the vmap)."""
        losses, _ = jax.vmap(loss_packed, in_axes=(None, None, 0, None, None, None, None, None))(
            {**frozen, **trained}, card, rows, dtype, lora_scale, remat, 1024, lora_dropout)
        return losses.sum()

    def step(trained, frozen, opt_state, rows):
        learned = rows["weights"].sum()

        def micro(grads, micro_rows):
            loss, g = jax.value_and_grad(rows_loss)(trained, frozen, micro_rows)
            return jax.tree.map(jnp.add, grads, g), loss

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), trained)
        grads, losses = jax.lax.scan(micro, zeros, rows)
        trained, opt_state, norm = apply_gradients(jax.tree.map(lambda g: g / learned, grads), trained, opt_state,
                                                   optimizer, clip)
        return trained, opt_state, losses.sum() / learned, norm

    return jax.jit(step, donate_argnums=(0, 2))


def train(model: JaxModel, batches: Iterable, run: Run | None = None, *, accumulate: int = 1,
          trainable: bool | str | Sequence[str] | None = None, mesh=None, remat: bool = False, seed: int = 0,
          **options) -> tuple[Params, History]:
    """Train for `run.steps` optimizer steps of `accumulate` packed rows each (see the
    module docstring); returns (the parameters, path -> array; the history). Stops
    early, with a warning, when the batches run out. `run`: a linnet.run.Run, or its
    fields as keywords (optimizer= an optax optimizer, steps=, clip=, save_to=,
    checkpoint=, ...; evaluate(params) -> metrics). trainable: default every parameter,
    or the adapters alone after add_lora. With `checkpoint`, resume from the latest
    checkpoint there (skipping the batches its steps took). `save_to` writes the
    result: the weights as safetensors, or the adapters as a PEFT directory.

    mesh: a `jax.sharding.Mesh` (`linnet.jax.sharding`). One axis: data-parallel, fully
    sharded training: every accumulated micro-step takes one row a device, and every
    parameter, its gradient and optimizer state are split along the largest axis the device
    count divides. Two, ("data", "model"): a micro-step takes one row a "data" index, and
    the weights are split tensor-parallel over "model" and fully sharded over "data". A
    "context" axis beside "data" (and "model") splits each row's positions over its
    devices, attention going round them as a ring (linnet.jax.attention.ring); a row must
    cut into 2 x its size equal chunks.
    remat: recompute each layer in backward (see `linnet.jax.model.hidden`).
    seed: the adapters' dropout masks
    (add_lora(dropout=)), drawn a row at a time from (seed, step, row), so a resumed run
    draws what an uninterrupted one does."""
    run, _ = run_and_options("train", run, options)
    if accumulate < 1:
        raise ValueError(f"train: accumulate={accumulate}; it must be >= 1")
    mesh = check_mesh(mesh)
    per_micro = 1 if mesh is None else mesh.shape[row_axis(mesh)]
    rate = model.lora_dropout
    compiled = _make_step(model.card, model.dtype, model.lora_scale, run.optimizer, run.clip, remat, rate)

    def step(number: int, chunk: list, state: State) -> Update | None:
        if len(chunk) < accumulate * per_micro:
            return None
        arrays = [context_rows(row_arrays(b), mesh) for b in chunk]
        for a, key in zip(arrays, dropout_keys(seed, number, len(arrays)) if rate else []):
            a["lora_key"] = key  # each row its own masks
        rows = {k: np.stack([a[k] for a in arrays]).reshape(accumulate, per_micro, -1) for k in arrays[0]}
        learned = float(rows["weights"].sum())
        if mesh is not None:
            rows = jax.device_put(rows, rows_shardings(rows, mesh, dim=1))
        if learned == 0:
            raise ValueError(f"step {number}: its {accumulate} batches hold no learned position")
        with in_force(mesh):
            state.trained, state.opt_state, loss, norm = compiled(state.trained, state.frozen, state.opt_state, rows)
        return Update(loss, norm, int(learned), int(sum(b.real for b in chunk)))

    return fit(model, batches, step, run, per_step=accumulate * per_micro, trainable=trainable, mesh=mesh,
               what="train: the batches")
