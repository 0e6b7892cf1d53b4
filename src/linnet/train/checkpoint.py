"""Checkpoints a run resumes from: trained parameters, optimizer, step, schedule, RNG.

Layout: `<dir>/step-00000010/` holding trained.safetensors (the parameters that train,
in float32: the adapters alone for a LoRA run), optimizer.pt, state.pt and
checksums.json (the SHA-256 of the other three). Each is written under a temporary
directory name and renamed into place, so a run killed at any instant leaves only
complete checkpoints; the `keep` latest are kept. Loading checks every file against its
checksum first: a truncated or altered checkpoint is refused by name, never half-loaded.
The RNG state covers torch (and CUDA), Python's `random` and NumPy's global generator.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from linnet.files import sha256_file
from linnet.train.parallel import world

PREFIX = "step-"
CHECKSUMS = "checksums.json"
STATE_FILES = ("trained.safetensors", "optimizer.pt", "state.pt")


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
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss = random.getstate()
    state = {"torch": torch.get_rng_state(), "python": [version, list(internal), gauss],
             "numpy": [kind, keys.tolist(), pos, has_gauss, cached]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


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
    sums = {"files": {name: sha256_file(tmp / name) for name in STATE_FILES}}
    (tmp / CHECKSUMS).write_text(json.dumps(sums, indent=1) + "\n")
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
    if not (path / "state.pt").is_file() and not (path / CHECKSUMS).is_file():
        path = latest_checkpoint(path)
        if path is None:
            return None
    state = verify_checkpoint(path)
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
    if optimizer is not None:
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
    if schedule is not None and state["schedule"] is not None:
        schedule.load_state_dict(state["schedule"])
    _set_rng_state(state["rng"])
    return {"step": state["step"], "extra": state["extra"], "path": path}


def _earlier(path: Path) -> str:
    earlier = [p for p in checkpoints(path.parent) if p.name < path.name and (p / CHECKSUMS).is_file()]
    return f"; the previous checkpoint is {earlier[-1]}: resume from it" if earlier else ""


def verify_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Check a checkpoint's files against its checksums.json and return its state.pt
    contents. A missing, truncated or altered file is refused by name."""
    path = Path(path)
    if not (path / "state.pt").is_file() and not (path / CHECKSUMS).is_file():
        raise ValueError(f"{path}: not a checkpoint directory (no state.pt); pass a run's checkpoints/step-… "
                         "directory or the run directory")
    if not (path / CHECKSUMS).is_file():
        raise ValueError(f"{path}: incomplete checkpoint (no {CHECKSUMS}: its write was interrupted){_earlier(path)}")
    try:
        recorded = json.loads((path / CHECKSUMS).read_text())["files"]
    except (json.JSONDecodeError, KeyError):
        raise ValueError(f"{path / CHECKSUMS}: unreadable; the checkpoint is damaged{_earlier(path)}") from None
    for name, want in recorded.items():
        file = path / name
        if not file.is_file():
            raise ValueError(f"{file}: missing from the checkpoint{_earlier(path)}")
        if sha256_file(file) != want:
            raise ValueError(f"{file}: corrupt or truncated (its SHA-256 differs from {CHECKSUMS}); refusing to "
                             f"resume from it{_earlier(path)}")
    return torch.load(path / "state.pt", weights_only=True)
