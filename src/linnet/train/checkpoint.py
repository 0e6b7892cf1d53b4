"""Checkpoints a run resumes from: trained parameters, optimizer, step, schedule, RNG.

Layout: `<dir>/step-00000010/` holding trained.safetensors (the parameters that train,
in float32: the adapters alone for a LoRA run), optimizer.pt, state.pt. Each is written
under a temporary directory name and renamed into place, so a run killed at any
instant leaves only complete checkpoints; the `keep` latest are kept.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from linnet.train.parallel import world

PREFIX = "step-"


def checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Complete checkpoints in `directory`, oldest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    found = checkpoints(directory)
    return found[-1] if found else None


def _trained(model) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def save_checkpoint(directory: str | os.PathLike, *, model, optimizer, step: int, schedule=None,
                    keep: int = 2, extra: dict[str, Any] | None = None) -> Path | None:
    """Write the checkpoint of `step` (first process only) and prune to the `keep`
    latest. `extra` holds what a caller's loop needs back (plain Python values)."""
    rank, _ = world()
    root = Path(directory)
    final = root / f"{PREFIX}{step:08d}"
    if rank != 0:
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    tensors = {n: p.detach().to("cpu", torch.float32).contiguous() for n, p in _trained(model).items()}
    save_file(tensors, str(tmp / "trained.safetensors"))
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    state = {
        "step": step,
        "schedule": None if schedule is None else schedule.state_dict(),
        "rng": _rng_state(),
        "extra": extra or {},
    }
    torch.save(state, tmp / "state.pt")
    if final.exists():  # the same step written again: swap it out whole
        stale = root / f".{final.name}.old-{os.getpid()}"
        os.rename(final, stale)
        os.rename(tmp, final)
        shutil.rmtree(stale)
    else:
        os.rename(tmp, final)
    for old in checkpoints(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(directory: str | os.PathLike, *, model, optimizer=None, schedule=None) -> dict[str, Any] | None:
    """Restore the latest checkpoint in `directory` (or a checkpoint directory itself)
    into the model's trained parameters, the optimizer, the schedule and the RNG.
    Returns {"step": …, "extra": …}, or None when there is none yet."""
    path = Path(directory)
    if not (path / "state.pt").is_file():
        path = latest_checkpoint(path)
        if path is None:
            return None
    tensors = load_file(str(path / "trained.safetensors"))
    trained = _trained(model)
    if set(tensors) != set(trained):
        extra_names = sorted(set(tensors) - set(trained))[:2]
        missing = sorted(set(trained) - set(tensors))[:2]
        raise ValueError(
            f"{path}: the checkpoint trains other parameters than this model "
            f"(only in the checkpoint: {extra_names}; only in the model: {missing}); "
            "load the model as the run loaded it (same card, trainable=, add_lora patterns)"
        )
    with torch.no_grad():
        for name, p in trained.items():
            p.copy_(tensors[name])
    state = torch.load(path / "state.pt", weights_only=True)
    if optimizer is not None:
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
    if schedule is not None and state["schedule"] is not None:
        schedule.load_state_dict(state["schedule"])
    torch.set_rng_state(state["rng"]["torch"])
    if "cuda" in state["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    return {"step": state["step"], "extra": state["extra"], "path": path}
