"""What every training command shares: reading its config from the command line, the run
directory, the model, optimizer and schedule a config describes, the held-out split, the
metrics log with its progress bar, and the summary.

A run directory (`runtime.output_dir`) holds config.json, metrics.jsonl, checkpoints/,
final/ and summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from linnet.commands.run_directory import RunDirectory
from linnet.commands.spellings import parse_with_config
from linnet.config import load, template, to_dict
from linnet.files import checkpoints as layout
from linnet.files.atomic import (
    write_text,
)
from linnet.files.weights import weight_files
from linnet.report.metrics import MetricsFile
from linnet.report.tables import print_table
from linnet.schedules import lambda_schedule, schedule_factor
from linnet.torch.distributed import data_share, process_group, world
from linnet.torch.loading import usable_device
from linnet.train.loop import start_runtime


def parse_command(argv: list[str] | None, prog: str, description: str, config_class: type, *, training: bool,
                  flags: Sequence[tuple[str, str]] = (), any_command: bool = False):
    """(args, config) for a command that reads a YAML config; config is None when the
    command only printed the template. `flags`: (name, help) of the command's own switches;
    `any_command`: the config may be any command's (recognised from its groups), with
    `config_class` the template's."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", help="YAML config (see --template)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a field, e.g. training.steps=100 (repeatable)")
    parser.add_argument("--template", action="store_true", help="print every field with its default and help")
    if training:
        parser.add_argument("--overwrite", action="store_true",
                            help="replace the linnet run in runtime.output_dir (once the new run takes its first step)")
        parser.add_argument("--resume", action="store_true", help="continue the run in runtime.output_dir from its "
                                                                   "latest checkpoint")
        parser.add_argument("--resume-from", metavar="CKPT", help="continue the run from this checkpoint of its "
                                                                  "checkpoints/ (the later ones are deleted)")
    else:
        parser.add_argument("--examples", type=int, default=3, help="examples to show (default: 3)")
    for name, text in flags:
        parser.add_argument(name, action="store_true", help=text)
    args = parse_with_config(parser, argv)
    if args.template:
        print(template(config_class))
        return args, None
    if args.config is None and not args.set:
        parser.error("give --config FILE (and/or --set KEY=VALUE); --template shows the fields")
    config = load(None if any_command else config_class, args.config, args.set)
    from linnet.report.tracking import check

    check(config.runtime.report_to)  # a missing tracker package is refused before anything is written
    return args, config


def engine_quantize(config) -> str | None:
    """An engine's `quantize=` for a run's policy: with it the engine samples from the
    policy's own NF4 base; from a policy split by fsdp or cut into pipeline stages it cannot
    share that, and takes the gathered, dequantized and merged weights instead."""
    t = config.training
    return None if t.shard == "fsdp" or t.pipeline > 1 else config.model.quantize


def steps_factor(config, steps: int):
    """The learning-rate factor of `config`'s lr_schedule over `steps` (raises when the
    schedule cannot fit, before anything is written)."""
    s = config.lr_schedule
    return schedule_factor(s, total=steps)


def optimizer_and_schedule(config, model, steps: int):
    """The config's AdamW over the model's trained parameters and its schedule."""
    from linnet.train.optimizer import adamw

    o = config.optimizer
    optimizer = adamw(model, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay,
                      shard=config.training.shard, kind=o.name)
    return optimizer, lambda_schedule(optimizer, steps_factor(config, steps))


def hold_out(items: list, share: float, seed: int) -> tuple[list, list]:
    """(training items, held-out items): a seeded `share` of the items held out, the rest
    in their order."""
    order = np.random.default_rng(seed).permutation(len(items))
    n = round(share * len(items))
    return [items[i] for i in sorted(order[n:])], [items[i] for i in order[:n]]


NEAR_RECORDS = 200_000  # past this many training records a run checks exact repeats only (near ones cost ~0.2 ms each)


def check_held_out(config, records: list, held_out: list | None = None, *, items: int | None = None) -> None:
    """Before anything trains: held-out records that repeat training records (exact or
    near duplicates, linnet.data.overlap) are warned about (data.overlap: warn) or refused
    (refuse). `held_out`: data.eval_path's records; None: data.eval_share's of `records`,
    split as `hold_out` splits the `items` read from them (checked where one item a record)."""
    import warnings

    from linnet.data.overlap import overlap

    d = config.data
    if d.overlap == "off":
        return
    if held_out is None:
        if items is not None and items != len(records):
            return
        records, held_out = hold_out(records, d.eval_share, config.runtime.seed)
    if not held_out or not records:
        return
    found = overlap(records, held_out, near=len(records) <= NEAR_RECORDS)
    if len(records) > NEAR_RECORDS:
        warnings.warn(f"data.overlap: {len(records):,} training records, so only exact repeats of held-out ones are "
                      f"checked before training (near ones take about a minute a 200,000): `linnet data check "
                      f"{d.path or 'TRAIN'} --against EVAL` checks both", stacklevel=2)
    elif not found.near_checked:
        warnings.warn("data.overlap: near duplicates between the training and held-out records are not checked "
                      "(exact ones are): pip install datasketch", stacklevel=2)
    if not found:
        return
    j, i = found.pairs[0][:2]
    files = d.path or " and ".join(str(m["path"]) for m in getattr(d, "mixture", None) or [])  # a mixture's sources
    against = d.eval_path or f"{files} (data.eval_share's held-out share)"
    fix = (f"`linnet data check {d.path or 'TRAIN'} --against {d.eval_path}` lists them: drop them from one side"
           if d.eval_path else "the file repeats records, and the split put copies on both sides: drop the repeats")
    message = (f"{against}: {len(found.pairs)} held-out record(s) repeat training records of {files} ({found.exact} "
               f"exact, {found.near} near; e.g. {held_out[j].where} and {records[i].where}), so the held-out "
               f"metrics would flatter the model; {fix}, or set data.overlap: off to train anyway")
    if d.overlap == "refuse":
        raise ValueError(message)
    warnings.warn(message, stacklevel=2)


def split_per_step(name: str, per_step: int, per_copy: int = 1) -> int:
    """A step's items for this process: `per_step` split evenly over the copies of the
    model (each process, or each `per_copy` processes splitting one model between them)."""
    shares = data_share(per_copy)[1]
    if per_step % shares:
        where = "processes" if per_copy == 1 else "copies of the model (training.split processes each)"
        raise ValueError(f"config: {name}={per_step} does not split evenly over {shares} {where}; "
                         f"use a multiple of {shares}")
    return per_step // shares


def load_model(card, config):
    """The model a fine-tuning config trains: the base frozen with adapters, or every
    weight trainable; split across the processes with training.shard=fsdp, training.split
    processes at a time splitting every block (tensor parallel), training.pipeline
    processes at a time holding consecutive blocks (pipeline stages), or training.context
    processes at a time splitting every row's positions (context parallel), all placed on
    one mesh (`run_mesh`)."""
    from linnet import nest

    m, lora, t, rt = config.model, config.lora, config.training, config.runtime
    if m.weights not in (None, "random"):
        try:
            weight_files(m.weights)
        except FileNotFoundError as e:
            raise ValueError(f"config: model.weights: {e}") from None
    split, stages, context = getattr(t, "split", 1), getattr(t, "pipeline", 1), getattr(t, "context", 1)
    start_runtime(rt.seed, threads=rt.threads, deterministic=rt.deterministic)
    rank, processes = world()
    device = str(usable_device(rt.device, "runtime.device"))
    if device == "cuda" and processes > 1:  # one GPU a process
        device = f"cuda:{os.environ.get('LOCAL_RANK', rank % torch.cuda.device_count())}"
        torch.cuda.set_device(device)
    mesh = run_mesh(torch.device(device).type, stages=stages, context=context, split=split)
    experts = _expert_mesh(card, t, processes, torch.device(device).type)
    model = nest.load(card, device=device, dtype=m.dtype, weights=m.weights, seed=rt.seed,
                      trainable=not lora.enabled, compile=m.compile, attention=m.attention,
                      tensor_parallel=mesh["split"] if split > 1 else None,
                      sequence_parallel=getattr(t, "sequence_parallel", False),
                      pipeline=mesh["stages"] if stages > 1 else None,  # each process builds its stage alone
                      # GPipe for a step with fewer rows than stages
                      pipeline_schedule=getattr(t, "pipeline_schedule", "1f1b"),
                      # no process ever holds the whole model (a stage's blocks: over copies of the pipeline)
                      fully_shard=t.shard == "fsdp" and processes > split * stages, expert_parallel=experts,
                      activation_checkpointing=t.activation_checkpointing,
                      activation_memory_budget=m.activation_memory_budget, quantize=m.quantize,
                      lora=lora_options(config) if lora.enabled else None)
    model.tile_mlp(t.mlp_tile)
    if context > 1:  # after the adapters: their gradients are summed over the context group too
        model.split_context(mesh["context"])
    trained = [p for p in model.parameters() if p.requires_grad]
    if rank == 0:
        parts = (f", {model.pipe}" if stages > 1 else "") + (f", split {split} ways" if split > 1 else "") + (
            " with its positions" if model.sequence is not None else "") + (
            f", each row over {context}" if context > 1 else "")
        on = f"{processes} processes ({t.shard}{parts})" if processes > 1 else device
        print(f"{card.name}: {sum(p.numel() for p in trained):,} of {sum(p.numel() for p in model.parameters()):,} "
              f"parameters train ({'LoRA' if lora.enabled else 'full'}) on {on}", file=sys.stderr)
    return model


def lora_options(config) -> dict:
    """add_lora's arguments from a config's lora group."""
    lora = config.lora
    return dict(patterns=lora.targets, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, rslora=lora.rslora,
                dora=lora.dora)


def _expert_mesh(card, t, processes: int, device_type: str):
    """training.expert's mesh: the experts split over groups of that many processes, the
    groups copies of each other (linnet.torch.moe.expert_parallel); None without it."""
    from torch.distributed.device_mesh import init_device_mesh

    if getattr(t, "expert", 1) == 1:
        return None
    if card.experts is None:
        raise ValueError(f"config: training.expert={t.expert} splits a mixture of experts; {card.name} has none")
    if processes % t.expert or t.split * t.pipeline > 1 or t.shard == "zero":
        raise ValueError(f"config: training.expert={t.expert} splits the experts over groups of that many of the "
                         f"run's {processes} processes (a divisor of the count), beside training.shard fsdp at most "
                         "for now: training.split and pipeline 1 and training.shard none or fsdp")
    copies = processes // t.expert
    shape, names = ((t.expert,), ("expert",)) if copies == 1 else ((copies, t.expert), ("expert_copies", "expert"))
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def run_mesh(device_type: str, *, stages: int = 1, context: int = 1, split: int = 1):
    """The run's one DeviceMesh, its dimensions named copies, stages, context and split
    (training.pipeline, training.context, training.split), the last on consecutive ranks
    (under torchrun, inside a node); None when every process holds a whole model."""
    if stages * context * split == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (data_share(stages * context * split)[1], stages, context, split),
                            mesh_dim_names=("copies", "stages", "context", "split"))


def _trackers(config, path: Path, label: str):
    """The run's experiment trackers (runtime.report_to), None when there are none."""
    from linnet.report.tracking import open_trackers

    report_to = config.runtime.report_to
    return open_trackers(report_to, path, name=f"{label}:{path.name}", config=to_dict(config)) if report_to else None


class MetricsLog:
    """A run's `on_step`: appends one JSON line a step (its held-out metrics included, when
    the step evaluated) to the run's metrics.jsonl and moves the progress bar, which shows
    the latest held-out metrics. Use it as a context: it times the run and closes the file."""

    def __init__(self, run: RunDirectory, label: str, steps: int, config, utilization=None):
        lead = world()[0] == 0  # every process evaluates (its share); the first writes and shows
        self.run, self.utilization = run, utilization  # tokens/s -> {"mfu", "hfu"} (None: not known)
        self.file = MetricsFile(run.path / "metrics.jsonl", label, steps, progress=config.runtime.progress,
                                trackers=_trackers(config, run.path, label)) if lead else None
        self.latest: dict = {}
        self.started = self.seconds = 0.0

    def __enter__(self) -> MetricsLog:
        self.started = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.started
        if self.file is not None:
            self.file.close()

    def __call__(self, step) -> None:
        row = {"step": step.step, "loss": step.loss, "lr": step.lr, "grad_norm": step.grad_norm,
               "learned": step.learned, "tokens_per_second": step.tokens_per_second,
               **(self.utilization(step.tokens_per_second) if self.utilization else {}),
               "seconds": step.seconds, **step.metrics}
        self.latest = {k: v for k, v in step.metrics.items() if k.startswith("held_out")} or self.latest
        if self.file is not None:
            self.file.write(row, loss=step.loss, tok_s=step.tokens_per_second, **self.latest)
        self.run.started()


class Job:
    """A training command's run, assembled once from its config (`start`): the run
    directory, checked before anything loads; the model (`load`); the `linnet.run.Run`
    the objective takes, with its optimizer and schedule, the directory's checkpoints and
    final/, the metrics log and the held-out evaluation (`open`); and summary.json
    (`summarize`). A command reads: read the data, start, load, open, run the objective,
    summarize.

        job = runs.start(config, steps, overwrite=False, resume=True)
        if job.complete is not None:
            return job.complete                 # the run had finished: its summary
        model = job.load(card)
        with job.open(model, evaluate) as run:
            history = train(model, rows, run, accumulate=config.training.accumulation)
        return job.summarize(history, card=card.name)
    """

    def __init__(self, config, steps: int, directory: RunDirectory, label: str, general=None, tenant=None):
        self.config, self.steps, self.directory, self.label = config, steps, directory, label
        self.complete = directory.complete
        self.log: MetricsLog | None = None
        self.general = general  # evaluation.general's packed rows, or None
        self.tenant = tenant  # one of several adapters' runs over a shared base (linnet.commands.adapters)

    def load(self, card):
        """The model the config trains (`load_model`), or a tenant's: the shared base
        carrying its adapters."""
        return load_model(card, self.config) if self.tenant is None else self.tenant.load(card, self.config)

    @contextmanager
    def open(self, model=None, evaluate=None, *, optimizer=None):
        """Write the run directory's files and yield the Run: the config's AdamW over what
        trains in `model` and its schedule over `steps` (or `optimizer`, the JAX backend's
        optax one, scheduled itself), the gradient clip, checkpoints (checkpoints/, every
        training.checkpoint_every, keeping training.keep), final/ and the metrics log,
        with `evaluate` every evaluation.every steps."""
        from linnet.run import Run

        c, t = self.config, self.config.training
        if self.general is not None:
            if model is None:
                raise ValueError("evaluation.general: the JAX backend does not evaluate a general set yet; drop it, or "
                                 "train with linnet sft")
            evaluate = with_general(evaluate, self.general, t.per_copy)
        schedule = None
        if optimizer is None:
            optimizer, schedule = optimizer_and_schedule(c, model, self.steps)
        rates = _utilization(model, t.context_length)
        with self.directory.open() as out, MetricsLog(self.directory, self.label, self.steps, c, rates) as self.log:
            yield Run(optimizer=optimizer, steps=self.steps, clip=c.optimizer.grad_clip, schedule=schedule,
                      save_to=out / "final", checkpoint=out / "checkpoints", checkpoint_every=t.checkpoint_every,
                      keep=t.keep, on_step=self.log if self.tenant is None else self.tenant.stepped(self.log),
                      evaluate=evaluate, evaluate_every=c.evaluation.every)

    def summarize(self, history, card: str, **extra: Any) -> dict:
        """summary.json (see `summarize`), with the card and the planned steps."""
        return summarize(self.directory, history, self.log, card=card, steps=self.steps, **extra)


def _utilization(model, context: int):
    """tokens/s -> MFU and HFU of a PyTorch model's training steps, each process's device
    at its peak (linnet.torch.flops); None for a model linnet cannot count (JAX's)."""
    if model is None or not hasattr(model, "checkpointing"):
        return None
    from linnet.torch.flops import utilization

    frozen, processes = any(not p.requires_grad for p in model.parameters()), world()[1]
    return lambda tokens_per_second: utilization(
        model.card, context, tokens_per_second / processes, model.device, model.dtype, frozen_base=frozen,
        recompute=model.checkpointing is not None)


def start(config, steps: int, *, overwrite: bool = False, resume: bool = False,
          resume_from: str | os.PathLike | None = None, label: str | None = None, tenant=None) -> Job:
    """The Job of a training command's config: its run directory checked (reads only) for
    the command line's --overwrite, --resume and --resume-from, and evaluation.general's
    records read. `tenant`: the run is one of `linnet adapters`' (its progress bar
    labelled with the adapter's name)."""
    general = general_rows(config)
    directory = RunDirectory(config, overwrite=overwrite, resume=resume, resume_from=resume_from)
    label = label or (config.command if tenant is None else f"{config.command} {tenant.name}")
    return Job(config, steps, directory, label, general, tenant)


def card_and_tokenizer(config):
    """(the card a fine-tuning config's model group names, RoPE changes applied; the
    tokenizer its records are read with: data.tokenizer, else the card's)."""
    from linnet.cards import REGISTRY, configured
    from linnet.data import load_tokenizer

    d = config.data
    card = configured(vars(config.model))
    if d.tokenizer and d.tokenizer not in REGISTRY and not Path(d.tokenizer).exists():
        raise ValueError(f"config: data.tokenizer={d.tokenizer!r}: no such directory; give a directory holding "
                         "tokenizer.json, a model or run directory, or a registered card")
    try:
        return card, load_tokenizer(d.tokenizer or card, chat_template=d.chat_template)
    except FileNotFoundError as e:
        if not d.tokenizer:
            raise
        raise ValueError(f"config: data.tokenizer: {e}") from None


def general_rows(config) -> list | None:
    """evaluation.general's records (general-capability text, chats or prompt/completion
    records) as packed rows of the run's tokenizer and row length, or None."""
    path = getattr(config.evaluation, "general", None)
    if not path:
        return None
    from linnet.commands import spellings
    from linnet.data import examples_from_records, read_records
    from linnet.data.examples import text_examples
    from linnet.packing import pack

    d, t = config.data, config.training
    tokenizer = card_and_tokenizer(config)[1]
    records = read_records(path, field="evaluation.general")
    if not records:
        raise ValueError(f"evaluation.general: {path} holds no records")
    if set(records[0].data) == {"text"}:  # documents, learned whole
        examples = text_examples(records, tokenizer, tokens=t.context_length)
    else:
        examples = examples_from_records(records, tokenizer, tokens=t.context_length, chat=d.chat, truncate=True,
                                         names=spellings.RECORDS)
    return list(pack(examples, t.context_length, pad_id=tokenizer.pad_id))


def with_general(evaluate, rows: list, per_copy: int):
    """`evaluate` (None: nothing else) and the loss on evaluation.general's rows, as
    held_out_general_loss: what fine-tuning costs the model elsewhere (forgetting)."""
    from linnet.train.evaluation import held_out_loss

    share, shares = data_share(per_copy)

    def both(model) -> dict:
        out = dict(evaluate(model)) if evaluate is not None else {}
        out["held_out_general_loss"] = held_out_loss(model, rows, share=share, shares=shares)
        return out

    return both


def execute(run, args, config, **options) -> int:
    """Run a training command's `run(config, ...)` with the command line's --overwrite,
    --resume and --resume-from (under torchrun, in its process group) and print the
    summary. After a Ctrl-C, say where the run resumes (exit status 130); on SIGTERM (a
    cluster's or spot instance's notice) finish the step in progress, write its
    checkpoint and say so (exit status 143, as a process killed by SIGTERM)."""
    from linnet.run import Preempted, stop_after_a_step

    with process_group(), stop_after_a_step():
        try:
            summary = run(config, overwrite=args.overwrite, resume=args.resume, resume_from=args.resume_from,
                          **options)
        except KeyboardInterrupt:
            return interrupted(config)
        except Preempted as stopped:
            return preempted(config, stopped)
        print_table(summary)
    return 0


def interrupted(config) -> int:
    """Say, after a Ctrl-C, where the run can resume from; the exit status 130."""
    found = layout.find_checkpoint(Path(config.runtime.output_dir) / "checkpoints")
    where = (f"the latest checkpoint is {found}; add --resume to the same command to continue from it"
             if found is not None else "no checkpoint was written yet; the same command with --overwrite restarts")
    print(f"linnet {config.command}: interrupted; {where}", file=sys.stderr)
    return 130


def preempted(config, stopped) -> int:
    """Say, after a SIGTERM, which checkpoint was written and how to continue; exit status 143."""
    if world()[0] == 0:
        found = layout.find_checkpoint(Path(config.runtime.output_dir) / "checkpoints")
        print(f"linnet {config.command}: stopped by SIGTERM after step {stopped.step}; its checkpoint is {found}; "
              "the same command with --resume continues from it", file=sys.stderr)
    return 143


def summarize(run: RunDirectory, history, log: MetricsLog, **extra: Any) -> dict:
    """summary.json from the whole metrics log (every session of a resumed run), and
    curves.png (with matplotlib); the first process writes and returns it, the others
    return {}."""
    from linnet.report.metrics import read_metrics
    from linnet.report.plots import write_curves

    if world()[0] != 0:
        return {}
    records = read_metrics(run.path)
    seconds = sum(r["seconds"] for r in records)
    summary = {
        **extra,
        "steps_this_run": len(history.steps),
        "seconds": round(log.seconds, 1),
        "first_loss": records[0]["loss"] if records else None,
        "last_loss": records[-1]["loss"] if records else None,
        "tokens_per_second": sum(r["tokens_per_second"] * r["seconds"] for r in records) / seconds if seconds else None,
        "final": str(run.path / "final"),
    }
    for key in ("mfu", "hfu"):  # over the whole run, each step weighed by its time
        if seconds and all(key in r for r in records):
            summary[key] = sum(r[key] * r["seconds"] for r in records) / seconds
    for key in sorted({k for r in records for k in r if k.startswith("held_out")}):
        summary[key] = [r[key] for r in records if key in r][-1]
    curves = write_curves(records, run.path / "curves.png", title=f"linnet {run.config.command}: {run.path.name}")
    summary["curves"] = None if curves is None else str(curves)
    write_text(run.path / "summary.json", json.dumps(summary, indent=2) + "\n")
    return summary
