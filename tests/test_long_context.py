"""Context extension in the card: RoPE scaling (linear, Llama 3, YaRN) read from and
written to transformers' config, the same logits as transformers, one formula for both
backends, and the config's overrides reaching a run and what it exports."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import yaml

from linnet import cli, nest
from linnet.cards import REGISTRY, RopeScaling, configured, rope_frequencies, trained_card, with_rope
from linnet.commands import quickstart
from tests.conftest import TINY, quickstart_model

torch.set_num_threads(1)

SCALINGS = {  # transformers' rope_parameters, original context 32 (TINY's is 256)
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    "yarn-set": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 16.0,
                 "beta_slow": 2.0, "attention_factor": 1.3, "truncate": False},
}


def _hf(family: str, scaling: dict, tmp_path):
    transformers = pytest.importorskip("transformers")
    config_class = {"llama": "LlamaConfig", "qwen2": "Qwen2Config"}[family]
    config = getattr(transformers, config_class)(**TINY, rope_parameters={**scaling, "rope_theta": 10000.0})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(tmp_path / family)
    return model, tmp_path / family


@pytest.mark.parametrize("kind", sorted(SCALINGS))
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_scaled_rope_gives_transformers_logits_past_the_original_context(family, kind, tmp_path):
    hf, directory = _hf(family, SCALINGS[kind], tmp_path)
    card = nest.resolve(directory)
    assert card.rope_scaling.kind == kind.split("-")[0]
    model = nest.load(directory)
    tokens = torch.randint(0, TINY["vocab_size"], (1, 160), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (model(tokens) - hf(tokens).logits).abs().max().item() <= 1e-4
    np.testing.assert_array_equal(model.inv_freq.numpy(), hf.model.rotary_emb.inv_freq.numpy())
    assert card.rope_scaling.cos_sin_scale == pytest.approx(hf.model.rotary_emb.attention_scaling)
    # written back as transformers reads it: the same scaling, the same logits
    model.save_weights(tmp_path / "back")
    again = nest.resolve(tmp_path / "back")
    assert (again.rope_base, again.rope_scaling, again.max_positions) == (card.rope_base, card.rope_scaling,
                                                                          card.max_positions)
    transformers = pytest.importorskip("transformers")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32).eval()
    with torch.no_grad():
        assert (back(tokens).logits - hf(tokens).logits).abs().max().item() <= 1e-5


@pytest.mark.parametrize("kind", [None, "linear", "llama3", "yarn"])
def test_one_formula_gives_both_backends_the_same_frequencies(kind):
    """NumPy (the JAX model, GGUF export) and torch compute the frequencies alike in
    float32, for every registered card and each scaling."""
    scaling = None if kind is None else RopeScaling(kind=kind, factor=4.0, original_max_positions=4096)
    for name in sorted(REGISTRY):
        card = nest.resolve(name)
        card = card if kind is None else card.replace(rope_scaling=scaling)
        theirs = rope_frequencies(card, np)
        assert theirs.dtype == np.float32
        # a few float32 roundings apart at most (numpy and torch order the llama3 blend's products apart)
        np.testing.assert_allclose(theirs, rope_frequencies(card, torch).numpy(), rtol=5e-7, atol=0, err_msg=name)


def test_config_overrides_set_base_scaling_and_context(tmp_path):
    quickstart_model(tmp_path / "m")
    base = nest.resolve(tmp_path / "m")
    assert base.rope_scaling is None
    card = configured({"card": str(tmp_path / "m"), "rope_base": 40000, "rope_scaling": {"kind": "yarn", "factor": 4}})
    assert card.rope_base == 40000.0 and card.max_positions == 4 * base.max_positions
    assert card.rope_scaling == RopeScaling(kind="yarn", factor=4.0, original_max_positions=base.max_positions)
    assert configured({"card": str(tmp_path / "m"), "rope_scaling": {"kind": "linear", "factor": 2},
                       "max_positions": 100}).max_positions == 100
    assert with_rope(card, scaling={"kind": "none"}).rope_scaling is None
    assert configured({"card": str(tmp_path / "m")}) == base
    for scaling, message in [({"kind": "ntk", "factor": 2}, "kind 'ntk' is not one of linear, llama3, yarn"),
                             ({"kind": "yarn", "factor": 0.5}, "factor=0.5"),
                             ({"kind": "yarn", "factr": 2}, "unknown key.s. factr")]:
        with pytest.raises(ValueError, match=f"config: model.rope_scaling: .*{message}"):
            with_rope(base, scaling=scaling)


def test_a_run_with_scaled_rope_trains_exports_and_chains_with_it(tmp_path):
    """`linnet sft` with model.rope_scaling trains the scaled model; the run's card (what
    the next stage loads) and its merged export carry the scaling as transformers reads it."""
    quickstart_model(tmp_path / "model")
    rows = [{"prompt": p, "completion": a} for p, a in quickstart.problems(np.random.default_rng(0), 12, 2)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = {"model": {"card": str(tmp_path / "model"), "rope_scaling": {"kind": "yarn", "factor": 2}},
              "data": {"path": str(tmp_path / "train.jsonl"), "chat": False}, "lora": {"rank": 4},
              "training": {"steps": 2, "context_length": 64}, "optimizer": {"lr": 1e-3},
              "lr_schedule": {"warmup_steps": 1}, "runtime": {"progress": False, "output_dir": str(tmp_path / "run")}}
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(config))
    assert cli.main(["sft", "--config", str(tmp_path / "sft.yaml")]) == 0
    card = trained_card(tmp_path / "run")
    original = nest.resolve(tmp_path / "model").max_positions
    assert card.rope_scaling == RopeScaling(kind="yarn", factor=2.0, original_max_positions=original)
    assert card.max_positions == 2 * original
    assert cli.main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "merged"), "--merge"]) == 0
    exported = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert exported["rope_parameters"]["rope_type"] == "yarn" and exported["max_position_embeddings"] == 2 * original
    assert nest.resolve(tmp_path / "merged").rope_scaling == card.rope_scaling


def _saved_bytes(model, row) -> tuple[float, int]:
    """(the row's loss, bytes of the tensors autograd keeps for backward) in one forward."""
    kept = []

    def pack(t):
        kept.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        total, count = model.loss_packed(row)
    return total, sum(kept)


@pytest.mark.parametrize("checkpointing", [False, "full"])
def test_mlp_tiles_give_the_same_loss_and_gradients_and_keep_less(checkpointing):
    """A row's MLP computed 7 positions at a time: the same loss and gradients as whole
    (f32, to rounding), the same logits without gradients, and less kept for backward
    (with whole blocks recomputed, where a block keeps its input alone, the same)."""
    from linnet.packing import Example, pack

    card = nest.resolve("debug").replace(vocab=96, hidden=32, intermediate=96, heads=4, kv_heads=2, head_dim=8)
    g = np.random.default_rng(0)
    (row,) = pack([Example.prompted(g.integers(3, 96, 4).tolist(), g.integers(3, 96, n).tolist()) for n in (20, 23)],
                  tokens=64)
    results = []
    for tile in (None, 7):
        model = nest.load(card, weights="random", seed=1, trainable=True, activation_checkpointing=checkpointing)
        model.tile_mlp(tile)
        total, kept = _saved_bytes(model, row)
        total.backward()
        with torch.no_grad():
            logits = model(torch.tensor(row.tokens[None, :row.real]))
        results.append((total, kept, {n: p.grad for n, p in model.named_parameters()}, logits))
    (whole, whole_kept, whole_grads, whole_logits), (tiled, tiled_kept, tiled_grads, tiled_logits) = results
    assert float(tiled.detach()) == pytest.approx(float(whole.detach()), rel=1e-6)
    for name, grad in whole_grads.items():
        torch.testing.assert_close(tiled_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    torch.testing.assert_close(tiled_logits, whole_logits, rtol=1e-6, atol=1e-6)
    assert tiled_kept == whole_kept if checkpointing else tiled_kept < 0.8 * whole_kept
    with pytest.raises(ValueError, match="positions=0"):
        model.tile_mlp(0)
