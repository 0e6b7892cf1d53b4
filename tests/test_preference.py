"""`linnet dpo` end to end on a tiny model directory and synthetic preference pairs."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from linnet import cli
from linnet.commands import quickstart
from linnet.commands.dpo import run
from linnet.config import DPOConfig, load
from tests.conftest import quickstart_model, same_metrics

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    quickstart_model(root / "model")
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


def test_dpo_rpo_alpha_reaches_the_loss(workspace, tmp_path):
    """dpo.rpo_alpha adds alpha x the chosen answers' NLL a token (3 digits and the stop
    token each) to the first step's loss, where DPO's own term is log 2 (LoRA starts at
    the reference)."""
    run(_config(workspace, tmp_path / "rpo", "dpo.rpo_alpha=0.5", "training.steps=1"))
    first = json.loads((tmp_path / "rpo" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["loss"] == pytest.approx(np.log(2) + 0.5 * -first["logps/chosen"] / 4, rel=1e-5)


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


LAYOUTS = {  # name: (settings, processes)
    "none": (["training.shard=none"], 2), "fsdp": (["training.shard=fsdp"], 2), "split": (["training.split=2"], 2),
    "pipeline": (["training.pipeline=2"], 2), "context": (["training.context=2"], 2),
    "pipeline-fsdp": (["training.pipeline=2", "training.shard=fsdp"], 4),
    "split-fsdp": (["training.split=2", "training.shard=fsdp"], 4),
    "sequence": (["training.split=2", "training.sequence_parallel=true"], 2),
    "context-fsdp": (["training.context=2", "training.shard=fsdp"], 4),
    "pipeline-context": (["training.pipeline=2", "training.context=2"], 4),
    "split-context-fsdp-sequence": (["training.split=2", "training.context=2", "training.shard=fsdp",
                                     "training.sequence_parallel=true"], 4),
}
SLOW_LAYOUTS = {  # eight processes; linnet sft runs the same layout in the default run (tests/test_mesh.py)
    "pipeline-split-fsdp": (["training.pipeline=2", "training.split=2", "training.shard=fsdp"], 8),
    # split-context-fsdp-sequence runs it with more in the default run, and linnet sft alone (tests/test_mesh.py)
    "split-context": (["training.split=2", "training.context=2"], 4),
}


@pytest.mark.parametrize("shard", [*LAYOUTS, *(pytest.param(k, marks=pytest.mark.slow) for k in SLOW_LAYOUTS)])
def test_two_processes_take_the_steps_of_one(workspace, tmp_path, shard):
    """Under torchrun each process takes half of every step's pairs (and of the held-out
    pairs), or with training.split=2 both split one model and take all of them, or with
    training.pipeline=2 each holds half its blocks and the step's rows pass through both
    (with training.shard=fsdp, four processes: two copies of the pipeline, each taking half
    the pairs, each stage sharded over its copies), or with training.context=2 both take
    every row, each half its positions, or with training.split=2 and training.shard=fsdp, four
    processes: two copies of the split, each process's part sharded over the copies, or with
    training.sequence_parallel too, the split's norms on half of each row's positions, or
    with training.context=2 and training.shard=fsdp, four processes: two copies of a context
    pair, every state sharded over all four, or with training.split=2 and training.context=2,
    four processes: each row over two splits (and with fsdp and sequence parallel, each part
    sharded over the context pair, the norms on a quarter of the row), or with
    training.pipeline=2 and training.context=2, four processes: each stage's pair splitting
    every row's positions, or eight processes: two copies of two stages
    split two ways, each part sharded over the copies: the same steps and held-out metrics
    as one process."""
    from tests.conftest import in_processes

    mode, processes = {**LAYOUTS, **SLOW_LAYOUTS}[shard]
    overrides = _overrides(workspace, tmp_path / "two", "training.steps=4", *mode)
    assert in_processes(_dpo_process, overrides, processes=processes) == [0] * processes
    if shard == "none":  # once: the count is checked before any layout
        with pytest.raises(AssertionError, match="does not split evenly over 2 processes"):
            in_processes(_dpo_process, _overrides(workspace, tmp_path / "odd", "dpo.pairs_per_step=5"))
    run(_config(workspace, tmp_path / "one", "training.steps=4"))
    same_metrics(tmp_path / "two", tmp_path / "one", ("loss", "grad_norm", "rewards/accuracies", "rewards/margins",
                                                      "pairs", "held_out_loss", "held_out_accuracy"),
                 steps=4, rel=1e-4, abs=1e-6)


def test_dpo_command_with_simpo_and_with_kto_records(workspace, tmp_path, monkeypatch):
    """dpo.loss_type=simpo trains with no reference pass; kto reads prompt/completion/label
    records (here each pair split into two labelled answers) and learns the preference."""
    from linnet.train import dpo as dpo_module

    monkeypatch.setattr(dpo_module, "cached_reference_log_probs",
                        lambda *a, **k: pytest.fail("simpo computed reference log-probabilities"))
    run(_config(workspace, tmp_path / "simpo", "dpo.loss_type=simpo", "dpo.beta=2.0", "training.steps=12"))
    rows = [json.loads(x) for x in (tmp_path / "simpo" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["rewards/margins"] > rows[0]["rewards/margins"]
    held = [r["held_out_accuracy"] for r in rows if "held_out_accuracy" in r]
    assert held[-1] > 0.55
    _kto_records(workspace, tmp_path / "kto.jsonl")
    summary = run(_config(workspace, tmp_path / "kto", "dpo.loss_type=kto", f"data.path={tmp_path / 'kto.jsonl'}",
                          "training.steps=16"))
    rows = [json.loads(x) for x in (tmp_path / "kto" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["loss"] == pytest.approx(0.5, abs=1e-5) and rows[0]["kl"] == 0.0
    held = [r["held_out_margin"] for r in rows if "held_out_margin" in r]
    assert held[-1] > max(held[0], 0) and summary["held_out_margin"] == held[-1]
    assert all(r["kl"] >= 0 and "rewards/chosen" in r and "logps/rejected" in r for r in rows)
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": "1+1", "completion": "2", "label": "yes"}) + "\n")
    with pytest.raises(ValueError, match="field 'label' must be true"):
        run(_config(workspace, tmp_path / "bad", "dpo.loss_type=kto", f"data.path={tmp_path / 'bad.jsonl'}"))


def _kto_records(workspace, path):
    """Each pair's answers as two unpaired records, the chosen one desirable."""
    records = []
    for line in (workspace / "pairs.jsonl").read_text().splitlines():
        pair = json.loads(line)
        records += [{"prompt": pair["prompt"], "completion": pair["chosen"], "label": True},
                    {"prompt": pair["prompt"], "completion": pair["rejected"], "label": False}]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")


@pytest.mark.parametrize("mode", ["split", "pipeline", "context"])
def test_kto_records_over_two_processes_take_one_process_steps(workspace, tmp_path, mode):
    """`linnet dpo` with dpo.loss_type=kto and training.split=2 (both processes split one
    model), training.pipeline=2 (each holds half its blocks; the last computes the
    losses, and the KL estimate's and the reference's log-probabilities pass through
    both) or training.context=2 (each computes half of every row's positions): every
    record of the step, with one process's losses, KL and held-out margins."""
    from tests.conftest import in_processes

    _kto_records(workspace, tmp_path / "kto.jsonl")
    kto = ["dpo.loss_type=kto", f"data.path={tmp_path / 'kto.jsonl'}", "training.steps=4"]
    assert in_processes(_dpo_process, _overrides(workspace, tmp_path / "two", *kto, f"training.{mode}=2")) == [0, 0]
    run(_config(workspace, tmp_path / "one", *kto))
    same_metrics(tmp_path / "two", tmp_path / "one", ("loss", "grad_norm", "kl", "held_out_margin"), steps=4,
                 rel=1e-4, abs=1e-6)
