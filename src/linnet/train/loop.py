"""The training loop: accumulate, reduce across processes, clip, step, schedule,
checkpoint, report. `train` runs the model's `loss_packed` entry (SFT, pretraining).

    history = train(model, pack(examples, tokens=4096), optimizer=opt, steps=1000,
                    accumulate=8, schedule=cosine_schedule(opt, 100, 1000), save_to="run/")

Loss scaling: each micro-batch's summed token loss is divided by the count of learned
positions of the whole optimizer step (all micro-batches, all processes) before
backward, so every learned token weighs the same whatever batch it sits in.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from linnet.history import History, Step, step_items
from linnet.train.checkpoint import load_checkpoint, save_checkpoint
from linnet.torch.distributed import clip_gradients, reduce_gradients, sum_across, world


def trained_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("nothing to train: load the model with trainable=True (or patterns), or add_lora")
    return params


def save_trained(model, path: str | os.PathLike) -> None:
    """The run's result: the adapters alone (PEFT format) after add_lora, else the
    whole model's weights (gathered from every process when sharded). The first
    process writes."""
    if not getattr(model, "lora", None):
        model.save_weights(path)
    elif world()[0] == 0:
        from linnet.torch.lora import save_peft

        save_peft(model, path)


def _count(batch, name: str) -> float:
    value = getattr(batch, name)
    return float(value.sum()) if name == "weights" else float(value)


def optimizer_step(params, optimizer, schedule, clip: float | None, loss: float, step: int,
                   checkpoint: str | os.PathLike | None, group=None) -> tuple[float, float]:
    """Reduce (over `group`, default every process), clip and apply the gradients;
    returns (grad norm, lr used). A non-finite loss or norm stops the run before the
    weights change."""
    reduce_gradients(params, group)
    norm = float(clip_gradients(params, clip))
    lr = optimizer.param_groups[0]["lr"]
    if not (math.isfinite(loss) and math.isfinite(norm)):
        optimizer.zero_grad(set_to_none=True)
        kept = f"; the last good checkpoint in {checkpoint} is intact" if checkpoint else ""
        raise FloatingPointError(
            f"step {step}: loss {loss} and gradient norm {norm}; training stopped before "
            f"the update{kept}. Lower the learning rate or check the data"
        )
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if schedule is not None:
        schedule.step()
    return norm, lr


def resume(checkpoint, model, optimizer, schedule) -> int:
    """The step to start from: the latest checkpoint's, or 0."""
    if checkpoint is None:
        return 0
    state = load_checkpoint(checkpoint, model=model, optimizer=optimizer, schedule=schedule)
    return 0 if state is None else state["step"]


def end_step(record: Step, history: History, on_step, *, model, optimizer, schedule, steps: int,
             checkpoint, checkpoint_every: int, keep: int) -> None:
    """Keep and report the step, then checkpoint it when due (every `checkpoint_every`
    steps and at the last)."""
    history.steps.append(record)
    if on_step is not None:
        on_step(record)
    if checkpoint is not None and (record.step % checkpoint_every == 0 or record.step == steps):
        save_checkpoint(checkpoint, model=model, optimizer=optimizer, step=record.step, schedule=schedule, keep=keep)


def train(
    model,
    batches: Iterable[Any],
    *,
    optimizer: torch.optim.Optimizer,
    steps: int,
    accumulate: int = 1,
    clip: float | None = 1.0,
    schedule=None,
    save_to: str | os.PathLike | None = None,
    checkpoint: str | os.PathLike | None = None,
    checkpoint_every: int = 100,
    keep: int = 2,
    on_step: Callable[[Step], None] | None = None,
) -> History:
    """Train `model` on packed batches for `steps` optimizer steps of `accumulate`
    batches each; see the module docstring. With `checkpoint`, resume from the latest
    checkpoint there (skipping the batches its steps consumed) and write one every
    `checkpoint_every` steps and at the end, keeping `keep`. Stops early, with a
    warning, when the batches run out."""
    if accumulate < 1 or steps < 0 or checkpoint_every < 1:
        raise ValueError("train: accumulate and checkpoint_every must be >= 1 and steps >= 0")
    params = trained_parameters(model)
    copies = getattr(model, "copies", None)  # a split model: the processes of a split share batches
    start = resume(checkpoint, model, optimizer, schedule)
    history = History()
    model.train()
    for step, micro in step_items(batches, accumulate, start=start, steps=steps, what="train: the batches"):
        t0 = time.perf_counter()
        learned, real = sum_across([sum(_count(b, "weights") for b in micro), sum(_count(b, "real") for b in micro)],
                                   copies)
        if learned == 0:
            raise ValueError(f"step {step}: its {len(micro)} batches hold no learned position")
        total = 0.0
        for batch in micro:
            loss_sum, _ = model.loss_packed(batch)
            (loss_sum / learned).backward()
            total = total + loss_sum.detach()
        (loss_all,) = sum_across([float(total)], copies)  # the step's one host sync
        loss = loss_all / learned
        norm, lr = optimizer_step(params, optimizer, schedule, clip, loss, step, checkpoint, copies)
        end_step(Step(step, loss, int(learned), int(real), norm, lr, time.perf_counter() - t0), history, on_step,
                 model=model, optimizer=optimizer, schedule=schedule, steps=steps, checkpoint=checkpoint,
                 checkpoint_every=checkpoint_every, keep=keep)
    if save_to is not None:
        save_trained(model, save_to)
    return history
