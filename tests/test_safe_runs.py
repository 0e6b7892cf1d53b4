"""What a run directory survives: a replaced run comes back when its replacement fails
first, a complete run is only reported on --resume, a kill's leftovers go at the next
start, metrics.jsonl keeps one row a step, Ctrl-C names the checkpoint that resumes, and
published files get ordinary permissions."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from linnet import cli
from linnet.commands import quickstart
from tests.conftest import quickstart_model

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("safe")
    quickstart_model(root / "model")
    rng = np.random.default_rng(0)
    (root / "train.jsonl").write_text("".join(json.dumps({"prompt": p, "completion": a}) + "\n"
                                              for p, a in quickstart.problems(rng, 80, 2)))
    config = {"model": {"card": str(root / "model")}, "data": {"path": str(root / "train.jsonl"), "chat": False},
              "lora": {"rank": 4}, "training": {"steps": 4, "context_length": 64, "checkpoint_every": 1},
              "optimizer": {"lr": 1e-3}, "lr_schedule": {"warmup_steps": 1}, "evaluation": {"every": 2},
              "runtime": {"progress": False, "output_dir": str(root / "run")}}
    (root / "sft.yaml").write_text(yaml.safe_dump(config))
    assert cli.main(["sft", "--config", str(root / "sft.yaml")]) == 0
    return root


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _sft(ws: Path, out: Path, *flags: str) -> int:
    return cli.main(["sft", "--config", str(ws / "sft.yaml"), "--set", f"runtime.output_dir={out}", *flags])


def test_resume_on_a_complete_run_reports_it_and_writes_nothing(ws, capsys):
    before = _tree(ws / "run")
    assert _sft(ws, ws / "run", "--resume") == 0
    assert "last_loss" in capsys.readouterr().out
    assert _tree(ws / "run") == before


def test_a_replaced_run_comes_back_when_the_new_one_fails_before_its_first_step(ws, tmp_path, monkeypatch):
    out = tmp_path / "run"
    shutil.copytree(ws / "run", out)
    before = _tree(out)
    from linnet.train import loop

    def fail(*args, **kwargs):
        raise RuntimeError("the new run broke in its first step")

    monkeypatch.setattr(loop, "take_step", fail)
    with pytest.raises(RuntimeError, match="first step"):
        _sft(ws, out, "--overwrite", "--set", "optimizer.lr=0.002")
    assert _tree(out) == before and not list(tmp_path.glob(".run.replaced-*"))
    monkeypatch.undo()
    assert _sft(ws, out, "--overwrite", "--set", "optimizer.lr=0.002") == 0  # it started: the old run is gone
    assert json.loads((out / "run.json").read_text())["recipe"]["optimizer.lr"] == 0.002
    assert not list(tmp_path.glob(".run.replaced-*"))


def test_a_new_run_that_fails_before_its_first_step_leaves_nothing_behind(ws, tmp_path, monkeypatch):
    from linnet.train import loop

    def fail(*args, **kwargs):
        raise RuntimeError("broke in the first step")

    monkeypatch.setattr(loop, "take_step", fail)
    with pytest.raises(RuntimeError, match="first step"):
        _sft(ws, tmp_path / "new")
    assert not (tmp_path / "new").exists()
    monkeypatch.undo()
    assert _sft(ws, tmp_path / "new") == 0  # the same command, corrected: no --overwrite needed


def test_a_killed_runs_leftovers_go_and_metrics_keep_one_row_a_step(ws, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(ws / "run", out)
    # as a kill at step 3 leaves it: step 2's checkpoint, a half-written checkpoint and weight
    # file, three metrics rows and a torn fourth, no summary
    for late in ("step-00000003", "step-00000004"):
        shutil.rmtree(out / "checkpoints" / late)
    (out / "checkpoints" / ".step-00000003.tmp-99999999").mkdir()
    (out / "final" / ".adapter_model.safetensors.x1y2.tmp").write_bytes(b"\0" * 10)
    (out / "summary.json").unlink()
    rows = (out / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text("\n".join(rows[:3]) + "\n" + rows[3][:17])
    assert _sft(ws, out, "--resume") == 0
    leftovers = [p for p in out.rglob(".*") if ".tmp" in p.name]
    assert leftovers == []
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    whole = [json.loads(line)["loss"] for line in (ws / "run" / "metrics.jsonl").read_text().splitlines()]
    again = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert again == whole  # resumed exactly


def test_resume_from_an_earlier_checkpoint_drops_the_later_ones(ws, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(ws / "run", out)
    assert _sft(ws, out, "--resume-from", str(out / "checkpoints" / "step-00000003")) == 0
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000003", "step-00000004"]
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]


def test_ctrl_c_names_the_checkpoint_that_resumes(ws, tmp_path, monkeypatch, capsys):
    from linnet.train import loop

    real = loop.take_step
    calls = []

    def interrupt_at_3(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, "take_step", interrupt_at_3)
    assert _sft(ws, tmp_path / "run") == 130
    err = capsys.readouterr().err
    assert "interrupted; the latest checkpoint is" in err and "step-00000002" in err and "--resume" in err


def test_sigterm_stops_after_the_step_with_its_checkpoint_and_the_resume_finishes_alike(ws, tmp_path, monkeypatch,
                                                                                       capsys):
    """SIGTERM (a cluster's or spot instance's notice) during step 2: the step finishes, its
    checkpoint is written though checkpoint_every is 100, the exit status is 143 and the
    message says how to go on; --resume then ends where the uninterrupted run ended."""
    import signal

    from linnet.train import loop

    real, calls, handler = loop.take_step, [], signal.getsignal(signal.SIGTERM)

    def notice_during_step_2(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    out = tmp_path / "run"
    monkeypatch.setattr(loop, "take_step", notice_during_step_2)
    assert _sft(ws, out, "--set", "training.checkpoint_every=100") == 143
    err = capsys.readouterr().err
    assert "stopped by SIGTERM after step 2" in err and "step-00000002" in err and "--resume" in err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000002"]
    assert not (out / "final").exists() and not (out / "summary.json").exists()
    assert signal.getsignal(signal.SIGTERM) is handler  # the run's own handler went with it
    monkeypatch.setattr(loop, "take_step", real)
    assert _sft(ws, out, "--set", "training.checkpoint_every=100", "--resume") == 0
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert losses == [json.loads(line)["loss"] for line in (ws / "run" / "metrics.jsonl").read_text().splitlines()]
    final = "final/adapter_model.safetensors"
    assert _tree(out)[final] == _tree(ws / "run")[final]


def test_published_files_get_ordinary_permissions(ws):
    umask = os.umask(0)
    os.umask(umask)
    for path in (ws / "run" / "final" / "adapter_model.safetensors", ws / "run" / "config.json",
                 ws / "run" / "summary.json"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask, path


def test_plot_reads_a_metrics_file_with_a_torn_last_line(ws, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "run"
    out.mkdir()
    rows = (ws / "run" / "metrics.jsonl").read_text()
    (out / "metrics.jsonl").write_text(rows + '{"step": 5, "lo')
    assert cli.main(["plot", str(out)]) == 0


def test_a_run_saved_with_grpos_former_clip_fields_compares_as_grpo_clip():
    """grpo.clip_low and grpo.clip_high became grpo.clip [low, high]: a run saved before
    compares its recipe under today's names, so it resumes."""
    from linnet.commands.runs import renamed

    saved = {"grpo.clip_low": 0.2, "grpo.clip_high": 0.28, "grpo.group": 8}
    assert renamed(saved) == {"grpo.clip": [0.2, 0.28], "grpo.group": 8}
    assert renamed({"grpo.group": 8}) == {"grpo.group": 8}


def test_a_run_saved_before_a_field_existed_resumes_at_its_old_value(ws, tmp_path, monkeypatch, capsys):
    """A field added later (dpo.rpo_alpha, grpo.engine) is absent from older runs' run.json:
    they resume when it holds the value they trained with, and are refused otherwise."""
    from linnet.commands import runs

    out = tmp_path / "run"
    shutil.copytree(ws / "run", out)
    record = json.loads((out / "run.json").read_text())
    lr = record["recipe"].pop("optimizer.lr")  # as if optimizer.lr had been added after this run
    (out / "run.json").write_text(json.dumps(record))
    monkeypatch.setattr(runs, "ADDED_FIELDS", {"optimizer.lr": lr})
    assert _sft(ws, out, "--resume") == 0
    monkeypatch.setattr(runs, "ADDED_FIELDS", {"optimizer.lr": lr * 2})
    assert _sft(ws, out, "--resume") == 2
    assert "optimizer.lr" in capsys.readouterr().err


def test_a_training_run_ends_with_its_curves_in_a_grid_a_screen_shows(ws, tmp_path):
    """curves.png is written at the end of a run (summary.json names it): at most three
    panels a row, so a run with many metrics grows down, not off the screen."""
    pytest.importorskip("matplotlib")
    from PIL import Image

    from linnet.report.plots import write_curves

    summary = json.loads((ws / "run" / "summary.json").read_text())
    assert summary["curves"] == str(ws / "run" / "curves.png")
    rows = [{"step": s, "loss": 2.0 / s, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_second": 10.0, "reward": 0.1 * s,
             "rewards/margins": 0.2 * s, "held_out_accuracy": 0.1 * s, "held_out_divergence": 1.0 / s}
            for s in range(1, 6)]
    width, height = Image.open(write_curves(rows, tmp_path / "curves.png")).size
    assert width <= 3 * 4.4 * 110 + 1 and height >= 3 * 3.3 * 110 - 1  # 8 panels: three rows of at most three
    assert write_curves([{"step": 1, "seconds": 2.0}], tmp_path / "none.png") is None  # nothing to draw: no file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curves.png"]
