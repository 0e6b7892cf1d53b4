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
    """Every file a run publishes, its checkpoints' included (safetensors writes 0600),
    gets 0o666 & ~umask, and every directory 0o777 & ~umask."""
    umask = os.umask(0)
    os.umask(umask)
    checkpoint = ws / "run" / "checkpoints" / "step-00000004"
    for path in (ws / "run" / "final" / "adapter_model.safetensors", ws / "run" / "config.json",
                 ws / "run" / "summary.json", *checkpoint.iterdir()):
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask, path
    assert stat.S_IMODE(checkpoint.stat().st_mode) == 0o777 & ~umask


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
    from linnet.commands.run_directory import renamed

    saved = {"grpo.clip_low": 0.2, "grpo.clip_high": 0.28, "grpo.group": 8}
    assert renamed(saved) == {"grpo.clip": [0.2, 0.28], "grpo.group": 8}
    assert renamed({"grpo.group": 8}) == {"grpo.group": 8}


def test_a_run_saved_before_a_field_existed_resumes_at_its_old_value(ws, tmp_path, monkeypatch, capsys):
    """A field added later (dpo.rpo_alpha, grpo.engine) is absent from older runs' run.json:
    they resume when it holds the value they trained with, and are refused otherwise."""
    from linnet.commands import run_directory as runs

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


# ---------------------------------------------------------------------------------------
# Nothing a user owns is overwritten or deleted; a run is extended; resume trusts the
# model's files, not their path (issue 41)


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_overwrite_replaces_only_the_runs_own_files(ws, tmp_path):
    """--overwrite replaces what a run wrote (run.json, metrics, checkpoints/, final/, ...)
    and leaves the user's notes and a data file kept in the run folder, which the new run
    reads, where they are."""
    out = tmp_path / "run"
    shutil.copytree(ws / "run", out)
    (out / "notes.txt").write_text("why this run\n")
    shutil.copy(ws / "train.jsonl", out / "data.jsonl")
    (out / "checkpoints" / "step-00000009").mkdir()  # a stale run file: it goes with the rest
    mine = {name: (out / name).read_bytes() for name in ("notes.txt", "data.jsonl")}
    assert _sft(ws, out, "--overwrite", "--set", f"data.path={out / 'data.jsonl'}", "--set", "optimizer.lr=0.002") == 0
    assert {name: (out / name).read_bytes() for name in mine} == mine
    assert json.loads((out / "run.json").read_text())["recipe"]["optimizer.lr"] == 0.002
    assert [r["step"] for r in _metrics(out)] == [1, 2, 3, 4]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000003", "step-00000004"]
    assert not list(tmp_path.glob(".run.replaced-*"))


def test_a_replaced_run_and_the_users_files_come_back_when_the_new_run_fails_first(ws, tmp_path, monkeypatch):
    out = tmp_path / "run"
    shutil.copytree(ws / "run", out)
    (out / "notes.txt").write_text("mine\n")
    before = _tree(out)
    from linnet.train import loop

    monkeypatch.setattr(loop, "take_step", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("first step")))
    with pytest.raises(RuntimeError, match="first step"):
        _sft(ws, out, "--overwrite")
    assert _tree(out) == before and not list(tmp_path.glob(".run.replaced-*"))


def test_extending_a_finished_run_re_plans_its_schedule(ws, tmp_path, capsys):
    """A finished 3-step run resumed with training.steps=5 takes steps 4 and 5 from its
    step-3 checkpoint. Its cosine schedule is re-planned over 5 steps: steps 1-3 keep the
    3-step plan's rates and steps 4-5 take the 5-step plan's, so the run equals neither
    uninterrupted run; the printed line says so."""
    three, five, extended = tmp_path / "three", tmp_path / "five", tmp_path / "extended"
    assert _sft(ws, three, "--set", "training.steps=3") == 0
    assert _sft(ws, five, "--set", "training.steps=5") == 0
    assert _sft(ws, extended, "--set", "training.steps=3") == 0
    capsys.readouterr()
    assert _sft(ws, extended, "--set", "training.steps=5", "--resume") == 0
    err = capsys.readouterr().err
    assert "goes from training.steps=3 to 5, continuing from its checkpoint of step 3" in err
    assert "re-planned over the new total" in err
    rows = _metrics(extended)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["lr"] for r in rows] == [r["lr"] for r in _metrics(three)] + [r["lr"] for r in _metrics(five)[3:]]
    assert [r["loss"] for r in rows[:3]] == [r["loss"] for r in _metrics(three)]
    assert rows[3]["lr"] > 0  # the 3-step plan had decayed to 0: continuing it would learn nothing
    summary = json.loads((extended / "summary.json").read_text())
    assert summary["steps"] == 5 and summary["steps_this_run"] == 2
    assert json.loads((extended / "run.json").read_text())["recipe"]["training.steps"] == 5
    assert _sft(ws, extended, "--set", "training.steps=5", "--resume") == 0  # now complete: reported only


def test_extending_with_a_constant_schedule_equals_the_uninterrupted_run(ws, tmp_path):
    """Under a constant rate the re-planned schedule is the same plan: 3 steps extended to
    5 equal an uninterrupted 5-step run bit for bit (losses and final weights)."""
    constant = ("--set", "lr_schedule.name=constant", "--set", "lr_schedule.warmup_steps=0")
    assert _sft(ws, tmp_path / "five", "--set", "training.steps=5", *constant) == 0
    assert _sft(ws, tmp_path / "extended", "--set", "training.steps=3", *constant) == 0
    assert _sft(ws, tmp_path / "extended", "--set", "training.steps=5", "--resume", *constant) == 0
    assert [r["loss"] for r in _metrics(tmp_path / "extended")] == [r["loss"] for r in _metrics(tmp_path / "five")]
    assert _tree(tmp_path / "extended" / "final") == _tree(tmp_path / "five" / "final")


def test_resume_accepts_the_same_model_under_another_path(ws, tmp_path):
    """The model is known by its files' fingerprints: a copy elsewhere resumes the run
    (an interrupted one, to the uninterrupted run's losses)."""
    out = tmp_path / "run"
    shutil.copytree(ws / "run", out)
    shutil.rmtree(out / "checkpoints" / "step-00000004")
    (out / "summary.json").unlink()
    shutil.copytree(ws / "model", tmp_path / "moved-model")
    assert _sft(ws, out, "--resume", "--set", f"model.card={tmp_path / 'moved-model'}") == 0
    assert [r["loss"] for r in _metrics(out)] == [r["loss"] for r in _metrics(ws / "run")]
    recipe = json.loads((out / "run.json").read_text())["recipe"]
    assert "model.card" not in recipe and "config.json" in recipe["model.card.files"]


def test_a_run_saved_before_model_fingerprints_still_resumes(ws, tmp_path, capsys):
    """A run.json from before linnet fingerprinted models holds the model's path: such a
    run still resumes, compared by that path as it was."""
    out = tmp_path / "run"
    shutil.copytree(ws / "run", out)
    record = json.loads((out / "run.json").read_text())
    del record["recipe"]["model.card.files"]
    record["recipe"]["model.card"] = str(ws / "model")
    (out / "run.json").write_text(json.dumps(record))
    assert _sft(ws, out, "--resume") == 0
    shutil.copytree(ws / "model", tmp_path / "elsewhere")
    assert _sft(ws, out, "--resume", "--set", f"model.card={tmp_path / 'elsewhere'}") == 2
    assert "model.card" in capsys.readouterr().err


def test_a_pickled_object_in_a_checkpoint_is_refused_as_not_a_linnet_checkpoint(ws, tmp_path, capsys):
    """A state.pt holding Python objects (checksums and all in order) is refused as not a
    linnet checkpoint file, never with torch's advice to load it with weights_only=False,
    and before anything is written."""
    import argparse

    out = tmp_path / "run"
    shutil.copytree(ws / "run", out)
    (out / "summary.json").unlink()
    latest = out / "checkpoints" / "step-00000004"
    torch.save({"step": 4, "payload": argparse.Namespace(x=1)}, latest / "state.pt")
    sums = json.loads((latest / "checksums.json").read_text())
    sums["files"]["state.pt"] = hashlib.sha256((latest / "state.pt").read_bytes()).hexdigest()
    (latest / "checksums.json").write_text(json.dumps(sums))
    before = _tree(out)
    assert _sft(ws, out, "--resume") == 2
    err = capsys.readouterr().err
    assert "state.pt: not a linnet checkpoint file" in err and "weights_only" not in err
    assert _tree(out) == before


def test_eval_json_writes_over_its_own_results_only(ws, tmp_path):
    """`linnet eval --json` writes a new file, and writes over a results file it wrote
    before (marked as its own), atomically."""
    target = tmp_path / "eval.json"
    argv = ["eval", str(ws / "run"), "--data", str(ws / "train.jsonl"), "--no-chat", "--context-length", "64",
            "--json", str(target)]
    assert cli.main(argv) == 0
    first = json.loads(target.read_text())
    assert first["written_by"] == "linnet eval" and first["loss"] > 0
    assert cli.main(argv) == 0  # its own result: replaced
    assert json.loads(target.read_text())["loss"] == first["loss"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_quickstart_overwrite_replaces_its_own_run_and_keeps_the_users_files(tmp_path):
    """A quickstart run is marked by its run.json: --overwrite replaces it (and one written
    before the mark), leaving the user's files in --out; an sft run is refused
    (tests/test_bad_inputs.py)."""
    out = tmp_path / "qs"
    small = ["quickstart", "--out", str(out), "--steps", "2", "--dpo-steps", "0", "--grpo-steps", "0", "--demos",
             "20", "--practice", "20", "--context-length", "64", "--threads", "1"]
    assert cli.main(small) == 0
    assert json.loads((out / "run.json").read_text()) == {"command": "quickstart"}
    (out / "notes.txt").write_text("mine\n")
    (out / "run.json").unlink()  # as a quickstart written before run.json marked it
    assert cli.main([*small, "--overwrite", "--seed", "1"]) == 0
    assert (out / "notes.txt").read_text() == "mine\n"
    assert (out / "run.json").is_file() and (out / "model" / "model.safetensors").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
