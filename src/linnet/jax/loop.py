"""The step loop every JAX trainer shares (train, dpo, grpo), as `linnet.train.loop` is
PyTorch's: the trained parameters split from the frozen ones and placed (over a mesh,
in parts), resume from a checkpoint, each step's compiled update, the Step report, the
non-finite stop, checkpoints, and the result saved. An objective supplies a compiled
step and what it reports (`Update`); clipping and the optimizer are `apply_gradients`,
the end of every compiled step.
"""

from __future__ import annotations

import fnmatch
import json
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from linnet.files import checkpoints as layout
from linnet.files.adapters import ADAPTERS, MAGNITUDES
from linnet.jax.lora import Params
from linnet.jax.model import JaxModel, save_peft, save_weights
from linnet.jax.sharding import place, place_like, row_axis, rows_shardings
from linnet.paths import select
from linnet.run import History, Preempted, Run, Step, due, step_items, stop_asked


@dataclass
class State:
    """The parameters that train (float32), the frozen ones, and the optimizer's state;
    an objective's step replaces `trained` and `opt_state`."""

    trained: Params
    frozen: Params
    opt_state: Any

    @property
    def params(self) -> Params:
        return {**self.frozen, **self.trained}


@dataclass
class Update:
    """What a step reports: its loss and gradient norm (arrays or floats), every learned
    and real position it trained on, and its metrics."""

    loss: Any
    norm: Any
    learned: int
    real: int
    metrics: dict[str, float] = field(default_factory=dict)


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
    """Stacked rows [R, ...] split over the mesh's (data) devices, filled out to a multiple
    of their count with all-zero rows (which learn nothing); as they are without a mesh."""
    if mesh is None:
        return rows
    missing = -len(rows["weights"]) % mesh.shape[row_axis(mesh)]
    rows = {k: np.concatenate([v, np.zeros((missing, *v.shape[1:]), v.dtype)]) for k, v in rows.items()}
    return jax.device_put(rows, rows_shardings(rows, mesh))


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


def fit(model: JaxModel, items: Iterable, step: Callable[[int, list, State], Update | None], run: Run, *,
        per_step: int, trainable=None, mesh=None, what: str = "the items") -> tuple[Params, History]:
    """Train for `run.steps` steps of `per_step` items: `step(number, items, state)` runs
    one compiled update and says what it did (None: the items ran short of a whole step,
    which ends the run with a warning). A non-finite loss or norm stops the run; resumes
    from `run.checkpoint`'s latest checkpoint and writes one every `checkpoint_every`
    steps and at the end; `run.evaluate(params)` adds held-out metrics when due;
    `run.save_to` writes the result. The schedule lives in the optax optimizer."""
    if run.schedule is not None:
        raise ValueError("JAX: Run.schedule is PyTorch's; give the optax optimizer a schedule (e.g. "
                         "optax.adamw(optax.warmup_cosine_decay_schedule(...)))")
    trained, frozen, opt_state, start = start_run(model, run.optimizer, trainable, run.checkpoint, mesh)
    state = State(trained, frozen, opt_state)
    history = History()
    saved = start
    for number, chunk, last in step_items(items, per_step, start=start, steps=run.steps, what=what):
        started = time.perf_counter()
        done = step(number, chunk, state)
        if done is None:
            warnings.warn(f"{what} ran out during step {number} of {run.steps}", stacklevel=2)
            if run.checkpoint is not None and saved < number - 1:  # the run's end is the step before
                save_checkpoint(run.checkpoint, number - 1, state.trained, state.opt_state, keep=run.keep)
            break
        record = Step(number, float(done.loss), int(done.learned), int(done.real), float(done.norm),
                      learning_rate(state.opt_state), time.perf_counter() - started, done.metrics)
        if not (np.isfinite(record.loss) and np.isfinite(record.grad_norm)):
            raise FloatingPointError(f"step {number}: loss {record.loss} and gradient norm {record.grad_norm}; "
                                     "lower the learning rate or check the data")
        if run.evaluate is not None and due(number, run.evaluate_every, last):
            record.metrics.update(run.evaluate(state.params))
        history.steps.append(record)
        if run.on_step is not None:
            run.on_step(record)
        stop = number < run.steps and bool(stop_asked())  # one process: no agreement to reach
        if run.checkpoint is not None and (stop or due(number, run.checkpoint_every, last)):
            save_checkpoint(run.checkpoint, number, state.trained, state.opt_state, keep=run.keep)
            saved = number
        if stop:
            raise Preempted(number, run.checkpoint)
    return finish(model, state.trained, state.frozen, run.save_to), history


def start_run(model: JaxModel, optimizer, trainable, checkpoint, mesh=None):
    """(trained, frozen, optimizer state, step to start from): the parameters split by
    `trainable` (default all, or the adapters after add_lora), trained ones as float32
    copies (each step donates its buffers; the model's arrays must survive), placed in
    parts over `mesh` (`linnet.jax.sharding`), and resumed from `checkpoint` when it holds one."""
    if trainable is None:  # the adapters (DoRA's magnitudes too, when there are any) or everything
        trainable = [p for p in [*ADAPTERS, MAGNITUDES] if fnmatch.filter(model.params, p)] if model.lora else True
    chosen = select(list(model.params), trainable, what="trainable")
    trained = {k: v for k, v in model.params.items() if k in chosen}
    frozen = {k: v for k, v in model.params.items() if k not in chosen}
    trained = {k: jnp.array(v, jnp.float32, copy=True) for k, v in trained.items()}
    head_dim = model.card.head_dim
    if mesh is not None:
        trained, frozen = place(trained, mesh, head_dim), place(frozen, mesh, head_dim)
    opt_state = optimizer.init(trained)
    if mesh is not None:  # its scalars too (a step count): placed as the step returns them, or step 2 compiles again
        opt_state = place_like(opt_state, trained, mesh, head_dim)
    start = 0
    if checkpoint is not None:
        start, trained, opt_state = load_checkpoint(checkpoint, trained, opt_state)
    return trained, frozen, opt_state, start


def finish(model: JaxModel, trained: Params, frozen: Params, save_to) -> Params:
    """All the parameters, written to `save_to` when given (adapters as PEFT after add_lora)."""
    params = {**frozen, **trained}
    if save_to is not None and model.lora:
        save_peft(model, save_to, params)
    elif save_to is not None:
        save_weights(params, save_to, model.card)
    return params
