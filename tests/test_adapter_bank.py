"""Many adapters over one base, unmerged: a batch mixing them samples what each adapter
merged alone samples (greedy tokens, log-probabilities to 1e-5)."""

from __future__ import annotations

import pytest
import torch

from linnet import nest
from linnet.commands import quickstart
from linnet.export import attach_adapter
from linnet.serve import Engine
from linnet.torch.adapter_bank import AdapterBank, AdapterEngine
from linnet.torch.lora import save_peft
from linnet.torch.passes import reorder_weights

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """A base and three adapters of different ranks and targets, their B drawn (not zero),
    so each changes what the base samples."""
    root = tmp_path_factory.mktemp("bank")
    base = root / "base"
    nest.load(quickstart.CARD, weights="random", seed=0).save_weights(base)
    quickstart.save_tokenizer(base / "tokenizer.json")
    specs = {"a": (4, "all-linear"), "b": (8, ["q_proj", "v_proj"]), "c": (2, ["down_proj", "o_proj"])}
    for k, (name, (rank, targets)) in enumerate(specs.items()):
        model = nest.load(base, weights=base)
        torch.manual_seed(k)  # A is drawn at add_lora
        model.add_lora(targets, rank=rank, alpha=2 * rank)
        g = torch.Generator().manual_seed(k)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith("lora_b"):
                    p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        save_peft(model, root / name, base_model=str(base))
    return root, list(specs)


def merged_engine(root, name):
    model = nest.load(root / "base", weights=root / "base")
    if name is not None:
        attach_adapter(model, root / name)
    return Engine(model)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("repeat", [1, 3])
def test_a_mixed_batch_samples_what_each_adapter_merged_alone_samples(adapters, repeat, fused):
    """Short prompts: every product gathers each row's adapter (35 positions in prefill);
    prompts three times as long: the prefill's 95 positions take one product an adapter.
    `fused`: the projections through oneDNN's fused copies, the additions in the passes
    (as on CPUs where that is faster), else through the layers and their hooks."""
    root, names = adapters
    engine = AdapterEngine(nest.load(root / "base", weights=root / "base"), {n: root / n for n in names})
    engine._reordered = reorder_weights(engine.model, fused)
    if fused and (engine._reordered is None or engine._reordered.layers is None):
        pytest.skip("this torch has no oneDNN reorder")
    prompts = [[quickstart.BOS, *quickstart.encode(p * repeat)]
               for p in ("12+34=", "56+07=", "90+11=", "33+33=", "01+02=")]
    routes = ["a", "b", None, "c", "a"]
    mixed = engine.sample(prompts, adapters=routes, max_new_tokens=6, temperature=0.0, stop=())
    for prompt, route, got in zip(prompts, routes, mixed):
        alone = merged_engine(root, route).sample([prompt], max_new_tokens=6, temperature=0.0, stop=())[0]
        assert got.tokens == alone.tokens, route
        torch.testing.assert_close(got.logprobs, alone.logprobs, atol=1e-5, rtol=0)
    base_only = merged_engine(root, None).sample(prompts[:1], max_new_tokens=6, temperature=0.0, stop=())[0]
    assert mixed[0].tokens != base_only.tokens  # the adapters matter: "a" changes the base's answer


def test_rows_that_stop_early_keep_their_adapters(adapters):
    """With stop tokens rows leave the batch at different steps and the cache is
    compacted: the rows that remain still go through their own adapters."""
    root, names = adapters
    engine = AdapterEngine(nest.load(root / "base", weights=root / "base"), {n: root / n for n in names})
    prompts = [[quickstart.BOS, *quickstart.encode(p)] for p in ("12+34=", "5+5=", "12+34=", "1+2=")]
    routes = ["a", "b", "c", "a"]
    stops = [11, 9]  # the first two rows' first tokens here: rows 2 and 3 move into their places
    mixed = engine.sample(prompts, adapters=routes, max_new_tokens=8, temperature=0.0, stop=stops)
    assert [len(c.tokens) for c in mixed] == [1, 1, 8, 6]
    for prompt, route, got in zip(prompts, routes, mixed):
        alone = merged_engine(root, route).sample([prompt], max_new_tokens=8, temperature=0.0, stop=stops)[0]
        assert got.tokens == alone.tokens, route


def test_bad_adapters_are_refused(adapters, tmp_path):
    root, _ = adapters
    model = nest.load(root / "base", weights=root / "base")
    with pytest.raises(ValueError, match="no adapter_config.json"):
        AdapterBank(model, {"x": tmp_path})
    bank = AdapterBank(model, {"a": root / "a"})
    with pytest.raises(ValueError, match="no adapter 'z'; these are loaded: a"):
        bank.index("z")
    bank.close()
    engine = AdapterEngine(nest.load(root / "base", weights=root / "base"), {"a": root / "a"})
    with pytest.raises(ValueError, match="2 adapters for 1 prompts"):
        engine.sample([[1, 4]], adapters=["a", "a"])


def test_adapters_come_and_go_between_calls(adapters):
    """An adapter added later samples as if it had been there from the start; one removed
    is refused by name, and the others are unchanged."""
    root, names = adapters
    engine = AdapterEngine(nest.load(root / "base", weights=root / "base"), {"a": root / "a"})
    prompts = [[quickstart.BOS, *quickstart.encode(p)] for p in ("12+34=", "56+07=")]
    engine.bank.add("c", root / "c")
    mixed = engine.sample(prompts, adapters=["c", "a"], max_new_tokens=5, temperature=0.0, stop=())
    for prompt, route, got in zip(prompts, ["c", "a"], mixed):
        assert got.tokens == merged_engine(root, route).sample([prompt], max_new_tokens=5, temperature=0.0,
                                                              stop=())[0].tokens
    engine.bank.remove("a")
    with pytest.raises(ValueError, match="no adapter 'a'; these are loaded: c"):
        engine.sample(prompts[:1], adapters=["a"])
    again = engine.sample(prompts[:1], adapters=["c"], max_new_tokens=5, temperature=0.0, stop=())[0]
    assert again.tokens == mixed[0].tokens
    with pytest.raises(ValueError, match="'c' is loaded already"):
        engine.bank.add("c", root / "c")


def test_a_4_bit_base_serves_its_adapters_unmerged(adapters):
    """An NF4 base (as `linnet serve --quantize nf4` loads it): a mixed batch samples what
    each adapter attached alone over the same NF4 base samples (the QLoRA policy's way)."""
    pytest.importorskip("bitsandbytes", reason="an NF4 base needs bitsandbytes (the qlora extra)")
    from linnet.commands.serve import load_served

    root, names = adapters
    served = load_served(str(root / "base"), "base", {n: str(root / n) for n in names}, quantize="nf4")
    engine = served["base"].engine
    assert engine.model.quantized
    prompts = [[quickstart.BOS, *quickstart.encode(p)] for p in ("12+34=", "56+07=", "90+11=", "33+33=")]
    routes = ["a", "b", None, "c"]
    mixed = engine.sample(prompts, adapters=routes, max_new_tokens=6, temperature=0.0, stop=())
    for prompt, route, got in zip(prompts, routes, mixed):
        model = nest.load(root / "base", weights=root / "base", quantize="nf4")
        if route is not None:
            attach_adapter(model, root / route)
        alone = Engine(model).sample([prompt], max_new_tokens=6, temperature=0.0, stop=())[0]
        assert got.tokens == alone.tokens, route
        torch.testing.assert_close(got.logprobs, alone.logprobs, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="--quantize nf4: .* not a model directory"):
        load_served(str(root / "a"), "a", quantize="nf4")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("repeat", [1, 4])
def test_dora_adapters_rescale_their_own_rows(tmp_path, bias, repeat):
    """A DoRA adapter beside a LoRA one and the base: each row samples what its adapter
    merged alone samples (DoRA's per-row rescaling of the whole product, the layers' biases
    kept out of it), gathered a row at a time and (long prompts) an adapter at a time."""
    base = tmp_path / "base"
    model = nest.load(quickstart.CARD.replace(qkv_bias=bias, o_bias=bias), weights="random", seed=0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.3)
    model.save_weights(base)
    quickstart.save_tokenizer(base / "tokenizer.json")
    for k, (name, dora) in enumerate((("d", True), ("l", False))):
        tuned = nest.load(base, weights=base)
        torch.manual_seed(k)
        tuned.add_lora(["q_proj", "o_proj", "down_proj"], rank=4, alpha=8, dora=dora)
        with torch.no_grad():
            for n, p in tuned.named_parameters():
                if n.endswith("lora_b"):
                    p.normal_(0, 0.3)
                if n.endswith("lora_magnitude"):
                    p.mul_(1 + 0.3 * torch.randn(p.shape))
        save_peft(tuned, tmp_path / name, base_model=str(base))
    engine = AdapterEngine(nest.load(base, weights=base), {"d": tmp_path / "d", "l": tmp_path / "l"})
    prompts = [[quickstart.BOS, *quickstart.encode(p * repeat)] for p in ("12+34=", "56+07=", "90+11=", "33+33=")]
    routes = ["d", "l", None, "d"]
    mixed = engine.sample(prompts, adapters=routes, max_new_tokens=6, temperature=0.0, stop=())
    for prompt, route, got in zip(prompts, routes, mixed):
        alone = merged_engine(tmp_path, route).sample([prompt], max_new_tokens=6, temperature=0.0, stop=())[0]
        assert got.tokens == alone.tokens, route
        torch.testing.assert_close(got.logprobs, alone.logprobs, atol=1e-5, rtol=0)
