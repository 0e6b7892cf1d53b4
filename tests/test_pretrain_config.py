"""Pretraining configs (every shipped preset, refusals, overrides), the recipe identity,
checkpoint epoch selection and the budget's epoch rounding."""

from __future__ import annotations

from pathlib import Path

import pytest

from linnet.config import PretrainConfig, checkpoint_epochs
from linnet.config import load as load_config
from linnet.config.fields import differences as recipe_differences
from linnet.config.fields import identity as recipe_identity
from linnet.pretrain.budget import epoch_boundaries, plan_budget
from linnet.pretrain.recipe import recipe_fields


def load(path, overrides=()):
    return load_config(PretrainConfig, path, overrides)

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("pretrain*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_preset_loads(path):
    config = load(path)
    assert config.data.cache and config.runtime.output_dir
    assert config.model.hidden % config.model.heads == 0 or config.model.head_dim


def test_presets_exist():
    assert {p.name for p in CONFIGS} >= {"pretrain-tiny-cpu.yaml", "pretrain-20m.yaml"}


def test_unknown_and_former_fields_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"--set training.epoch=3: unknown field 'epoch' in training; did you mean "
                                         r"training.epochs\?"):
        load(None, ["training.epoch=3"])
    with pytest.raises(ValueError, match=r"data.buffer_size_mib is a former field .*data.shuffle_group_size"):
        load(None, ["data.buffer_size_mib=128"])
    with pytest.raises(ValueError, match=r"lr_schedule.warmup_fraction is a former field .*warmup_steps"):
        load(None, ["lr_schedule.warmup_fraction=0.1"])
    with pytest.raises(ValueError, match=r"lr_schedule.name: 'linear' is not one of 'cosine', 'wsd'"):
        load(None, ["lr_schedule.name=linear"])
    with pytest.raises(ValueError, match=r"optimizer.grad_clip=0.0; use a positive threshold, or null"):
        load(None, ["optimizer.grad_clip=0"])


def test_overrides_are_typed(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("training:\n  epochs: 8\noptimizer:\n  lr: 1e-3\n")
    config = load(path, ["optimizer.grad_clip=null", "training.checkpoint_epochs=[2, 4]",
                         "training.checkpoint_policy=explicit", "data.source=[a.txt, b.jsonl]"])
    assert config.training.epochs == 8 and config.optimizer.lr == 1e-3 and config.optimizer.grad_clip is None
    assert checkpoint_epochs(config) == [2, 4] and config.data.source == ["a.txt", "b.jsonl"]
    with pytest.raises(ValueError, match=r"training.micro_batch_size: expected int, got 'many'"):
        load(None, ["training.micro_batch_size=many"])


def test_checkpoint_epoch_policies():
    assert checkpoint_epochs(load(None, ["training.epochs=10"])) == []  # final
    assert checkpoint_epochs(load(None, ["training.epochs=10", "training.checkpoint_policy=interval",
                                         "training.checkpoint_epochs=3"])) == [3, 6, 9]
    assert checkpoint_epochs(load(None, ["training.epochs=4", "training.checkpoint_policy=interval"])) == [1, 2, 3, 4]
    assert checkpoint_epochs(load(None, ["training.epochs=10", "training.checkpoint_policy=explicit",
                                         "training.checkpoint_epochs=[10, 1, 10]"])) == [1, 10]
    with pytest.raises(ValueError, match=r"explicit policy needs epochs between 1 and training.epochs=10"):
        load(None, ["training.epochs=10", "training.checkpoint_policy=explicit", "training.checkpoint_epochs=[11]"])
    with pytest.raises(ValueError, match=r"interval policy takes one integer K"):
        load(None, ["training.checkpoint_policy=interval", "training.checkpoint_epochs=[1, 2]"])


def test_sharding_refuses_what_it_cannot_split():
    with pytest.raises(ValueError, match="optimizer.name=adamw8bit with training.shard=fsdp is not supported"):
        load(None, ["training.shard=fsdp", "optimizer.name=adamw8bit"])
    with pytest.raises(ValueError, match="training.shard=zero with decentralized"):
        load(None, ["training.shard=zero", "decentralized.num_models=2"])
    assert load(None, ["training.shard=zero", "optimizer.name=adamw8bit"]).training.shard == "zero"


def test_recipe_identity_ignores_where_a_run_happens_and_what_it_keeps():
    base = recipe_fields(load(None), "cafe")
    same = recipe_fields(load(None, [
        "runtime.device=cuda:1", "runtime.output_dir=elsewhere", "data.prefetch=false", "data.prepare_workers=1",
        "training.checkpoint_policy=interval", "training.save_epoch_training_state=true", "runtime.threads=2",
        "data.cache=moved/cache", "evaluation.batch_size=7", "training.shard=fsdp",
    ]), "cafe")
    assert recipe_identity(same) == recipe_identity(base)
    for change in ["optimizer.lr=1e-4", "optimizer.grad_clip=null", "runtime.seed=1", "data.shuffle_group_size=4",
                   "training.micro_batch_size=16", "lr_schedule.name=wsd", "model.dtype=bfloat16",
                   "training.targets_per_parameter=10"]:
        assert recipe_identity(recipe_fields(load(None, [change]), "cafe")) != recipe_identity(base), change
    assert recipe_identity(recipe_fields(load(None), "beef")) != recipe_identity(base)  # another cache
    differences = recipe_differences(base, recipe_fields(load(None, ["optimizer.lr=1e-4", "runtime.seed=3"]), "cafe"))
    assert differences == ["optimizer.lr: 0.003 (saved) vs 0.0001 (now)", "runtime.seed: 0 (saved) vs 3 (now)"]


def test_epoch_boundaries_round_the_cumulative_targets_half_up():
    # 10 targets per epoch nominal, batches of 4: cumulative 10, 20, 30 -> 2.5, 5, 7.5 batches
    assert epoch_boundaries(30, 3, 4) == [3, 5, 8]
    assert epoch_boundaries(1000, 4, 100) == [3, 5, 8, 10]  # 2.5 -> 3, 5, 7.5 -> 8, 10
    assert epoch_boundaries(999, 4, 100) == [2, 5, 7, 10]  # 2.4975 -> 2, 4.995 -> 5, 7.4925 -> 7, 9.99 -> 10


def test_default_budget_is_20_targets_per_parameter_in_40_epochs():
    budget = plan_budget(1_000_000, context=256, sequences_per_update=8)
    assert budget.targets == 20_000_000 and budget.epochs == 40
    assert budget.steps == round(20_000_000 / 2048) == 9766
    sizes = {b - a for a, b in zip((0, *budget.boundaries[:-1]), budget.boundaries)}
    assert sizes == {244, 245}
    assert budget.epoch_steps(1) == range(1, 245) and budget.epoch_of(245) == 2 and budget.epoch_of(9766) == 40
    with pytest.raises(ValueError, match=r"leaves epoch 1 without a whole batch; lower training.epochs"):
        plan_budget(1000, context=256, sequences_per_update=8, epochs=40)
