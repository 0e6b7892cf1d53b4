"""Activation checkpointing: the gradients of a checkpointed decoder equal those of one
that keeps every activation (full, LoRA, DoRA; every block recomputed, or attention's
outputs kept), also sharded over two processes and split over two, and through DPO, GRPO
and the config."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from linnet import nest
from linnet.packing import Example, Pair, pack
from linnet.torch import fully_shard
from linnet.train import train
from linnet.train.dpo import dpo
from linnet.train.grpo import Prompt, grpo
from tests.conftest import in_processes

torch.set_num_threads(1)
CARD = nest.resolve("debug").replace(vocab=64, hidden=32, intermediate=64, heads=4, kv_heads=2, head_dim=8,
                                     layers=3, tied_embeddings=False)
MODES = [True, "selective", "offload"]


def _rows():
    g = np.random.default_rng(0)
    docs = [Example.prompted(g.integers(3, 64, 5).tolist(), g.integers(3, 64, int(n)).tolist())
            for n in g.integers(2, 14, size=24)]
    return list(pack(docs, tokens=48))


def _gradients(mode, adapters: str | None = None, model=None) -> dict[str, torch.Tensor]:
    if model is None:
        model = nest.load(CARD, weights="random", seed=1, trainable=adapters is None, activation_checkpointing=mode)
    if adapters is not None:
        torch.manual_seed(2)
        model.add_lora("*_proj.weight", rank=4, dora=adapters == "dora", dropout=0.1 if adapters == "dropout" else 0)
        with torch.no_grad():  # B away from zero, so every adapter has a gradient path
            for name, p in model.named_parameters():
                if name.endswith("lora_b"):
                    p.normal_(0, 0.1)
    torch.manual_seed(3)  # the same dropout masks in both runs
    for row in _rows()[:2]:
        loss, n = model.loss_packed(row)
        (loss / n).backward()
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("adapters", [None, "lora", "dora", "dropout"])
def test_checkpointed_gradients_equal_stored_ones(mode, adapters):
    stored, checkpointed = _gradients(False, adapters), _gradients(mode, adapters)
    assert stored.keys() == checkpointed.keys() and len(stored) > 0
    for name in stored:
        torch.testing.assert_close(checkpointed[name], stored[name], atol=1e-6, rtol=0, msg=name)


def test_checkpointing_is_for_training_and_can_be_switched():
    model = nest.load(CARD, weights="random", seed=1, trainable=True, activation_checkpointing="selective")
    assert model.checkpointing == "selective"
    with torch.no_grad():  # no graph to recompute: the plain forward
        loss, _ = model.loss_packed(_rows()[0])
    model.checkpoint_activations(False)
    assert model.checkpointing is None
    with pytest.raises(ValueError, match="activation_checkpointing='some'"):
        model.checkpoint_activations("some")
    with pytest.raises(ValueError, match="activation_memory_budget .* use it with compile='inductor'"):
        nest.load(CARD, weights="random", activation_memory_budget=0.5)


def test_trainers_switch_it_through_causal_lm_and_keep_a_chosen_mode():
    from linnet.torch import CausalLM

    lm = CausalLM(nest.load(CARD, weights="random", activation_checkpointing="selective"))
    lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert lm.is_gradient_checkpointing and lm.decoder.checkpointing == "selective"
    lm.gradient_checkpointing_disable()
    assert not lm.is_gradient_checkpointing
    lm.gradient_checkpointing_enable()
    assert lm.decoder.checkpointing == "full"


def _sharded_gradients(rank, mode):
    from linnet.torch.sharding import full

    model = fully_shard(nest.load(CARD, weights="random", seed=1, trainable=True, activation_checkpointing=mode))
    loss, n = model.loss_packed(_rows()[rank])
    (loss / 2).backward()  # each process's share of a two-row step, summed across the processes by FSDP
    return {k: full(p.grad).detach().numpy().copy() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("mode", MODES)
def test_checkpointed_gradients_equal_stored_ones_under_fully_shard(mode):
    stored, checkpointed = in_processes(_sharded_gradients, False)[0], in_processes(_sharded_gradients, mode)[0]
    assert stored.keys() == checkpointed.keys() and len(stored) > 0
    for name in stored:
        np.testing.assert_allclose(checkpointed[name], stored[name], atol=1e-6, rtol=0, err_msg=name)


def _split_losses(rank, mode):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("copies", "split"))
    model = nest.load(CARD, weights="random", seed=0, trainable=True, tensor_parallel=mesh["split"],
                      activation_checkpointing=mode)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    return [s.loss for s in train(model, _rows()[:6], optimizer=opt, steps=3, accumulate=2).steps]


def test_checkpointing_under_tensor_parallel_trains_alike():
    stored, checkpointed = in_processes(_split_losses, False)[0], in_processes(_split_losses, True)[0]
    assert checkpointed == pytest.approx(stored, rel=1e-6)


def test_dpo_and_grpo_take_the_same_steps_checkpointed():
    def run(mode):
        model = nest.load(CARD, weights="random", seed=0, activation_checkpointing=mode)
        torch.manual_seed(0)  # the adapters' A matrices come from the global generator
        model.add_lora("*_proj.weight", rank=4)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
        g = np.random.default_rng(1)
        pairs = [Pair(g.integers(3, 64, 4).tolist(), g.integers(3, 64, 5).tolist(), g.integers(3, 64, 3).tolist())
                 for _ in range(8)]
        preference = [s.loss for s in dpo(model, pairs, optimizer=opt, steps=2, pairs_per_step=4, tokens=64).steps]
        from linnet.serve import Engine

        engine = Engine(nest.load(CARD, weights="random", seed=0))
        prompts = [Prompt(g.integers(3, 64, 4).tolist(), answer=None) for _ in range(4)]
        policy = [s.loss for s in grpo(model, engine, prompts, lambda p, c: float(sum(c) % 5), optimizer=opt,
                                       steps=2, group=2, prompts_per_step=2, max_new_tokens=4, tokens=64,
                                       verbose=False).steps]
        return preference, policy

    (dpo_on, grpo_on), (dpo_off, grpo_off) = run(True), run(False)
    assert dpo_on == pytest.approx(dpo_off, rel=1e-6) and grpo_on == pytest.approx(grpo_off, rel=1e-6, abs=1e-9)


def test_the_config_switch_reaches_the_model_and_leaves_the_recipe_alone(tmp_path):
    from linnet.commands.run_directory import recipe
    from linnet.commands.runs import load_model
    from linnet.config import SFTConfig, load

    (tmp_path / "x.jsonl").write_text("{}\n")
    config = load(SFTConfig, None, [f"data.path={tmp_path / 'x.jsonl'}", "training.activation_checkpointing=selective",
                                    "lora.enabled=false", "model.weights=random"])
    assert load_model(CARD, config).checkpointing == "selective"
    plain = load(SFTConfig, None, [f"data.path={tmp_path / 'x.jsonl'}", "lora.enabled=false", "model.weights=random"])
    assert recipe(config) == recipe(plain)  # the same run: resuming may switch it on or off
