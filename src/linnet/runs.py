"""What every training command shares: the config groups for the model, adapters,
optimizer, schedule and steps; the run directory; loading the model to train; the
metrics log with its progress bar; the summary; and the command-line parsing.

A run directory holds config.json, metrics.jsonl, checkpoints/, final/ and summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from linnet.config import load_config, option, template, to_dict
from linnet.files import write_text
from linnet.torch.distributed import data_share, from_first, world

ALL_LINEAR = ["model.layers.*.self_attn.*_proj", "model.layers.*.mlp.*_proj"]


@dataclass
class ModelConfig:
    card: str = option("debug", "registered card name or local Hugging Face model directory")
    weights: str | None = option(None, "weights directory or file; null: the card's own; 'random': seeded init")
    dtype: str | None = option(None, "compute dtype (float32, bfloat16); null: bfloat16 on CUDA, float32 on CPU")
    device: str | None = option(None, "cpu, cuda, cuda:1 …; null: cuda when present")
    attention: str = option("auto", "attention path inside packed rows: auto, documents, dense, flex, varlen")
    compile: bool = option(False, "compile each block with torch.compile (inductor)")


@dataclass
class LoraConfig:
    enabled: bool = option(True, "train low-rank adapters on a frozen base; false: full fine-tuning")
    rank: int = option(16, "adapter rank")
    alpha: float = option(32.0, "adapter scale numerator: alpha / rank (or / sqrt(rank) with rslora)")
    dropout: float = option(0.0, "dropout on the adapters' input")
    rslora: bool = option(False, "scale by alpha / sqrt(rank)")
    dora: bool = option(False, "DoRA: a trained magnitude per output row beside the low-rank direction update")
    targets: list[str] = option(ALL_LINEAR, "glob patterns of the linear layers that get adapters")


@dataclass
class OptimizerConfig:
    lr: float = option(2e-4, "peak learning rate")
    betas: list[float] = option([0.9, 0.999], "AdamW betas")
    weight_decay: float = option(0.0, "AdamW decoupled weight decay")
    eps: float = option(1e-8, "AdamW epsilon")


@dataclass
class ScheduleConfig:
    name: Literal["cosine", "wsd", "constant"] = option("cosine", "cosine, wsd (warmup-stable-decay) or constant")
    warmup: int = option(10, "linear warmup steps")
    floor: float = option(0.0, "final lr as a share of the peak (cosine, wsd)")
    decay: float = option(0.2, "wsd: share of the steps spent decaying")


@dataclass
class TrainingConfig:
    steps: int | None = option(None, "optimizer steps; null: from epochs")
    epochs: float = option(1.0, "passes over the training rows when steps is null")
    accumulate: int = option(1, "packed rows per optimizer step")
    clip: float | None = option(1.0, "global gradient-norm clip; null: measure only")
    seed: int = option(0, "seed for initialisation, shuffling and dropout")
    eval_every: int = option(50, "held-out evaluation every this many steps (and at the end): loss; "
                                 "grpo: reward, pass@1, pass@k")
    checkpoint_every: int = option(100, "checkpoint every this many steps (and at the end)")
    keep: int = option(2, "checkpoints kept")
    shard: Literal["none", "zero", "fsdp"] = option(
        "none", "under torchrun: none (a whole copy a process), zero (optimizer state split across the "
                "processes), fsdp (weights, gradients and optimizer state split: fully_shard)")
    split: int = option(1, "under torchrun (sft, full fine-tuning): processes that split every block between "
                           "them (tensor parallel) and take the same rows; the processes form copies of such splits")


def make_schedule(s: ScheduleConfig, optimizer, steps: int):
    from linnet.train import constant_schedule, cosine_schedule, wsd_schedule

    try:
        if s.name == "cosine":
            return cosine_schedule(optimizer, s.warmup, steps, floor=s.floor)
        if s.name == "wsd":
            return wsd_schedule(optimizer, s.warmup, steps, decay=s.decay, floor=s.floor)
        return constant_schedule(optimizer, s.warmup)
    except ValueError as e:
        raise ValueError(f"config: schedule ({s.name}, warmup {s.warmup}) over {steps} steps: {e}") from None


def _output_directory(path: Path, config_json: str, *, overwrite: bool, resume: bool) -> None:
    """Refuse to write into a used run directory unless told to replace or resume it;
    a resumed run must have the same config."""
    if path.exists() and any(path.iterdir()):
        if overwrite:
            shutil.rmtree(path)
        elif not resume:
            raise ValueError(
                f"{path}: the run directory exists and is not empty; pass --resume to continue "
                "that run from its latest checkpoint, or --overwrite to replace it"
            )
        elif (path / "config.json").is_file() and (path / "config.json").read_text() != config_json:
            raise ValueError(
                f"{path / 'config.json'}: the run was started with another config; resume it with "
                "the same config, or start a new run directory"
            )
    path.mkdir(parents=True, exist_ok=True)




def split_per_step(name: str, per_step: int) -> int:
    """A step's items for this process: `per_step` split evenly over the processes."""
    processes = world()[1]
    if per_step % processes:
        raise ValueError(f"config: {name}={per_step} does not split evenly over {processes} processes; "
                         f"use a multiple of {processes}")
    return per_step // processes


def open_run(config: Any, *, overwrite: bool, resume: bool) -> Path:
    """Create (or reopen, with resume) the run directory and write its config.json; the
    first process does, and every process gets its refusal."""
    out = Path(config.output)
    config_json = json.dumps(to_dict(config), indent=2) + "\n"
    refusal = None
    if world()[0] == 0:
        try:
            _output_directory(out, config_json, overwrite=overwrite, resume=resume)
            write_text(out / "config.json", config_json)
        except ValueError as e:
            refusal = str(e)
    refusal = from_first(refusal)
    if refusal:
        raise ValueError(refusal)
    return out


def load_model(card, m: ModelConfig, lora: LoraConfig, seed: int, shard: str = "none", split: int = 1):
    """The model to train: the base frozen with adapters, or every weight trainable;
    split across the processes with shard="fsdp", or `split` processes at a time
    splitting every block (tensor parallel)."""
    from linnet import nest
    from linnet.torch.sharding import fully_shard

    torch.manual_seed(seed)
    rank, processes = world()
    device = m.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and processes > 1:  # one GPU a process
        device = f"cuda:{os.environ.get('LOCAL_RANK', rank % torch.cuda.device_count())}"
        torch.cuda.set_device(device)
    mesh = None
    if split > 1:
        from torch.distributed.device_mesh import init_device_mesh

        copies = data_share(split)[1]
        mesh = init_device_mesh(torch.device(device).type, (copies, split), mesh_dim_names=("copies", "split"))
    model = nest.load(card, device=device, dtype=m.dtype, weights=m.weights, seed=seed,
                      trainable=not lora.enabled, compile=m.compile, attention=m.attention,
                      tensor_parallel=None if mesh is None else mesh["split"])
    if lora.enabled:
        model.add_lora(lora.targets, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, rslora=lora.rslora,
                       dora=lora.dora)
    if shard == "fsdp" and processes > 1:
        fully_shard(model)
    trained = [p for p in model.parameters() if p.requires_grad]
    if rank == 0:
        on = (f"{processes} processes ({shard}{f', split {split} ways' if split > 1 else ''})" if processes > 1
              else device)
        print(f"{card.name}: {sum(p.numel() for p in trained):,} of {sum(p.numel() for p in model.parameters()):,} "
              f"parameters train ({'LoRA' if lora.enabled else 'full'}) on {on}", file=sys.stderr)
    return model


def adamw(o: OptimizerConfig, model, shard: str = "none") -> torch.optim.Optimizer:
    """AdamW over the trained parameters; its state split across the processes with
    shard="zero" (ZeroRedundancyOptimizer)."""
    trained = [p for p in model.parameters() if p.requires_grad]
    options = dict(lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay, eps=o.eps)
    if shard == "zero" and world()[1] > 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(trained, optimizer_class=torch.optim.AdamW, **options)
    return torch.optim.AdamW(trained, **options)


class MetricsLog:
    """Appends one JSON line a step to metrics.jsonl and moves the progress bar;
    `evaluate(step) -> dict` adds held-out metrics every `every` steps and at the end
    (the bar shows the latest of them)."""

    def __init__(self, out: Path, label: str, steps: int, every: int, evaluate=None):
        from linnet.progress import Progress

        lead = world()[0] == 0  # every process evaluates (its share); the first writes and shows
        self.file = (out / "metrics.jsonl").open("a") if lead else None
        self.bar = Progress(steps, label) if lead else None
        self.steps, self.every, self.evaluate = steps, every, evaluate
        self.latest: dict = {}

    def __call__(self, step) -> None:
        row = {"step": step.step, "loss": step.loss, "lr": step.lr, "grad_norm": step.grad_norm,
               "learned": step.learned, "tokens_per_second": step.tokens_per_second,
               "seconds": step.seconds, **step.metrics}
        if self.evaluate is not None and (step.step % self.every == 0 or step.step == self.steps):
            self.latest = self.evaluate(step)
            row.update(self.latest)
        if self.file is not None:
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()
            self.bar.update(step.step, loss=step.loss, tok_s=step.tokens_per_second, **self.latest)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.bar.close()


def summarize(out: Path, history, seconds: float, **extra: Any) -> dict:
    """summary.json from the whole metrics log (earlier runs of a resumed one included);
    the first process writes and returns it, the others return {}."""
    if world()[0] != 0:
        return {}
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in history.steps]
    summary = {
        **extra,
        "steps_this_run": len(steps),
        "seconds": round(seconds, 1),
        "first_loss": records[0]["loss"] if records else None,
        "last_loss": records[-1]["loss"] if records else None,
        "tokens_per_second": sum(x.real for x in steps) / sum(x.seconds for x in steps) if steps else None,
        "final": str(out / "final"),
    }
    for key in sorted({k for r in records for k in r if k.startswith("held_out")}):
        summary[key] = [r[key] for r in records if key in r][-1]
    write_text(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    return summary


def parse_command(argv: list[str] | None, prog: str, description: str, config_class: type, *, training: bool,
                  flags: Sequence[tuple[str, str]] = ()):
    """(args, config) for a command that reads a YAML config; config is None when the
    command only printed the template. `flags`: (name, help) of the command's own switches."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", help="YAML config (see --template)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a field, e.g. training.steps=100 (repeatable)")
    parser.add_argument("--template", action="store_true", help="print every field with its default and help")
    if training:
        parser.add_argument("--overwrite", action="store_true", help="replace an existing run directory")
        parser.add_argument("--resume", action="store_true", help="continue the run in the run directory")
    else:
        parser.add_argument("--examples", type=int, default=3, help="examples to show (default: 3)")
    for name, text in flags:
        parser.add_argument(name, action="store_true", help=text)
    args = parser.parse_args(argv)
    if args.template:
        print(template(config_class))
        return args, None
    if args.config is None and not args.set:
        parser.error("give --config FILE (and/or --set KEY=VALUE); --template shows the fields")
    return args, load_config(config_class, args.config, args.set)


def print_table(rows) -> None:
    rows = list(rows.items()) if isinstance(rows, dict) else rows
    if not rows:
        return
    width = max(len(str(k)) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
