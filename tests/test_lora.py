"""Low-rank adapters: unchanged at start, merge, gradients, save/bind, PEFT export."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from linnet import nest
from linnet.packing import Example, pack
from linnet.torch.lora import save_peft
from linnet.torch.weights import bind_weights
from tests.conftest import make_hf_model

PATTERNS = ["model.layers.*.self_attn.*_proj.weight", "model.layers.*.mlp.*"]
TOKENS = torch.randint(0, 97, (2, 13), generator=torch.Generator().manual_seed(0))


def _perturb_adapters(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_b"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
            if name.endswith("lora_magnitude"):  # DoRA: magnitudes away from the rows' norms
                p.mul_(1 + 0.2 * torch.rand(p.shape, generator=g))


def _model(tmp_path, family="llama"):
    make_hf_model(family).save_pretrained(tmp_path / "base")
    return nest.load(tmp_path / "base")


def test_fresh_adapter_leaves_logits_unchanged_and_only_adapters_train(tmp_path):
    model = _model(tmp_path)
    before = model(TOKENS)
    layers = model.add_lora(PATTERNS, rank=4, alpha=8)
    assert len(layers) == 2 * 7
    assert torch.equal(model(TOKENS), before)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(n.endswith(("lora_a", "lora_b")) for n in trainable)
    (row,) = pack([Example.plain(TOKENS[0].tolist())], tokens=16)
    loss, _ = model.loss_packed(row)
    loss.backward()
    for name, p in model.named_parameters():
        assert (p.grad is not None) == name.endswith(("lora_a", "lora_b")), name


def test_merge_equals_unmerged(tmp_path):
    model = _model(tmp_path)
    model.add_lora(PATTERNS, rank=4, alpha=8, rslora=True)
    _perturb_adapters(model)
    with torch.no_grad():
        unmerged = model(TOKENS)
        model.merge_lora()
        merged = model(TOKENS)
    assert not any("lora" in n for n, _ in model.named_parameters())
    assert (merged - unmerged).abs().max() < 1e-5
    assert (unmerged - model(TOKENS)).abs().max() < 1e-5


@pytest.mark.parametrize("names,key", [("linnet", "model.layers.0.self_attn.q_proj.lora_a"),
                                       ("hf", "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight")])
def test_saved_adapters_bind_into_a_fresh_model(tmp_path, names, key):
    """The seed's save_weights(path, names=, include=[...]): the adapters alone, under
    our paths or PEFT's names, bind back into a model given the same adapters."""
    model = _model(tmp_path)
    model.add_lora(PATTERNS, rank=4)
    _perturb_adapters(model)
    model.save_weights(tmp_path / "adapters.safetensors", names=names, include=["*.lora_a", "*.lora_b"])
    with safe_open(tmp_path / "adapters.safetensors", "pt") as f:
        assert key in f.keys() and len(f.keys()) == 2 * 14
    other = _model(tmp_path)
    other.add_lora(PATTERNS, rank=4)
    loaded = bind_weights(other, tmp_path / "adapters.safetensors", strict=False)
    assert len(loaded) == 2 * 14
    with torch.no_grad():
        assert torch.equal(other(TOKENS), model(TOKENS))


def test_save_weights_exclude_and_bad_names(tmp_path):
    model = _model(tmp_path)
    model.save_weights(tmp_path / "w.safetensors", exclude=["model.layers.*"])
    with safe_open(tmp_path / "w.safetensors", "pt") as f:
        assert sorted(f.keys()) == ["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"]
    with pytest.raises(ValueError, match="names='peft'; use 'hf'"):
        model.save_weights(tmp_path / "x.safetensors", names="peft")
    with pytest.raises(ValueError, match="exclude pattern '\\*.lora_a' matches no parameter"):
        model.save_weights(tmp_path / "x.safetensors", exclude=["*.lora_a"])


@pytest.mark.parametrize("family,dora", [("llama", False), ("qwen2", False), ("llama", True), ("qwen2", True)])
def test_peft_export_loads_in_peft_with_equal_logits(tmp_path, family, dora):
    """LoRA and DoRA (use_dora) adapters: PEFT computes our logits from our files, and
    PEFT's files bind back."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    model = _model(tmp_path, family)
    model.add_lora(PATTERNS, rank=4, alpha=16, dora=dora)
    _perturb_adapters(model)
    save_peft(model, tmp_path / "peft")
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    tuned = peft.PeftModel.from_pretrained(base, tmp_path / "peft").eval()
    with torch.no_grad():
        assert (tuned(TOKENS).logits - model(TOKENS)).abs().max() < 1e-4
    # and back: PEFT's file binds into a linnet model
    again = _model(tmp_path, family)
    again.add_lora(PATTERNS, rank=4, alpha=16, dora=dora)
    bind_weights(again, tmp_path / "peft", strict=False)
    with torch.no_grad():
        assert torch.equal(again(TOKENS), model(TOKENS))
    if dora:  # and PEFT's own saved DoRA adapters bind too
        tuned.save_pretrained(tmp_path / "from-peft")
        third = _model(tmp_path, family)
        third.add_lora(PATTERNS, rank=4, alpha=16, dora=True)
        assert len(bind_weights(third, tmp_path / "from-peft", strict=False)) == 3 * 14
        with torch.no_grad():
            assert (third(TOKENS) - model(TOKENS)).abs().max() < 1e-5


@pytest.mark.parametrize("dora", [False, True])
def test_adapter_dropout_in_training_equals_peft(tmp_path, dora):
    """In training mode with adapter dropout (the same masks: one draw a layer, in the same
    order, from the same seed), LoRA's and DoRA's outputs and gradients equal PEFT's (DoRA:
    the base output of the input as it is, the magnitude's rescaling on the dropped input)."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    model = _model(tmp_path)
    model.add_lora(PATTERNS, rank=4, alpha=16, dora=dora, dropout=0.3)
    _perturb_adapters(model)
    save_peft(model, tmp_path / "peft")
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    theirs = peft.PeftModel.from_pretrained(base, tmp_path / "peft", is_trainable=True).train()
    model.train()
    tokens = TOKENS[:1]
    torch.manual_seed(7)
    ours_out = model(tokens)
    torch.manual_seed(7)
    theirs_out = theirs(tokens).logits
    torch.manual_seed(8)
    other_mask = model(tokens)
    assert (ours_out - theirs_out).abs().max() < 1e-4
    assert (other_mask - ours_out).abs().max() > 1e-3  # the dropout is live: another seed, other outputs
    ours_out.square().mean().backward()
    theirs_out.square().mean().backward()
    ours = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    for name, p in theirs.named_parameters():
        if not p.requires_grad:
            continue
        key = (name.replace("base_model.model.", "").replace(".lora_A.default.weight", ".lora_a")
               .replace(".lora_B.default.weight", ".lora_b")
               .replace(".lora_magnitude_vector.default.weight", ".lora_magnitude"))
        torch.testing.assert_close(ours[key].view_as(p.grad), p.grad, rtol=1e-3, atol=1e-6, msg=key)


def test_dora_starts_unchanged_trains_its_magnitudes_and_merges(tmp_path):
    model = _model(tmp_path)
    with torch.no_grad():
        before = model(TOKENS)
    model.add_lora(PATTERNS, rank=4, alpha=16, dora=True)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert sum(n.endswith("lora_magnitude") for n in trained) == 14 and len(trained) == 3 * 14
    with torch.no_grad():
        assert (model(TOKENS) - before).abs().max() < 1e-5  # m = the rows' norms, B = 0
    row = next(pack([Example.plain(TOKENS[0].tolist())], tokens=16))
    model.loss_packed(row)[0].backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters()
               if n.endswith(("lora_magnitude", "lora_b")))
    _perturb_adapters(model)
    with torch.no_grad():
        adapted = model(TOKENS)
        model.merge_lora()
        assert (model(TOKENS) - adapted).abs().max() < 1e-5
    assert not any("lora" in n for n, _ in model.named_parameters())


def test_lora_errors(tmp_path):
    model = nest.load("debug", weights="random")
    with pytest.raises(ValueError, match="matches no linear"):
        model.add_lora("model.layers.*.attn.*")
    untied = nest.load(nest.resolve("debug").replace(tied_embeddings=False), weights="random")
    with pytest.raises(ValueError, match="the output head takes no adapter"):
        untied.add_lora("lm_head")  # the losses read its weight directly: an adapter there would never train
    with pytest.raises(ValueError, match="rank"):
        model.add_lora(PATTERNS, rank=0)
    model.add_lora(PATTERNS, rank=2)
    with pytest.raises(ValueError, match="already has an adapter"):
        model.add_lora(PATTERNS, rank=2)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_the_seeds_paths_pick_what_the_checkpoint_paths_pick(tmp_path, family):
    """Seed 000's `layers.*.attention.*_proj.weight` (Meta's names) adapts the layers that
    `model.layers.*.self_attn.*_proj.weight` does, in every family; `trainable=` and
    `save_weights(include=)` read the seeds' names too."""
    make_hf_model(family).save_pretrained(tmp_path / "base")
    seed, hf = nest.load(tmp_path / "base"), nest.load(tmp_path / "base")
    assert seed.add_lora("layers.*.attention.*_proj.weight", rank=2) == hf.add_lora(
        "model.layers.*.self_attn.*_proj.weight", rank=2) != []
    assert seed.add_lora("layers.*.feed_forward.*", rank=2) == hf.add_lora("model.layers.*.mlp.*", rank=2) != []
    trained = nest.load(tmp_path / "base", trainable=["layers.0.attention_norm.weight", "embedding.weight"])
    assert {n for n, p in trained.named_parameters() if p.requires_grad} == {
        "model.layers.0.input_layernorm.weight", "model.embed_tokens.weight"}


@pytest.mark.parametrize("dora", [False, True])
def test_adapters_given_to_load_equal_add_lora_after_it(dora):
    """nest.load(lora=...) is model.add_lora(...) after loading: the same draws from the
    global RNG, the same trained parameters."""
    card = nest.resolve("debug")
    adapters = dict(patterns="*_proj.weight", rank=4, alpha=8, dora=dora)
    torch.manual_seed(5)
    given = nest.load(card, weights="random", seed=0, lora=adapters)
    torch.manual_seed(5)
    after = nest.load(card, weights="random", seed=0)
    after.add_lora(**adapters)
    assert given.lora == after.lora
    mine, theirs = given.state_dict(), after.state_dict()
    assert mine.keys() == theirs.keys()
    for name in theirs:
        assert torch.equal(mine[name], theirs[name]), name
    assert [n for n, p in given.named_parameters() if p.requires_grad] == \
        [n for n, p in after.named_parameters() if p.requires_grad]


@pytest.mark.parametrize("lora, trainable, message", [
    (dict(rank=4), False, "a dict of add_lora's arguments, 'patterns' and any of"),
    (dict(patterns="*_proj.weight", ranks=4), False, "a dict of add_lora's arguments"),
    (dict(patterns="*_proj.weight", rank=0), False, "rank=0; it must be at least 1"),
    (dict(patterns="*_proj.weight", dropout=1.0), False, r"dropout=1.0; it must be in \[0, 1\)"),
    (dict(patterns="*_proj.weight"), True, "lora= trains the adapters alone"),
])
def test_load_refuses_adapters_it_cannot_add_before_reading_a_weight(tmp_path, lora, trainable, message):
    with pytest.raises(ValueError, match=message):  # the weights do not exist: nothing was read
        nest.load(nest.resolve("debug"), weights=tmp_path / "absent", lora=lora, trainable=trainable)
