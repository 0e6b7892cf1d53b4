"""PyTorch checkpoints a run resumes from: trained parameters, optimizer, step, schedule, RNG.

A checkpoint (`<dir>/step-00000010/`, published atomically and checksummed by
`linnet.files.checkpoints`) holds trained.safetensors (the parameters that train, in
float32: the adapters alone for a LoRA run), optimizer.pt and state.pt. A sharded, split
or pipelined model's (fully_shard, tensor_parallel, pipeline) checkpoint has a `sharded/`
directory instead of the first two, where each process writes its parts of the trained
parameters and optimizer state (torch.distributed.checkpoint; it loads back under another
layout, or whole).
Loading checks every file against its checksum first. The RNG state covers torch (and
CUDA), Python's `random` and NumPy's global generator. The step comes back from the
checkpoint and the learning-rate schedule's plan from the caller: a `LambdaLR` given to
`load_checkpoint` keeps its own factor (a run extended to more steps re-plans its schedule
over the new total from the checkpoint's step on, as TRL does with max_steps).
"""

from __future__ import annotations

import os
import pickle
import random
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from linnet.files import checkpoints as layout
from linnet.torch.distributed import barrier, from_first, union_across, world
from linnet.torch.sharding import is_sharded

SHARDED = "sharded"


def _trained(model) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def rng_state() -> dict[str, Any]:
    """Every generator a run draws from (torch's, CUDA's, NumPy's and Python's global ones)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss = random.getstate()
    state = {"torch": torch.get_rng_state(), "python": [version, list(internal), gauss],
             "numpy": [kind, keys.tolist(), pos, has_gauss, cached]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


def save_checkpoint(directory: str | os.PathLike, *, model, optimizer, step: int, schedule=None,
                    keep: int = 2, extra: dict[str, Any] | None = None) -> Path | None:
    """Write the checkpoint of `step` and prune to the `keep` latest: the first process
    writes it, with every process writing its parts of a sharded model. `extra` holds
    what a caller's loop needs back (plain Python values)."""
    sharded = _in_parts(model)
    if hasattr(optimizer, "consolidate_state_dict"):  # ZeroRedundancyOptimizer: each process holds a part
        optimizer.consolidate_state_dict(to=0)

    def write(tmp: Path) -> None:
        if sharded:
            _save_parts(tmp / SHARDED, model, optimizer)
        if world()[0] != 0:
            return
        if not sharded:
            tensors = {n: p.detach().to("cpu", torch.float32).contiguous() for n, p in _trained(model).items()}
            save_file(tensors, str(tmp / "trained.safetensors"))
            torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        write_state(tmp, step, schedule=None if schedule is None else schedule.state_dict(), extra=extra)

    return publish(directory, step, write, keep=keep, every_process=sharded)


def write_state(tmp: Path, step: int, *, schedule=None, extra: dict[str, Any] | None = None) -> None:
    """state.pt: the step, the schedule's state, the RNG states and the caller's extras."""
    torch.save({"step": step, "schedule": schedule, "rng": rng_state(), "extra": extra or {}}, tmp / "state.pt")


def publish(directory: str | os.PathLike, step: int, write, *, keep: int = 2, every_process: bool = False) -> Path:
    """`linnet.files.checkpoints.publish` across this run's processes."""
    return layout.publish(directory, step, write, keep=keep, rank=world()[0], every_process=every_process,
                          agree=from_first, barrier=barrier)


def load_checkpoint(directory: str | os.PathLike, *, model, optimizer=None, schedule=None) -> dict[str, Any] | None:
    """Restore the latest checkpoint in `directory` (or a checkpoint directory itself)
    into the model's trained parameters, the optimizer, the schedule and the RNG.
    Returns {"step": …, "extra": …}, or None when there is none yet."""
    path = layout.find_checkpoint(directory)
    if path is None:
        return None
    state = verify_checkpoint(path)
    if (path / SHARDED).is_dir():
        _load_parts(path, model, optimizer)
    elif _in_parts(model):
        raise ValueError(f"{path}: written by a run without fully_shard or pipeline; resume it whole (or load its "
                         "trained.safetensors with bind_weights and start the sharded run afresh)")
    else:
        tensors = load_file(str(path / "trained.safetensors"))
        trained = _trained(model)
        layout.same_names(path, tensors, trained)
        with torch.no_grad():
            for name, p in trained.items():
                p.copy_(tensors[name])
        if optimizer is not None:
            optimizer.load_state_dict(read_pt(path / "optimizer.pt"))
            if hasattr(optimizer, "consolidate_state_dict"):
                # ZeroRedundancyOptimizer hands each process's states to its local optimizer
                # as saved, past that optimizer's own load_state_dict; bitsandbytes' 8-bit AdamW
                # saves its quantization states nested and takes them apart only there
                optimizer.optim.load_state_dict(optimizer.optim.state_dict())
    if schedule is not None and state["schedule"] is not None:
        load_schedule(schedule, state["schedule"], optimizer)
    set_rng_state(state["rng"])
    return {"step": state["step"], "extra": state["extra"], "path": path}


def _in_parts(model) -> bool:
    """Whether each process holds part of the model (fully_shard, tensor_parallel, pipeline)."""
    return is_sharded(model) or getattr(model, "pipe", None) is not None


def _options():
    """The state dicts' options: trained parameters only (`same_names` checks them, so
    loading need not insist on the frozen ones); optimizer state keyed by each parameter's
    name, flattened (a pipeline's stages hold different parameters and param groups;
    bitsandbytes' 8-bit states as linnet.train.optimizer builds them flatten too)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=True, flatten_optimizer_state_dict=True, strict=False)


def _save_parts(path: Path, model, optimizer) -> None:
    """Every process writes its parts of the trained parameters and optimizer state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    params, optim = get_state_dict(model, optimizer, options=_options())
    dcp.save({"model": params, "optimizer": optim}, checkpoint_id=path)


def _load_parts(path: Path, model, optimizer) -> None:
    """Read `path`/sharded into the model (sharded or whole) and the optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    options = _options()
    saved = dcp.FileSystemReader(str(path / SHARDED)).read_metadata().state_dict_metadata
    trained = union_across(_trained(model)) if getattr(model, "pipe", None) else _trained(model)  # every stage's
    layout.same_names(path, {k.removeprefix("model.") for k in saved if k.startswith("model.")}, trained)
    if optimizer is None:
        state = {"model": get_model_state_dict(model, options=options)}
    else:  # get_state_dict fills a fresh optimizer's state by an lr=0 step; the load overwrites it
        params, optim = get_state_dict(model, optimizer, options=options)
        state = {"model": params, "optimizer": optim}
    with warnings.catch_warnings():  # one process reading parts is intended, not a mistake
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state, checkpoint_id=path / SHARDED, no_dist=world()[1] == 1)
    if optimizer is None:
        set_model_state_dict(model, state["model"], options=options)
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=options)


def load_schedule(schedule, saved: dict[str, Any], optimizer=None) -> None:
    """Restore a schedule's step from a checkpoint. A `LambdaLR` keeps the factor it was
    built with (the saved one's plan, its total steps, is left out) and sets the
    optimizer's rates from it at the restored step: the same rates when the plan is the
    same, the new plan's when a run is extended (or shortened) to another total."""
    from torch.optim.lr_scheduler import LambdaLR

    if not isinstance(schedule, LambdaLR):
        schedule.load_state_dict(saved)
        return
    saved = {**saved, "lr_lambdas": [None] * len(schedule.lr_lambdas)}
    schedule.load_state_dict(saved)
    rates = [base * factor(schedule.last_epoch) for base, factor in zip(schedule.base_lrs, schedule.lr_lambdas)]
    if optimizer is not None:
        for group, rate in zip(optimizer.param_groups, rates):
            group["lr"] = rate
    schedule._last_lr = rates


def read_pt(path: str | os.PathLike) -> Any:
    """`torch.load` of a checkpoint's .pt file, tensors and plain values only
    (weights_only): a file holding other Python objects is refused as not a linnet
    checkpoint file (never loaded with weights_only=False), a damaged one by name."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError:
        raise ValueError(f"{path}: not a linnet checkpoint file (it holds Python objects no linnet checkpoint "
                         "holds, so it was not loaded); resume from a checkpoint a linnet run wrote "
                         "(runtime.output_dir/checkpoints/step-…)") from None
    except (RuntimeError, EOFError) as e:  # not a zip archive, or cut short
        raise ValueError(f"{path}: not a readable checkpoint file ({type(e).__name__}); it may be cut short or "
                         "damaged: resume from another checkpoint of the run") from None


def verify_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Check a checkpoint's files against its checksums and return its state.pt contents."""
    return read_pt(layout.verify(path) / "state.pt")
