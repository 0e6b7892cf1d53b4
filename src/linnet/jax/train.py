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
import functools
import json
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from linnet.adapter_files import ADAPTERS, MAGNITUDES
from linnet.jax.lora import save_peft
from linnet.jax.model import JaxModel, Params, loss_packed, row_arrays, save_weights
from linnet.paths import select
from linnet import checkpoint_layout as layout
from linnet.history import History, Step, step_items


@functools.lru_cache(maxsize=8)
def _make_step(card, dtype, lora_scale: float, optimizer, clip: float | None, remat: bool):
    """The compiled step, cached: another run with the same model and optimizer object
    (a resumed one) does not compile again."""

    def rows_loss(trained, frozen, rows):
        """Summed loss of [n, P] rows (one a device over a mesh: GSPMD splits the vmap)."""
        losses, _ = jax.vmap(loss_packed, in_axes=(None, None, 0, None, None, None))(
            {**frozen, **trained}, card, rows, dtype, lora_scale, remat)
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


def apply_gradients(grads: Params, trained: Params, opt_state, optimizer, clip: float | None):
    """(trained, optimizer state, global gradient norm) after clipping the norm to `clip`
    and applying the optimizer: the end of every JAX trainer's compiled step."""
    norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)))
    if clip is not None:
        scale = jnp.minimum(1.0, clip / (norm + 1e-6))
        grads = jax.tree.map(lambda g: g * scale, grads)
    updates, opt_state = optimizer.update(grads, opt_state, trained)
    return jax.tree.map(lambda p, u: p + u.astype(p.dtype), trained, updates), opt_state, norm


def place_rows(rows: dict[str, np.ndarray], mesh) -> dict:
    """Stacked rows [R, ...] split over the mesh's devices, filled out to a multiple of
    the device count with all-zero rows (which learn nothing); as they are without a mesh."""
    if mesh is None:
        return rows
    from jax.sharding import NamedSharding, PartitionSpec

    devices = mesh.shape[mesh.axis_names[0]]
    missing = -len(rows["weights"]) % devices
    rows = {k: np.concatenate([v, np.zeros((missing, *v.shape[1:]), v.dtype)]) for k, v in rows.items()}
    return jax.device_put(rows, NamedSharding(mesh, PartitionSpec(mesh.axis_names[0])))


def _part(x, mesh):
    """A NamedSharding splitting `x` along its largest axis the mesh's device count
    divides (FSDP); whole on every device when none does."""
    from jax.sharding import NamedSharding, PartitionSpec

    axis = mesh.axis_names[0]
    for d in sorted(range(x.ndim), key=lambda d: -x.shape[d]):
        if x.shape[d] % mesh.shape[axis] == 0:
            return NamedSharding(mesh, PartitionSpec(*[axis if i == d else None for i in range(x.ndim)]))
    return NamedSharding(mesh, PartitionSpec())


def learning_rate(opt_state) -> float:
    """The rate the step used, when the optimizer exposes it (optax.inject_hyperparams); else NaN."""
    hyper = getattr(opt_state, "hyperparams", None)
    return float(hyper["learning_rate"]) if hyper and "learning_rate" in hyper else float("nan")


def save_checkpoint(directory, step: int, trained: Params, opt_state, *, keep: int = 2) -> Path:
    """A checkpoint in the layout PyTorch's trainers use (atomic, checksummed, the `keep`
    latest kept): trained.safetensors, optimizer.npz (the optax state's leaves in tree
    order) and state.json (the step)."""
    from safetensors.numpy import save_file

    def write(tmp: Path) -> None:
        save_file({k: np.asarray(v, np.float32) for k, v in trained.items()}, str(tmp / "trained.safetensors"))
        np.savez(tmp / "optimizer.npz", **{f"{i:05d}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(opt_state))})
        (tmp / "state.json").write_text(json.dumps({"step": step}) + "\n")

    return layout.publish(directory, step, write, keep=keep)


def load_checkpoint(directory, trained: Params, opt_state) -> tuple[int, Params, Any]:
    """(step, trained parameters, optimizer state) from the latest checkpoint in
    `directory`, shaped and placed like the fresh `trained` and `opt_state`; (0, them)
    when there is none."""
    from safetensors.numpy import load_file

    path = layout.find_checkpoint(directory)
    if path is None:
        return 0, trained, opt_state
    layout.verify(path)
    if not (path / "state.json").is_file():
        raise ValueError(f"{path}: a PyTorch trainer's checkpoint; the JAX trainers resume from their own (state.json)")
    state = json.loads((path / "state.json").read_text())
    tensors = load_file(str(path / "trained.safetensors"))
    layout.same_names(path, tensors, trained)
    leaves, tree = jax.tree.flatten(opt_state)
    with np.load(path / "optimizer.npz") as saved:
        loaded = [saved[f"{i:05d}"] for i in range(len(saved.files))]
    if [np.shape(x) for x in loaded] != [np.shape(x) for x in leaves]:
        raise ValueError(f"{path / 'optimizer.npz'}: its state does not fit this optimizer; resume with the "
                         "optimizer the run used")
    def like(x, y):  # placed (and split over a mesh) as the fresh value is
        return jax.device_put(jnp.asarray(x, y.dtype), y.sharding) if isinstance(y, jax.Array) else x

    restored = jax.tree.unflatten(tree, [like(x, y) for x, y in zip(loaded, leaves)])
    return state["step"], {k: like(tensors[k], v) for k, v in trained.items()}, restored


def train(model: JaxModel, batches: Iterable, *, optimizer, steps: int, accumulate: int = 1,
          clip: float | None = 1.0, trainable: bool | str | Sequence[str] | None = None,
          save_to=None, checkpoint=None, checkpoint_every: int = 100, keep: int = 2, mesh=None, remat: bool = False,
          evaluate: Callable[[Params], dict] | None = None, evaluate_every: int = 50,
          on_step: Callable[[Step], None] | None = None) -> tuple[Params, History]:
    """Train for `steps` optimizer steps of `accumulate` packed rows each (see the
    module docstring); returns (the parameters, path -> array; the history). Stops
    early, with a warning, when the batches run out. trainable: default every
    parameter, or the adapters alone after add_lora. With `checkpoint`, resume from the
    latest checkpoint there (skipping the batches its steps took) and write one every
    `checkpoint_every` steps and at the end, keeping `keep`. `save_to` writes the
    result: the weights as safetensors, or the adapters as a PEFT directory.

    mesh: a one-axis `jax.sharding.Mesh` for data-parallel, fully sharded training: every
    accumulated micro-step takes one row a device, and every parameter, its gradient and
    optimizer state are split along the largest axis the device count divides.
    remat: recompute each layer in backward (see `linnet.jax.model.hidden`).
    evaluate: params -> metrics, every `evaluate_every` steps and at the last, added to
    the step's metrics before `on_step` sees it."""
    if accumulate < 1 or steps < 0 or checkpoint_every < 1:
        raise ValueError("train: accumulate and checkpoint_every must be >= 1 and steps >= 0")
    trained, frozen, opt_state, start = start_run(model, optimizer, trainable, checkpoint, mesh)
    per_micro, row_sharding = 1, None
    if mesh is not None:
        from jax.sharding import NamedSharding, PartitionSpec

        per_micro = mesh.shape[mesh.axis_names[0]]
        row_sharding = NamedSharding(mesh, PartitionSpec(None, mesh.axis_names[0]))
    step_fn = _make_step(model.card, model.dtype, model.lora_scale, optimizer, clip, remat)
    history = History()
    per_step = accumulate * per_micro
    for step, chunk in step_items(batches, per_step, start=start, steps=steps, what="train: the batches"):
        if len(chunk) < per_step:
            warnings.warn(f"train: the batches ran out during step {step} of {steps}", stacklevel=2)
            break
        t0 = time.perf_counter()
        arrays = [row_arrays(b) for b in chunk]
        rows = {k: np.stack([a[k] for a in arrays]).reshape(accumulate, per_micro, -1) for k in arrays[0]}
        learned = float(rows["weights"].sum())
        if row_sharding is not None:
            rows = jax.device_put(rows, row_sharding)
        if learned == 0:
            raise ValueError(f"step {step}: its {accumulate} batches hold no learned position")
        trained, opt_state, loss, norm = step_fn(trained, frozen, opt_state, rows)
        record = Step(step, float(loss), int(learned), int(sum(b.real for b in chunk)), float(norm),
                      learning_rate(opt_state), time.perf_counter() - t0)
        if evaluate is not None and (step % evaluate_every == 0 or step == steps):
            record.metrics.update(evaluate({**frozen, **trained}))
        end_step(record, history, on_step, trained, opt_state, steps=steps, checkpoint=checkpoint,
                 checkpoint_every=checkpoint_every, keep=keep)
    return finish(model, trained, frozen, save_to), history


def start_run(model: JaxModel, optimizer, trainable, checkpoint, mesh=None):
    """(trained, frozen, optimizer state, step to start from): the parameters split by
    `trainable` (default all, or the adapters after add_lora), trained ones as float32
    copies (each step donates its buffers; the model's arrays must survive), placed in
    parts over `mesh`, and resumed from `checkpoint` when it holds one."""
    if trainable is None:  # the adapters (DoRA's magnitudes too, when there are any) or everything
        trainable = [p for p in [*ADAPTERS, MAGNITUDES] if fnmatch.filter(model.params, p)] if model.lora else True
    chosen = select(list(model.params), trainable, what="trainable")
    trained = {k: v for k, v in model.params.items() if k in chosen}
    frozen = {k: v for k, v in model.params.items() if k not in chosen}
    trained = {k: jnp.array(v, jnp.float32, copy=True) for k, v in trained.items()}
    if mesh is not None:
        trained = {k: jax.device_put(v, _part(v, mesh)) for k, v in trained.items()}
        frozen = {k: jax.device_put(v, _part(v, mesh)) for k, v in frozen.items()}
    opt_state = optimizer.init(trained)
    start = 0
    if checkpoint is not None:
        start, trained, opt_state = load_checkpoint(checkpoint, trained, opt_state)
    return trained, frozen, opt_state, start


def end_step(record: Step, history: History, on_step, trained: Params, opt_state, *, steps: int, checkpoint,
             checkpoint_every: int, keep: int) -> None:
    """Refuse a non-finite step, keep and report it, and checkpoint when due."""
    if not (np.isfinite(record.loss) and np.isfinite(record.grad_norm)):
        raise FloatingPointError(f"step {record.step}: loss {record.loss} and gradient norm {record.grad_norm}; "
                                 "lower the learning rate or check the data")
    history.steps.append(record)
    if on_step is not None:
        on_step(record)
    if checkpoint is not None and (record.step % checkpoint_every == 0 or record.step == steps):
        save_checkpoint(checkpoint, record.step, trained, opt_state, keep=keep)


def finish(model: JaxModel, trained: Params, frozen: Params, save_to) -> Params:
    """All the parameters, written to `save_to` when given (adapters as PEFT after add_lora)."""
    params = {**frozen, **trained}
    if save_to is not None and model.lora:
        save_peft(model, save_to, params)
    elif save_to is not None:
        save_weights(params, save_to, model.card)
    return params
