"""The config vocabulary: every shipped preset loads as its command reads it, every
command's template loads back to its defaults, former names are refused naming the new
one, and a field a command does not read is refused by that command."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from linnet.commands import plan as plan_command
from linnet.config import (
    COMMANDS,
    FORMER_FIELDS,
    DistillConfig,
    DPOConfig,
    GRPOConfig,
    PretrainConfig,
    RewardConfig,
    SFTConfig,
    command_of,
    from_data,
    load,
    load_any,
    template,
    to_dict,
)

CONFIGS = sorted((Path(__file__).parents[1] / "configs").glob("*.yaml"))
PRESETS = {"sft-lora.yaml": "sft", "sft-full.yaml": "sft", "dpo.yaml": "dpo", "dpo_online.yaml": "dpo", "grpo.yaml": "grpo", "ppo.yaml": "ppo", "reward.yaml": "reward",
           "distill.yaml": "distill",
           "pretrain-tiny-cpu.yaml": "pretrain", "pretrain-20m.yaml": "pretrain", "packed4-20m-awc.yaml": "pretrain",
           "packed4-20m-atc.yaml": "pretrain", "packed4-tiny-cpu.yaml": "pretrain"}


def test_every_command_has_presets_and_every_preset_is_known():
    assert sorted(p.name for p in CONFIGS) == sorted(PRESETS)
    assert set(PRESETS.values()) == set(COMMANDS)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_presets_load_as_their_command_and_plan(path, capsys):
    config = load_any(path)
    assert config.command == PRESETS[path.name]
    assert to_dict(load(type(config), path)) == to_dict(config)  # detection picks the class the run uses
    assert plan_command.main(["--config", str(path), "--json"]) == 0
    assert '"params"' in capsys.readouterr().out


@pytest.mark.parametrize("cls", [SFTConfig, DPOConfig, GRPOConfig, RewardConfig, DistillConfig,
                                                                                   PretrainConfig], ids=lambda c: c.command)
def test_each_template_loads_back_to_the_defaults(cls, tmp_path):
    text = template(cls)
    data = yaml.safe_load(text)
    if cls is not PretrainConfig:
        data["data"]["path"] = "x.jsonl"  # the fields without a usable default
    if cls is DistillConfig:
        data["distill"]["teacher"] = "debug"
    config = from_data(cls, data)
    assert command_of(data) == cls.command
    given = {} if cls is PretrainConfig else {"data": {"path": "x.jsonl"}}
    if cls is DistillConfig:
        given["distill"] = {"teacher": "debug"}
    defaults = to_dict(from_data(cls, given))
    assert to_dict(config) == defaults
    assert "targets_per_parameter" not in text if cls is not PretrainConfig else "lora:" not in text


# (a config written with the old name, the field that replaced it)
RENAMED = [
    ("training.accumulate=2", "training.accumulation"),
    ("training.clip=0.5", "optimizer.grad_clip"),
    ("training.seed=1", "runtime.seed"),
    ("training.eval_every=10", "evaluation.every"),
    ("output=runs/x", "runtime.output_dir"),
    ("model.device=cpu", "runtime.device"),
    ("data.tokens=512", "training.context_length"),
    ("schedule.warmup=5", "warmup_steps"),
    ("schedule.floor=0.1", "min_lr_ratio"),
    ("schedule.decay=0.3", "decay_fraction"),
    ("report_to=[wandb]", "runtime.report_to"),
    ("grpo.reward=exact", "grpo.rewards"),
]


@pytest.mark.parametrize("old, new", RENAMED, ids=[r[0] for r in RENAMED])
def test_former_names_fail_with_one_message_naming_the_new_field(old, new):
    with pytest.raises(ValueError, match=f"is a former field and is no longer read; .*{new}") as error:
        load(SFTConfig, None, ["data.path=x.jsonl", old])
    assert "\n" not in str(error.value)
    assert old.split("=")[0].split(".")[0] in FORMER_FIELDS or old.split("=")[0] in FORMER_FIELDS


@pytest.mark.parametrize("cls, field", [
    (SFTConfig, "training.targets_per_parameter=10"),
    (SFTConfig, "model.hidden=64"),
    (DPOConfig, "training.accumulation=2"),
    (GRPOConfig, "data.chosen=x"),
    (PretrainConfig, "model.card=debug"),
    (PretrainConfig, "evaluation.every=5"),
], ids=lambda x: x if isinstance(x, str) else x.command)
def test_a_field_the_command_does_not_read_is_refused_by_name(cls, field):
    name = field.split("=")[0]
    with pytest.raises(ValueError, match=rf"{name} is not read by `linnet {cls.command}` \(only by linnet "):
        load(cls, None, ["data.path=x.jsonl", field] if cls is not PretrainConfig else [field])


def test_command_defaults_differ_where_the_command_says():
    sft, pretrain = load(SFTConfig, None, ["data.path=x.jsonl"]), PretrainConfig()
    assert (sft.optimizer.lr, pretrain.optimizer.lr) == (2e-4, 3e-3)
    assert (sft.training.context_length, pretrain.training.context_length) == (2048, 1024)
    assert sft.runtime.output_dir == "runs/sft" and pretrain.runtime.output_dir == "runs/pretrain"
    partial = load(PretrainConfig, None, ["optimizer.weight_decay=0.2"])  # a group given in part keeps the rest
    assert partial.optimizer.lr == 3e-3 and partial.optimizer.betas == [0.9, 0.95]
