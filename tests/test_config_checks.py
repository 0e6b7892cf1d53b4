"""Every value is checked wherever it enters, and the names users bring are answered
(issue 41): nan and infinity are refused in every float of every group, from YAML and from
Python; absurd values warn and ignored combinations are refused; PEFT's target names and
all-linear pick adapters; an unknown field, another trainer's name or a key given twice is
refused where it was written. The command-line cases are in tests/test_bad_inputs.py."""

from __future__ import annotations

import dataclasses
import re
import typing

import pytest

from linnet import nest
from linnet.config import FOREIGN_FIELDS, DPOConfig, GRPOConfig, PretrainConfig, SFTConfig, load
from linnet.config.groups import (
    DistillSettings,
    DPOSettings,
    LoraConfig,
    OptimizerConfig,
    RewardSettings,
)
from linnet.config.sampling import GRPOOptions, GRPOSettings
from linnet.paths import adapted_layers, target_matches
from linnet.run import Run, run_and_options

NAN, INF = float("nan"), float("inf")
DATA = ["data.path=x.jsonl"]


def _float_fields(cls: type, command: str, prefix: str = "") -> list[str]:
    """The dotted float fields (float, float | None, list[float], int | float) `command`
    reads in config `cls`, its groups' included."""
    hints = typing.get_type_hints(cls)
    found = []
    for f in dataclasses.fields(cls):
        if f.metadata.get("only") is not None and command not in f.metadata["only"]:
            continue
        tp = hints[f.name]
        inner = [t for t in (tp, *typing.get_args(tp)) if dataclasses.is_dataclass(t)]
        if inner:
            found += _float_fields(inner[0], command, f"{prefix}{f.name}.")
        elif float in (tp, *typing.get_args(tp), *[a for t in typing.get_args(tp) for a in typing.get_args(t)]):
            found.append(f"{prefix}{f.name}")
    return found


FLOATS = sorted({name: cls for cls in (PretrainConfig, SFTConfig, DPOConfig, GRPOConfig)
                 for name in _float_fields(cls, cls.command)}.items())
GIVEN = {"decentralized.adaptive_consensus.start_frac": ["decentralized.adaptive_consensus.p=1"],
         "decentralized.adaptive_consensus.p": ["decentralized.adaptive_consensus.start_frac=0.5"]}


def test_the_float_fields_are_found():
    names = dict(FLOATS)
    assert {"optimizer.weight_decay", "dpo.beta", "grpo.beta", "grpo.clip", "grpo.pass_reward", "model.rope_base",
            "decentralized.adaptive_consensus.p", "training.epochs"} <= set(names) and len(names) >= 30


@pytest.mark.parametrize("name, cls", FLOATS, ids=[n for n, _ in FLOATS])
@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf"])
def test_every_float_field_refuses_nan_and_infinity_from_yaml(name, cls, value):
    given = f"[0.2, {value}]" if name in ("grpo.clip", "optimizer.betas") else value
    sets = [f"{name}={given}", *GIVEN.get(name, [])] + ([] if cls is PretrainConfig else DATA)
    with pytest.raises(ValueError, match=rf"^--set {re.escape(name)}={re.escape(given)}: {re.escape(name)}(\[1\])?="
                                         r"-?(nan|inf); use a finite number$"):
        load(cls, None, sets)


@pytest.mark.parametrize("settings, field, value", [
    (DPOSettings, "beta", INF), (DPOSettings, "label_smoothing", NAN), (DPOSettings, "rpo_alpha", NAN),
    (GRPOOptions, "beta", NAN), (GRPOOptions, "clip", [0.2, INF]), (GRPOOptions, "correction_cap", INF),
    (GRPOSettings, "pass_reward", NAN), (RewardSettings, "margin", NAN), (RewardSettings, "margin", -INF),
    (DistillSettings, "temperature", INF), (OptimizerConfig, "weight_decay", NAN), (LoraConfig, "alpha", INF),
])
def test_groups_built_in_python_refuse_nan_and_infinity(settings, field, value):
    group = getattr(settings, "YAML", {OptimizerConfig: "optimizer", LoraConfig: "lora"}.get(settings))
    with pytest.raises(ValueError, match=rf"^config: {group}\.{field}=.*(nan|inf).*; use a finite number$"):
        settings(**{field: value})


@pytest.mark.parametrize("settings, options, message", [
    (GRPOOptions, {"beta": NAN}, r"^grpo: beta=nan; use a finite number$"),
    (GRPOOptions, {"clip": (0.2, INF)}, r"^grpo: clip=\[0.2, inf\]; use a finite number$"),
    (DPOSettings, {"beta": INF}, r"^dpo: beta=inf; use a finite number$"),
    (RewardSettings, {"margin": NAN}, r"^reward: margin=nan; use a finite number$"),
    (DistillSettings, {"beta": NAN}, r"^distill: beta=nan; use a finite number$"),
    (GRPOOptions, {"temperature": 0.0}, r"^grpo: temperature=0 samples greedily"),
    (DPOSettings, {"loss_type": "hinge", "label_smoothing": 0.1}, r"^dpo: label_smoothing=0.1 is read by "
                                                                  r"loss_type sigmoid, robust or simpo only"),
])
def test_python_keywords_are_checked_and_named_in_python_s_spelling(settings, options, message):
    who = settings.YAML
    with pytest.raises(ValueError, match=message):
        run_and_options(who, Run(optimizer=None, steps=1), options, settings)


@pytest.mark.parametrize("fields, message", [
    (dict(clip=-1.0), r"^Run: clip=-1.0; use a positive, finite gradient-norm threshold \(a negative one would step "
                      r"uphill, 0 would freeze training\)"),
    (dict(clip=0), r"^Run: clip=0;"),
    (dict(clip=NAN), r"^Run: clip=nan;"),
    (dict(clip=INF), r"^Run: clip=inf;"),
    (dict(steps=NAN), r"^Run: steps=nan must be a whole number >= 0$"),
    (dict(steps=2.5), r"^Run: steps=2.5 must be a whole number"),
    (dict(steps=-1), r"^Run: steps=-1 must be >= 0$"),
    (dict(keep=0), r"^Run: keep=0 must be >= 1$"),
    (dict(evaluate_every=INF), r"^Run: evaluate_every=inf must be a whole number"),
])
def test_the_run_refuses_a_clip_or_count_that_cannot_train(fields, message):
    with pytest.raises(ValueError, match=message):
        Run(**{"optimizer": None, "steps": 1, **fields})
    with pytest.raises(ValueError, match=message):  # the trainers' keywords build the same Run
        run_and_options("train", None, {"optimizer": None, "steps": 1, **fields})


def test_the_run_takes_what_trains():
    assert Run(optimizer=None, steps=3.0, clip=None).clip is None
    assert Run(optimizer=None, steps=0, clip=0.5).steps == 0


def test_a_huge_weight_decay_warns_with_the_reason_and_an_impossible_one_is_refused():
    with pytest.warns(UserWarning, match=r"optimizer.weight_decay=50 is far above the usual 0 to 0.1: AdamW's "
                                         r"decoupled decay multiplies .* by 1 - lr x weight_decay = 0.99 every step"):
        load(SFTConfig, None, [*DATA, "optimizer.weight_decay=50"])
    with pytest.raises(ValueError, match=r"weight_decay=1000 with optimizer.lr=0.01: .* = -9 every step, which "
                                         r"zeroes or flips them"):
        OptimizerConfig(lr=1e-2, weight_decay=1000)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load(PretrainConfig, None, ["optimizer.weight_decay=0.1"])  # the usual values are quiet
        load(SFTConfig, None, [*DATA, "optimizer.weight_decay=1"])


@pytest.mark.parametrize("sets, ignored", [
    (["lora.dora=true"], "lora.dora=true"),
    (["lora.rslora=true", "lora.dropout=0.1"], "lora.dropout=0.1, lora.rslora=true"),
    (["lora.rank=8"], "lora.rank=8"),
    (["lora.targets=[q_proj]"], "lora.targets=['q_proj']"),
])
def test_lora_options_without_lora_are_refused(sets, ignored):
    with pytest.raises(ValueError, match=rf"lora.enabled=false trains every weight, without adapters, so "
                                         rf"{re.escape(ignored)} would be ignored; remove (it|them), or set "
                                         r"lora.enabled=true"):
        load(SFTConfig, None, [*DATA, "lora.enabled=false", *sets])
    assert load(SFTConfig, None, [*DATA, *sets]).lora.enabled  # with LoRA they are read
    assert not load(SFTConfig, None, [*DATA, "lora.enabled=false", "lora.rank=16"]).lora.enabled  # the default


@pytest.mark.parametrize("loss, field, value", [
    ("ipo", "label_smoothing", 0.1), ("hinge", "label_smoothing", 0.1), ("orpo", "label_smoothing", 0.2),
    ("sigmoid", "simpo_gamma", 1.0), ("sigmoid", "desirable_weight", 2.0), ("simpo", "undesirable_weight", 0.5),
])
def test_dpo_options_the_loss_does_not_read_are_refused(loss, field, value):
    with pytest.raises(ValueError, match=rf"dpo.{field}={value} is read by dpo.loss_type .* only, and "
                                         rf"dpo.loss_type={loss} would ignore it"):
        DPOSettings(loss_type=loss, **{field: value})


@pytest.mark.parametrize("loss, field, value", [
    ("sigmoid", "label_smoothing", 0.1), ("robust", "label_smoothing", 0.1), ("simpo", "label_smoothing", 0.1),
    ("simpo", "simpo_gamma", 1.0), ("kto", "desirable_weight", 2.0),
])
def test_dpo_options_the_loss_reads_are_taken(loss, field, value):
    assert getattr(DPOSettings(loss_type=loss, **{field: value}), field) == value


def test_greedy_grpo_is_refused_with_the_reason():
    with pytest.raises(ValueError, match=r"grpo.temperature=0 samples greedily: every completion of a group is the "
                                         r"same, so every group's rewards are equal"):
        GRPOSettings(temperature=0)
    assert GRPOSettings(temperature=0.7).temperature == 0.7


LAYERS = [f"model.layers.{i}.{part}" for i in range(2) for part in (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
    "mlp.down_proj")]


@pytest.mark.parametrize("patterns, picked", [
    ("q_proj", ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"]),
    (["q_proj", "v_proj"], [f"model.layers.{i}.self_attn.{p}_proj" for p in "qv" for i in range(2)]),
    (["self_attn.o_proj"], ["model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj"]),
    ("all-linear", LAYERS),
    (["all-linear", "q_proj"], LAYERS),
    (["model.layers.*.mlp.*_proj"], [n for n in LAYERS if ".mlp." in n]),
    (["model.layers.1.mlp.down_proj.weight"], ["model.layers.1.mlp.down_proj"]),
])
def test_adapter_targets_take_peft_s_names_all_linear_and_globs(patterns, picked):
    assert sorted(adapted_layers(LAYERS, patterns)) == sorted(picked)


def test_a_short_name_matches_whole_parts_of_a_path_only():
    assert not target_matches("model.layers.0.self_attn.q_proj", "proj")
    assert not target_matches("model.layers.0.self_attn.q_proj", "_proj")
    assert target_matches("model.layers.0.self_attn.q_proj", "0.self_attn.q_proj")
    with pytest.raises(ValueError, match=r"pattern 'qv_proj' matches no linear weight; .*q_proj \(PEFT's "
                                         r"target_modules\), or all-linear"):
        adapted_layers(LAYERS, ["q_proj", "qv_proj"])
    with pytest.raises(ValueError, match=r"^add_lora: pattern 'lm_head' .*; the output head takes no adapter \(train "
                                         r"it in full with trainable='lm_head.weight'\)$"):
        adapted_layers(LAYERS, ["lm_head"])
    with pytest.raises(ValueError, match=r"^add_lora: pattern 'q_\{0\}' matches no linear weight"):  # braces as written
        adapted_layers(LAYERS, ["q_{0}"])


def test_torch_add_lora_takes_short_names_and_refuses_a_rank_larger_than_a_layer():
    model = nest.load("debug", weights="random")
    assert model.add_lora(["q_proj", "v_proj"], rank=4) == [
        f"model.layers.{i}.self_attn.{p}_proj" for p in "qv" for i in range(2)]
    model = nest.load("debug", weights="random")
    layers = model.add_lora("all-linear", rank=32)  # k_proj is 32 x 64: rank 32 is its whole
    assert len(layers) == 14 and "lm_head" not in layers
    with pytest.raises(ValueError, match=r"^add_lora: rank=33 is larger than the adapted layer "
                                         r"model.layers.0.self_attn.k_proj \(32 x 64\): .* the largest useful rank "
                                         r"is 32"):
        nest.load("debug", weights="random").add_lora("all-linear", rank=33)
    model = nest.load("debug", weights="random")
    assert len(model.add_lora(["gate_proj", "up_proj"], rank=64)) == 4  # 192 x 64: 64 fits
    with pytest.raises(ValueError, match=r"rank=100000 .* the largest useful rank is 64"):
        nest.load("debug", weights="random").add_lora(["gate_proj", "up_proj", "down_proj"], rank=100000)
    with pytest.raises(ValueError, match=r"rank=100000 .* the largest useful rank is 64"):  # loaded with adapters
        nest.load("debug", weights="random", lora=dict(patterns="q_proj", rank=100000))
    with pytest.raises(ValueError, match=r"^add_lora: rank=2.5; it must be an integer$"):
        nest.load("debug", weights="random").add_lora("q_proj", rank=2.5)


@pytest.mark.jax  # JAX in the worker: last, after the tests that fork (tests/conftest.py)
def test_the_jax_backend_takes_short_names_too():
    pytest.importorskip("jax")
    model = nest.load("debug", backend="jax", weights="random")
    assert model.add_lora(["q_proj", "v_proj"], rank=4) == [
        f"model.layers.{i}.self_attn.{p}_proj" for p in "qv" for i in range(2)]
    assert len(nest.load("debug", backend="jax", weights="random").add_lora("all-linear", rank=4)) == 14


def test_a_lora_run_stores_the_names_as_written_and_adapts_what_they_pick(tmp_path):
    import json

    import numpy as np

    from linnet import cli
    from linnet.commands import quickstart
    from tests.conftest import quickstart_model

    quickstart_model(tmp_path / "model")
    problems = quickstart.problems(np.random.default_rng(0), 40, 2)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"prompt": p, "completion": a}) + "\n"
                                                  for p, a in problems))
    sets = [f"model.card={tmp_path / 'model'}", f"data.path={tmp_path / 'train.jsonl'}", "data.chat=false",
            "training.context_length=64", "training.steps=1", "lr_schedule.warmup_steps=0", "runtime.progress=false",
            f"runtime.output_dir={tmp_path / 'run'}", "lora.targets=[q_proj, v_proj]", "lora.rank=4"]
    assert cli.main(["sft", *[a for s in sets for a in ("--set", s)]]) == 0
    assert json.loads((tmp_path / "run" / "config.json").read_text())["lora"]["targets"] == ["q_proj", "v_proj"]
    saved = json.loads((tmp_path / "run" / "final" / "adapter_config.json").read_text())["target_modules"]
    assert sorted(saved) == sorted(f"model.layers.{i}.self_attn.{p}_proj" for p in "qv" for i in range(4))


def test_every_unknown_field_is_reported_at_once_where_it_was_written(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  card: debug\ndata:\n  path: x.jsonl\nlearning_rate: 1e-4\noptimizer:\n  lr: 1e-3\n"
                    "  weight_decy: 0.1\nlora_r: 8\ntraining:\n  accumulate: 2\nseed: 3\n")
    with pytest.raises(ValueError) as caught:
        load(SFTConfig, path, ["training.stpes=3", "bf16=true"])
    first, *lines = str(caught.value).splitlines()
    assert first == "7 fields are not read by `linnet sft`:"
    assert [line.strip() for line in lines] == [
        f"{path} line 5: unknown field 'learning_rate' (a TRL, PEFT or Axolotl name); use optimizer.lr",
        f"{path} line 8: unknown field 'weight_decy' in optimizer; did you mean optimizer.weight_decay?",
        f"{path} line 9: unknown field 'lora_r' (a TRL, PEFT or Axolotl name); use lora.rank",
        f"{path} line 11: training.accumulate is a former field and is no longer read; use training.accumulation",
        "--set training.stpes=3: unknown field 'stpes' in training; did you mean training.steps?",
        f"{path} line 12: unknown field 'seed'; did you mean runtime.seed?",
        "--set bf16=true: unknown field 'bf16' (a TRL, PEFT or Axolotl name); use model.dtype: bfloat16 (auto picks "
        "it where the device computes bf16 natively)",
    ]


# The names users bring most from TRL and Axolotl (docs/coming-from.md), each answered with linnet's field.
BROUGHT = {
    "learning_rate": "optimizer.lr", "num_train_epochs": "training.epochs",
    "gradient_accumulation_steps": "training.accumulation", "max_seq_length": "training.context_length",
    "max_length": "training.context_length", "sequence_len": "training.context_length", "lora_r": "lora.rank",
    "lora_alpha": "lora.alpha", "lora_dropout": "lora.dropout", "target_modules": "lora.targets",
    "per_device_train_batch_size": "training.context_length", "warmup_steps": "lr_schedule.warmup_steps",
    "max_grad_norm": "optimizer.grad_clip", "output_dir": "runtime.output_dir", "seed": "runtime.seed",
    "bf16": "model.dtype", "max_steps": "training.steps", "weight_decay": "optimizer.weight_decay",
}


@pytest.mark.parametrize("name, ours", BROUGHT.items(), ids=list(BROUGHT))
def test_the_names_users_bring_are_answered_with_ours(name, ours):
    with pytest.raises(ValueError, match=rf"^--set {name}=1: unknown field '{name}'.*\b{re.escape(ours)}\b"):
        load(SFTConfig, None, [*DATA, f"{name}=1"])


def test_foreign_names_point_at_fields_that_exist():
    from tests.test_spellings import yaml_fields

    fields = yaml_fields()
    named = {name for fix in FOREIGN_FIELDS.values() for name in re.findall(r"\b([a-z_]+\.[a-z_]+)\b", fix)}
    assert named and named <= fields, named - fields
    assert not set(FOREIGN_FIELDS) & {name.split(".")[0] for name in fields}  # never a group's name


def test_a_key_given_twice_is_refused_with_both_lines(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("data:\n  path: x.jsonl\noptimizer:\n  lr: 1e-3\n  weight_decay: 0.1\n  lr: 2e-3\n")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))} line 6: optimizer.lr is given twice \(lines 4 "
                                         r"and 6\); YAML would keep the second silently: keep one$"):
        load(SFTConfig, path)
    path.write_text("data: {path: x.jsonl}\noptimizer: {lr: 1e-3}\n")  # the same key in two groups is two fields
    assert load(SFTConfig, path, ["lora.alpha=16"]).optimizer.lr == 1e-3


def test_a_value_s_error_names_the_file_line_it_came_from(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("data:\n  path: x.jsonl\ntraining:\n  steps: many\n")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))} line 4: training.steps: expected int, got "
                                         r"'many'$"):
        load(SFTConfig, path)
    with pytest.raises(ValueError, match=r"^--set training.steps=\.nan: training.steps: expected int, got nan$"):
        load(SFTConfig, path, ["training.steps=.nan"])


def test_an_unreadable_config_file_is_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"is a directory; --config takes a YAML file"):
        load(SFTConfig, tmp_path)
    (tmp_path / "bin.yaml").write_bytes(b"\x80\x81 binary")
    with pytest.raises(ValueError, match=r"bin.yaml: not a UTF-8 text file"):
        load(SFTConfig, tmp_path / "bin.yaml")


def test_a_value_out_of_range_is_named_alone_where_it_was_written(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  card: debug\ndata:\n  path: x.jsonl\nlora:\n  alpha: 8\n  dropout: 2\n")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))} line 7: lora.dropout=2.0; it must be in \[0, 1\)$"):
        load(SFTConfig, path)
    with pytest.raises(ValueError, match=r"^--set lora.alpha=-1: lora.alpha=-1.0; it must be > 0$"):
        load(SFTConfig, path, ["lora.alpha=-1"])
    with pytest.raises(ValueError, match=r"^config: dpo.label_smoothing=0.6; it must be in \[0, 0.5\)$"):
        DPOConfig(dpo=DPOSettings(label_smoothing=0.6))  # made in Python: no file to name
