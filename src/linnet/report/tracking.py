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
Numbers are logged at each row's `step` under the names TRL (transformers' Trainer) gives
them, so a TRL run and a linnet run share a dashboard: `train/loss`, `train/learning_rate`,
`train/grad_norm`, `train/epoch`, `train/rewards/margins`, ..., and the held-out ones as
`eval/loss`, `eval/accuracy`, ... (`tracker_name`); metrics.jsonl keeps linnet's names, and
lists and strings stay there only.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

BACKENDS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio"}


WANDB_LOGIN = ("wandb needs a login to send runs: `wandb login`, or WANDB_API_KEY, or WANDB_MODE=offline to keep "
               "the run in RUN/wandb (`wandb sync` sends it later)")


def check(report_to: Sequence[str], where: str = "runtime.report_to") -> None:
    """Refuse an unknown backend, one whose package is not installed, or wandb online
    without a login, naming the fix, before anything is written."""
    for name in report_to:
        if name not in BACKENDS:
            raise ValueError(f"{where}: {name!r} is not a tracker; use any of {', '.join(BACKENDS)}")
        if importlib.util.find_spec(BACKENDS[name]) is None:
            raise ValueError(f"{where}: {name} is not installed; pip install {BACKENDS[name]} (or "
                             "'linnet[tracking]' for every tracker), or remove it from report_to")
        if name == "wandb" and not _wandb_can_log():
            raise ValueError(f"{where}: {WANDB_LOGIN}")


def _wandb_can_log() -> bool:
    """Offline (or disabled), or a key where wandb looks for one: WANDB_API_KEY, or the
    login `wandb login` keeps in ~/.netrc (or NETRC) for its host."""
    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "dryrun", "disabled") or os.environ.get("WANDB_API_KEY"):
        return True
    import netrc
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


# linnet's metric names that TRL's trackers spell otherwise (after the train/ or eval/ prefix)
TRL_NAMES = {"lr": "learning_rate"}


def tracker_name(key: str) -> str:
    """A metrics row's name as TRL logs it: held-out metrics under eval/, the rest under
    train/ (`loss` -> `train/loss`, `lr` -> `train/learning_rate`, `held_out_loss` ->
    `eval/loss`)."""
    if key.startswith("held_out_"):
        return "eval/" + key.removeprefix("held_out_")
    return "train/" + TRL_NAMES.get(key, key)


def _numbers(row: dict[str, Any]) -> dict[str, float]:
    return {tracker_name(k): float(v) for k, v in row.items()
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
        try:
            self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "linnet"), name=name, dir=str(run),
                                  config=config, reinit="create_new")
        except wandb.errors.UsageError as e:  # a login check() could not see (a settings file's other host)
            raise ValueError(f"runtime.report_to: {WANDB_LOGIN} ({e})") from None

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
