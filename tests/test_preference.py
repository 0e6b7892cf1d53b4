"""`linnet dpo` end to end on a tiny model directory and synthetic preference pairs."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from linnet import cli, nest
from linnet.commands import quickstart
from linnet.commands.dpo import run
from linnet.config import DPOConfig, load

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    nest.load(quickstart.CARD, weights="random", seed=0).save_weights(root / "model")
    quickstart.save_tokenizer(root / "model" / "tokenizer.json")
    rng = np.random.default_rng(0)
    lines = []
    for prompt, answer in quickstart.problems(rng, 200, 2):
        wrong = f"{(int(answer) + int(rng.integers(1, 50))) % 200:03d}"
        lines.append(json.dumps({"prompt": prompt, "chosen": answer, "rejected": wrong}))
    (root / "pairs.jsonl").write_text("\n".join(lines) + "\n")
    return root


def _overrides(workspace, out, *extra):
    return [f"model.card={workspace / 'model'}", f"data.path={workspace / 'pairs.jsonl'}", "data.chat=false",
            "training.context_length=128", "data.eval_share=0.1", "dpo.pairs_per_step=16", "dpo.beta=0.5",
            "lora.rank=8", "optimizer.lr=3e-3", "lr_schedule.warmup_steps=1", "training.steps=8",
            "evaluation.every=4", f"runtime.output_dir={out}", *extra]


def _config(workspace, out, *extra):
    return load(DPOConfig, None, _overrides(workspace, out, *extra))


def test_dpo_run_writes_metrics_and_an_adapter(workspace, tmp_path):
    summary = run(_config(workspace, tmp_path / "run"))
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 8
    assert metrics[0]["loss"] == pytest.approx(np.log(2), abs=1e-5)
    assert {"rewards/accuracies", "rewards/margins", "rewards/chosen", "rewards/rejected", "logps/chosen",
            "logps/rejected", "pairs"} <= set(metrics[0])
    held = [m["held_out_accuracy"] for m in metrics if "held_out_accuracy" in m]
    assert len(held) == 2 and held[-1] > 0.55 and summary["held_out_accuracy"] == held[-1]
    assert (tmp_path / "run" / "final" / "adapter_model.safetensors").is_file()


def test_dpo_config_errors(workspace, tmp_path):
    with pytest.raises(ValueError, match="accumulation is not read by `linnet dpo`"):
        _config(workspace, tmp_path, "training.accumulation=2")
    with pytest.raises(ValueError, match="dpo.beta"):
        _config(workspace, tmp_path, "dpo.beta=0")
    with pytest.raises(ValueError, match="raise training.context_length"):
        run(_config(workspace, tmp_path / "small", "training.context_length=16"))
    assert not (tmp_path / "small").exists()


def test_dpo_template(capsys):
    assert cli.main(["dpo", "--template"]) == 0
    out = capsys.readouterr().out
    assert "label_smoothing" in out and "pairs_per_step" in out


def _dpo_process(rank, overrides):
    from linnet.commands.dpo import main as dpo_cli

    return dpo_cli([a for o in overrides for a in ("--set", o)])


@pytest.mark.parametrize("shard", ["none", "fsdp"])
def test_two_processes_take_the_steps_of_one(workspace, tmp_path, shard):
    """Under torchrun each process takes half of every step's pairs (and of the held-out
    pairs): the same steps and held-out metrics as one process."""
    from tests.conftest import in_processes

    overrides = _overrides(workspace, tmp_path / "two", "training.steps=4", f"training.shard={shard}")
    assert in_processes(_dpo_process, overrides) == [0, 0]
    with pytest.raises(AssertionError, match="does not split evenly over 2 processes"):
        in_processes(_dpo_process, _overrides(workspace, tmp_path / "odd", "dpo.pairs_per_step=5"))
    run(_config(workspace, tmp_path / "one", "training.steps=4"))
    two, one = ([json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
                for d in ("two", "one"))
    assert len(two) == len(one) == 4
    for a, b in zip(two, one):
        for key in ("loss", "grad_norm", "rewards/accuracies", "rewards/margins", "pairs", "held_out_loss",
                    "held_out_accuracy"):
            assert (key in a) == (key in b)
            assert key not in b or a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
