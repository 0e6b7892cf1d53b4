"""Checkpoint directories, for both backends and the pretraining harness: names, atomic
publishing, checksums, and finding the one to resume from.

A checkpoint is `<directory>/step-00000010/`, holding the trained parameters, the optimizer
state, a state file (the step and what the trainer needs back) and checksums.json (the
SHA-256 of every other file). What the files hold is the trainer's business
(`linnet.train.checkpoint` for PyTorch, `linnet.jax.train` for JAX); this module only
makes sure a run killed at any instant leaves complete checkpoints, and that a damaged one
is refused by name rather than half-loaded.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from linnet.files.atomic import disk_full, ordinary_permissions, sha256_file

PREFIX = "step-"
CHECKSUMS = "checksums.json"
STATE_FILES = ("state.pt", "state.json")  # PyTorch's, JAX's


def checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Complete checkpoints in `directory`, oldest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def is_checkpoint(path: str | os.PathLike) -> bool:
    path = Path(path)
    return (path / CHECKSUMS).is_file() or any((path / name).is_file() for name in STATE_FILES)


def find_checkpoint(directory: str | os.PathLike) -> Path | None:
    """`directory` itself when it is a checkpoint, else its latest checkpoint (None: none yet)."""
    path = Path(directory)
    if is_checkpoint(path):
        return path
    found = checkpoints(path)
    return found[-1] if found else None


def publish(directory: str | os.PathLike, step: int, write, *, keep: int = 2, rank: int = 0,
            every_process: bool = False, agree=lambda value: value, barrier=lambda: None) -> Path:
    """Make `<directory>/step-<step>` all at once: `write(tmp)` fills a temporary
    directory (on every process with every_process, else on the first alone); the first
    process (`rank` 0) then records every file's checksum, renames it into place and
    prunes to the `keep` latest (0: keep all). Under several processes `agree` gives every
    process the first's value (the temporary name) and `barrier` waits for all of them."""
    root = Path(directory)
    final = root / f"{PREFIX}{step:08d}"
    if rank != 0 and not every_process:
        return final
    name = f".{final.name}.tmp-{os.getpid()}"
    tmp = root / (agree(name) if every_process else name)
    try:
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
            ordinary_permissions(tmp)  # the user's umask, not safetensors' 0600
    except BaseException as e:  # the half-written checkpoint goes; a full disk is said plainly
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        full = disk_full(e, final)
        if full is None or full is e:
            raise
        raise full from None
    if rank == 0:
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


def _earlier(path: Path) -> str:
    earlier = [p for p in checkpoints(path.parent) if p.name < path.name and (p / CHECKSUMS).is_file()]
    return (f"; the previous checkpoint is {earlier[-1]}: resume from it (`linnet sft|dpo|grpo --resume-from "
            f"{earlier[-1]}`, or `linnet pretrain --resume-from {earlier[-1]}`)") if earlier else ""


def verify(path: str | os.PathLike) -> Path:
    """Check a checkpoint's files against its checksums.json; a missing, truncated or
    altered file is refused by name, pointing at the previous checkpoint."""
    path = Path(path)
    if not is_checkpoint(path):
        raise ValueError(f"{path}: not a checkpoint directory (no state file); pass a run's checkpoints/step-… "
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
    return path


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
