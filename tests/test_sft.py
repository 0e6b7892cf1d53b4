"""`linnet sft` end to end on a tiny model directory and a synthetic JSONL task."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from linnet import cli, nest
from linnet.commands import quickstart
from linnet.commands.sft import run
from linnet.config import RewardConfig, SFTConfig, load

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    model = nest.load(quickstart.CARD, weights="random", seed=0)
    model.save_weights(root / "model")
    quickstart.save_tokenizer(root / "model" / "tokenizer.json")
    rng = np.random.default_rng(0)
    lines = [json.dumps({"prompt": p, "completion": a}) for p, a in quickstart.problems(rng, 400, 2)]
    (root / "train.jsonl").write_text("\n".join(lines) + "\n")
    return root


def _config(workspace, out, **training):
    overrides = [
        f"model.card={workspace / 'model'}",
        f"data.path={workspace / 'train.jsonl'}",
        "data.chat=false", "training.context_length=256", "data.eval_share=0.1",
        "lora.enabled=false", "optimizer.lr=3e-3", "lr_schedule.warmup_steps=2",
        "evaluation.every=5", "training.checkpoint_every=5",
        f"runtime.output_dir={out}",
    ] + [f"training.{k}={v}" for k, v in training.items()]
    return load(SFTConfig, None, overrides)


def test_sft_run_learns_and_writes_its_directory(workspace, tmp_path):
    summary = run(_config(workspace, tmp_path / "run", steps=12))
    out = tmp_path / "run"
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    held = [m["held_out_loss"] for m in metrics if "held_out_loss" in m]
    assert len(metrics) == 12 and len(held) == 3
    assert held[-1] < held[0] < metrics[0]["loss"] * 0.8
    assert summary["held_out_loss"] == held[-1]
    assert (out / "final" / "model.safetensors").is_file() and (out / "final" / "config.json").is_file()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000010", "step-00000012"]
    assert json.loads((out / "config.json").read_text())["training"]["steps"] == 12


def test_lora_run_saves_a_peft_adapter(workspace, tmp_path):
    config = _config(workspace, tmp_path / "lora", steps=3)
    config.lora.enabled = True
    run(config)
    assert json.loads((tmp_path / "lora" / "final" / "adapter_config.json").read_text())["r"] == 16


def test_existing_run_directory_is_not_overwritten(workspace, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="--overwrite"):
        run(_config(workspace, out, steps=2))
    assert (out / "notes.txt").read_text() == "mine"


def test_resume_continues_the_same_run(workspace, tmp_path):
    whole = run(_config(workspace, tmp_path / "whole", steps=8))
    out = tmp_path / "run"
    run(_config(workspace, out, steps=8))
    # as if killed after step 6: only step 5's checkpoint and five metrics lines remain, no summary
    shutil.rmtree(out / "checkpoints" / "step-00000008")
    (out / "summary.json").unlink()
    lines = (out / "metrics.jsonl").read_text().splitlines()[:5]
    (out / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    again = run(_config(workspace, out, steps=8), resume=True)
    assert again["steps_this_run"] == 3
    assert again["last_loss"] == whole["last_loss"]
    with pytest.raises(ValueError, match="fewer than the 8 steps"):  # more steps extend the run (test_safe_runs)
        run(_config(workspace, out, steps=7), resume=True)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["training.steps=0"], "training.steps"),
        (["training.stpes=3"], "unknown field 'stpes'"),
        (["optimizer.lr=fast"], "optimizer.lr"),
        (["lr_schedule.name=linear"], "schedule.name"),
        (["data.path=''"], "data.path is required"),
        (["data.path="], "data.path: expected str"),
        (["training.split=2", "training.shard=zero", "lora.enabled=false"], "training.split=2 with training.shard=zero"),
        (["training.split=0", "lora.enabled=false"], "training.split=0; it must be a positive integer"),
        (["training.pipeline=2", "training.shard=zero"], "training.pipeline=2 with training.shard=zero"),
        (["training.pipeline=2", "training.shard=fsdp", "training.pipeline_schedule=zero-bubble"],
         "zero-bubble with training.shard=fsdp is not supported yet"),
        (["training.pipeline_schedule=interleaved"], "set training.pipeline to 2 or more stages"),
        (["training.pipeline=2", "training.pipeline_schedule=zero-bubble", "training.activation_checkpointing=true"],
         "zero-bubble with training.activation_checkpointing is not supported"),
        (["training.split=2", "optimizer.name=adamw8bit", "lora.enabled=false"], "adamw8bit with training.split=2"),
        (["training.shard=ddp"], "training.shard"),
    ],
)
def test_bad_configs_fail_before_training(workspace, tmp_path, overrides, message):
    base = [f"model.card={workspace / 'model'}", f"data.path={workspace / 'train.jsonl'}", f"runtime.output_dir={tmp_path / 'x'}"]
    with pytest.raises(ValueError, match=message):
        load(SFTConfig, None, base + overrides)
    assert not (tmp_path / "x").exists()


def test_bad_data_fails_before_anything_is_written(workspace, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "1+2="}) + "\n")
    config = _config(workspace, tmp_path / "run", steps=2)
    config.data.path = str(bad)
    with pytest.raises(ValueError, match="completion"):
        run(config)
    assert not (tmp_path / "run").exists()


def test_cli_inspect_and_plot(workspace, tmp_path, capsys):
    yaml_path = tmp_path / "run.yaml"
    yaml_path.write_text(
        f"model: {{card: {workspace / 'model'}}}\n"
        f"data: {{path: {workspace / 'train.jsonl'}, chat: false}}\n"
        f"training: {{context_length: 256}}\n"
        f"runtime: {{output_dir: {tmp_path / 'cli'}}}\n"
    )
    assert cli.main(["inspect", "--config", str(yaml_path), "--examples", "1"]) == 0
    shown = capsys.readouterr().out
    assert "[[" in shown and "padding share" in shown and "steps per epoch" in shown
    args = ["sft", "--config", str(yaml_path), "--set", "training.steps=2", "--set", "lora.enabled=false",
            "--set", "lr_schedule.warmup_steps=1"]
    assert cli.main(args) == 0
    assert cli.main(args) == 2  # the run directory now exists: refused
    assert "--overwrite" in capsys.readouterr().err
    pytest.importorskip("matplotlib")
    assert cli.main(["plot", str(tmp_path / "cli")]) == 0
    assert (tmp_path / "cli" / "curves.png").stat().st_size > 1000


def test_schedule_that_cannot_fit_fails_before_anything_is_written(workspace, tmp_path):
    config = _config(workspace, tmp_path / "run", steps=2)
    config.lr_schedule.warmup_steps = 10
    with pytest.raises(ValueError, match="warmup"):
        run(config)
    assert not (tmp_path / "run").exists()


def _sft_process(rank, overrides, *flags):
    from linnet.commands.sft import main as sft_cli

    return sft_cli([a for o in overrides for a in ("--set", o)] + list(flags))


def test_two_processes_splitting_a_model_train_its_adapters_like_one(workspace, tmp_path):
    """`linnet sft` with LoRA and training.split=2: the two processes split every block and
    its adapters, and take the steps and write the adapters of one process with the same
    rows."""
    from safetensors.torch import load_file

    from tests.conftest import in_processes

    common = [f"model.card={workspace / 'model'}", f"data.path={workspace / 'train.jsonl'}", "data.chat=false",
              "training.context_length=256", "data.eval_share=0.1", "optimizer.lr=3e-3", "lora.rank=4",
              "lr_schedule.warmup_steps=1", "evaluation.every=3", "training.steps=3", "training.accumulation=2"]
    assert in_processes(_sft_process, common + [f"runtime.output_dir={tmp_path / 'two'}", "training.split=2"]) == [0, 0]
    run(load(SFTConfig, None, common + [f"runtime.output_dir={tmp_path / 'one'}"]))
    two, one = ([json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
                for d in ("two", "one"))
    assert [m["loss"] for m in two] == pytest.approx([m["loss"] for m in one], rel=1e-5)
    assert [m["grad_norm"] for m in two] == pytest.approx([m["grad_norm"] for m in one], rel=1e-4)
    x, y = (load_file(str(tmp_path / d / "final" / "adapter_model.safetensors")) for d in ("two", "one"))
    assert x.keys() == y.keys() and x
    for key in y:
        torch.testing.assert_close(x[key], y[key], atol=1e-5, rtol=0, msg=key)


@pytest.mark.parametrize("shard", ["none", "zero", "zero-8bit", "fsdp", "split", "pipeline", "pipeline-8bit",
                                   "pipeline-interleaved", "pipeline-zero-bubble", "pipeline-fsdp"])
def test_two_processes_under_torchrun_train_like_one_with_twice_the_rows(workspace, tmp_path, shard):
    """`linnet sft` in two processes (each a share of the rows; a whole copy each, the
    optimizer split (its 8-bit states too, against 8-bit AdamW in one process), or
    everything split) takes the steps one process takes with twice
    the accumulation: the same losses, held-out losses and final weights, written once.
    With training.split=2 the two processes split one model and take the same rows (with
    training.pipeline=2 each holds half its blocks, and the two rows of a step pass along
    on a 1F1B schedule, or interleaved 1F1B or zero-bubble with two chunks a process, with 8-bit states
    too, resuming); its head, tied to the embedding, then trains apart from it, as the
    head of an untied copy does in one process. With training.shard=fsdp too, four
    processes make two copies of the pipeline, each stage's blocks sharded over its
    copies, and take the steps of one process with four rows a step, resuming alike."""
    from safetensors.torch import load_file

    from tests.conftest import in_processes

    common = [f"model.card={workspace / 'model'}", f"data.path={workspace / 'train.jsonl'}", "data.chat=false",
              "training.context_length=256", "data.eval_share=0.1", "lora.enabled=false", "optimizer.lr=3e-3",
              "lr_schedule.warmup_steps=2", "evaluation.every=3", "training.checkpoint_every=3", "training.steps=6"]
    eight_bit = shard.endswith("-8bit")
    if eight_bit:
        pytest.importorskip("bitsandbytes", reason="8-bit AdamW needs bitsandbytes (the qlora extra)")
        common.append("optimizer.name=adamw8bit")
    # the pipeline's schedule (one process has none)
    schedule = [f"training.pipeline_schedule={shard.split('-', 1)[1]}"] if shard.endswith(("-interleaved",
                                                                                           "-zero-bubble")) else []
    copies = 2 if shard.endswith("-fsdp") else 1  # of a two-stage pipeline, its stages sharded over them
    shard = shard.split("-")[0]
    mode = [f"training.{shard}=2", "training.accumulation=2"] if shard in ("split", "pipeline") else \
        [f"training.shard={shard}", "training.accumulation=1"]
    if copies > 1:
        mode.append("training.shard=fsdp")
    two_args = common + [f"runtime.output_dir={tmp_path / 'two'}", *mode, *schedule]
    assert in_processes(_sft_process, two_args, processes=2 * copies) == [0] * 2 * copies
    if shard in ("split", "pipeline"):
        whole = nest.load(workspace / "model")
        whole.untie_head()
        whole.save_weights(tmp_path / "untied")
        common[0] = f"model.card={tmp_path / 'untied'}"
    run(load(SFTConfig, None, common + [f"runtime.output_dir={tmp_path / 'one'}",
                                        f"training.accumulation={2 * copies}"]))
    two, one = ([json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
                for d in ("two", "one"))
    assert len(two) == len(one) == 6
    for a, b in zip(two, one):
        assert a["learned"] == b["learned"]
        for key in ("loss", "grad_norm", "held_out_loss"):
            assert (key in a) == (key in b)
            assert key not in b or a[key] == pytest.approx(b[key], rel=1e-5), key
    x, y = (load_file(str(tmp_path / d / "final" / "model.safetensors")) for d in ("two", "one"))
    for key in y:  # AdamW magnifies rounding where a gradient is tiny (a split sums its products apart)
        torch.testing.assert_close(x[key], y[key], atol=1e-5 if shard != "split" else 3e-4, rtol=0, msg=key)
    assert sorted(p.name for p in (tmp_path / "two" / "checkpoints").iterdir()) == ["step-00000003", "step-00000006"]
    if copies > 1:  # each block weight was written in two parts, one by each copy of its stage
        from torch.distributed.checkpoint import FileSystemReader

        stored = FileSystemReader(tmp_path / "two" / "checkpoints" / "step-00000006" / "sharded").read_metadata()
        parts = {k: len(v.chunks) for k, v in stored.state_dict_metadata.items() if k.endswith("q_proj.weight")}
        assert parts and set(parts.values()) == {2}, parts
    if shard == "fsdp" or copies > 1 or eight_bit and shard == "pipeline":
        # killed after step 4: step 3's parts (a pipeline's 8-bit states too) and three metrics lines
        # remain; --resume finishes alike
        shutil.rmtree(tmp_path / "two" / "checkpoints" / "step-00000006")
        (tmp_path / "two" / "summary.json").unlink()
        metrics = tmp_path / "two" / "metrics.jsonl"
        metrics.write_text("\n".join(metrics.read_text().splitlines()[:3]) + "\n")
        assert in_processes(_sft_process, two_args, "--resume", processes=2 * copies) == [0] * 2 * copies
        again = [json.loads(x) for x in metrics.read_text().splitlines()]
        assert [m["loss"] for m in again] == pytest.approx([m["loss"] for m in two], rel=1e-6)


def test_a_general_set_is_measured_beside_the_held_out_set(workspace, tmp_path):
    """evaluation.general: its loss at every evaluation, in metrics.jsonl and the summary,
    equal to the loss of the final model on those records."""
    from linnet.commands.runs import general_rows
    from linnet.train.evaluation import held_out_loss

    general = tmp_path / "general.jsonl"
    rng = np.random.default_rng(7)
    general.write_text("".join(json.dumps({"text": p + a[::-1]}) + "\n" for p, a in quickstart.problems(rng, 30, 2)))
    config = _config(workspace, tmp_path / "run", steps=6)
    config.evaluation.every, config.evaluation.general = 3, str(general)
    summary = run(config)
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    measured = [m["held_out_general_loss"] for m in metrics if "held_out_general_loss" in m]
    assert [m["step"] for m in metrics if "held_out_general_loss" in m] == [3, 6] and "held_out_loss" in metrics[2]
    final = nest.load(tmp_path / "run" / "final", weights=tmp_path / "run" / "final")
    assert summary["held_out_general_loss"] == measured[-1] == pytest.approx(
        held_out_loss(final, general_rows(config)), rel=1e-5)
    with pytest.raises(ValueError, match="evaluation.general"):  # a reward model has no general loss
        load(RewardConfig, None, [f"evaluation.general={general}"])


def test_a_run_that_holds_nothing_out_trains_without_held_out_metrics(workspace, tmp_path):
    config = _config(workspace, tmp_path / "all", steps=2)
    config.data.eval_share = 0.0
    summary = run(config)
    assert summary["steps_this_run"] == 2 and not any(k.startswith("held_out") for k in summary)
