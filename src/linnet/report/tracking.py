"""Experiment tracking: every metrics row of a run also goes to TensorBoard, Weights & Biases,
MLflow or Trackio, with the run's config.

    runtime:
      report_to: [tensorboard, mlflow]      # none by default

    trackers = open_trackers(["tensorboard"], "runs/sft", name="sft", config=config_dict)
    log = on_step(["wandb"], "runs/mine", config={...})   # a Python trainer's on_step=
    history = train(model, rows, optimizer=opt, steps=100, on_step=log)

Each backend is the library itself, imported only when named; an unknown name, or one
whose package is missing, is one clear error before anything is written (`check`). Where
they write: TensorBoard event files in RUN/tensorboard; wandb in RUN/wandb (its mode from
WANDB_MODE: offline runs stay there); MLflow in a file store, RUN/mlruns, unless
MLFLOW_TRACKING_URI names a database or server; Trackio in its own local store (TRACKIO_DIR), project "linnet".
Numbers are logged at each row's `step` under the row's names (TRL's: rewards/margins,
...); lists and strings stay in metrics.jsonl only.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

BACKENDS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio"}


def check(report_to: Sequence[str], where: str = "runtime.report_to") -> None:
    """Refuse an unknown backend or one whose package is not installed, naming the fix."""
    for name in report_to:
        if name not in BACKENDS:
            raise ValueError(f"{where}: {name!r} is not a tracker; use any of {', '.join(BACKENDS)}")
        if importlib.util.find_spec(BACKENDS[name]) is None:
            raise ValueError(f"{where}: {name} is not installed; pip install {BACKENDS[name]} (or "
                             "'linnet[tracking]' for every tracker), or remove it from report_to")


def _numbers(row: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in row.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class _TensorBoard:
    def __init__(self, run: Path, name: str, config: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run / "tensorboard"))
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=1, default=str) + "\n```", 0)

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def finish(self) -> None:
        self.writer.close()


class _Wandb:
    def __init__(self, run: Path, name: str, config: dict):
        import wandb

        (run / "wandb").mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "linnet"), name=name, dir=str(run),
                              config=config, reinit="create_new")

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def finish(self) -> None:
        self.run.finish()


class _MLflow:
    def __init__(self, run: Path, name: str, config: dict):
        import mlflow

        from linnet.config.fields import flatten

        self.mlflow = mlflow
        if "MLFLOW_TRACKING_URI" not in os.environ:  # a file store beside the run (set the URI for a server)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps it, in maintenance mode
            mlflow.set_tracking_uri((run / "mlruns").resolve().as_uri())
        self.run = mlflow.start_run(run_name=name)
        params = {k: str(v)[:500] for k, v in flatten(config).items()}
        for start in range(0, len(params), 100):  # MLflow takes at most 100 parameters a batch
            mlflow.log_params(dict(list(params.items())[start:start + 100]))

    def log(self, step: int, values: dict[str, float]) -> None:
        self.mlflow.log_metrics(values, step=step)

    def finish(self) -> None:
        self.mlflow.end_run()


class _Trackio:
    def __init__(self, run: Path, name: str, config: dict):
        import trackio

        self.trackio = trackio
        self.run = trackio.init(project=os.environ.get("TRACKIO_PROJECT", "linnet"), name=name, config=config,
                                embed=False)

    def log(self, step: int, values: dict[str, float]) -> None:
        self.trackio.log(values, step=step)

    def finish(self) -> None:
        self.trackio.finish()


_OPEN = {"tensorboard": _TensorBoard, "wandb": _Wandb, "mlflow": _MLflow, "trackio": _Trackio}


class Trackers:
    """The open trackers of a run: `log(row)` sends a metrics row's numbers to each."""

    def __init__(self, backends: list):
        self.backends = backends

    def log(self, row: dict[str, Any]) -> None:
        values = _numbers(row)
        for backend in self.backends:
            backend.log(int(row["step"]), values)

    def finish(self) -> None:
        for backend in self.backends:
            backend.finish()


def open_trackers(report_to: Sequence[str], run: str | os.PathLike, *, name: str,
                  config: dict[str, Any] | None = None) -> Trackers:
    """Start a run in each named tracker, with `config` (plain data) as its parameters."""
    check(report_to)
    return Trackers([_OPEN[b](Path(run), name, config or {}) for b in report_to])


def on_step(report_to: Sequence[str], run: str | os.PathLike, *, name: str = "linnet",
            config: dict[str, Any] | None = None) -> Callable:
    """An `on_step` for the Python trainers (train, dpo, grpo, ...): each Step's loss, lr,
    grad norm, tokens/s and metrics go to the trackers; `.finish()` closes them."""
    trackers = open_trackers(report_to, run, name=name, config=config)

    def log(step) -> None:
        trackers.log({"step": step.step, "loss": step.loss, "lr": step.lr, "grad_norm": step.grad_norm,
                      "tokens_per_second": step.tokens_per_second, **step.metrics})

    log.finish = trackers.finish  # type: ignore[attr-defined]
    return log
