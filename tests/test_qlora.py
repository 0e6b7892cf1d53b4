"""QLoRA: an NF4 base (bitsandbytes) under f32 adapters. The quantization is the
library's own, training lowers held-out loss, the adapters export to PEFT for the plain
base, merging dequantizes first, and DPO and GRPO run with a quantized policy and
engine. Also the 8-bit AdamW states."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from linnet import nest
from linnet.packing import Example, Pair, pack
from linnet.train.dpo import dpo
from linnet.train.grpo import Prompt, grpo
from tests.conftest import in_processes, make_hf_model, quickstart_model, same_metrics
from tests.test_sharding import _rows, _run

bnb = pytest.importorskip("bitsandbytes", reason="QLoRA and 8-bit AdamW need bitsandbytes (the qlora extra)")

from linnet.torch.quantize import dense, quant_states, quantized_bytes  # noqa: E402

torch.set_num_threads(1)
CARD = nest.resolve("debug").replace(vocab=96, hidden=64, intermediate=160, heads=4, kv_heads=2, head_dim=16,
                                     layers=2, tied_embeddings=False)
PATTERNS = ["*_proj"]
TOKENS = torch.randint(3, 96, (2, 13), generator=torch.Generator().manual_seed(0))


def _adapted(quantize="nf4", dtype=None, source="random", dora=False):
    model = nest.load(CARD if source == "random" else source, weights="random" if source == "random" else None,
                      seed=0, quantize=quantize, dtype=dtype)
    torch.manual_seed(1)
    model.add_lora(PATTERNS, rank=4, alpha=8, dora=dora)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():  # B away from zero: the adapters change the logits
        for name, p in model.named_parameters():
            if name.endswith("lora_b"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def test_the_base_is_the_librarys_own_nf4():
    plain = nest.load(CARD, weights="random", seed=0)
    quantized = nest.load(CARD, weights="random", seed=0, quantize="nf4")
    assert quantized.quantized == "nf4" and plain.quantized is None
    weights, states = dict(plain.named_parameters()), quant_states(quantized)
    linears = 0
    for name, p in quantized.named_parameters():
        if name not in states:  # embeddings, norms and the head keep the compute dtype
            assert not name.endswith("_proj.weight") and torch.equal(p, weights[name]), name
            continue
        linears += 1
        w = weights[name]
        codes, state = bnb.functional.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
        theirs = bnb.functional.dequantize_4bit(codes, state)
        assert state.nested and state.state2.blocksize == 256
        assert p.dtype == torch.uint8 and not p.requires_grad
        assert torch.equal(dense(p, states[name]), theirs), name  # the same round trip, so the same error
        assert 0 < (dense(p, states[name]) - w).abs().mean() < 0.3 * w.abs().mean()  # 16 levels a block: ~0.2 of |w|
    assert linears == 7 * CARD.layers
    stored = quantized_bytes(quantized) / sum(CARD.layers * d_out * d_in for d_out, d_in in
                                              CARD.linear_shapes().values())
    assert 0.5 < stored < 0.56  # 4 bits + an 8-bit absmax per 64 + an f32 per 64 x 256 (+ the offsets)
    quantized.to("meta")  # the quantization state moves with its codes
    assert {s.absmax.device.type for s in quant_states(quantized).values()} == {"meta"}



@pytest.mark.parametrize("source", ["random", "file"])
def test_loading_quantizes_a_weight_at_a_time(tmp_path, monkeypatch, source):
    """While an NF4 model loads (random or from files), each block weight is quantized as it
    arrives: no block's linear weight is ever held in the compute dtype, and the codes equal
    those of the whole plain model quantized afterwards."""
    from linnet.torch import loading as loading_module
    from linnet.torch import quantize as quantize_module

    plain = nest.load(CARD.replace(layers=3), weights="random", seed=0)
    plain.save_weights(tmp_path / "w")
    fill, nf4, loading, dense_weights = loading_module._fill, quantize_module.nf4, [], []

    def watched_fill(model, *args):
        loading.append(model)
        return fill(model, *args)

    def watched_nf4(weight, dtype):
        dense_weights.append(sum(not p.is_meta and p.dtype == dtype for b in loading[0].model.layers
                                 for name, p in b.named_parameters() if name.endswith("proj.weight")))
        return nf4(weight, dtype)

    monkeypatch.setattr(loading_module, "_fill", watched_fill)
    monkeypatch.setattr(quantize_module, "nf4", watched_nf4)
    weights = dict(weights="random", seed=0) if source == "random" else dict(weights=tmp_path / "w")
    quantized = nest.load(CARD.replace(layers=3), quantize="nf4", **weights)
    assert dense_weights == [0] * 7 * 3  # every weight quantized on arrival, none kept in f32
    states = quant_states(quantized)
    for name, p in plain.named_parameters():
        if name in states:
            codes, _ = bnb.functional.quantize_4bit(p.detach(), blocksize=64, quant_type="nf4",
                                                    compress_statistics=True)
            assert torch.equal(quantized.get_parameter(name), codes), name
        else:
            assert torch.equal(quantized.get_parameter(name), p), name


def test_adapters_train_over_the_frozen_base_and_gradients_match_its_dequantized_copy():
    quantized = _adapted()
    plain = _adapted(quantize=None)
    states = quant_states(quantized)
    with torch.no_grad():  # the same base: the plain model given the dequantized weights
        for (name, p), q in zip(plain.named_parameters(), quantized.parameters(), strict=True):
            p.copy_(dense(q, states.get(name)))
    row = next(pack([Example.plain(TOKENS[0].tolist() + TOKENS[1].tolist())], tokens=32))
    grads = []
    for model in (quantized, plain):
        loss, n = model.loss_packed(row)
        (loss / n).backward()
        grads.append({k: p.grad for k, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and all(k.endswith(("lora_a", "lora_b")) for k in grads[0])
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("dtype,tolerance", [("float32", 1e-4), ("bfloat16", 0.1)])
@pytest.mark.parametrize("dora", [False, True])
def test_merging_dequantizes_first_and_keeps_the_adapted_logits(dtype, tolerance, dora):
    model = _adapted(dtype=dtype, dora=dora)
    with torch.no_grad():
        adapted = model(TOKENS).float()
        model.merge_lora()
        merged = model(TOKENS).float()
    assert model.quantized is None and not quant_states(model) and not any("lora" in n for n, _ in model.named_parameters())
    assert all(p.dtype == model.dtype for p in model.parameters())
    assert (merged - adapted).abs().max() < tolerance
    # the same adapters merged onto the original base give other logits: the bug this avoids
    onto_original = _adapted(quantize=None, dtype=dtype, dora=dora)
    with torch.no_grad():
        onto_original.merge_lora()
        assert (onto_original(TOKENS).float() - adapted).abs().max() > 2 * (merged - adapted).abs().max()


def test_peft_export_loads_in_peft_over_the_plain_base(tmp_path):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from linnet.torch.lora import save_peft

    make_hf_model("llama").save_pretrained(tmp_path / "base")
    model = _adapted(source=tmp_path / "base")
    save_peft(model, tmp_path / "peft")
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    tuned = peft.PeftModel.from_pretrained(base, tmp_path / "peft").eval()
    plain = _adapted(quantize=None, source=tmp_path / "base")  # the same adapters over the original weights
    with torch.no_grad():
        assert (tuned(TOKENS).logits - plain(TOKENS)).abs().max() < 1e-4
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["peft_type"] == "LORA"


def test_dpo_and_grpo_run_with_a_quantized_policy_and_engine():
    from linnet.serve import Engine

    policy = _adapted()
    before = {n: p.detach().clone() for n, p in policy.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    g = np.random.default_rng(0)
    pairs = [Pair(g.integers(3, 96, 4).tolist(), g.integers(3, 96, 5).tolist(), g.integers(3, 96, 3).tolist())
             for _ in range(4)]
    preference = dpo(policy, pairs, optimizer=opt, steps=2, pairs_per_step=2, tokens=64).steps
    assert len(preference) == 2 and all(np.isfinite(s.loss) for s in preference)
    engine = Engine(nest.load(CARD, weights="random", seed=0, quantize="nf4"))
    prompts = [Prompt(g.integers(3, 96, 4).tolist(), answer=None) for _ in range(4)]
    history = grpo(policy, engine, prompts, lambda p, c: float(sum(c) % 5), optimizer=opt, steps=2, group=2,
                   prompts_per_step=2, max_new_tokens=4, tokens=64, verbose=False)
    assert len(history.steps) == 2
    layer, theirs = engine.model.model.layers[1].mlp.up_proj, policy.model.layers[1].mlp.up_proj
    assert layer.weight is theirs.weight  # one NF4 base, shared
    assert layer.lora_b is not None and layer.lora_b is not theirs.lora_b  # a copy of the adapters beside it
    assert any(not torch.equal(p, before[n]) for n, p in policy.named_parameters() if p.requires_grad)
    engine.load_weights(policy)
    _scores_as(policy, engine)


def _scores_as(policy, engine):
    """The engine's log-probabilities of what it samples are the policy's."""
    prompt = TOKENS[0].tolist()
    done = engine.sample([prompt], max_new_tokens=3, seed=0)[0]
    ex = Example.prompted(prompt, done.tokens)
    (row,) = pack([ex], tokens=len(ex))
    with torch.no_grad():
        theirs = policy.log_probs_packed(row)[len(prompt) - 1: len(ex) - 1]
    torch.testing.assert_close(theirs, torch.as_tensor(done.logprobs), atol=1e-4, rtol=0)


def test_an_engine_without_quantize_samples_from_the_dequantized_merged_policy():
    from linnet.serve import Engine

    policy = _adapted()
    engine = Engine(nest.load(CARD, weights="random", seed=0))
    engine.load_weights(policy)
    _scores_as(policy, engine)
    with pytest.raises(ValueError, match="NF4 but the policy's is not"):
        Engine(nest.load(CARD, weights="random", quantize="nf4")).load_weights(nest.load(CARD, weights="random"))



def _qlora_run(model, rows, accumulate, out):
    """Train, save the adapters and the whole (dequantized) model, and load a plain engine
    from the policy; returns the steps and the engine's weights."""
    from linnet.serve import Engine

    steps = _run(model, rows, accumulate, save_to=out / "final")
    model.save_weights(out / "whole.safetensors")
    engine = Engine(nest.load(CARD, weights="random", seed=1))
    engine.load_weights(model)
    return steps, {n: p.detach().numpy().copy() for n, p in engine.model.named_parameters()}


def _sharded_qlora(rank, dora, out):
    from linnet.serve import Engine
    from linnet.torch import fully_shard
    from linnet.torch.sharding import local

    model = fully_shard(_adapted(dora=dora))
    codes = [m.weight for m in model.modules() if getattr(m, "quant_state", None) is not None]
    held = sum(local(w).numel() for w in codes) / sum(w.numel() for w in codes)
    with pytest.raises(ValueError, match="split by fully_shard, so an NF4 engine cannot share"):
        Engine(nest.load(CARD, weights="random", quantize="nf4")).load_weights(model)
    return held, *_qlora_run(model, _rows()[rank::2], 1, out)


@pytest.mark.parametrize("dora", [False, True])
def test_fully_sharded_qlora_trains_like_one_process(tmp_path, dora):
    """FSDP over an NF4 base: each process holds half of the 4-bit codes, and two processes
    take one process's losses, gradient norms, adapters, dequantized weights and engine
    copy over both batches."""
    from safetensors.torch import load_file

    (held, steps, engine), (_, steps1, engine1) = in_processes(_sharded_qlora, dora, tmp_path / "two")
    ref_steps, ref_engine = _qlora_run(_adapted(dora=dora), _rows(), 2, tmp_path / "one")
    assert held == 0.5 and steps == steps1
    for (loss, norm, learned), (ref_loss, ref_norm, ref_learned) in zip(steps, ref_steps, strict=True):
        assert learned == ref_learned
        assert loss == pytest.approx(ref_loss, rel=1e-5) and norm == pytest.approx(ref_norm, rel=1e-4)
    for name in ("final/adapter_model.safetensors", "whole.safetensors"):
        two, one = load_file(str(tmp_path / "two" / name)), load_file(str(tmp_path / "one" / name))
        assert two.keys() == one.keys() and any("mlp.up_proj" in key for key in one)
        for key in one:
            torch.testing.assert_close(two[key], one[key], atol=3e-4, rtol=0, msg=key)
    for name, tensor in ref_engine.items():
        np.testing.assert_allclose(engine[name], tensor, atol=3e-4, rtol=0, err_msg=name)
        np.testing.assert_array_equal(engine[name], engine1[name], err_msg=name)

def test_quantized_misuse_is_refused(tmp_path):
    with pytest.raises(ValueError, match="freezes the base: load with trainable=False"):
        nest.load(CARD, weights="random", quantize="nf4", trainable=True)
    with pytest.raises(ValueError, match="quantize='nf8'"):
        nest.load(CARD, weights="random", quantize="nf8")
    model = nest.load(CARD, weights="random", quantize="nf4")
    with pytest.raises(ValueError, match="stored in NF4 and cannot train"):
        model.set_trainable(["model.layers.0.mlp.up_proj.weight"])
    nest.load(CARD, weights="random").save_weights(tmp_path / "w.safetensors")
    from linnet.torch.weights import bind_weights

    with pytest.raises(ValueError, match="stored in NF4 in this model"):
        bind_weights(model, tmp_path / "w.safetensors")


def test_eight_bit_adamw_keeps_8_bit_moments_and_trains():
    from linnet.train import train
    from linnet.train.optimizer import adamw

    model = nest.load(CARD, weights="random", seed=0, trainable=True)
    optimizer = adamw(model, lr=3e-3, kind="adamw8bit")
    rows = list(pack([Example.plain(list(range(3, 40)))] * 4, tokens=48))
    history = train(model, rows * 5, optimizer=optimizer, steps=20)
    assert history.steps[-1].loss < 0.5 * history.steps[0].loss
    state = optimizer.state[model.model.embed_tokens.weight]
    assert state["state1"].dtype == state["state2"].dtype == torch.uint8
    with pytest.raises(ValueError, match="paged 8-bit states page CUDA memory"):
        adamw(model, lr=1e-3, kind="paged_adamw8bit")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    from linnet.commands import quickstart

    root = tmp_path_factory.mktemp("qlora")
    quickstart_model(root / "model")
    lines = [json.dumps({"prompt": p, "completion": a})
             for p, a in quickstart.problems(np.random.default_rng(0), 300, 2)]
    (root / "train.jsonl").write_text("\n".join(lines) + "\n")
    return root


def _sft(workspace, out, *extra):
    from linnet.config import SFTConfig, load

    return load(SFTConfig, None, [
        f"model.card={workspace / 'model'}", f"data.path={workspace / 'train.jsonl'}", "data.chat=false",
        "training.context_length=256", "data.eval_share=0.1", "model.quantize=nf4", "optimizer.name=adamw8bit",
        "optimizer.lr=1e-2", "lr_schedule.warmup_steps=2", "evaluation.every=4", "training.checkpoint_every=4",
        "training.steps=8", f"runtime.output_dir={out}", *extra])


def test_a_qlora_sft_run_with_8_bit_adamw_learns_and_resumes_exactly(workspace, tmp_path):
    import shutil

    from linnet.commands.sft import run

    whole = run(_sft(workspace, tmp_path / "whole"))
    metrics = [json.loads(x) for x in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    held = [m["held_out_loss"] for m in metrics if "held_out_loss" in m]
    assert len(held) == 2 and held[-1] < 0.9 * metrics[0]["loss"] and held[-1] < held[0]
    assert (tmp_path / "whole" / "final" / "adapter_config.json").is_file()
    out = tmp_path / "cut"
    run(_sft(workspace, out))
    shutil.rmtree(out / "checkpoints" / "step-00000008")  # as if killed after step 5
    (out / "summary.json").unlink()
    (out / "metrics.jsonl").write_text("\n".join((out / "metrics.jsonl").read_text().splitlines()[:5]) + "\n")
    again = run(_sft(workspace, out), resume=True)
    assert again["steps_this_run"] == 4 and again["last_loss"] == whole["last_loss"]



def _sft_process(rank, config, resume=False):
    from linnet.commands.sft import run

    return run(config, resume=resume).get("last_loss")  # the first process writes the summary


@pytest.mark.parametrize("shard, optimizer", [pytest.param("fsdp", "adamw", marks=pytest.mark.slow), ("fsdp", "adamw8bit"),
                                              pytest.param("zero", "adamw8bit", marks=pytest.mark.slow)])
def test_a_sharded_qlora_sft_run_takes_one_process_steps_and_resumes(workspace, tmp_path, shard, optimizer):
    """`linnet sft` with model.quantize=nf4 and training.shard=fsdp (the 4-bit base split;
    8-bit AdamW's states whole beside the whole adapters) or zero (8-bit AdamW's states
    split) in two processes takes the steps one process takes
    with twice the accumulation, writes the same adapters, and a run killed after step 5
    resumes to the same losses."""
    import shutil

    from safetensors.torch import load_file

    from linnet.commands.sft import run

    fsdp = [f"optimizer.name={optimizer}", f"training.shard={shard}", "training.accumulation=1"]
    two = in_processes(_sft_process, _sft(workspace, tmp_path / "two", *fsdp))
    run(_sft(workspace, tmp_path / "one", f"optimizer.name={optimizer}", "training.accumulation=2"))
    assert two[0] is not None
    same_metrics(tmp_path / "two", tmp_path / "one", ("loss", "grad_norm", "held_out_loss"), steps=8, rel=1e-5)
    x, y = (load_file(str(tmp_path / d / "final" / "adapter_model.safetensors")) for d in ("two", "one"))
    assert x.keys() == y.keys() and x
    for key in y:
        torch.testing.assert_close(x[key], y[key], atol=1e-5, rtol=0, msg=key)
    out = tmp_path / "two"
    shutil.rmtree(out / "checkpoints" / "step-00000008")  # as if killed after step 5
    (out / "summary.json").unlink()
    (out / "metrics.jsonl").write_text("\n".join((out / "metrics.jsonl").read_text().splitlines()[:5]) + "\n")
    again = in_processes(_sft_process, _sft(workspace, out, *fsdp), True)
    assert again == two

def test_a_pipelined_qlora_sft_run_takes_one_process_steps(workspace, tmp_path):
    """`linnet sft` with model.quantize=nf4 and training.pipeline=2: each process builds and
    quantizes its own stage's blocks; the two stages take one process's steps and write its
    adapters."""
    from safetensors.torch import load_file

    from linnet.commands.sft import run

    staged = ["optimizer.name=adamw", "training.accumulation=2"]
    assert in_processes(_sft_process, _sft(workspace, tmp_path / "two", *staged, "training.pipeline=2"))[0]
    run(_sft(workspace, tmp_path / "one", *staged))
    same_metrics(tmp_path / "two", tmp_path / "one", ("loss", "grad_norm"), steps=8, rel=1e-5)
    x, y = (load_file(str(tmp_path / d / "final" / "adapter_model.safetensors")) for d in ("two", "one"))
    assert x.keys() == y.keys() and x
    for key in y:  # 1e-4: 1% of one Adam step at lr 1e-2, which rounding of a near-zero gradient can move
        torch.testing.assert_close(x[key], y[key], atol=1e-4, rtol=0, msg=key)


@pytest.mark.parametrize("overrides, message", [
    (["lora.enabled=false"], "model.quantize=nf4 freezes the base in 4 bits"),
    (["model.quantize=int4"], "model.quantize='int4'; use nf4"),
    (["optimizer.name=adamw", "training.split=2"], "model.quantize=nf4 with training.split=2 is not supported yet"),
    (["model.quantize=null", "lora.enabled=false", "training.shard=fsdp"],
     "optimizer.name=adamw8bit with training.shard=fsdp and full fine-tuning is not supported yet; use "
     "training.shard=zero"),
    (["model.quantize=null", "training.split=2"], "optimizer.name=adamw8bit with training.split=2 is not supported "
                                                  "yet; use optimizer.name=adamw"),
    (["optimizer.name=adamw", "model.compile=true"], "model.quantize=nf4 with model.compile=true"),
    (["model.dtype=half"], "model.dtype='half'"),
])
def test_bad_qlora_configs_fail_before_training(workspace, tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        _sft(workspace, tmp_path / "x", *overrides)
    assert not (tmp_path / "x").exists()
