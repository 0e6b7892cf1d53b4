"""Packed decentralized runs in the pretraining harness, and their snapshots.

`linnet pretrain` with a `decentralized` group trains a `PackedTrainee`: N workers in one
PackedLlama with PackedAdamW, one micro-batch each per update (the update's global batch in
stream order: worker i takes its i-th micro-batch). Validation, best.json and the root
`epoch-NNN.safetensors` / `final.safetensors` use the global average of the workers in an
ordinary Decoder; `node-NNN/epoch-NNN.safetensors` hold each worker's own weights.

A packed snapshot is a `checkpoints/step-NNNNNNNN/` directory of the layout every trainer
shares (written in a temporary directory and renamed into place, so an interrupted one
leaves nothing a reader would take, and the next run rewrites it):

    node-000.pt …   kind packed_worker (version 1), one per worker: index, worker count,
                    recipe identity, epoch, step, cursor, the model's card, `model` (named
                    parameters) and `optimizer` ({"state": {name: {exp_avg, exp_avg_sq,
                    step}}, "param_groups": [... "params": names]}); compact float32 CPU
                    clones in their own shapes, no arena padding, no other worker's data
    state.pt        the shared state every linnet checkpoint has (schedule, RNG, progress,
                    loader cursor, recipe)
    packed.pt       the root, kind packed_epoch (version 4), written last: scheme, topology,
                    adaptive consensus, optimizer groups and counter, and the ordered worker
                    files with their SHA-256
    checksums.json  every file's SHA-256 (checkpoint_layout)

`read_packed_state` is the one reader: it validates the whole set (files, checksums, kinds,
indices, counts, recipe, step, names and shapes) before anything is restored. One worker's
file reads on its own, by seed 002's name for it or its own path, with the seed's parameter
names or linnet's (`linnet.pretrain.snapshots.read_worker_state`):

    local = read_worker_state("runs/x/node-000/epoch-002.pt")   # or runs/x/checkpoints/step-…/node-000.pt
    local["model"]["embedding.weight"], local["optimizer"]["state"]["model.norm.weight"]["exp_avg"]
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from linnet.files import checkpoints as layout
from linnet.files.atomic import sha256_file
from linnet.pretrain.consensus import AdaptiveConsensus
from linnet.pretrain.decentralized import PackedLlama, local_mean_losses, to_decoder
from linnet.pretrain.decentralized_optimizer import PackedAdamW
from linnet.schedules import schedule_factor
from linnet.train.checkpoint import read_pt
from linnet.train.loop import Work

ROOT, ROOT_KIND, ROOT_VERSION = "packed.pt", "packed_epoch", 4
WORKER_KIND, WORKER_VERSION = "packed_worker", 1
FORMAT = "linnet.packed"


def worker_file(i: int) -> str:
    return f"node-{i:03d}.pt"


def consensus_plan(config, total_steps: int) -> AdaptiveConsensus | None:
    """The run's adaptive consensus over the original schedule (None without the section)."""
    a = config.decentralized.adaptive_consensus
    if a is None:
        return None
    s, lr = config.lr_schedule, config.optimizer.lr
    factor = schedule_factor(s, total=total_steps)
    return AdaptiveConsensus.plan(start_frac=a.start_frac, p=a.p, total=total_steps, lr_at=lambda r: lr * factor(r))


class PackedTrainee:
    """What the pretraining runner trains when the config has a `decentralized` group."""

    def __init__(self, config, card, total_steps: int, device: torch.device, dtype: torch.dtype):
        d = config.decentralized
        self.config, self.card, self.num_models = config, card, d.num_models
        self.model = PackedLlama(card, d.num_models, seed=config.runtime.seed, dtype=dtype).to(device)
        self.consensus = consensus_plan(config, total_steps)
        self.optimizer = PackedAdamW(self.model, config, consensus=self.consensus)
        self.params = [self.model.parameter_storage]
        self.micro_batches = d.num_models  # one per worker an update
        self._average: torch.nn.Module | None = None
        self._losses: torch.Tensor | None = None

    def metadata(self) -> dict[str, Any]:
        d = self.config.decentralized
        return {"num_models": d.num_models, "scheme": d.scheme, "topology": d.topology,
                "adaptive_consensus": None if self.consensus is None else self.consensus.metadata()}

    def work(self, batches: Iterator, learned: int) -> Work:
        """The update: the workers' micro-batches stacked [N, B, T]; the loss is the sum of
        the local means (each worker's gradient its own, no division by N)."""
        def stacked():
            rows = list(batches)
            B = rows[0].examples
            yield (torch.stack([r.tokens.view(B, -1) for r in rows]), torch.stack([r.targets.view(B, -1) for r in rows]))

        def loss(_, batch):
            self._losses = local_mean_losses(self.model, *batch)
            return self._losses.sum(), {}

        return Work(stacked(), loss, 1.0, learned, learned)

    def report(self, row: dict[str, Any]) -> None:
        """The step's packed metrics: the workers' mean loss (`loss`), each one's loss and
        clipped-before norm, the mixing strength and the consensus distance."""
        local = self._losses.detach().float().cpu().tolist()
        row["loss"] = sum(local) / len(local)
        row["local_losses"] = local
        row["local_grad_norms"] = self.optimizer.local_norms.cpu().tolist()
        row["mixing_gamma"] = self.optimizer.last_gamma
        row["consensus_distance"] = self.model.consensus_distance()

    def evaluation_model(self) -> torch.nn.Module:
        """An ordinary Decoder holding the workers' global average (the one evaluated)."""
        average = self.model.average_state_dict()
        if self._average is None:
            self._average = to_decoder(self.card, average, self.model.parameter_storage.device)
        else:
            with torch.no_grad():
                for name, p in self._average.named_parameters():
                    p.copy_(average[name])
        return self._average

    def save_weights(self, out: Path, stem: str) -> None:
        """`stem`.safetensors: the average; node-NNN/`stem`.safetensors: each worker's."""
        self.evaluation_model().save_weights(out / f"{stem}.safetensors", dtype=torch.float32)
        for i in range(self.num_models):
            (out / f"node-{i:03d}").mkdir(exist_ok=True)
            to_decoder(self.card, self.model.local_state_dict(i)).save_weights(
                out / f"node-{i:03d}" / f"{stem}.safetensors", dtype=torch.float32)

    # -- snapshots -------------------------------------------------------------------

    def worker_state(self, i: int, shared: dict[str, Any]) -> dict[str, Any]:
        """Worker i's file: its weights and AdamW state by name (compact CPU clones)."""
        m, v = (self.model.views(a) for a in (self.optimizer.first_moment_storage,
                                              self.optimizer.second_moment_storage))
        step = float(self.optimizer.updates)
        state = {s.name: {"exp_avg": m[s.name][i].float().cpu().clone(), "exp_avg_sq": v[s.name][i].float().cpu().clone(),
                          "step": torch.tensor(step)} for s in self.model.layout}
        return {"format": FORMAT, "kind": WORKER_KIND, "version": WORKER_VERSION, "index": i,
                "num_models": self.num_models, **shared,
                "model_config": json.loads(json.dumps(dataclasses.asdict(self.card), default=str)),
                "model": self.model.local_state_dict(i),
                "optimizer": {"state": state, "param_groups": self._groups()}}

    def _groups(self) -> list[dict[str, Any]]:
        g = self.optimizer.param_groups[0]
        names = [s.name for s in self.model.layout]
        decayed = [s.name for s in self.model.layout if len(s.shape) >= 2]
        base = {"lr": g["lr"], "betas": list(g["betas"]), "eps": g["eps"]}
        return [{**base, "weight_decay": g["weight_decay"], "params": decayed},
                {**base, "weight_decay": 0.0, "params": [n for n in names if n not in decayed]}]

    def save_state(self, directory: Path, step: int, schedule, extra: dict[str, Any]) -> Path:
        """A packed snapshot of `step` in `directory` (see the module docstring): worker
        files, the shared state.pt, then the root naming the workers with their SHA-256."""
        from linnet.train.checkpoint import publish, write_state

        shared = {"recipe": extra["recipe"]["identity"], "epoch": extra["progress"]["epoch"], "step": step,
                  "cursor": extra["cursor"]}

        def write(tmp: Path) -> None:
            refs = []
            for i in range(self.num_models):
                path = tmp / worker_file(i)
                torch.save(self.worker_state(i, shared), path)
                refs.append({"index": i, "file": path.name, "sha256": sha256_file(path)})
            write_state(tmp, step, schedule=schedule.state_dict(), extra=extra)
            torch.save({"format": FORMAT, "kind": ROOT_KIND, "version": ROOT_VERSION, **shared, **self.metadata(),
                        "updates": self.optimizer.updates, "param_groups": self._groups(), "workers": refs},
                       tmp / ROOT)

        return publish(directory, step, write, keep=0)

    def load_state(self, checkpoint: Path, schedule) -> None:
        """Restore a packed snapshot, validated whole by `read_packed_state` first: every
        worker's weights and moments, the update counter, the schedule and the RNG."""
        from linnet.train.checkpoint import set_rng_state, verify_checkpoint

        d = self.config.decentralized
        snapshot = read_packed_state(checkpoint, model=self.model, expect={
            "num_models": d.num_models, "scheme": d.scheme, "topology": d.topology,
            "adaptive_consensus": self.metadata()["adaptive_consensus"]})
        state = verify_checkpoint(checkpoint)
        self.restore(snapshot)
        schedule.load_state_dict(state["schedule"])
        set_rng_state(state["rng"])

    def restore(self, snapshot: dict[str, Any]) -> None:
        """Load `read_packed_state`'s result: every worker's weights and moments, the counter."""
        root, workers = snapshot["root"], snapshot["workers"]
        m, v = (self.model.views(a) for a in (self.optimizer.first_moment_storage,
                                              self.optimizer.second_moment_storage))
        with torch.no_grad():
            for i, worker in enumerate(workers):
                self.model.load_local_state_dict(i, worker["model"])
                for name, s in worker["optimizer"]["state"].items():
                    m[name][i].copy_(s["exp_avg"])
                    v[name][i].copy_(s["exp_avg_sq"])
        S = self.model.parameter_storage
        self.optimizer.state[S]["step"] = torch.tensor(float(root["updates"]))
        self.optimizer.param_groups[0]["lr"] = root["param_groups"][0]["lr"]  # the rate of the next update


def read_packed_state(path: str | Path, *, model: PackedLlama | None = None,
                      expect: dict[str, Any] | None = None) -> dict[str, Any]:
    """The whole packed snapshot at `path`, validated: every file against checksums.json,
    the root's kind and version, each worker file present, matching the root's SHA-256,
    of kind packed_worker with its index, the worker count, the recipe, step and cursor of
    the root, and the same names and shapes (the model's layout, when given). `expect`:
    root fields that must hold these values (num_models, scheme, topology, ...).
    Returns {"root": ..., "workers": [...]} or raises naming the file and field."""
    path = layout.verify(path)
    if not (path / ROOT).is_file():
        raise ValueError(f"{path}: not a packed snapshot (no {ROOT}); resume an ordinary checkpoint with an "
                         "ordinary config (no decentralized group)")
    root = read_pt(path / ROOT)
    if root.get("kind") != ROOT_KIND or root.get("version") != ROOT_VERSION:
        raise ValueError(f"{path / ROOT}: kind {root.get('kind')!r} version {root.get('version')!r}; this reader "
                         f"takes kind {ROOT_KIND!r} version {ROOT_VERSION}")
    for name, value in (expect or {}).items():
        if root.get(name) != value:
            raise ValueError(f"{path / ROOT}: decentralized.{name} is {root.get(name)!r} in the snapshot and "
                             f"{value!r} in this config; resume with the run's own setting")
    if [r["index"] for r in root["workers"]] != list(range(root["num_models"])):
        raise ValueError(f"{path / ROOT}: worker references {[r['index'] for r in root['workers']]} are not workers "
                         f"0 to {root['num_models'] - 1} in order")
    workers = []
    for ref in root["workers"]:
        file = path / ref["file"]
        if not file.is_file():
            raise ValueError(f"{file}: worker {ref['index']}'s file is missing; the snapshot cannot resume (copy the "
                             "root together with its node files)")
        if sha256_file(file) != ref["sha256"]:
            raise ValueError(f"{file}: its SHA-256 is not the one {ROOT} records; the worker file was altered or "
                             "belongs to another snapshot")
        worker = read_pt(file)
        for key, want in (("kind", WORKER_KIND), ("version", WORKER_VERSION), ("index", ref["index"]),
                          ("num_models", root["num_models"]), ("recipe", root["recipe"]), ("step", root["step"]),
                          ("epoch", root["epoch"]), ("cursor", root["cursor"])):
            if worker.get(key) != want:
                raise ValueError(f"{file}: {key} is {worker.get(key)!r}, the root says {want!r}")
        workers.append(worker)
    shapes = {n: tuple(t.shape) for n, t in workers[0]["model"].items()}
    want = {s.name: s.shape for s in model.layout} if model is not None else shapes
    for worker, ref in zip(workers, root["workers"]):
        got = {n: tuple(t.shape) for n, t in worker["model"].items()}
        moments = set(worker["optimizer"]["state"])
        if got != want or moments != set(want):
            wrong = sorted(set(got) ^ set(want)) or sorted(n for n in got if got[n] != want.get(n)) \
                or sorted(moments ^ set(want))
            raise ValueError(f"{path / ref['file']}: parameters differ from the model's ({', '.join(wrong[:3])}); "
                             "the snapshot is of another model")
    return {"root": root, "workers": workers, "path": path}
