"""Checkpoints a run resumes from: trained parameters, optimizer, step, schedule, RNG.

Layout: `<dir>/step-00000010/` holding trained.safetensors (the parameters that train,
in float32: the adapters alone for a LoRA run), optimizer.pt, state.pt and
checksums.json (the SHA-256 of every other file). A sharded or split model's
(fully_shard, tensor_parallel) checkpoint has a `sharded/` directory instead of the first
two, where each process writes its parts of the trained parameters and optimizer state
(torch.distributed.checkpoint; it loads back under another layout, or whole). The JAX
trainers write the same layout through `publish` (optimizer.npz for optax's state).
Each checkpoint is written under a temporary directory name and renamed into place, so a
run killed at any instant leaves only complete checkpoints; the `keep` latest are kept.
Loading checks every file against its checksum first: a truncated or altered checkpoint
is refused by name, never half-loaded. The RNG state covers torch (and CUDA), Python's
`random` and NumPy's global generator.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from linnet.files import sha256_file
from linnet.torch.sharding import is_sharded
from linnet.train.parallel import barrier, from_first, world

PREFIX = "step-"
CHECKSUMS = "checksums.json"
SHARDED = "sharded"


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
    """Write the checkpoint of `step` and prune to the `keep` latest: the first process
    writes it, with every process writing its parts of a sharded model. `extra` holds
    what a caller's loop needs back (plain Python values)."""
    sharded = is_sharded(model)
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
    torch.save({"step": step, "schedule": schedule, "rng": _rng_state(), "extra": extra or {}}, tmp / "state.pt")


def publish(directory: str | os.PathLike, step: int, write, *, keep: int = 2, every_process: bool = False) -> Path:
    """Make `<directory>/step-<step>` all at once: `write(tmp)` fills a temporary
    directory (on every process with every_process, else on the first alone); the first
    process then records every file's checksum, renames it into place and prunes to the
    `keep` latest."""
    rank = world()[0]
    root = Path(directory)
    final = root / f"{PREFIX}{step:08d}"
    if rank != 0 and not every_process:
        return final
    tmp = root / f".{final.name}.tmp-{from_first(os.getpid()) if every_process else os.getpid()}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    if every_process:
        barrier()  # the directory exists before anyone writes into it
    write(tmp)
    if rank == 0:
        files = sorted(p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file())
        sums = {"files": {name: sha256_file(tmp / name) for name in files}}
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
    if every_process:
        barrier()  # every process returns with the checkpoint in place
    return final


def load_checkpoint(directory: str | os.PathLike, *, model, optimizer=None, schedule=None) -> dict[str, Any] | None:
    """Restore the latest checkpoint in `directory` (or a checkpoint directory itself)
    into the model's trained parameters, the optimizer, the schedule and the RNG.
    Returns {"step": …, "extra": …}, or None when there is none yet."""
    path = find_checkpoint(directory)
    if path is None:
        return None
    state = verify_checkpoint(path)
    if (path / SHARDED).is_dir():
        _load_parts(path, model, optimizer)
    elif is_sharded(model):
        raise ValueError(f"{path}: written by a run without fully_shard; resume it unsharded (or load its "
                         "trained.safetensors with bind_weights and start the sharded run afresh)")
    else:
        tensors = load_file(str(path / "trained.safetensors"))
        trained = _trained(model)
        same_names(path, tensors, trained)
        with torch.no_grad():
            for name, p in trained.items():
                p.copy_(tensors[name])
        if optimizer is not None:
            optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
    if schedule is not None and state["schedule"] is not None:
        schedule.load_state_dict(state["schedule"])
    _set_rng_state(state["rng"])
    return {"step": state["step"], "extra": state["extra"], "path": path}


def find_checkpoint(directory: str | os.PathLike) -> Path | None:
    """`directory` itself when it is a checkpoint, else its latest checkpoint (None: none yet)."""
    path = Path(directory)
    if (path / "state.pt").is_file() or (path / CHECKSUMS).is_file():
        return path
    return latest_checkpoint(path)


def same_names(path: Path, saved, trained) -> None:
    """Refuse a checkpoint that trains other parameters than the model, naming some."""
    if set(saved) != set(trained):
        extra_names = sorted(set(saved) - set(trained))[:2]
        missing = sorted(set(trained) - set(saved))[:2]
        raise ValueError(
            f"{path}: the checkpoint trains other parameters than this model "
            f"(only in the checkpoint: {extra_names}; only in the model: {missing}); "
            "load the model as the run loaded it (same card, trainable=, add_lora patterns)"
        )


def _save_parts(path: Path, model, optimizer) -> None:
    """Every process writes its parts of the trained parameters and optimizer state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    params, optim = get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=True))
    dcp.save({"model": params, "optimizer": optim}, checkpoint_id=path)


def _load_parts(path: Path, model, optimizer) -> None:
    """Read `path`/sharded into the model (sharded or whole) and the optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_model_state_dict, get_state_dict, set_model_state_dict, set_state_dict)

    options = StateDictOptions(ignore_frozen_params=True)
    saved = dcp.FileSystemReader(str(path / SHARDED)).read_metadata().state_dict_metadata
    same_names(path, {k.removeprefix("model.") for k in saved if k.startswith("model.")}, _trained(model))
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
