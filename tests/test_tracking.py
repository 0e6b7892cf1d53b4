"""Experiment tracking: `runtime.report_to` sends every step's metrics and the config to
TensorBoard, Weights & Biases (offline), MLflow (a file store) and Trackio (local), each read
back with that library's own reader; unknown or missing trackers are refused up front."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from linnet import cli
from tests.test_safe_runs import ws  # noqa: F401  (a tiny model, records and an sft.yaml)


def _sft(ws: Path, out: Path, *sets: str) -> int:  # noqa: F811
    return cli.main(["sft", "--config", str(ws / "sft.yaml"), "--set", f"runtime.output_dir={out}",
                     *[a for s in sets for a in ("--set", s)]])


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def test_tensorboard_gets_every_step_and_the_config(ws, tmp_path):  # noqa: F811
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert _sft(ws, tmp_path / "run", "runtime.report_to=[tensorboard]") == 0
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"), size_guidance={"tensors": 0}).Reload()
    loss = {e.step: e.value for e in events.Scalars("train/loss")}  # TRL's names: a dashboard shows both
    assert loss.keys() == _losses(tmp_path / "run").keys() == {1, 2, 3, 4}
    assert all(loss[s] == pytest.approx(v, rel=1e-6) for s, v in _losses(tmp_path / "run").items())
    assert {e.step for e in events.Scalars("eval/loss")} == {2, 4}
    assert {e.step for e in events.Scalars("train/learning_rate")} == {1, 2, 3, 4}
    config = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert '"steps": 4' in config


def _wandb_records(path: Path):
    """The records of an offline run's .wandb file: LevelDB-log framing (a 7-byte file
    header, 32 KiB blocks, each chunk 4 bytes of checksum, 2 of length, 1 of type: full,
    first, middle, last), each record a wandb protobuf. wandb 0.31 reads it in its Go core
    and ships no Python reader, so the framing is read here and the messages by wandb's
    own protobuf classes."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:  # a block's tail too short for a header is padding
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full or last: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def test_wandb_offline_run_holds_every_step_and_the_config(ws, tmp_path, monkeypatch):  # noqa: F811
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    assert _sft(ws, tmp_path / "run", "runtime.report_to=[wandb]") == 0
    import wandb

    # run.finish() returns once wandb's core has taken every record; its writer may still
    # hold the file's last block in a buffer (a fresh-clone run under load read no history).
    # Shutting the core down closes the file: the process's own exit does this for a user.
    wandb.teardown()
    (records,) = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    history, config = {}, {}
    for record in _wandb_records(records):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            history[items["_step"]] = items
        elif kind in ("config", "run"):  # the run record carries the config given to init
            items = record.config.update if kind == "config" else record.run.config.update
            config.update({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items})
    assert {s: h["train/loss"] for s, h in history.items() if "train/loss" in h} == pytest.approx(
        _losses(tmp_path / "run"))
    assert config["training"]["steps"] == 4


def test_mlflow_file_store_holds_every_step_and_the_params(ws, tmp_path, monkeypatch):  # noqa: F811
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the reader opens the same file store
    assert _sft(ws, tmp_path / "run", "runtime.report_to=[mlflow]") == 0
    client = MlflowClient(tracking_uri=(tmp_path / "run" / "mlruns").resolve().as_uri())
    (run,) = client.search_runs(experiment_ids=[e.experiment_id for e in client.search_experiments()])
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/loss")}
    assert history == pytest.approx(_losses(tmp_path / "run"))
    assert run.data.params["training.steps"] == "4" and run.data.params["lora.rank"] == "4"


def test_trackio_local_store_holds_every_step_and_the_config(ws, tmp_path, monkeypatch):  # noqa: F811
    pytest.importorskip("trackio")
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    monkeypatch.setenv("TRACKIO_PROJECT", "linnet-test")
    import importlib

    import trackio.sqlite_storage as storage
    import trackio.utils

    importlib.reload(trackio.utils)  # the store's directory is read from TRACKIO_DIR at import
    importlib.reload(storage)
    assert _sft(ws, tmp_path / "run", "runtime.report_to=[trackio]") == 0
    (name,) = storage.SQLiteStorage.get_runs("linnet-test")
    logs = storage.SQLiteStorage.get_logs("linnet-test", name)
    assert {r["step"]: r["train/loss"] for r in logs if "train/loss" in r} == pytest.approx(_losses(tmp_path / "run"))
    assert storage.SQLiteStorage.get_run_config("linnet-test", name)["training"]["steps"] == 4


def test_unknown_and_missing_trackers_are_refused_before_anything_is_written(ws, tmp_path, monkeypatch, capsys):  # noqa: F811
    assert _sft(ws, tmp_path / "a", "runtime.report_to=[comet]") == 2
    assert "runtime.report_to names 'comet'" in capsys.readouterr().err
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert _sft(ws, tmp_path / "b", "runtime.report_to=[wandb]") == 2
    assert "pip install wandb" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_wandb_online_without_a_login_is_one_message_before_anything_is_written(ws, tmp_path, monkeypatch,  # noqa: F811
                                                                               capsys):
    pytest.importorskip("wandb")
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))  # no login there
    assert _sft(ws, tmp_path / "run", "runtime.report_to=[wandb]") == 2
    err = capsys.readouterr().err
    assert "wandb needs a login" in err and "WANDB_MODE=offline" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()
    (tmp_path / "netrc").write_text("machine api.wandb.ai login user password 0123456789abcdef\n")
    (tmp_path / "netrc").chmod(0o600)
    from linnet.report.tracking import check

    check(["wandb"])  # `wandb login`'s entry is a login


def test_a_python_trainers_on_step_logs_to_the_trackers(tmp_path):
    pytest.importorskip("tensorboard")
    import torch
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from linnet import nest
    from linnet.packing import Example, pack
    from linnet.report.tracking import on_step
    from linnet.train import train

    model = nest.load(nest.resolve("debug").replace(vocab=32, hidden=32, intermediate=64, heads=4, kv_heads=2,
                                                    head_dim=8), weights="random", trainable=True)
    rows = list(pack([Example(list(range(3, 3 + n))) for n in (5, 7, 9, 4)], tokens=32))
    log = on_step(["tensorboard"], tmp_path, config={"lr": 1e-3})
    history = train(model, rows * 3, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), steps=3,
                    on_step=log)
    log.finish()
    events = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    assert [(e.step, pytest.approx(e.value)) for e in events.Scalars("train/loss")] == [(s.step, s.loss)
                                                                                  for s in history.steps]


def test_progress_bars_show_rate_and_eta_on_a_terminal_and_nothing_elsewhere(monkeypatch):
    import io

    from linnet.report.progress import Progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    screen = Terminal()
    bar = Progress(10, "sft", stream=screen)
    bar.update(5, loss=1.5)
    bar.close()
    assert "5/10" in screen.getvalue() and "it/s" in screen.getvalue() and "eta" in screen.getvalue()
    log = io.StringIO()  # a file or pipe: silent
    Progress(10, "sft", stream=log).update(10)
    assert log.getvalue() == ""
    monkeypatch.setenv("LINNET_QUIET", "1")  # linnet --quiet
    quiet = Terminal()
    Progress(10, "sft", stream=quiet).update(3)
    assert quiet.getvalue() == ""


def test_quiet_anywhere_on_the_command_line_turns_bars_off(monkeypatch):
    import os

    monkeypatch.setenv("LINNET_QUIET", "0")  # restored after the test
    assert cli.main(["info", "debug", "--quiet"]) == 0
    assert os.environ["LINNET_QUIET"] == "1"
