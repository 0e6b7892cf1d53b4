"""Mixture-of-experts cards (Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral) against
transformers on tiny random models: logits, packed losses, gradients, weights in and out,
greedy sampling."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from linnet import nest
from linnet.packing import Example, pack
from linnet.serve import Engine

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)

TINY = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, max_position_embeddings=128, rms_norm_eps=1e-6, num_experts_per_tok=2)
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(intermediate_size=48, moe_intermediate_size=16, num_experts=6,
                                         norm_topk_prob=True)),
    "qwen3_moe-raw-weights": ("Qwen3MoeConfig", dict(intermediate_size=48, moe_intermediate_size=16, num_experts=4,
                                                     norm_topk_prob=False)),
    "mixtral": ("MixtralConfig", dict(intermediate_size=24, num_local_experts=4, sliding_window=None)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(intermediate_size=48, moe_intermediate_size=16, num_experts=4,
                                         shared_expert_intermediate_size=24, norm_topk_prob=False)),
}


def _count(hf) -> int:
    """A transformers model's count of experts a block, as its config spells it."""
    return getattr(hf.config, "num_local_experts", None) or hf.config.num_experts


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def moe(request, tmp_path_factory):
    """(transformers model, its directory): random weights, the norms moved off one and the
    router scaled up, so that routing differs from position to position."""
    name, extra = FAMILIES[request.param]
    config = getattr(transformers, name)(**TINY, **extra)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
            if n.endswith("gate.weight"):
                p.normal_(0, 1.0)
    directory = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(directory)
    return hf.eval(), directory


def test_logits_and_weights_round_trip_equal_transformers(moe, tmp_path):
    hf, directory = moe
    model = nest.load(directory, weights=directory, dtype="float32")
    assert model.card.experts is not None and model.card.experts.count == _count(hf)
    tokens = torch.randint(0, 97, (3, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits
        torch.testing.assert_close(model(tokens), expected, atol=1e-4, rtol=0)
    model.save_weights(tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(tokens).logits, expected, atol=1e-5, rtol=0)
    again = nest.load(tmp_path / "out", weights=tmp_path / "out").card
    assert (again.family, again.experts, again.qk_norm) == (model.card.family, model.card.experts, model.card.qk_norm)


def test_a_packed_row_s_loss_and_gradients_equal_transformers(moe):
    """Two documents in one packed row: the summed loss, and after one backward the
    gradient of every parameter (attention, router, every expert), equal transformers' on
    the documents apart (its own backward)."""
    hf, directory = moe
    model = nest.load(directory, weights=directory, dtype="float32", trainable=True)
    rng = np.random.default_rng(2)
    docs = [rng.integers(1, 97, n).tolist() for n in (13, 9)]
    (row,) = pack([Example(d) for d in docs], tokens=24)
    total, count = model.loss_packed(row)
    total.backward()
    hf.zero_grad()
    hf.train()
    loss = 0
    for d in docs:
        ids = torch.tensor([d])
        logits = hf(ids).logits[0, :-1]
        loss = loss + torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum")
    loss.backward()
    hf.eval()
    assert int(count) == sum(len(d) - 1 for d in docs)
    torch.testing.assert_close(total.detach(), loss.detach(), rtol=1e-5, atol=1e-4)
    theirs = dict(hf.named_parameters())  # transformers 5 holds the experts stacked as linnet does, by the same names
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, theirs[name].grad, rtol=1e-4, atol=1e-5, msg=name)
    assert "model.layers.1.mlp.experts.gate_up_proj" in theirs


def test_the_engine_samples_what_transformers_generates(moe):
    hf, directory = moe
    engine = Engine(nest.load(directory, weights=directory, dtype="float32"))
    prompts = [[5, 17, 33, 2], [8, 8, 40, 61, 12, 90]]
    done = engine.sample(prompts, max_new_tokens=8, temperature=0.0, stop=())
    for prompt, got in zip(prompts, done):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
        assert got.tokens == out[0, len(prompt):].tolist()


def test_all_linear_adapts_attention_and_experts_and_what_is_not_yet_is_refused(moe):
    hf, directory = moe
    model = nest.load(directory, weights=directory, dtype="float32")
    adapted = model.add_lora("all-linear", rank=4)  # the attention's layers (and a shared expert's), and the experts'
    assert adapted and all(".self_attn." in name or ".shared_expert." in name for name in adapted)
    assert any(".shared_expert." in name for name in adapted) == bool(model.card.experts.shared)
    assert len(model.lora["experts"]) == 2 * model.card.layers and "gate.weight" not in str(model.lora)
    with pytest.raises(ValueError, match="mixture-of-experts"):
        model.tile_mlp(8)
    with pytest.raises(ValueError, match="mixture-of-experts"):
        nest.load(directory, weights=directory, pipeline=2)
    with pytest.raises(ValueError, match="PyTorch backend"):
        nest.load(directory, backend="jax")


def test_counts_and_the_planner(moe):
    """Every parameter counted, a token's share (its chosen experts alone) by transformers'
    tensors; the planner counts both, FLOPs by the active ones, and the adapters all-linear
    puts on the attention and the experts' stacked tensors."""
    from linnet.cards import resolve
    from linnet.plan import Method, estimate

    hf, directory = moe
    card = resolve(str(directory))
    assert card.params() == sum(p.numel() for p in hf.parameters())
    experts = hf.model.layers[0].mlp.experts
    one = (experts.gate_up_proj.numel() + experts.down_proj.numel()) // card.experts.count
    idle = card.layers * (card.experts.count - card.experts.per_token) * one
    assert card.active_params() == card.params() - idle
    plan = estimate(card, Method("lora", rank=4), total_targets=1e6)
    assert (plan.params, plan.active) == (card.params(), card.active_params())
    assert plan.compute.flops == 4 * card.active_params() * 1e6
    model = nest.load(directory, weights=directory, dtype="float32")
    model.add_lora("all-linear", rank=4)
    assert plan.trainable == sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_full_fine_tuning_learns_a_row(moe):
    from linnet.train import train
    from linnet.train.optimizer import adamw

    _, directory = moe
    model = nest.load(directory, weights=directory, dtype="float32", trainable=True)
    (row,) = pack([Example(list(range(3, 40)))], tokens=40)
    optimizer = adamw(model, lr=1e-2)
    history = train(model, [row] * 12, optimizer=optimizer, steps=12)
    assert history.losses[-1] < 0.5 * history.losses[0]
    assert all(s.metrics["expert_load_max"] >= 1 for s in history.steps)  # each step reports the balance


def _with_balancing(directory, to, coefficient=0.05):
    """The model of `directory` with output_router_logits and `coefficient`, copied to `to`."""
    import json
    import shutil

    shutil.copytree(directory, to)
    config = json.loads((to / "config.json").read_text())
    config.update(output_router_logits=True, router_aux_loss_coef=coefficient)
    (to / "config.json").write_text(json.dumps(config))
    return nest.load(to, weights=to, dtype="float32", trainable=True)


def test_the_load_balancing_loss_is_transformers(moe, tmp_path):
    """With output_router_logits the router's loss of a forward pass, pooled over the blocks
    as transformers pools it, times its coefficient: the same loss and router gradients."""
    from linnet.torch.moe import balancing, router_metrics

    _, directory = moe
    model = _with_balancing(directory, tmp_path / "aux")
    assert model.card.experts.aux_loss == 0.05
    doc = np.random.default_rng(3).integers(1, 97, 20).tolist()
    (row,) = pack([Example(doc)], tokens=20)
    with balancing(model) as aux:
        total, count = model.loss_packed(row)
    (total / count + aux[0]).backward()
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "aux", dtype=torch.float32)
    ids = torch.tensor([doc])
    out = hf(ids, labels=ids)
    assert float(out.aux_loss.detach()) > 0
    out.loss.backward()
    torch.testing.assert_close((total / count + aux[0]).detach(), out.loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dict(model.named_parameters())["model.layers.0.mlp.gate.weight"].grad,
                               hf.model.layers[0].mlp.gate.weight.grad, rtol=1e-4, atol=1e-6)
    with torch.no_grad(), balancing(model) as aux:  # evaluation: nothing recorded
        model.loss_packed(row)
    assert aux == []
    balance = router_metrics(model)
    assert balance["expert_load_max"] >= 1 >= balance["expert_load_min"] and router_metrics(model) == {}
    assert balance["router_balancing_loss"] == pytest.approx(float(out.aux_loss.detach()), rel=1e-5)  # logged


def test_the_load_balancing_loss_joins_every_objective_once_a_step(moe, tmp_path):
    """In SFT, DPO and GRPO steps the coefficient times the balancing loss joins the loss and
    the metrics; accumulating micro-batches averages it (not adds it, as the accumulated
    losses of transformers' Trainer do)."""
    import math

    from linnet.packing import Pair
    from linnet.torch.moe import balancing
    from linnet.train import train
    from linnet.train.dpo import dpo
    from linnet.train.grpo import Prompt, grpo

    _, directory = moe
    model = _with_balancing(directory, tmp_path / "aux", coefficient=0.5)
    (row,) = pack([Example(np.random.default_rng(3).integers(1, 97, 20).tolist())], tokens=20)
    with torch.no_grad():
        total, count = model.loss_packed(row)
    with torch.enable_grad(), balancing(model) as aux:
        model.loss_packed(row)
    aux = float(aux[0].detach())
    expected = float(total / count) + aux
    frozen = torch.optim.SGD(model.parameters(), lr=0.0)
    for accumulate in (1, 2):  # the same row twice: its loss, its balancing loss once
        history = train(model, [row] * accumulate, optimizer=frozen, steps=1, accumulate=accumulate)
        assert history.losses[0] == pytest.approx(expected, rel=1e-5)
        assert history.steps[0].metrics["router_balancing_loss"] == pytest.approx(aux / 0.5, rel=1e-5)

    g = np.random.default_rng(0)
    prompts = [g.integers(3, 40, size=int(g.integers(2, 6))).tolist() for _ in range(8)]
    model.add_lora("all-linear", rank=4, alpha=8)
    frozen = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    pairs = [Pair([1, *p], [*p, 2], [*p[::-1], 2]) for p in prompts]
    history = dpo(model, pairs, optimizer=frozen, steps=2, pairs_per_step=4, beta=0.5, tokens=64)
    for step in history.steps:  # the reference's passes, without gradients, count nothing
        assert step.loss == pytest.approx(math.log(2) + 0.5 * step.metrics["router_balancing_loss"], abs=1e-6)
        assert step.metrics["router_balancing_loss"] > 0
    engine = Engine(nest.load(directory, weights=directory, dtype="float32"))
    history = grpo(model, engine, [Prompt(p) for p in prompts], lambda p, c: float(7 in c),
                   optimizer=frozen, steps=1, prompts_per_step=4, group=4, max_new_tokens=4, stop=(), seed=0,
                   verbose=False)
    assert history.steps[0].metrics["router_balancing_loss"] > 0


@pytest.mark.parametrize("experts", [["mlp.experts.gate_up_proj", "mlp.experts.down_proj"], ["gate_up_proj"]])
def test_adapters_on_the_experts_are_peft_s(moe, tmp_path, experts):
    """Adapters on the attention and on the stacked experts (one pair an expert): written
    as PEFT's, they load in PEFT over the transformers model with the same logits, load back
    into linnet, and merge into the weights without changing them."""
    peft = pytest.importorskip("peft")
    from linnet.export import attach_adapter
    from linnet.torch.lora import save_peft

    hf, directory = moe
    model = nest.load(directory, weights=directory, dtype="float32")
    torch.manual_seed(4)
    model.add_lora(["q_proj", "v_proj", *experts], rank=2, alpha=4)
    assert len(model.lora["experts"]) == model.card.layers * len(experts)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_b"):
                p.normal_(0, 0.5)
    tokens = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ours = model(tokens)
        assert not torch.allclose(ours, hf(tokens).logits, atol=1e-3)  # the experts' adapters change the output
    save_peft(model, tmp_path / "adapter")
    tuned = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32), tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(tuned(tokens).logits, ours, atol=1e-4, rtol=0)
    again = nest.load(directory, weights=directory, dtype="float32")
    attach_adapter(again, tmp_path / "adapter")
    model.merge_lora()
    with torch.no_grad():
        torch.testing.assert_close(again(tokens), ours, atol=1e-5, rtol=0)
        torch.testing.assert_close(model(tokens), ours, atol=1e-4, rtol=0)


def test_the_experts_adapters_train(moe):
    from linnet.train import train
    from linnet.train.optimizer import adamw

    _, directory = moe
    model = nest.load(directory, weights=directory, dtype="float32")
    model.add_lora(["gate_up_proj", "down_proj"], rank=4, alpha=8)  # (a shared expert's down_proj too, as in PEFT)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(".mlp.experts." in n or ".mlp.shared_expert.down_proj." in n for n in trained)
    assert all(n.endswith(("lora_a", "lora_b")) for n in trained)
    (row,) = pack([Example(list(range(3, 40)))], tokens=40)
    history = train(model, [row] * 12, optimizer=adamw(model, lr=5e-2), steps=12)
    assert history.losses[-1] < 0.95 * history.losses[0]  # only the experts adapt: slowly, but they do


def test_qlora_stores_the_experts_in_nf4_and_trains_their_adapters(moe, tmp_path):
    """quantize='nf4' holds each expert's weights as NF4 codes (a state an expert): the
    model computes what its dequantized weights compute, its adapters on the experts train
    while the codes stay, merging leaves the logits, and an NF4 engine shares them."""
    pytest.importorskip("bitsandbytes", reason="quantize='nf4' needs bitsandbytes")
    import shutil

    from linnet.torch.quantize import quant_states, quantized_bytes
    from linnet.train import train
    from linnet.train.optimizer import adamw

    _, directory = moe
    model = nest.load(directory, weights=directory, dtype="float32", quantize="nf4")
    experts = model.model.layers[0].mlp.experts
    card = model.card
    assert experts.gate_up_proj.dtype == torch.uint8 and len(experts.quant_state["down_proj"]) == card.experts.count
    stacked = [n for n in quant_states(model) if ".mlp.experts." in n]
    assert len(stacked) == 2 * card.layers
    weights = card.layers * (card.experts.count * 3 * card.experts.intermediate * card.hidden
                             + sum(o * i for o, i in card.linear_shapes().values()))
    assert 0.5 * weights < quantized_bytes(model) < 0.6 * weights  # every block weight in about 4.2 bits
    tokens = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(5))
    model.save_weights(tmp_path / "dense")  # the dequantized weights, as checkpoints hold them
    shutil.copy(directory / "config.json", tmp_path / "dense" / "config.json")
    plain = nest.load(tmp_path / "dense", weights=tmp_path / "dense", dtype="float32")
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), plain(tokens), atol=1e-5, rtol=0)

    codes = experts.down_proj.clone()
    (row,) = pack([Example(list(range(3, 40)))], tokens=40)
    losses = []
    for m in (model, plain):  # the same adapters train alike over the codes and over their plain weights
        torch.manual_seed(0)
        m.add_lora(["q_proj", "gate_up_proj", "down_proj"], rank=4, alpha=8)
        losses.append(train(m, [row] * 8, optimizer=adamw(m, lr=5e-2), steps=8).losses)
    assert losses[0] == pytest.approx(losses[1], rel=1e-4) and losses[0][-1] < 0.97 * losses[0][0]
    assert torch.equal(experts.down_proj, codes) and experts.lora_b.abs().sum() > 0
    engine = Engine(nest.load(directory, weights=directory, dtype="float32", quantize="nf4"))
    engine.load_weights(model)
    assert engine.model.model.layers[0].mlp.experts is experts  # the policy's codes and adapters, not a copy
    prompt = [5, 6, 7]
    with torch.no_grad():
        before = model(tokens)
        sampled = engine.sample([prompt], max_new_tokens=6, temperature=0.0, stop=())[0].tokens
        model.merge_lora()
        torch.testing.assert_close(model(tokens), before, atol=1e-4, rtol=0)
    assert experts.down_proj.dtype == torch.float32 and experts.quant_state is None
    assert Engine(model).sample([prompt], max_new_tokens=6, temperature=0.0, stop=())[0].tokens == sampled


def test_preference_and_rl_objectives_train_a_mixture_of_experts(moe):
    """DPO from a pair's log-probabilities and GRPO through the engine, on the MoE with
    adapters on its attention and experts: DPO starts at log 2 and learns; GRPO's steps
    train the experts' adapters."""
    import math

    from linnet.packing import Pair
    from linnet.train.dpo import dpo
    from linnet.train.grpo import Prompt, grpo

    _, directory = moe
    g = np.random.default_rng(0)
    prompts = [g.integers(3, 40, size=int(g.integers(2, 6))).tolist() for _ in range(32)]
    model = nest.load(directory, weights=directory, dtype="float32")
    torch.manual_seed(0)
    model.add_lora("all-linear", rank=4, alpha=8)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    pairs = [Pair([1, *p], [*p, 2], [*p[::-1], 2]) for p in prompts]
    history = dpo(model, pairs, optimizer=optimizer, steps=8, pairs_per_step=16, beta=0.5, tokens=64)
    assert history.steps[0].loss == pytest.approx(math.log(2), abs=1e-6)
    assert history.steps[-1].loss < math.log(2) - 0.05

    policy = nest.load(directory, weights=directory, dtype="float32")
    policy.add_lora("all-linear", rank=4, alpha=8)
    engine = Engine(nest.load(directory, weights=directory, dtype="float32"))
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=2e-2)

    def sevens(prompt, completion):  # reward the token 7
        return sum(t == 7 for t in completion) / max(len(completion), 1)

    history = grpo(policy, engine, [Prompt(p) for p in prompts], sevens, optimizer=optimizer, steps=3,
                   prompts_per_step=4, group=8, max_new_tokens=8, stop=(), seed=0, verbose=False)
    assert len(history.steps) == 3 and all(math.isfinite(s.loss) for s in history.steps)
    assert any(s.grad_norm > 0 for s in history.steps)  # (a group whose rewards are all alike has no gradient)
    assert any(p.abs().sum() > 0 for n, p in policy.named_parameters() if n.endswith("experts.lora_b"))


def _expert_parallel_steps(rank, directory, lengths, expert, adapters):
    """Two SGD steps of full fine-tuning (or of adapters on the attention and the experts),
    this process's row through the experts split over groups of `expert` processes (copies
    of each other), beside the same steps of the whole model on every row in this process:
    the largest differences of the losses, the dense gradients and this process's experts'."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from linnet.torch.distributed import clip_gradients, reduce_gradients
    from linnet.torch.moe import expert_parallel

    torch.set_num_threads(1)
    g = np.random.default_rng(7)
    rows = [next(iter(pack([Example(g.integers(1, 97, n).tolist())], tokens=n))) for n in lengths]
    copies = dist.get_world_size() // expert
    mesh = init_device_mesh("cpu", (copies, expert), mesh_dim_names=("expert_copies", "expert"))
    mesh = mesh if copies > 1 else mesh["expert"]
    # full fine-tuning: each process loads its own experts alone; adapters: added first, then the experts split
    reference, model = (nest.load(directory, weights=directory, dtype="float32", trainable=not adapters,
                                  expert_parallel=None if adapters else split) for split in (None, mesh))
    for m in (reference, model) if adapters else ():
        torch.manual_seed(0)
        m.add_lora("all-linear", rank=2, alpha=4)
        with torch.no_grad():
            for name, p in m.named_parameters():
                if name.endswith("lora_b"):
                    p.normal_(0, 0.5)
    if adapters:
        expert_parallel(model, mesh)
    assert model.model.layers[0].mlp.experts.down_proj.to_local().shape[0] == reference.card.experts.count // expert
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (reference, model)]
    worst = {"loss": 0.0, "dense": 0.0, "experts": 0.0, "norm": 0.0}
    for _ in range(2):
        count = sum(float(r.weights.sum()) for r in rows)
        whole = sum(reference.loss_packed(r)[0] for r in rows)
        (whole / count).backward()
        mine = model.loss_packed(rows[rank])[0]
        (mine / count).backward()
        reduce_gradients(list(model.parameters()))
        total = mine.detach().clone()
        dist.all_reduce(total)
        worst["loss"] = max(worst["loss"], abs(float(total - whole.detach())))
        norms = [clip_gradients(list(m.parameters()), None) for m in (reference, model)]
        worst["norm"] = max(worst["norm"], abs(float(norms[0] - norms[1])))
        theirs = dict(reference.named_parameters())
        for name, p in ((n, p) for n, p in model.named_parameters() if p.requires_grad):
            expected, split = theirs[name].grad, isinstance(p, DTensor)
            if split:  # this process's experts
                per, mine = expected.shape[0] // expert, rank % expert
                expected = expected[mine * per:(mine + 1) * per]
            key = "experts" if split else "dense"
            worst[key] = max(worst[key], float(((p.grad.to_local() if split else p.grad) - expected).abs().max()))
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return worst


@pytest.mark.parametrize("processes, expert, adapters", [(2, 2, False), (4, 4, False), (4, 2, False),
                                                       (4, 2, True)])
def test_expert_parallel_equals_one_process(moe, processes, expert, adapters):
    """Experts split over 2 and 4 gloo processes, and over pairs of 4 (two copies of the
    split), each process with a row of its own (the first of two positions: some experts
    get nothing from it): losses, gradients and the gradient norm over two steps equal one
    process's to 1e-5, in full fine-tuning and with adapters on attention and experts."""
    from tests.conftest import in_processes

    hf, directory = moe
    if _count(hf) % expert:
        pytest.skip(f"{_count(hf)} experts do not split over {expert} processes")
    lengths = [2, 17, 11, 23][:processes]
    for worst in in_processes(_expert_parallel_steps, str(directory), lengths, expert, adapters,
                              processes=processes):
        assert worst["loss"] < 1e-4 and worst["dense"] < 1e-5 and worst["experts"] < 1e-5 and worst["norm"] < 1e-5, worst


def _sft_process(rank, overrides):
    from linnet.commands.sft import main

    return main([a for o in overrides for a in ("--set", o)])


def _quickstart_moe(tmp_path) -> list[str]:
    """A tiny random Qwen3-MoE model over the quickstart's tokenizer in tmp_path/moe and
    quickstart records in tmp_path/train.jsonl: the `linnet sft` overrides that train on them."""
    import json

    from linnet.commands import quickstart

    config = transformers.Qwen3MoeConfig(vocab_size=quickstart.CARD.vocab, hidden_size=32, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                         intermediate_size=48, moe_intermediate_size=16, num_experts=4,
                                         num_experts_per_tok=2, max_position_embeddings=256, bos_token_id=quickstart.BOS,
                                         eos_token_id=quickstart.EOS, pad_token_id=0)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path / "moe")
    quickstart.save_tokenizer(tmp_path / "moe" / "tokenizer.json")
    problems = quickstart.problems(np.random.default_rng(0), 200, 2)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"prompt": p, "completion": a}) + "\n"
                                                  for p, a in problems))
    return [f"model.card={tmp_path / 'moe'}", f"data.path={tmp_path / 'train.jsonl'}", "data.chat=false",
            "training.context_length=64"]


def test_the_commands_refuse_what_a_mixture_of_experts_cannot_do_naming_the_option(tmp_path):
    """`linnet jax` says the JAX backend has no mixture-of-experts models before starting a
    run (or JAX); `linnet sft` with training.mlp_tile names that field."""
    from linnet.commands import jax_sft, sft

    base = [a for o in (*_quickstart_moe(tmp_path), "data.eval_share=0") for a in ("--set", o)]
    with pytest.raises(ValueError, match=r"the JAX backend .* has no mixture-of-experts models yet: use the PyTorch"):
        jax_sft.main([*base, "--set", f"runtime.output_dir={tmp_path / 'jax'}"])
    assert not (tmp_path / "jax").exists()
    with pytest.raises(ValueError, match=r"positions=16 \(the config's training.mlp_tile\) on a mixture-of-experts"):
        sft.main([*base, "--set", "training.mlp_tile=16", "--set", f"runtime.output_dir={tmp_path / 'tiled'}"])


@pytest.mark.jax
def test_the_jax_loader_refuses_a_mixture_of_experts_before_reading_weights(tmp_path):
    pytest.importorskip("jax")
    from linnet.jax import load_model

    _quickstart_moe(tmp_path)
    with pytest.raises(ValueError, match=r"the JAX backend .* has no mixture-of-experts models yet: use the PyTorch"):
        load_model(tmp_path / "moe")


def test_linnet_sft_with_training_expert_equals_one_process(tmp_path):
    """`linnet sft` under 2 gloo processes with training.expert=2 (the experts split, each
    process its own rows) trains as one process does: the same losses step by step and the
    same final weights, written whole; so does it over 4 processes, each row's positions and
    the experts split over pairs of them and the dense parts sharded over all 4
    (training.context=2, training.shard=fsdp), and with
    adapters on attention and experts (the experts split, or the base sharded); and a run of it cut after step 2 resumes as one
    process, to the same end."""
    from safetensors.numpy import load_file

    from linnet.commands.sft import run
    from linnet.config import SFTConfig, load
    from tests.conftest import in_processes, same_metrics

    base = _quickstart_moe(tmp_path)

    def overrides(out, *extra):
        return [*base, "data.eval_share=0.05", "training.steps=4", "lora.enabled=false", "optimizer.lr=1e-2",
                "lr_schedule.warmup_steps=1", "evaluation.every=2", "data.overlap='off'", f"runtime.output_dir={out}",
                *extra]

    run(load(SFTConfig, None, overrides(tmp_path / "one", "training.accumulation=4")))
    split = ["training.expert=2", "training.accumulation=2"]  # the same 4 rows a step: 2 in each process
    assert in_processes(_sft_process, overrides(tmp_path / "two", *split), processes=2) == [0, 0]
    same_metrics(tmp_path / "two", tmp_path / "one", ["loss", "held_out_loss"], steps=4, abs=1e-5)
    # over 4 processes: each row's positions split over pairs of them (context parallel), the experts split
    # over the same pairs, the dense parts sharded (FSDP) over all 4
    pairs = ["training.expert=2", "training.context=2", "training.accumulation=2", "training.shard=fsdp"]
    assert in_processes(_sft_process, overrides(tmp_path / "fsdp", *pairs), processes=4) == [0] * 4
    same_metrics(tmp_path / "fsdp", tmp_path / "one", ["loss", "held_out_loss"], steps=4, abs=1e-5)
    # cut after step 2 (its checkpoint in parts, each process's experts), resumed as one process
    assert in_processes(_sft_process, overrides(tmp_path / "cut", *split, "training.steps=2"), processes=2) == [0, 0]
    resumed = load(SFTConfig, None, overrides(tmp_path / "cut", "training.accumulation=4"))
    run(resumed, resume=True)
    same_metrics(tmp_path / "cut", tmp_path / "one", ["loss", "held_out_loss"], steps=4, abs=1e-5)
    # adapters on the attention and on the experts, whole on each process, as one process trains them
    run(load(SFTConfig, None, overrides(tmp_path / "lora-one", "training.accumulation=4", "lora.enabled=true")))
    assert in_processes(_sft_process, overrides(tmp_path / "lora-two", *split, "lora.enabled=true"),
                        processes=2) == [0, 0]
    # and the same adapters placed on the empty model, the base sharded (FSDP) over 2 processes as it loads
    assert in_processes(_sft_process, overrides(tmp_path / "lora-fsdp", "training.accumulation=2", "lora.enabled=true",
                                                "training.shard=fsdp"), processes=2) == [0, 0]
    for run_dir in ("lora-two", "lora-fsdp"):
        same_metrics(tmp_path / run_dir, tmp_path / "lora-one", ["loss", "held_out_loss"], steps=4, abs=1e-5)
        ours, theirs = (load_file(tmp_path / d / "final" / "adapter_model.safetensors") for d in (run_dir, "lora-one"))
        assert sorted(ours) == sorted(theirs) and any("experts" in k for k in ours)
        for key in theirs:
            np.testing.assert_allclose(ours[key], theirs[key], atol=1e-5, err_msg=f"{run_dir}: {key}")
    for run_dir in ("two", "fsdp", "cut"):
        ours, theirs = (load_file(tmp_path / d / "final" / "model.safetensors") for d in (run_dir, "one"))
        assert sorted(ours) == sorted(theirs) and any(".experts.3." in k for k in ours)
        for key in theirs:
            np.testing.assert_allclose(ours[key], theirs[key], atol=1e-5, err_msg=f"{run_dir}: {key}")
