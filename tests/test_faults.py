"""Killed runs resume to the same weights (bench/faults.py, a few trials): SIGKILL inside a
checkpoint publish or an atomic file write of sft, dpo, grpo and pretraining, and at a
random moment of a token-cache preparation; each then resumes to the uninterrupted run's
weights (SHA-256), leaves no temporary file and one metrics row a step.

And faults speak plainly: a full disk while writing a checkpoint, the final weights, the
metrics or an export is one line naming the file and the fix, and leaves no temporary
folder and no empty final/; a device a run cannot use is one line; `linnet --version`."""

from __future__ import annotations

import errno
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from linnet import cli
from linnet.commands import quickstart
from tests.conftest import quickstart_model


@pytest.mark.slow
def test_killed_runs_resume_to_the_same_weights():
    script = Path(__file__).parents[1] / "bench" / "faults.py"
    done = subprocess.run([sys.executable, str(script), "--trials", "10", "--seed", "3", "--out", "-"],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "**10 of 10 clean**" in done.stdout


# ---------------------------------------------------------------------------------------
# Faults speak plainly (issue 41)


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("faults")
    quickstart_model(root / "model")
    rng = np.random.default_rng(0)
    (root / "train.jsonl").write_text("".join(json.dumps({"prompt": p, "completion": a}) + "\n"
                                              for p, a in quickstart.problems(rng, 40, 2)))
    config = {"model": {"card": str(root / "model")}, "data": {"path": str(root / "train.jsonl"), "chat": False},
              "lora": {"rank": 4}, "training": {"steps": 2, "context_length": 64, "checkpoint_every": 1},
              "optimizer": {"lr": 1e-3}, "lr_schedule": {"warmup_steps": 1},
              "runtime": {"progress": False, "output_dir": str(root / "run")}}
    (root / "sft.yaml").write_text(yaml.safe_dump(config))
    assert cli.main(["sft", "--config", str(root / "sft.yaml")]) == 0
    return root


def _full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def _one_line(err: str, *parts: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("linnet ")]
    assert "Traceback" not in err and len(lines) == 1, err
    for part in parts:
        assert re.search(part, lines[0]), lines[0]
    return lines[0]


def _temporary(root: Path) -> list[Path]:
    return [p for p in root.rglob(".*") if ".tmp" in p.name or ".replaced-" in p.name or ".old-" in p.name]


@pytest.mark.parametrize("where", ["checkpoint", "checkpoint-torch", "final"])
def test_a_full_disk_in_a_training_run_is_one_line_and_leaves_no_temporary_file(ws, tmp_path, monkeypatch, capsys,
                                                                                 where):
    from linnet.train import checkpoint

    out = tmp_path / "run"
    if where == "checkpoint":
        monkeypatch.setattr(checkpoint, "save_file", _full)
        expect = r"checkpoints/step-00000001: not written \(No space left on device\): the disk is full"
    elif where == "checkpoint-torch":  # what DPO and GRPO met: torch.save's own words for it
        def torch_full(*args, **kwargs):
            raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0: file write failed")

        monkeypatch.setattr(checkpoint.torch, "save", torch_full)
        expect = r"checkpoints/step-00000001: not written \(file write failed\): the disk is full"
    else:
        import safetensors.numpy

        monkeypatch.setattr(safetensors.numpy, "save_file", _full)
        expect = r"final/adapter_model.safetensors: not written \(No space left on device\): the disk is full"
    code = cli.main(["sft", "--config", str(ws / "sft.yaml"), "--set", f"runtime.output_dir={out}"])
    assert code == 2
    _one_line(capsys.readouterr().err, expect, r"Free space there.*--resume")
    assert _temporary(tmp_path) == []
    assert not (out / "final").exists()  # no empty final/
    if where != "final":
        assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())


def test_a_full_disk_while_writing_metrics_is_one_line(ws, tmp_path, monkeypatch, capsys):
    from linnet.report import metrics

    monkeypatch.setattr(metrics.MetricsFile, "write", _full)
    code = cli.main(["sft", "--config", str(ws / "sft.yaml"), "--set", f"runtime.output_dir={tmp_path / 'run'}"])
    assert code == 2
    _one_line(capsys.readouterr().err, r"No space left on device.*the disk is full")


def test_a_full_disk_during_an_export_leaves_no_export(ws, tmp_path, monkeypatch, capsys):
    from linnet.torch import weights

    monkeypatch.setattr(weights, "save_file", _full)
    out = tmp_path / "exports" / "merged"
    assert cli.main(["export", str(ws / "run"), "--out", str(out), "--merge"]) == 2
    _one_line(capsys.readouterr().err, r"merged/model.safetensors: not written .*the disk is full")
    assert not (tmp_path / "exports").exists()


def test_a_failed_quickstart_leaves_no_temporary_folder(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("broke mid-run")

    monkeypatch.setattr(quickstart, "save_tokenizer", broken)  # after the stages, before publishing
    with pytest.raises(RuntimeError, match="mid-run"):
        quickstart.run(tmp_path / "qs", steps=1, dpo_steps=1, grpo_steps=0, demos=10, practice=10, tokens=64,
                       threads=1)
    assert list(tmp_path.iterdir()) == []


def test_a_cuda_index_past_the_devices_is_one_line(ws, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    code = cli.main(["sft", "--config", str(ws / "sft.yaml"), "--set", f"runtime.output_dir={tmp_path / 'run'}",
                     "--set", "runtime.device=cuda:7"])
    assert code == 2
    _one_line(capsys.readouterr().err, r"runtime.device=cuda:7: this machine shows 1 CUDA device \(cuda:0\)")
    assert not (tmp_path / "run").exists()


def test_version(capsys):
    from linnet import __version__

    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"linnet {__version__}"
