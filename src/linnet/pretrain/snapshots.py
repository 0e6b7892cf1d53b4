"""A pretraining run's training-state snapshots by the names seed 002 gives them, and one
packed worker's state to inspect.

linnet keeps a run's training state in checkpoint directories, `RUN/checkpoints/step-NNNNNNNN/`
(linnet.files.checkpoints: published atomically, checksummed, one layout for every
trainer). Seed 002 names the same snapshots by epoch: `RUN/epoch-NNN.pt`, `RUN/final.pt`,
and a packed worker's part `RUN/node-NNN/epoch-NNN.pt`. Those names are resolved here,
through the kind (`epoch`, `final`) and the completed-epoch count each snapshot records in
its state.pt, rather than written as files beside the directories: nothing then has to be
kept in step with the directories (an alias cannot outlive or miss its snapshot), a copied
run directory holds each tensor once, and runs written before the names were understood
answer to them too.

    linnet pretrain --config runs/tiny/config.yaml --resume runs/tiny/epoch-002.pt \\
        --set runtime.output_dir=runs/tiny-branch

    find_checkpoint("runs/tiny/epoch-002.pt")      # runs/tiny/checkpoints/step-00000016
    local = read_worker_state("runs/packed4-tiny-cpu/node-000/epoch-002.pt")
    local["model"]["embedding.weight"]             # the seed's name, or model.embed_tokens.weight
    local["optimizer"]["state"]["embedding.weight"]["exp_avg"]
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from linnet.files import checkpoints as layout
from linnet.files.atomic import sha256_file
from linnet.paths import from_seed_path
from linnet.train.checkpoint import read_pt

CHECKPOINTS = "checkpoints"
SEED_NAME = re.compile(r"(?:epoch-(\d+)|final)(?:\.pt)?")  # epoch-010.pt, epoch-010, final.pt, final
WORKER_DIR = re.compile(r"node-(\d+)")


@dataclass(frozen=True)
class Snapshot:
    """A retained snapshot: its directory, its kind (`epoch` or `final`) and the epochs
    completed when it was taken."""

    path: Path
    kind: str
    epoch: int


def retained(run_dir: str | os.PathLike) -> list[Snapshot]:
    """The run's epoch and final snapshots, oldest first, by what each state.pt records
    (a SIGTERM's `stop` snapshot is neither; one whose state.pt is unreadable answers to
    no name, and resuming its step directory reports the damage)."""
    found = []
    for path in layout.checkpoints(Path(run_dir) / CHECKPOINTS):
        try:
            extra = read_pt(path / "state.pt")["extra"]
            kind, epoch = extra.get("kind"), extra["progress"]["epoch"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if kind in ("epoch", "final"):
            found.append(Snapshot(path, kind, int(epoch)))
    return found


def _resolve(run_dir: Path, name: str, shown: Path) -> Path:
    """The snapshot directory the seed's `name` means in `run_dir`: `epoch-NNN` the one
    recording NNN completed epochs (the last epoch's is the final snapshot), `final` the
    final one. Refused naming `shown` (what the user wrote) and the names that exist."""
    match = SEED_NAME.fullmatch(name)
    assert match is not None
    snapshots = retained(run_dir)
    epoch = None if match.group(1) is None else int(match.group(1))
    hits = [s for s in snapshots if (s.kind == "final" if epoch is None else s.epoch == epoch)]
    if hits:
        return hits[-1].path
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{shown}: {run_dir} is not a directory; name a snapshot of a run directory "
                                "(RUN/epoch-NNN.pt, RUN/final.pt)")
    kept = [f"epoch-{s.epoch:03d}.pt" for s in snapshots if s.kind == "epoch"]
    kept += [f"final.pt (epoch-{s.epoch:03d}.pt)" for s in snapshots if s.kind == "final"][-1:]
    what = "the final state" if epoch is None else f"epoch {epoch}"
    has = f"it keeps {', '.join(kept)}" if kept else "it keeps none"
    raise FileNotFoundError(
        f"{shown}: {run_dir} keeps no training-state snapshot of {what}; {has}. Resume one of those, or a "
        f"step directory under {run_dir / CHECKPOINTS}; a run keeps its selected epochs' snapshots with "
        "training.checkpoint_policy=interval|explicit and training.save_epoch_training_state=true")


def find_checkpoint(source: str | os.PathLike) -> Path:
    """A checkpoint directory; the latest checkpoint of a run directory; or a snapshot by
    the seed's name, `RUN/epoch-NNN.pt`, `RUN/epoch-NNN` or `RUN/final.pt`."""
    path = Path(source)
    if not path.is_dir() and SEED_NAME.fullmatch(path.name):
        return _resolve(path.parent, path.name, path)
    found = layout.find_checkpoint(path / CHECKPOINTS) if (path / CHECKPOINTS).is_dir() else None
    found = found or layout.find_checkpoint(path)
    if found is None:
        raise FileNotFoundError(f"{path}: no checkpoint there (expected RUN/epoch-NNN.pt, RUN/final.pt, a "
                                "checkpoints/step-… directory or a run directory holding checkpoints/)")
    return found


class SeedNames(dict):
    """A dict by linnet's parameter paths (`model.embed_tokens.weight`) that also takes the
    seeds' names for them (`embedding.weight`, `layers.0.attention.q_proj.weight`:
    linnet.paths.from_seed_path). It iterates over linnet's paths alone."""

    def __missing__(self, key):
        if isinstance(key, str) and (path := from_seed_path(key)) != key and dict.__contains__(self, path):
            return dict.__getitem__(self, path)
        raise KeyError(key)

    def __contains__(self, key) -> bool:
        return dict.__contains__(self, key) or (isinstance(key, str) and dict.__contains__(self, from_seed_path(key)))

    def get(self, key, default=None):
        return self[key] if key in self else default


def read_worker_state(path: str | os.PathLike) -> dict[str, Any]:
    """One packed worker's training state, to inspect: the seed's `RUN/node-NNN/epoch-NNN.pt`
    or `RUN/node-NNN/final.pt` (that worker's file of the snapshot the root name means,
    `find_checkpoint`), or a snapshot's own `RUN/checkpoints/step-…/node-NNN.pt`.

    Returns the worker file's dict (kind packed_worker: index, worker count, recipe, epoch,
    step, cursor, `model_config`, `model`, `optimizer`), its `model` and
    `optimizer["state"]` taking the seed's parameter names as well as linnet's. The file is
    checked against its snapshot's checksums.json when it lies in one, and loaded with
    `weights_only=True`. Resuming takes the whole snapshot (`--resume RUN/epoch-NNN.pt`)."""
    from linnet.pretrain.decentralized_run import ROOT, WORKER_KIND, WORKER_VERSION, worker_file

    path = Path(path)
    file = path
    worker = WORKER_DIR.fullmatch(path.parent.name)
    if not path.is_file() and SEED_NAME.fullmatch(path.name) and worker is not None:
        snapshot = _resolve(path.parent.parent, path.name, path)
        file = snapshot / worker_file(int(worker.group(1)))
        if not (snapshot / ROOT).is_file():
            raise ValueError(f"{path}: {snapshot} is an ordinary run's snapshot, with no worker files; a packed run "
                             "(a decentralized group) writes node-NNN.pt")
        if not file.is_file():
            held = sorted(p.name for p in snapshot.glob("node-*.pt"))
            raise FileNotFoundError(f"{path}: the snapshot {snapshot} has no {file.name}; it holds "
                                    f"{', '.join(held)}")
    if not file.is_file():
        raise FileNotFoundError(f"{path}: no such worker file (expected RUN/node-NNN/epoch-NNN.pt, "
                                "RUN/node-NNN/final.pt or RUN/checkpoints/step-…/node-NNN.pt)")
    sums = file.parent / layout.CHECKSUMS
    if sums.is_file():
        want = json.loads(sums.read_text()).get("files", {}).get(file.name)
        if want is not None and sha256_file(file) != want:
            raise ValueError(f"{file}: corrupt or truncated (its SHA-256 differs from {sums})")
    state = read_pt(file)
    if not isinstance(state, dict) or state.get("kind") != WORKER_KIND or state.get("version") != WORKER_VERSION:
        kind = state.get("kind") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"{file}: not a packed worker file (kind {kind!r}; this reader takes kind {WORKER_KIND!r} "
                         f"version {WORKER_VERSION}, a packed snapshot's node-NNN.pt)")
    state["model"] = SeedNames(state["model"])
    state["optimizer"]["state"] = SeedNames(state["optimizer"]["state"])
    return state
