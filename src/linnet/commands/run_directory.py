"""A training command's run directory (`runtime.output_dir`), checked before anything is
written: what a run learns from (its recipe: the config's fields that change what it
learns, and fingerprints of its data and model files), and the rules for a new run, a
resumed one (the same recipe; a longer budget extends it) and a replaced one (only what a
run writes goes, and only a run of the same command).

A run directory holds run.json (the command and recipe), config.json, metrics.jsonl,
checkpoints/, final/, summary.json and curves.png.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from linnet.config import to_dict
from linnet.config.fields import differences, flatten, identity
from linnet.files import checkpoints as layout
from linnet.files.atomic import (
    RUN_ENTRIES,
    SetAside,
    check_writable,
    fingerprint,
    is_leftover,
    model_files,
    recover_set_aside,
    remove_leftovers,
    write_text,
)
from linnet.report.metrics import keep_metrics
from linnet.torch.distributed import barrier, data_share, from_first, world
from linnet.torch.loading import usable_device

# Fields that never change what a fine-tuning run learns: where it runs and what it keeps.
# The data files' contents stand for their paths, so data may move between sessions.
RUN_FIELDS = frozenset({"runtime.device", "runtime.output_dir", "runtime.threads", "runtime.progress", "runtime.report_to",
                        "training.checkpoint_every", "training.keep", "evaluation.every", "evaluation.general",
                        "data.overlap", "data.path",
                        "data.eval_path", "dpo.reference_cache", "training.activation_checkpointing",
                        "model.activation_memory_budget", "grpo.vllm_gpu_memory_utilization"})


# How the processes hold the model: a run's checkpoint loads under any of these (its parts
# are regathered), so a run may resume on another number of processes or another layout.
# What a step learns from stays fixed: for sft and distill the rows a step takes, over
# every copy (training.accumulation x the copies: `rows_per_step`).
LAYOUT_FIELDS = ("training.shard", "training.split", "training.pipeline", "training.pipeline_schedule",
                 "training.context", "training.sequence_parallel", "training.expert")
ROWS_PER_STEP = "training.rows_per_step"


# Fields added after runs were saved without them, with the value those runs trained with:
# a run saved before a field existed resumes when the field still has that value.
ADDED_FIELDS = {"dpo.rpo_alpha": 0.0, "grpo.engine": "builtin", "grpo.engine_dtype": None, "grpo.reward_workers": 1,
                "training.pipeline_schedule": "1f1b", "training.expert": 1}


def renamed(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved recipe under today's field names: GRPO's grpo.clip_low and grpo.clip_high
    became grpo.clip [low, high]."""
    if "grpo.clip_low" not in saved:
        return saved
    saved = dict(saved)
    saved["grpo.clip"] = [saved.pop("grpo.clip_low"), saved.pop("grpo.clip_high")]
    return saved


# Fields that name a model's files (a model or run directory, a weights file, a tokenizer):
# where one is a local path, the recipe holds `<field>.files`, the fingerprint of each file
# the model is read from, in place of the path: the same model named by another path
# resumes, and a model whose weights or tokenizer changed is refused naming the file.
MODEL_FIELDS = ("model.card", "model.weights", "data.tokenizer", "distill.teacher")

# What a run reads: never inside what a run writes (an output is never an input).
INPUT_FIELDS = ("data.path", "data.eval_path", *MODEL_FIELDS)

# The fields of a run's budget: resuming with a larger one extends the run.
BUDGET_FIELDS = ("training.steps", "training.epochs")


def _local(value: Any) -> Path | None:
    """`value` as a local path when it names one (not a registered card, not 'random')."""
    from linnet.cards import REGISTRY

    if not isinstance(value, str) or not value or value == "random" or value in REGISTRY:
        return None
    path = Path(value)
    return path if path.exists() else None


def recipe(config) -> dict[str, Any]:
    """The flat fields that decide what a run learns, with its data files' fingerprints
    and its model files' (`MODEL_FIELDS`)."""
    fields = {k: v for k, v in flatten(to_dict(config)).items() if k not in RUN_FIELDS and k not in LAYOUT_FIELDS}
    if config.command in ("sft", "distill"):
        t = config.training
        fields[ROWS_PER_STEP] = fields.pop("training.accumulation") * data_share(t.per_copy)[1]
    mixture = fields.pop("data.mixture", None)
    if mixture:  # the sources' contents and weights, not their paths
        fields["data.mixture.fingerprints"] = [_data_fingerprint(m["path"]) for m in mixture]
        fields["data.mixture.weights"] = [m["weight"] for m in mixture]
        fields["data.mixture.splits"] = [m.get("split") for m in mixture]
    else:
        fields["data.fingerprint"] = _data_fingerprint(config.data.path)
    if config.data.eval_path:
        fields["data.eval_fingerprint"] = _data_fingerprint(config.data.eval_path)
    for name in MODEL_FIELDS:
        path = _local(fields.get(name))
        if path is not None:
            del fields[name]
            fields[f"{name}.files"] = model_files(path)
    return dict(sorted(fields.items()))


def _data_fingerprint(path: str) -> str:
    """A local data file's (or directory's) fingerprint; a hub dataset's name (with
    data.split, a recipe field, it is what the run read)."""
    return fingerprint(path) if Path(path).exists() else f"hub dataset {path}"


def _as_saved(saved: dict[str, Any], now: dict[str, Any], config) -> dict[str, Any]:
    """`now` as a run saved before linnet fingerprinted model files compares it: such a
    run recorded each model field's path, and is compared by that path, as it was. One
    saved before runs could change layout recorded the layout and training.accumulation
    (its processes unknown): compared by those, as it was."""
    now = dict(now)
    flat = flatten(to_dict(config))
    if any(name in saved for name in LAYOUT_FIELDS):
        now.update({name: flat[name] for name in LAYOUT_FIELDS if name in saved})
        if ROWS_PER_STEP in now and ROWS_PER_STEP not in saved:
            del now[ROWS_PER_STEP]
            now["training.accumulation"] = flat["training.accumulation"]
    for name in MODEL_FIELDS:
        if f"{name}.files" in now and f"{name}.files" not in saved and name in saved:
            del now[f"{name}.files"]
            now[name] = flat[name]
    return now


def _budget(fields: dict[str, Any]) -> tuple[str, Any]:
    """(field, value) of a recipe's budget: training.steps when given, else training.epochs."""
    steps = fields.get("training.steps")
    return ("training.steps", steps) if steps is not None else ("training.epochs", fields.get("training.epochs"))


def _changes(saved: dict[str, Any], now: dict[str, Any], config) -> list[str]:
    """What differs between a saved recipe and the config's, the budget left out: a model
    or data file named by its path, any other field with both values."""
    saved = {k: v for k, v in saved.items() if k not in BUDGET_FIELDS}
    now = {k: v for k, v in now.items() if k not in BUDGET_FIELDS}
    flat = flatten(to_dict(config))
    found = []
    for name in MODEL_FIELDS:
        then, files = saved.pop(f"{name}.files", None), now.pop(f"{name}.files", None)
        if then is None or files is None:
            if then is not None or files is not None:  # a local model then, a registered one now, or the reverse
                found.append(f"{name}: {'local files' if then is not None else repr(saved.get(name))} (run) vs "
                             f"{repr(flat.get(name)) if files is not None else repr(now.get(name))} (now)")
                saved.pop(name, None)
                now.pop(name, None)
            continue
        where = Path(flat[name])
        where = where if where.is_dir() else where.parent
        for file in sorted(set(then) | set(files)):
            if file not in files:
                found.append(f"{name}: {where / file} is gone since the run began")
            elif file not in then:
                found.append(f"{name}: {where / file} is new since the run began")
            elif then[file] != files[file]:
                found.append(f"{name}: {where / file} changed since the run began (its SHA-256 differs)")
    for key, name in (("data.fingerprint", "data.path"), ("data.eval_fingerprint", "data.eval_path")):
        if saved.get(key) != now.get(key):
            found.append(f"{key}: {flat.get(name)} holds other records than those the run began with (their "
                         "SHA-256 differs: the file changed, or this is another file)"
                         if key in saved and key in now else f"{key}: {saved.get(key)!r} (run) vs "
                                                             f"{now.get(key)!r} (now)")
        saved.pop(key, None)
        now.pop(key, None)
    return found + differences(saved, now, ("run", "now"))


class RunDirectory:
    """Where a fine-tuning run writes (`runtime.output_dir`), checked before anything is
    written: a new or empty directory starts the run; `resume` continues a run of the
    same command, config, model and data from its latest checkpoint (a complete one only
    gives back its summary; with a larger training.steps or training.epochs it is
    extended, its schedule re-planned over the new total); `overwrite` replaces a linnet
    run of the same command, setting its files (RUN_ENTRIES) aside until the new run has
    taken its first step (restored if the new run fails first). A new run that fails
    before its first step leaves its directory empty, so the corrected command runs as it
    is. Nothing else is touched: a directory that holds no linnet run is refused, files
    beside a run's own stay where they are, and no input (data, model, tokenizer) may lie
    in what the run writes.

        run = RunDirectory(config, overwrite=False, resume=True)    # checks; reads only
        with run.open() as out:                                      # writes
            ...                                                      # run.started() after step 1
    """

    def __init__(self, config, *, overwrite: bool, resume: bool, resume_from: str | os.PathLike | None = None):
        if overwrite and (resume or resume_from):
            raise ValueError("--resume continues the run in runtime.output_dir and --overwrite replaces it; give "
                             "one of them")
        self.config, self.overwrite, self.resume = config, overwrite, resume or resume_from is not None
        self.resume_from = None if resume_from is None else Path(resume_from)
        self.path = Path(config.runtime.output_dir)
        self.complete: dict | None = None  # the summary of a run already finished
        self.step = 0  # the step of the checkpoint the run resumes from
        self.aside: SetAside | None = None
        self.made: Path | None = None  # the directory `open` made (or found empty), until the first step
        self.existed = True
        self.extended: str | None = None  # what a resumed run's larger budget says (see `_extend`)
        state = None
        if world()[0] == 0:
            try:
                self.recipe = recipe(config)
                state = self._check()
            except (ValueError, OSError) as e:
                state = str(e)
        state = from_first(state)
        if isinstance(state, str):
            raise ValueError(state)
        self.complete, self.step = state
        if self.extended is not None:
            print(f"linnet {config.command}: {self.extended}", file=sys.stderr)

    def _check(self) -> tuple[dict | None, int]:
        """(a complete run's summary, the step to resume from); refusals raise. Reads only."""

        command, path = self.config.command, self.path
        if self.config.runtime.device is not None:
            usable_device(self.config.runtime.device, "runtime.device")
        check_writable(path, "runtime.output_dir")
        self._inputs_outside()
        recover_set_aside(path)
        if not (path.is_dir() and any(not is_leftover(p) for p in path.iterdir())):  # leftovers are no run
            if self.resume_from is not None:
                raise ValueError(f"--resume-from {self.resume_from}: {path} (runtime.output_dir) holds no run to "
                                 "resume; name the run's folder there, or drop --resume-from")
            if self.resume:  # a scheduler may pass --resume to every launch; a mistyped folder shows here
                print(f"linnet: {path} holds no run yet: --resume starts one", file=sys.stderr)
            return None, 0
        run_file = path / "run.json"
        if not (self.resume or self.overwrite):
            raise ValueError(f"{path}: the run directory exists and is not empty; pass --resume to continue that "
                             "run from its latest checkpoint, or --overwrite to replace it")
        if not run_file.is_file():
            raise ValueError(f"{path}: holds files but no linnet run (no run.json); refusing to "
                             f"{'replace' if self.overwrite else 'resume'} it: choose another runtime.output_dir")
        saved = json.loads(run_file.read_text())
        if saved.get("command") != command:
            other = saved.get("command", "pretrain")
            if self.overwrite:
                raise ValueError(f"{run_file}: a `linnet {other}` run; `linnet {command} --overwrite` replaces only "
                                 f"a `linnet {command}` run: choose another runtime.output_dir")
            raise ValueError(f"{run_file}: a `linnet {other}` run, not a `linnet {command}` one; resume it with its "
                             "own command, or choose another runtime.output_dir")
        if self.overwrite:
            return None, 0
        older = {k: v for k, v in ADDED_FIELDS.items() if k in self.recipe}
        then = {**older, **renamed(saved["recipe"])}
        now = _as_saved(then, self.recipe, self.config)
        changed = _changes(then, now, self.config)
        if changed:
            raise ValueError(f"{run_file}: the run learned from another config or data; differing: "
                             f"{'; '.join(changed)}. Resume with the run's own config ({path / 'config.json'}), "
                             "model and data, or start a new runtime.output_dir")
        if self.resume_from is not None:
            found = self.resume_from
            if found.resolve().parent != (path / "checkpoints").resolve() or not layout.is_checkpoint(found):
                raise ValueError(f"{found}: --resume-from takes a checkpoint of this run, "
                                 f"{path / 'checkpoints'}/{layout.PREFIX}…")
            layout.verify(found)
        else:
            found = layout.find_checkpoint(path / "checkpoints")
        step = int(found.name.removeprefix(layout.PREFIX)) if found is not None else 0
        if _budget(then) != _budget(now):
            self._extend(_budget(then), _budget(now), step, found)
        elif self.resume_from is None and (path / "summary.json").is_file():
            return json.loads((path / "summary.json").read_text()), 0
        if found is not None and (found / "state.pt").is_file():  # a foreign or damaged state, refused now
            from linnet.train.checkpoint import read_pt

            read_pt(found / "state.pt")
        return None, step

    def _extend(self, then: tuple[str, Any], now: tuple[str, Any], step: int, found: Path | None) -> None:
        """Accept a resumed run's larger budget, or refuse a smaller one: training.steps
        no fewer than the steps taken, or more training.epochs. The schedule is re-planned
        over the new total from the checkpoint's step on (as TRL does with max_steps)."""
        (field, old), (name, new) = then, now
        config, run_file = self.config, self.path / "run.json"
        if field != name:
            raise ValueError(f"{run_file}: the run's budget is {field}={old}; extend it with a larger {field}, not "
                             f"{name}, or start a new runtime.output_dir")
        if name == "training.steps" and new < step:
            raise ValueError(f"{run_file}: training.steps={new} is fewer than the {step} steps the run has taken "
                             f"({found}); give training.steps >= {step}, or --resume-from an earlier checkpoint")
        if name == "training.epochs" and new < old:
            raise ValueError(f"{run_file}: training.epochs={new} is fewer than the run's {old}; give more epochs to "
                             "extend it, or --resume-from an earlier checkpoint with the run's own")
        where = f"its checkpoint of step {step}" if found is not None else "its start (no checkpoint was kept)"
        self.extended = (f"the run in {self.path} goes from {field}={old} to {new}, continuing from {where}; "
                         f"the learning-rate schedule ({config.lr_schedule.name}, lr_schedule.warmup_steps "
                         f"{config.lr_schedule.warmup_steps}) is re-planned over the new total: the steps after "
                         f"{step} take the new plan's rates, the first {step} kept the old plan's")

    def _inputs_outside(self) -> None:
        """Refuse an input (data, model, tokenizer) that is the run directory itself or
        lies in what a run writes there (RUN_ENTRIES), and a data directory holding the run
        directory: an output is never an input."""
        out = self.path.resolve()
        flat = flatten(to_dict(self.config))
        inputs = [(name, flat.get(name)) for name in INPUT_FIELDS]
        inputs += [(f"data.mixture[{i}].path", m["path"]) for i, m in enumerate(flat.get("data.mixture") or [])]
        for name, value in inputs:
            path = _local(value) if not name.startswith("data.") else (
                Path(value) if isinstance(value, str) and value else None)
            if path is None:
                continue
            path = path.resolve()
            if path == out:
                raise ValueError(f"{name}={value} is runtime.output_dir itself, which this run writes: an output is "
                                 "never an input; choose another runtime.output_dir")
            if out in path.parents:
                entry = path.relative_to(out).parts[0]
                if any(fnmatch.fnmatch(entry, e) for e in RUN_ENTRIES):
                    what = "--overwrite replaces" if self.overwrite else "the run writes"
                    raise ValueError(f"{name}={value} lies in {out / entry}, which {what}: an output is never an "
                                     "input; move it out of runtime.output_dir, or choose another one")
            if name.startswith("data.") and path.is_dir() and path in out.parents:
                raise ValueError(f"runtime.output_dir={self.path} lies inside {name}={value}: the run's files would "
                                 f"change the data it reads; choose a runtime.output_dir outside {value}")

    @contextmanager
    def open(self):
        """Write the run's files: set aside a run it replaces, clear what killed writes left,
        keep metrics.jsonl up to the resumed step, write config.json and run.json. A failure
        inside the block before `started()` restores a run it replaced."""
        if world()[0] == 0:
            used = self.path.is_dir() and any(not is_leftover(p) for p in self.path.iterdir())
            if self.overwrite and used:
                self.aside = SetAside(self.path)
            if not used:
                self.made, self.existed = self.path, self.path.exists()
            self.path.mkdir(parents=True, exist_ok=True)
            record = {"command": self.config.command, "identity": identity(self.recipe), "recipe": self.recipe,
                      "directory": os.getcwd()}  # where config.json's relative paths are read from
            write_text(self.path / "run.json", json.dumps(record, indent=1) + "\n")  # first: it marks the run
            remove_leftovers(self.path, self.path / "checkpoints", self.path / "final")
            if self.resume_from is not None:  # the run continues from there: what came after goes
                for later in layout.checkpoints(self.path / "checkpoints"):
                    if int(later.name.removeprefix(layout.PREFIX)) > self.step:
                        shutil.rmtree(later)
            if self.resume_from is not None or self.extended is not None:  # complete again only at its end
                (self.path / "summary.json").unlink(missing_ok=True)
            keep_metrics(self.path / "metrics.jsonl", self.path / "metrics.jsonl", self.step)
            write_text(self.path / "config.json", json.dumps(to_dict(self.config), indent=2) + "\n")
        barrier()
        try:
            yield self.path
        except BaseException:
            if self.aside is not None:  # the new run failed before its first step: the old one comes back
                self.aside.restore()
                self.aside = None
            elif self.made is not None:  # a new run that never stepped leaves nothing to --resume or --overwrite
                for path in self.made.iterdir():
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
                if not self.existed:
                    self.made.rmdir()
            raise
        self.started()

    def started(self) -> None:
        """The new run took its first step: a run it replaces goes for good, and what it
        wrote stays if it fails later."""
        self.made = None
        if self.aside is not None:
            self.aside.drop()
            self.aside = None
