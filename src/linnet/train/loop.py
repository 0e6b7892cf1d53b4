"""The step every PyTorch trainer takes, and `train`, which runs the model's
`loss_packed` entry (SFT; the pretraining runner takes the same step).

    history = train(model, pack(examples, tokens=4096), optimizer=opt, steps=1000,
                    accumulate=8, schedule=cosine_schedule(opt, 100, 1000), save_to="run/")

A step, whatever the objective (`take_step`): each micro-batch's summed loss is divided by
the step's normaliser (the count of learned positions of every micro-batch of every
process, for SFT; the step's pairs, for DPO; ...) before backward, so every learned token
weighs the same whatever batch it sits in; then the gradients are summed across processes,
clipped, applied, and the schedule steps; a non-finite loss or norm stops the run before
the weights change. An objective supplies only what differs, as a `Work`: its
micro-batches, the summed loss (and statistics) of one, and the normaliser. `fit` runs the
steps of a `linnet.run.Run`: resume, cut the items into steps, evaluate, report each
`Step`, checkpoint, save the result. Adding an objective is a loss function and a `Work`
(see linnet.train.dpo, linnet.train.grpo).
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from linnet.files import checkpoints as layout
from linnet.paths import CRITIC
from linnet.run import History, Preempted, Run, Step, due, run_and_options, step_items, stop_asked
from linnet.torch.distributed import (
    clip_gradients,
    idle_passes,
    matched,
    most_across,
    passes_short,
    reduce_gradients,
    sum_across,
    world,
)
from linnet.torch.moe import balancing, router_metrics
from linnet.torch.stages import HiddenAt
from linnet.train.checkpoint import load_checkpoint, save_checkpoint


@dataclass
class Work:
    """What one step trains on, as an objective prepares it.

    batches     this process's micro-batches (a sequence when iterations > 1; a
                generator is read once, as the batches are needed)
    loss        (index, batch) -> (its summed loss, a tensor; its summed statistics,
                a dict of floats named in `stats`); called once a batch and iteration
    count       the step's normaliser over every process (learned positions, pairs …)
    learned     this process's learned positions; real: its non-padding positions
    stats       the statistics' names (every process sums each, 0 with no batches)
    metrics     those statistics summed over every process -> what the Step reports
    idle        called after the batches: the passes a sharded model still owes
                (linnet.torch.distributed.passes_short); by default, for a sequence of
                batches, `fit` makes them with the objective's own loss times zero
    iterations  optimizer steps on the same batches (GRPO reuses its samples)
    group       the processes to sum over (a split or pipelined model's copies); None: every one
    pipe        a pipelined model's stage (linnet.torch.stages), which `fit` takes from
                the model: its schedule runs every batch's forward and backward at once, in
                place of `loss` and of idle passes, and the gradient's norm adds every
                stage's squares
    head        for a pipelined model, the objective's loss from a batch's log-probabilities
                (index, batch, log_probs) -> as `loss`, on the last stage, or a
                linnet.torch.stages.HiddenAt (from hidden states); None: loss_packed's
    """

    batches: Iterable[Any]
    loss: Callable[[int, Any], tuple[torch.Tensor, dict[str, float]]]
    count: float
    learned: float
    real: float
    stats: Sequence[str] = ()
    metrics: Callable[[dict[str, float]], dict[str, float]] | None = None
    idle: Callable[[], None] | None = None
    iterations: int = 1
    group: Any = None
    pipe: Any = None
    head: Any = None


def start_runtime(seed: int, *, threads: int | None = None, deterministic: bool = False) -> None:
    """A run's threads, determinism and the seeds of every generator it draws from
    (torch, NumPy's and Python's global ones)."""
    if threads:
        torch.set_num_threads(threads)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def copies_of(model):
    """The processes whose sums make a step of `model` (None: every process): a split or
    pipelined model's copies, each copy's processes taking the same batches."""
    return getattr(model, "copies", None)


def trained_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("nothing to train: load the model with trainable=True (or patterns), or add_lora")
    return params


def save_trained(model, path: str | os.PathLike) -> None:
    """The run's result: the adapters alone (PEFT format) after add_lora, else the
    whole model's weights (gathered from every process when sharded or split); a PPO
    critic beside them, as critic.safetensors. The first process writes."""
    if not getattr(model, "lora", None):
        model.save_weights(path)
    else:
        from linnet.torch.lora import save_peft

        save_peft(model, path)
    critic = [f"{part}*" for part in CRITIC if hasattr(model, part.rstrip("."))]
    if critic:
        model.save_weights(os.path.join(path, "critic.safetensors"), include=critic, names="linnet",
                           dtype=torch.float32)


def optimizer_step(params, run: Run, loss: float, step: int, group=None, stages=None) -> tuple[float, float]:
    """Reduce (over `group`, default every process), clip (the norm over `stages` too, a
    pipeline's processes holding other parameters) and apply the gradients with the run's
    optimizer and schedule; returns (grad norm, lr used). A non-finite loss or norm stops
    the run before the weights change."""
    optimizer = run.optimizer
    reduce_gradients(params, group)
    norm = float(clip_gradients(params, run.clip, across=stages))
    lr = optimizer.param_groups[0]["lr"]
    if not (math.isfinite(loss) and math.isfinite(norm)):
        optimizer.zero_grad(set_to_none=True)
        found = None if run.checkpoint is None else layout.find_checkpoint(run.checkpoint)
        kept = f"; the last good checkpoint, {found}, is intact" if found is not None else \
            "; no checkpoint was written before it" if run.checkpoint is not None else ""
        raise FloatingPointError(
            f"step {step}: loss {loss} and gradient norm {norm}; training stopped before "
            f"the update{kept}. Lower the learning rate or check the data"
        )
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if run.schedule is not None:
        run.schedule.step()
    return norm, lr


def take_step(params: Sequence[torch.nn.Parameter], work: Work, run: Run, step: int,
              started: float | None = None) -> Step:
    """Accumulate `work`'s micro-batches, then reduce, clip, step and schedule (see the
    module docstring), `work.iterations` times; the Step reports the last iteration's
    loss and statistics, its norm, and the first iteration's learning rate."""
    started = time.perf_counter() if started is None else started
    norms, rates = [], []
    for _ in range(work.iterations):
        total: Any = 0.0
        stats = dict.fromkeys(work.stats, 0.0)
        if work.pipe is not None:  # the stages' schedule runs every batch's forward and backward
            total, summed = work.pipe.run(work.batches, work.count, work.head, work.stats)
            stats = dict(zip(work.stats, summed))
        else:
            for index, batch in enumerate(work.batches):
                loss_sum, batch_stats = work.loss(index, batch)
                (loss_sum / work.count).backward()
                total = total + loss_sum.detach()
                for name, value in batch_stats.items():
                    stats[name] += value
        if work.idle is not None:
            work.idle()
        # the iteration's one host sync
        loss_all, learned, real, *summed = sum_across([float(total), work.learned, work.real, *stats.values()],
                                                      work.group)
        loss = loss_all / work.count
        norm, lr = optimizer_step(params, run, loss, step, group=work.group,
                                  stages=None if work.pipe is None else work.pipe.group)
        norms.append(norm)
        rates.append(lr)
    metrics = work.metrics(dict(zip(stats, summed))) if work.metrics is not None else {}
    return Step(step, loss, int(learned), int(real), norms[-1], rates[0], time.perf_counter() - started, metrics)


def resume(run: Run, model) -> tuple[int, dict]:
    """The step to start from (the latest checkpoint's, or 0) and the checkpoint's extras."""
    if run.checkpoint is None:
        return 0, {}
    state = load_checkpoint(run.checkpoint, model=model, optimizer=run.optimizer, schedule=run.schedule)
    return (0, {}) if state is None else (state["step"], state["extra"])


def fit(model, items: Iterable[Any], work: Callable[[int, list], Work], run: Run, *, per_step: int,
        what: str = "the items", start: int | None = None, carry=None) -> History:
    """Train for `run.steps` steps of `per_step` items each: `work(step, items)` makes each
    step's Work (sampling, scoring and packing happen there), `take_step` trains on it.
    Resumes from `run.checkpoint`'s latest checkpoint (skipping the items its steps took),
    adds `run.evaluate(model)`'s held-out metrics when due, calls `run.on_step`, writes
    checkpoints, and saves the result to `run.save_to`. `start`: the step a caller that
    restored its own state resumes after (the pretraining runner). `carry`: what the work
    keeps across steps beyond the model (GRPO's samples drawn ahead): its `state(step)`
    goes into each checkpoint and `restore(extra)` takes it back. Stops early, with a
    warning, when the items run out."""
    params = trained_parameters(model)
    if start is None:
        start, extra = resume(run, model)
        if carry is not None:
            carry.restore(extra)
    history = History()
    for step, chunk, last in step_items(items, per_step, start=start, steps=run.steps, what=what):
        started = time.perf_counter()
        model.train()
        record = take_step(params, _matched(model, _balanced(model, work(step, chunk))), run, step, started)
        record.metrics.update(router_metrics(model))  # a mixture of experts' balance ({} for other models)
        if run.evaluate is not None and due(step, run.evaluate_every, last):
            record.metrics.update(run.evaluate(model))
        history.steps.append(record)
        if run.on_step is not None:
            run.on_step(record)
        saved = run.checkpoint is not None and due(step, run.checkpoint_every, last)
        stop = step < run.steps and _stop_agreed()
        if run.checkpoint is not None and (saved or stop):
            save_checkpoint(run.checkpoint, model=model, optimizer=run.optimizer, step=step, schedule=run.schedule,
                            keep=run.keep, extra=None if carry is None else carry.state(step))
        if stop:
            raise Preempted(step, run.checkpoint)
    if run.save_to is not None:
        save_trained(model, run.save_to)
    return history


def _stop_agreed() -> bool:
    """A stop asked for on any process (SIGTERM reaches them at different moments): every
    process stops after the same step. One collective a step, only while a command listens."""
    asked = stop_asked()
    return asked is not None and bool(most_across(int(asked)))


def head_loss(model, head) -> Callable[[int, Any], tuple[torch.Tensor, dict[str, float]]]:
    """An objective's per-batch loss (Work.loss) from its last-stage `head` (Work.head), for
    a model in one piece: the head of the batch's log-probabilities, or of its final hidden
    states at a HiddenAt's positions."""
    if isinstance(head, HiddenAt):
        return lambda index, batch: head.head(index, batch, model.hidden_packed(batch, at=head.positions(batch)))
    return lambda index, batch: head(index, batch, model.log_probs_packed(batch))


@torch.no_grad()
def head_values(model, rows: Sequence, head, sizes: Sequence[int]) -> list[torch.Tensor]:
    """Forward only: what `head` (as Work.head) returns for each row, `sizes[i]` values for
    row i, float64 on the CPU: through a pipelined model's stages (Pipe.values, every stage
    getting the last's), else row by row (a sharded model's idle passes after)."""
    if getattr(model, "pipe", None) is not None:
        return [v.cpu() for v in model.pipe.values(rows, head, sizes)]
    values = head_loss(model, head)
    return [values(i, row).double().cpu() for i, row in enumerate(matched(rows, model))]


def _matched(model, work: Work) -> Work:
    """`work` as `model` runs it: through a pipelined model's stages (`Work.pipe`), else with
    the idle passes that bring this process to the busiest process's count of passes, when
    the model is sharded (every forward and backward a collective) and the objective names
    none: its own loss on its first batch, times zero (the same entries and gradients as a
    real pass), or a short row with no batch at all."""
    if getattr(model, "pipe", None) is not None:
        return dataclasses.replace(work, pipe=model.pipe, idle=None)
    if work.idle is not None or not isinstance(work.batches, Sequence):
        return work
    short = passes_short(len(work.batches), model)

    def idle():
        for _ in range(short):
            if work.batches:
                (work.loss(0, work.batches[0])[0] * 0).backward()
            else:
                idle_passes(1, model)

    return dataclasses.replace(work, idle=idle)


def _balanced(model, work: Work) -> Work:
    """`work` with a mixture of experts' load-balancing loss (linnet.torch.moe.balancing)
    added to each micro-batch's summed loss, pooled over the micro-batch's forward passes
    and weighted by its share of this process's positions, every process alike (each of a
    context group's routes its own positions): the step's loss is the objective's plus the
    card's coefficient times that mean, whatever the objective, the accumulation or the
    count of processes."""
    experts = getattr(getattr(model, "card", None), "experts", None)
    if experts is None or not experts.aux_loss or not work.real:
        return work
    scale = work.count / (work.real * world()[1])

    def loss(index: int, batch) -> tuple[torch.Tensor, dict[str, float]]:
        with balancing(model) as aux:
            loss_sum, stats = work.loss(index, batch)
        return (loss_sum + aux[0] * (scale * batch.real) if aux else loss_sum), stats

    return dataclasses.replace(work, loss=loss)


def _weights(batch) -> float:
    return float(batch.weights.sum())


def train(model, batches: Iterable[Any], run: Run | None = None, *, accumulate: int = 1, **options) -> History:
    """Train `model` on packed batches for `run.steps` optimizer steps of `accumulate`
    batches each; see the module docstring. `run` is a linnet.run.Run, or its fields as
    keywords (optimizer=, steps=, clip=, schedule=, save_to=, checkpoint=,
    checkpoint_every=, keep=, on_step=, evaluate=, evaluate_every=). Stops early, with a
    warning, when the batches run out."""
    run, _ = run_and_options("train", run, options)
    if accumulate < 1:
        raise ValueError(f"train: accumulate={accumulate}; it must be >= 1")
    copies = copies_of(model)  # split or pipelined: the processes of a copy share batches

    def work(step: int, micro: list) -> Work:
        learned = sum(_weights(b) for b in micro)
        (count,) = sum_across([learned], copies)
        if count == 0:
            raise ValueError(f"step {step}: its {len(micro)} batches hold no learned position")
        return Work(micro, lambda _, batch: (model.loss_packed(batch)[0], {}), count, learned,
                    sum(float(b.real) for b in micro), group=copies)

    return fit(model, batches, work, run, per_step=accumulate, what="train: the batches")
