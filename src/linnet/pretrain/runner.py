"""The pretraining run (`linnet pretrain`, linnet.commands.pretrain): train a Llama
decoder from a token cache, with epoch validation, checkpoint policies and exact resume.

    summary = run(load(PretrainConfig, "configs/pretrain-tiny-cpu.yaml"))

Each update is `linnet.train.loop.take_step` over this process's microbatches, read from
the loader as they are needed: backward of each summed token loss divided by the update's
target count, then reduce across processes, clip, step, schedule (a non-finite norm stops). At the end of
each virtual epoch the fixed validation subset is evaluated, best.json updated, and the
epoch's retained files written.

Under P processes (torchrun; gloo on CPU, NCCL on GPUs) the global batch is the same
sample stream as in one process: each process trains `accumulation / P` of the update's
microbatches and skips the others', so the losses equal a one-process run's to rounding,
and the cursor, checkpoints and recipe identity do not depend on P (a run may resume under
another process count). The first process alone writes the run directory.

A run directory holds:

    config.yaml   the resolved config (pass it back with --config to resume)
    run.json      recipe identity and fields, budget, cache, environment
    metrics.jsonl one row per update; `held_out_loss` on each epoch's last row
    best.json     the best epoch by validation loss and the file holding its weights
                  (its epoch file, or final.safetensors for the last epoch), if kept
    epoch-NNN.safetensors   weights of selected epochs (interval/explicit policies)
    final.safetensors       final weights (every policy but none)
    checkpoints/step-NNNNNNNN/  resumable training state (linnet.train.checkpoint format,
                  plus checksums.json): final, and selected epochs with
                  save_epoch_training_state; `--resume RUN/epoch-NNN.pt` (or final.pt)
                  names them as seed 002 does (linnet.pretrain.snapshots)
    summary.json  final metrics and full validation; its presence marks a complete run

Running a config whose output directory holds an incomplete run resumes it from its
latest checkpoint (the recipe identity must match); a complete run is left as it is.

What trains is a trainee: `OrdinaryTrainee` (one Decoder and AdamW), or, with a
`decentralized` group, `linnet.pretrain.decentralized_run.PackedTrainee` (N packed workers whose
average is validated and exported at the root, each worker under node-NNN/). Both give the
step's `Work`, the model to evaluate, weight exports and training-state snapshots.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from linnet.config import PretrainConfig, checkpoint_epochs
from linnet.config.fields import differences
from linnet.config.fields import identity as recipe_identity
from linnet.files import checkpoints as layout
from linnet.files.atomic import SetAside, check_writable, is_leftover, recover_set_aside, remove_leftovers, write_text
from linnet.pretrain.budget import Budget
from linnet.pretrain.cache import TokenCache, open_cache
from linnet.pretrain.recipe import (
    make_budget,
    model_card,
    recipe_fields,
    to_yaml,
)
from linnet.pretrain.snapshots import CHECKPOINTS, find_checkpoint
from linnet.report.metrics import MetricsFile, keep_metrics, read_metrics
from linnet.report.plots import write_curves
from linnet.schedules import lambda_schedule, schedule_factor
from linnet.torch.flops import flops_per_token, utilization
from linnet.torch.loading import compute_dtype
from linnet.train.checkpoint import verify_checkpoint

# ---------------------------------------------------------------------------------------
# The model, optimizer and schedule of a config


def cache_card(config: PretrainConfig, cache: TokenCache):
    """The config's model card for the cache's tokenizer (its vocabulary, its EOS)."""
    return model_card(config, cache.vocab_size, cache.eos_id, str(cache.path))


# ---------------------------------------------------------------------------------------
# Checkpoints: linnet.train.checkpoint directories, verified by checksums (found by step
# directory, run directory or the seed's names: linnet.pretrain.snapshots.find_checkpoint)


@dataclass
class Counters:
    """Counters a checkpoint carries besides the model, optimizer and schedule."""

    step: int = 0
    epoch: int = 0  # completed epochs
    best: dict[str, Any] | None = None
    seconds: float = 0.0  # training time so far (all sessions)
    loader_seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"step": self.step, "epoch": self.epoch, "best": self.best, "seconds": self.seconds,
                "loader_seconds": self.loader_seconds}


def save_state(out: Path, *, trainee, schedule, loader, progress: Counters, kind: str,
               fields: dict[str, Any], identity: str) -> Path | None:
    """A resumable snapshot: the trainee's checkpoint directory plus checksums.json,
    written last (a checkpoint without it is incomplete). Every process calls it (a split
    optimizer state is gathered, sharded parts written by each); the first writes the rest."""
    extra = {
        "kind": kind,
        "progress": progress.as_dict(),
        "cursor": loader.cursor(),
        "recipe": {"identity": identity, "fields": fields},
    }
    return trainee.save_state(out / CHECKPOINTS, progress.step, schedule, extra)


class OrdinaryTrainee:
    """One Decoder and its AdamW: what an ordinary pretraining run trains (the packed
    counterpart is linnet.pretrain.decentralized_run.PackedTrainee). `share`: this process's
    micro-batches an update; `count`: the update's targets over every process."""

    def __init__(self, model, optimizer, share: int, count: int):
        from linnet.train.loop import trained_parameters

        self.model, self.optimizer, self.micro_batches, self.count = model, optimizer, share, count
        self.params = trained_parameters(model)

    def work(self, batches, learned: int):
        from linnet.train.loop import Work

        return Work(batches, lambda _, batch: (self.model.loss_packed(batch)[0], {}), self.count, learned, learned)

    def report(self, row: dict[str, Any]) -> None:
        """Nothing beyond the step's own metrics."""

    def evaluation_model(self):
        return self.model

    def metadata(self) -> None:
        return None

    def save_weights(self, out: Path, stem: str) -> None:
        self.model.save_weights(out / f"{stem}.safetensors", dtype=torch.float32)

    def save_state(self, directory: Path, step: int, schedule, extra: dict[str, Any]) -> Path | None:
        from linnet.train.checkpoint import save_checkpoint

        return save_checkpoint(directory, model=self.model, optimizer=self.optimizer, step=step, schedule=schedule,
                               keep=0, extra=extra)

    def load_state(self, checkpoint: Path, schedule) -> None:
        from linnet.train.checkpoint import load_checkpoint

        load_checkpoint(checkpoint, model=self.model, optimizer=self.optimizer, schedule=schedule)


def _trainee(config: PretrainConfig, card, budget: Budget, device: torch.device, processes: int):
    """The run's model and optimizer: a PackedTrainee with a decentralized group, else an
    OrdinaryTrainee."""
    from linnet import nest
    from linnet.train.optimizer import adamw

    m, t, o = config.model, config.training, config.optimizer
    if config.decentralized is not None:
        from linnet.pretrain.decentralized_run import PackedTrainee

        if m.compile or t.activation_checkpointing or t.mlp_tile or o.name != "adamw":
            raise ValueError("config: packed decentralized training runs eager, without activation checkpointing or "
                             "MLP tiles, with its own AdamW over the arenas: set model.compile=false, "
                             "training.activation_checkpointing=false, training.mlp_tile=null and optimizer.name=adamw")
        return PackedTrainee(config, card, budget.steps, device, compute_dtype(m.dtype, device, card))
    model = nest.load(card, device=device, dtype=m.dtype, weights="random", seed=config.runtime.seed, trainable=True,
                      compile=m.compile, attention=m.attention, activation_checkpointing=t.activation_checkpointing,
                      activation_memory_budget=m.activation_memory_budget,
                      fully_shard=t.shard == "fsdp" and processes > 1)  # each process drawing only its part
    model.tile_mlp(t.mlp_tile)
    optimizer = adamw(model, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, kind=o.name,
                      shard=t.shard)
    return OrdinaryTrainee(model, optimizer, t.accumulation // processes,
                           budget.batch_targets)


# ---------------------------------------------------------------------------------------
# The run directory


def _environment(device: torch.device) -> dict[str, Any]:
    env = {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__,
           "platform": platform.platform(), "device": str(device), "cpu_threads": torch.get_num_threads()}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


def _check_cache_settings(config: PretrainConfig, cache: TokenCache) -> None:
    """The config's corpus settings, when it names a corpus, must be the cache's."""
    from linnet.pretrain.prepare import requested_settings, settings_differences

    d = config.data
    if not d.source and d.dataset is None and not d.mixture:
        return
    saved = dict(cache.settings)
    try:
        wanted = requested_settings(d)
    except FileNotFoundError:  # the corpus moved away: the cache stands on its own
        wanted = requested_settings(dataclasses.replace(d, source=[], validation_source=[], mixture=[]))
        for key in ("source", "validation_source", "mixture"):
            saved.pop(key, None)
            wanted.pop(key, None)
    changed = settings_differences(saved, wanted)
    if changed:
        raise ValueError(f"{cache.path}: prepared with other settings than this config: " + "; ".join(changed)
                         + ". Point data.cache at a cache prepared with this config (`linnet prepare`)")


@dataclass
class Start:
    """Where a run starts: fresh, or from a verified checkpoint."""

    checkpoint: Path | None = None
    state: dict[str, Any] | None = None
    complete: dict[str, Any] | None = None  # the summary of a run already finished
    clear: bool = False  # replace the run in the output directory (--overwrite)


def _start(config: PretrainConfig, out: Path, fields: dict[str, Any], identity: str,
           resume: str | os.PathLike | None, overwrite: bool) -> Start:
    """Decide (and check) where the run starts. It only reads (but for settling what a
    killed replacement left), so that every process decides alike before the first one
    changes anything (`Start.clear`)."""

    def refuse_other_recipe(where: Path, run_dir: Path, saved_fields: dict[str, Any], saved_identity: str) -> None:
        changed = differences(saved_fields, fields, ("run", "config"))
        if changed:
            raise ValueError(
                f"{where}: written by another recipe (identity {saved_identity}; this config gives {identity}); "
                f"differing fields: {'; '.join(changed)}. Resume with the run's own config "
                f"({run_dir / 'config.yaml'}), changing only device, output directory, prefetch or checkpoint "
                "retention; or start a fresh run"
            )

    check_writable(out, "runtime.output_dir")
    recover_set_aside(out)
    used = out.exists() and any(not is_leftover(p) for p in out.iterdir())  # a killed write's leftover is not a run
    if used and overwrite and not (out / "run.json").is_file():
        raise ValueError(f"{out}: holds files but no linnet run (no run.json); refusing to replace it: choose "
                         "another runtime.output_dir")
    if used and overwrite and (other := json.loads((out / "run.json").read_text()).get("command")) != "pretrain":
        raise ValueError(f"{out / 'run.json'}: a `linnet {other}` run; `linnet pretrain --overwrite` replaces only a "
                         "`linnet pretrain` run: choose another runtime.output_dir")
    if resume is not None:
        checkpoint = find_checkpoint(resume)
        run_dir = checkpoint.parent.parent
        same = out.exists() and out.resolve() == run_dir.resolve()
        if same and overwrite:
            raise ValueError(f"--overwrite would delete {checkpoint}, the checkpoint to resume from; branch into a "
                             "fresh runtime.output_dir instead")
        if used and not same and not overwrite:
            raise ValueError(f"{out}: the output directory holds another run; branch from {checkpoint} into a fresh "
                             "runtime.output_dir (or pass --overwrite)")
    elif used and not overwrite:
        run_file = out / "run.json"
        if not run_file.is_file():
            raise ValueError(f"{out}: exists and is not a linnet pretraining run; choose another runtime.output_dir")
        saved = json.loads(run_file.read_text())
        refuse_other_recipe(run_file, out, saved["recipe"]["fields"], saved["recipe"]["identity"])
        if (out / "summary.json").is_file():
            return Start(complete=json.loads((out / "summary.json").read_text()))
        found = layout.checkpoints(out / CHECKPOINTS)
        if not found:  # nothing retained to resume from: the same recipe starts again
            print(f"{out}: an incomplete run that kept no training state (checkpoint policy "
                  f"{saved.get('checkpoint_policy', '?')}); starting it again", file=sys.stderr)
            return Start(clear=True)
        checkpoint, run_dir = found[-1], out
    else:
        return Start(clear=overwrite and out.exists())
    state = verify_checkpoint(checkpoint)
    recipe = state["extra"].get("recipe")
    if recipe is None:
        raise ValueError(f"{checkpoint}: not a pretraining checkpoint (a fine-tuning run's?); --resume-from takes a "
                         "checkpoint written by `linnet pretrain`")
    refuse_other_recipe(checkpoint, run_dir, recipe["fields"], recipe["identity"])
    return Start(checkpoint, state, clear=overwrite and used and out.resolve() != run_dir.resolve())


# ---------------------------------------------------------------------------------------
# The run


def _open_run_directory(out: Path, start: Start, progress: Counters, config: PretrainConfig,
                        record: dict[str, Any]) -> None:
    """The run directory at the start of a session (first process): metrics kept up to
    the checkpoint (rows a resumed run would otherwise log twice), best.json, the
    resolved config and run.json."""
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "run.json", json.dumps(record, indent=1) + "\n")  # first: it marks the run
    remove_leftovers(out, out / CHECKPOINTS)
    if start.checkpoint is None:
        write_text(out / "metrics.jsonl", "")
    else:
        source_run = start.checkpoint.parent.parent
        keep_metrics(source_run / "metrics.jsonl", out / "metrics.jsonl", progress.step)
        print(f"resuming from {start.checkpoint} (epoch {progress.epoch}, update {progress.step})", file=sys.stderr)
        if progress.best is not None:
            if progress.best["weights"] and source_run.resolve() != out.resolve():  # a branch: name the original
                kept = source_run / progress.best["weights"]
                progress.best["weights"] = str(kept) if kept.is_file() else None
            write_text(out / "best.json", json.dumps(progress.best, indent=1) + "\n")
    write_text(out / "config.yaml", to_yaml(config))


def run(config: PretrainConfig, *, resume: str | os.PathLike | None = None, overwrite: bool = False) -> dict[str, Any]:
    """Pretrain as `config` says (resuming when told, or when its output directory holds
    an incomplete run); returns the summary written to summary.json, on every process.
    `resume`: a checkpoints/step-… directory, a run directory (its latest), or the seed's
    `RUN/epoch-NNN.pt` / `RUN/final.pt` (linnet.pretrain.snapshots.find_checkpoint)."""
    from linnet.config import to_dict
    from linnet.pretrain.loader import Loader, Validation
    from linnet.report.tracking import check as check_trackers
    from linnet.report.tracking import open_trackers
    from linnet.run import Preempted, Run
    from linnet.torch.distributed import barrier, from_first, world
    from linnet.torch.loading import usable_device
    from linnet.train.evaluation import held_out_loss
    from linnet.train.loop import fit, start_runtime

    d, t, rt = config.data, config.training, config.runtime
    check_trackers(rt.report_to)
    rank, processes = world()
    lead = rank == 0  # writes the run directory
    if config.decentralized is not None and processes > 1:
        raise ValueError(f"config: decentralized training computes its {config.decentralized.num_models} workers "
                         f"together on one device; run it in one process, not under torchrun ({processes})")
    if t.accumulation % processes:
        raise ValueError(f"config: training.accumulation={t.accumulation} micro-batches an update do not split "
                         f"evenly over {processes} processes; use a multiple of {processes} (the global batch, "
                         "micro_batch_size x accumulation sequences, is part of the recipe)")
    device = usable_device(rt.device, "runtime.device")
    if device.type == "cuda" and processes > 1:  # one GPU a process
        if device.index is None:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
        torch.cuda.set_device(device)
    if not d.cache:
        raise ValueError("config: data.cache is required (prepare it with `linnet prepare --config …`)")
    cache = open_cache(d.cache)
    _check_cache_settings(config, cache)
    if cache.manifest.get("validation_repeats") and d.overlap != "off":
        from linnet.pretrain.prepare import check_repeats

        check_repeats(d, cache.manifest["validation_repeats"], "cache's validation split")
    fields = recipe_fields(config, cache.fingerprint)
    identity = recipe_identity(fields)
    card = cache_card(config, cache)
    budget = make_budget(config, card.params())
    if not d.repeat:
        from linnet.pretrain.loader import shard_groups

        available = sum(g.count for g in shard_groups(cache.train, t.context_length, d.shuffle_group_size))
        if budget.sequences > available:
            raise ValueError(
                f"{cache.path}: the budget needs {budget.sequences:,} training sequences of {t.context_length} tokens "
                f"and the cache holds {available:,} ({budget.sequences / max(available, 1):.2f} passes); prepare a "
                "larger cache, lower the budget (training.targets_per_parameter), or set data.repeat=true"
            )
    selected = checkpoint_epochs(config)
    out = Path(rt.output_dir)
    start = _start(config, out, fields, identity, resume, overwrite)
    if start.complete is not None:
        return start.complete
    barrier()  # every process has read the output directory before the first one changes it
    # an overwritten run is set aside until this one has taken its first update (restored if it fails first)
    aside = SetAside(out) if lead and start.clear else None

    def session() -> dict[str, Any]:
        nonlocal aside
        start_runtime(rt.seed, threads=rt.threads, deterministic=rt.deterministic)
        trainee = _trainee(config, card, budget, device, processes)
        dtype = compute_dtype(config.model.dtype, device, card)  # what its matmuls run in (MFU's peak)
        assert sum(p.numel() for p in trainee.evaluation_model().parameters()) == card.params()
        optimizer = trainee.optimizer
        schedule = lambda_schedule(optimizer, schedule_factor(config.lr_schedule, total=budget.steps))
        progress = Counters()
        loader_kw = dict(context=t.context_length, group_size=d.shuffle_group_size, seed=rt.seed, repeat=d.repeat,
                         prefetch=d.prefetch, device=device)
        if start.checkpoint is not None:
            extra = start.state["extra"]
            trainee.load_state(start.checkpoint, schedule)
            progress = Counters(**extra["progress"])
            loader = Loader.restore(cache.train, extra["cursor"], **loader_kw)
        else:
            loader = Loader(cache.train, **loader_kw)
        if lead:
            _open_run_directory(out, start, progress, config, {
                "command": "pretrain",
                "recipe": {"identity": identity, "fields": fields},
                "checkpoint_policy": t.checkpoint_policy,
                "budget": {"parameters": budget.parameters, "targets": budget.targets, "steps": budget.steps,
                           "epochs": budget.epochs, "boundaries": list(budget.boundaries),
                           "batch_targets": budget.batch_targets,
                           "flops_per_token": flops_per_token(card, t.context_length)},
                "cache": {"path": str(cache.path), "fingerprint": cache.fingerprint, "train_tokens": cache.train.tokens,
                          "validation_tokens": cache.validation.tokens, "vocab_size": cache.vocab_size},
                "loader": {"sequences_per_pass": loader.sequences_per_pass,
                           "passes": budget.sequences / loader.sequences_per_pass},
                "processes": processes,
                "decentralized": trainee.metadata(),
                "environment": _environment(device),
                "resumed_from": None if start.checkpoint is None else str(start.checkpoint),
            })
        validation = Validation(cache.validation, context=t.context_length,
                                subset_sequences=config.evaluation.subset_sequences, device=device) \
            if (config.evaluation.subset_sequences or config.evaluation.full_validation) else None

        save_kw = dict(trainee=trainee, schedule=schedule, loader=loader, fields=fields, identity=identity)
        metrics = None
        if lead:
            print(f"pretrain: {budget.parameters:,} parameters, {budget.steps:,} updates in {budget.epochs} epochs, "
                  f"{budget.trained_targets:,} targets on {device} x {processes} (recipe {identity})", file=sys.stderr)
            trackers = open_trackers(rt.report_to, out, name=f"pretrain:{out.name}",
                                     config=to_dict(config)) if rt.report_to else None
            metrics = MetricsFile(out / "metrics.jsonl", "pretrain", budget.steps, progress=rt.progress,
                                  trackers=trackers)
        B = t.micro_batch_size
        share = trainee.micro_batches  # this process's micro-batches of each update, after `before` sequences
        before, after = rank * share * B, (processes - 1 - rank) * share * B
        learned = budget.batch_targets  # the global batch's targets, every one learned
        clip = config.optimizer.grad_clip if config.decentralized is None else None  # PackedAdamW clips locally
        waited = 0.0  # seconds the current update waited for the loader

        def micro_batches():
            """This process's share of the update's micro-batches, read as they are needed."""
            nonlocal waited
            waited = 0.0
            loader.skip(before)
            for _ in range(share):
                tl = time.perf_counter()
                batch = loader.batch(B)
                waited += time.perf_counter() - tl
                yield batch
            loader.skip(after)

        session_start, session_steps = time.perf_counter(), 0

        def at_step(record) -> None:
            """After each update: the metrics row; at an epoch's end its validation, best.json
            and retained files (the epoch boundary)."""
            nonlocal aside, session_steps
            step, epoch = record.step, budget.epoch_of(record.step)
            record.metrics["loader_seconds"] = waited
            progress.step, progress.seconds = step, progress.seconds + record.seconds
            progress.loader_seconds += waited
            session_steps += 1
            if aside is not None:
                aside.drop()
                aside = None
            row = {"step": step, "epoch": epoch, "loss": record.loss, "lr": record.lr, "grad_norm": record.grad_norm,
                   "tokens_per_second": record.tokens_per_second,
                   **utilization(card, t.context_length, record.tokens_per_second / processes, device, dtype,
                                 frozen_base=False, recompute=bool(t.activation_checkpointing)),
                   "seconds": record.seconds, "loader_seconds": waited,
                   "targets": step * learned}
            trainee.report(row)
            last = step == budget.boundaries[epoch - 1]
            if last and validation is not None and len(validation.subset):
                row["held_out_loss"] = held_out_loss(trainee.evaluation_model(),
                                                     validation.subset_batches(config.evaluation.batch_size),
                                                     share=rank, shares=processes)
                if progress.best is None or row["held_out_loss"] < progress.best["held_out_loss"]:
                    progress.best = {"epoch": epoch, "step": step, "held_out_loss": row["held_out_loss"],
                                     "weights": _weights_of(epoch, t.checkpoint_policy, selected, budget.epochs)}
                    if lead:
                        write_text(out / "best.json", json.dumps(progress.best, indent=1) + "\n")
            if metrics is not None:
                metrics.write(row, loss=row["loss"], tok_s=record.tokens_per_second)
            if last:
                progress.epoch = epoch
                if t.checkpoint_policy != "none" and epoch in selected:
                    trainee.save_weights(out, f"epoch-{epoch:03d}")  # every process: a sharded model gathers
                    if t.save_epoch_training_state and epoch < budget.epochs:  # the last is the final state
                        save_state(out, progress=progress, kind="epoch", **save_kw)

        # the run's state is restored above (trainee, progress, loader): fit starts after its step, and writes
        # no checkpoint of its own (epoch snapshots and the final state are this runner's)
        plumbing = Run(optimizer=optimizer, steps=budget.steps, clip=clip, schedule=schedule, on_step=at_step)
        try:
            fit(trainee.model, range(budget.steps), lambda step, _: trainee.work(micro_batches(), share * B * t.context_length),
                plumbing, per_step=1, start=progress.step, what="pretrain: the budget")
        except Preempted as stopped:  # SIGTERM: the step's state is kept (unless the policy keeps none)
            kept = t.checkpoint_policy != "none"
            if kept:
                save_state(out, progress=progress, kind="stop", **save_kw)
            raise Preempted(stopped.step, out / CHECKPOINTS if kept else None) from None
        finally:
            if metrics is not None:
                metrics.close()
            loader.close()
        if t.checkpoint_policy != "none":
            if progress.step > (start.state["step"] if start.state else 0) or start.checkpoint is None:
                save_state(out, progress=progress, kind="final", **save_kw)
            trainee.save_weights(out, "final")
        full = None
        if validation is not None and config.evaluation.full_validation:
            t0 = time.perf_counter()
            full = held_out_loss(trainee.evaluation_model(), validation.full_batches(config.evaluation.batch_size),
                                 share=rank, shares=processes)
            full_seconds = time.perf_counter() - t0
        summary = None
        if lead:
            summary = _summary(config, out, budget, card, progress, identity, session_steps,
                               time.perf_counter() - session_start)
            if trainee.metadata() is not None:
                summary["decentralized"] = trainee.metadata()
            if full is not None:
                summary.update(full_validation_loss=full, full_validation_perplexity=float(np.exp(full)),
                               full_validation_sequences=validation.total, full_validation_seconds=round(full_seconds, 2))
            curves = write_curves(read_metrics(out, missing_ok=True), out / "curves.png",
                                  title=f"linnet pretrain: {out.name}")
            summary["curves"] = None if curves is None else str(curves)
            write_text(out / "summary.json", json.dumps(summary, indent=1) + "\n")
        return from_first(summary)

    try:
        return session()
    except BaseException:
        if aside is not None:
            aside.restore()
        raise


def _weights_of(epoch: int, policy: str, selected, epochs: int) -> str | None:
    """The file of the run directory that will hold `epoch`'s weights, if any: its own
    epoch file, or the final weights for the last epoch (written at the end, by every
    policy but none)."""
    if epoch in selected:
        return f"epoch-{epoch:03d}.safetensors"
    return "final.safetensors" if epoch == epochs and policy != "none" else None


def _summary(config, out: Path, budget: Budget, card, progress: Counters, identity: str, session_steps: int,
             session_seconds: float) -> dict[str, Any]:
    rows = read_metrics(out, missing_ok=True)
    last_epoch = [r["loss"] for r in rows if r.get("epoch") == budget.epochs]
    tokens = budget.batch_targets * budget.steps
    tokens_per_second = tokens / progress.seconds if progress.seconds else None
    return {
        "recipe": identity,
        "parameters": budget.parameters,
        "steps": budget.steps,
        "epochs": budget.epochs,
        "targets": budget.trained_targets,
        "train_seconds": round(progress.seconds, 2),
        "steps_this_session": session_steps,
        "tokens_per_second": tokens_per_second,
        "model_tflops_per_second": tokens_per_second * flops_per_token(card, config.training.context_length) / 1e12
        if tokens_per_second else None,
        **{key: sum(r[key] * r["seconds"] for r in rows) / sum(r["seconds"] for r in rows)  # time-weighted
           for key in ("mfu", "hfu") if rows and all(key in r for r in rows)},
        "loader_share": progress.loader_seconds / progress.seconds if progress.seconds else None,
        "first_loss": rows[0]["loss"] if rows else None,
        "final_loss": rows[-1]["loss"] if rows else None,
        "last_epoch_mean_loss": float(np.mean(last_epoch)) if last_epoch else None,
        "held_out_loss": next((r["held_out_loss"] for r in reversed(rows) if "held_out_loss" in r), None),
        "best": progress.best,
        "final_weights": str(out / "final.safetensors") if (out / "final.safetensors").is_file() else None,
    }


def plan(config: PretrainConfig) -> list[tuple[str, str]]:
    """The budget table of a config (needs its cache for the vocabulary)."""
    cache = open_cache(config.data.cache)
    card = cache_card(config, cache)
    budget = make_budget(config, card.params())
    return budget.table() + [
        ("cache", f"{cache.path} ({cache.train.tokens:,} training tokens)"),
        ("passes over the cache", f"{budget.sequences * config.training.context_length / max(cache.train.tokens, 1):.2f}"),
        ("FLOPs per token", f"{flops_per_token(card, config.training.context_length):.3g}"),
    ]
