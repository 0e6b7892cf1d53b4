"""The JAX backend against the PyTorch decoder on the same weights: hidden states,
losses, log-probabilities and gradients of packed rows for each family's flags, the
blockwise loss against plain autodiff, and training steps equal to PyTorch's."""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest
import torch

from linnet import nest
from linnet.cards import RopeScaling
from linnet.packing import Example, Pair, pack
from tests.conftest import quickstart_model

pytestmark = pytest.mark.jax  # last in the run: see tests/conftest.py

BASE = nest.resolve("debug").replace(vocab=96, hidden=32, intermediate=64, heads=4, kv_heads=2, head_dim=8, layers=2)
FLAGS = {
    "llama": {},
    "llama3-scaled-untied": {"tied_embeddings": False},
    "qwen2-biases": {"qkv_bias": True},
    "qwen3-qk-norm": {"qk_norm": True, "tied_embeddings": False},
    "all-biases": {"qkv_bias": True, "o_bias": True, "mlp_bias": True},
    "yarn": {"rope_scaling": RopeScaling(kind="yarn", factor=4.0, original_max_positions=8)},
}


@pytest.fixture(scope="module")
def jx():
    """(jax, linnet.jax.model): imported inside the tests only (see pytestmark); four
    host devices for the mesh tests (tests/conftest.py)."""
    jax = pytest.importorskip("jax")
    from linnet.jax import model

    return jax, model


def _rows(n=2, tokens=48, seed=0):
    g = np.random.default_rng(seed)
    docs = [Example.prompted(g.integers(3, 96, 3).tolist(), g.integers(3, 96, int(k)).tolist())
            for k in g.integers(2, 14, size=8 * n)]
    return list(pack(docs, tokens=tokens))[:n]


def _pair(jx, flags, tmp_path):
    """The same random weights as a torch model and a JAX model (read from safetensors)."""
    _, model = jx
    card = BASE.replace(**flags)
    torch_model = nest.load(card, weights="random", seed=3, trainable=True)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # norms and biases away from their init, so they count
        for name, p in torch_model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    torch_model.save_weights(tmp_path / "w.safetensors", dtype=torch.float32)
    return torch_model, nest.load(card, backend="jax", weights=str(tmp_path / "w.safetensors"))


@pytest.mark.parametrize("family", sorted(FLAGS))
def test_packed_entries_equal_pytorch(jx, family, tmp_path):
    jax, _ = jx
    torch_model, jax_model = _pair(jx, FLAGS[family], tmp_path)
    for row in _rows():
        with torch.no_grad():
            loss, count = torch_model.loss_packed(row)
        jloss, jcount = jax_model.loss_packed(row)
        assert float(jcount) == float(count)
        assert float(jloss) == pytest.approx(float(loss), rel=1e-5)
        real = row.real  # torch leaves the trailing padding uncomputed (zeros)
        np.testing.assert_allclose(np.asarray(jax_model.hidden_packed(row))[:real],
                                   torch_model.hidden_packed(row).detach().numpy()[:real], atol=2e-5, rtol=0)
        learned = row.weights > 0
        np.testing.assert_allclose(np.asarray(jax_model.log_probs_packed(row))[learned],
                                   torch_model.log_probs_packed(row).detach().numpy()[learned], atol=2e-5, rtol=0)


def test_gradients_equal_pytorch(jx, tmp_path):
    jax, model = jx
    torch_model, jax_model = _pair(jx, FLAGS["qwen3-qk-norm"], tmp_path)
    row = _rows(1)[0]
    loss, _ = torch_model.loss_packed(row)
    loss.backward()
    arrays = model.row_arrays(row)
    grads = jax.jit(jax.grad(lambda p: model.loss_packed(p, jax_model.card, arrays, rows=16)[0]))(jax_model.params)
    assert set(grads) == {n for n, _ in torch_model.named_parameters()}
    for remat in (False, True):  # remat: each layer is a checkpoint (recomputed in backward)
        loss = functools.partial(lambda p, remat: model.loss_packed(p, jax_model.card, arrays, remat=remat)[0],
                                 remat=remat)
        jaxpr = str(jax.make_jaxpr(jax.grad(loss))(jax_model.params))
        assert ("checkpoint" in jaxpr or "remat" in jaxpr) == remat
    for name, p in torch_model.named_parameters():
        np.testing.assert_allclose(np.asarray(grads[name]), p.grad.numpy(), atol=2e-5, rtol=1e-4, err_msg=name)


def test_blockwise_losses_equal_plain_autodiff(jx):
    """The custom_vjp losses over blocks that do not divide the rows (padding) against
    jax.nn on whole logits, values and gradients, cross-entropy and log-probabilities."""
    jax, _ = jx
    import jax.numpy as jnp

    from linnet.jax.loss import linear_cross_entropy, linear_token_log_probs

    g = np.random.default_rng(0)
    h, w = jnp.asarray(g.normal(size=(37, 16)), jnp.float32), jnp.asarray(g.normal(size=(50, 16)), jnp.float32)
    t = jnp.asarray(g.integers(0, 50, 37))
    wt = jnp.asarray(g.integers(0, 2, 37), jnp.float32)
    coef = jnp.asarray(g.normal(size=37), jnp.float32)

    def plain_logp(h, w):
        return jnp.take_along_axis(jax.nn.log_softmax(h @ w.T), t[:, None], axis=-1)[:, 0]

    cases = [(lambda h, w: linear_cross_entropy(h, w, t, wt, 8), lambda h, w: -(plain_logp(h, w) * wt).sum()),
             (lambda h, w: (linear_token_log_probs(h, w, t, 8) * coef).sum(),
              lambda h, w: (plain_logp(h, w) * coef).sum())]
    for blockwise, plain in cases:
        np.testing.assert_allclose(blockwise(h, w), plain(h, w), rtol=1e-5)
        for a, b in zip(jax.jit(jax.grad(blockwise, (0, 1)))(h, w), jax.grad(plain, (0, 1))(h, w)):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_training_steps_equal_pytorch(jx, tmp_path):
    """Four SGD steps of two accumulated rows, clipped: the same losses and gradient
    norms as linnet.train.train, and the same weights after (saved and read back)."""
    import optax

    from linnet.jax.train import train as jax_train
    from linnet.train import train

    torch_model, jax_model = _pair(jx, FLAGS["llama3-scaled-untied"], tmp_path)
    rows = _rows(8, seed=1)
    history = train(torch_model, rows, optimizer=torch.optim.SGD(torch_model.parameters(), lr=0.5), steps=4,
                    accumulate=2, clip=0.3)
    params, jhistory = jax_train(jax_model, rows, optimizer=optax.sgd(0.5), steps=4, accumulate=2, clip=0.3,
                                 save_to=tmp_path / "jax")
    assert jhistory.losses == pytest.approx(history.losses, rel=1e-5)
    assert [s.grad_norm for s in jhistory.steps] == pytest.approx([s.grad_norm for s in history.steps], rel=1e-4)
    back = nest.load(str(tmp_path / "jax"), weights=str(tmp_path / "jax"))
    from linnet.jax import load_source

    source = load_source(str(tmp_path / "jax"), weights=str(tmp_path / "jax")).params  # read back in JAX
    for name, p in torch_model.named_parameters():
        np.testing.assert_allclose(np.asarray(params[name]), p.detach().numpy(), atol=1e-5, err_msg=name)
        np.testing.assert_allclose(dict(back.named_parameters())[name].detach().numpy(), p.detach().numpy(),
                                   atol=1e-5, err_msg=name)
        np.testing.assert_allclose(np.asarray(source[name]), p.detach().numpy(), atol=1e-5, err_msg=name)


def test_trainable_patterns_and_refusals(jx, tmp_path):
    import optax

    from linnet.jax.train import train as jax_train

    _, jax_model = _pair(jx, {}, tmp_path)
    before = {k: np.asarray(v) for k, v in jax_model.params.items()}
    params, history = jax_train(jax_model, _rows(2), optimizer=optax.inject_hyperparams(optax.adamw)(1e-2),
                                steps=2, trainable="model.layers.*.mlp.*")
    assert len(history) == 2 and history.steps[0].lr == pytest.approx(1e-2)
    for name, value in params.items():
        assert np.array_equal(np.asarray(value), before[name]) == (".mlp." not in name), name
    with pytest.raises(ValueError, match="matches no parameter"):
        jax_train(jax_model, _rows(1), optimizer=optax.sgd(0.1), steps=1, trainable="nothing.*")
    with pytest.raises(ValueError, match="does not take trainable"):
        nest.load(BASE, backend="jax", weights="random", trainable=True)


def test_shared_prompt_rows_equal_pytorch_and_separate_documents(jx, tmp_path):
    """A prompt placed once with its completions attending to it (Packed.prefix): the
    completions' log-probabilities equal PyTorch's on the same row and the JAX model's on
    separate prompt + completion documents."""
    from linnet.packing import pack_prompted

    torch_model, jax_model = _pair(jx, {"qk_norm": True}, tmp_path)
    groups = [([5, 6, 7, 8], [[9, 10, 11], [12, 13], [14, 15, 16, 17]]), ([20, 21], [[22, 23], [24, 25, 26]])]
    shared, separate = (next(pack_prompted(groups, 48, share=share)) for share in (True, False))
    assert shared.prefix is not None and shared.real < separate.real

    def answers(logp, row):  # each completion's learned log-probabilities, in order
        return np.concatenate([np.asarray(logp)[a:b][np.asarray(row.weights)[a:b] > 0]
                               for a, b in zip(row.bounds[:-1], row.bounds[1:])])

    got = answers(jax_model.log_probs_packed(shared), shared)
    with torch.no_grad():
        np.testing.assert_allclose(got, answers(torch_model.log_probs_packed(shared).numpy(), shared), atol=2e-5)
    np.testing.assert_allclose(got, answers(jax_model.log_probs_packed(separate), separate), atol=2e-5)


def _lora_pair(jx, tmp_path, dora=False):
    """A torch model and a JAX model with the same base weights and the same adapters
    (B away from zero, DoRA's magnitudes away from the row norms, so they count from the
    first step)."""
    torch_model, jax_model = _pair(jx, {"tied_embeddings": False, "qkv_bias": True}, tmp_path)
    patterns = ["model.layers.*.self_attn.*_proj", "model.layers.*.mlp.*_proj"]
    torch.manual_seed(0)  # A from the global generator: the same whatever tests ran before in this process
    layers = torch_model.add_lora(patterns, rank=4, alpha=8, dora=dora)
    # the seeds' names for the same layers (seed 000: layers.*.attention.*_proj.weight)
    assert jax_model.add_lora(["layers.*.attention.*_proj.weight", "layers.*.feed_forward.*_proj"], rank=4, alpha=8,
                              dora=dora) == layers
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in torch_model.named_parameters():
            if name.endswith("lora_b"):
                p.normal_(0, 0.05, generator=g)
            if name.endswith("lora_magnitude"):
                p.mul_(1 + 0.2 * torch.rand(p.shape, generator=g))
    import jax.numpy as jnp

    for name, p in torch_model.named_parameters():
        if name.endswith(("lora_a", "lora_b", "lora_magnitude")):
            jax_model.params[name] = jnp.asarray(p.detach().numpy())
    return torch_model, jax_model


@pytest.mark.parametrize("dora", [False, True])
def test_lora_trains_like_pytorch_and_saves_for_peft(jx, tmp_path, dora):
    """Adapters (and DoRA's magnitudes) alone train by default; the steps equal PyTorch's;
    the saved PEFT directory binds into a PyTorch model; merging changes no output."""
    import optax

    from linnet.jax.model import merge_lora
    from linnet.jax.train import train as jax_train
    from linnet.torch.weights import bind_weights
    from linnet.train import train

    torch_model, jax_model = _lora_pair(jx, tmp_path, dora)
    rows = _rows(6, seed=2)
    adapters = [p for p in torch_model.parameters() if p.requires_grad]
    history = train(torch_model, rows, optimizer=torch.optim.SGD(adapters, lr=0.5), steps=3, accumulate=2)
    params, jhistory = jax_train(jax_model, rows, optimizer=optax.sgd(0.5), steps=3, accumulate=2,
                                 save_to=tmp_path / "peft")
    assert jhistory.losses == pytest.approx(history.losses, rel=1e-5)
    for name, p in torch_model.named_parameters():
        assert np.array_equal(np.asarray(params[name]), np.asarray(jax_model.params[name])) == (not p.requires_grad)
    fresh = nest.load(jax_model.card, weights=str(tmp_path / "w.safetensors"))
    fresh.add_lora(["model.layers.*.self_attn.*_proj", "model.layers.*.mlp.*_proj"], rank=4, alpha=8, dora=dora)
    bind_weights(fresh, tmp_path / "peft")
    row = rows[0]
    with torch.no_grad():
        want = float(fresh.loss_packed(row)[0])
    assert float(jax_model.loss_packed(row, params)[0]) == pytest.approx(want, rel=1e-5)
    merged = merge_lora(jax_model, params)
    assert not any(".lora_" in k for k in merged)
    assert float(jax_model.loss_packed(row, merged)[0]) == pytest.approx(want, rel=1e-5)


def test_resume_equals_an_uninterrupted_run(jx, tmp_path):
    """AdamW, 4 steps straight against 2 + stop + resume 2: the same losses to the bit;
    a damaged optimizer file is refused by name."""
    import optax

    from linnet.jax.train import train as jax_train

    _, jax_model = _pair(jx, {}, tmp_path)
    rows = _rows(8, seed=4)
    adamw = optax.adamw(1e-2)  # one object: the runs share one compiled step
    run = lambda steps, ckpt: jax_train(jax_model, rows, optimizer=adamw, steps=steps, accumulate=2,
                                        checkpoint=ckpt, checkpoint_every=2)
    _, straight = run(4, tmp_path / "straight")
    run(2, tmp_path / "resumed")
    params, rest = run(4, tmp_path / "resumed")
    assert [s.step for s in rest.steps] == [3, 4] and rest.losses == straight.losses[2:]
    assert sorted(p.name for p in (tmp_path / "resumed").iterdir()) == ["step-00000002", "step-00000004"]
    damaged = tmp_path / "resumed" / "step-00000004" / "optimizer.npz"
    damaged.write_bytes(damaged.read_bytes()[:-8])
    with pytest.raises(ValueError, match="optimizer.npz: corrupt or truncated"):
        run(6, tmp_path / "resumed")


def test_mesh_trains_like_one_device_with_the_rows_accumulated(jx, tmp_path):
    """Two devices, a row each per micro-step, parameters and optimizer state split between
    them, layers recomputed in backward: the losses and weights of one device
    accumulating both rows without recomputation."""
    jax, _ = jx
    import optax
    from jax.sharding import Mesh

    from linnet.jax.train import _make_step
    from linnet.jax.train import train as jax_train

    if len(jax.devices()) < 2:
        pytest.skip("needs two devices (tests/conftest.py sets XLA_FLAGS; it was overridden)")
    _, jax_model = _pair(jx, {"tied_embeddings": False}, tmp_path)
    rows = _rows(8, seed=5)
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    # momentum SGD: a sharded optimizer state, without Adam's amplifying of rounding where gradients are tiny
    split, history = jax_train(jax_model, rows, optimizer=optax.sgd(0.5, momentum=0.9), steps=2, accumulate=2,
                               mesh=mesh, remat=True)
    whole, reference = jax_train(jax_model, rows, optimizer=optax.sgd(0.5, momentum=0.9), steps=2, accumulate=4)
    assert history.losses == pytest.approx(reference.losses, rel=1e-5)
    assert [s.learned for s in history.steps] == [s.learned for s in reference.steps]
    embed = split["model.embed_tokens.weight"]
    assert embed.addressable_shards[0].data.shape[0] * 2 == embed.shape[0]  # each device holds half
    ckpt = tmp_path / "ckpt"  # a resumed mesh run keeps its parameters split
    jax_train(jax_model, rows, optimizer=optax.sgd(0.5, momentum=0.9), steps=1, accumulate=2, mesh=mesh,
              checkpoint=ckpt)
    resumed, _ = jax_train(jax_model, rows, optimizer=optax.sgd(0.5, momentum=0.9), steps=2, accumulate=2,
                           mesh=mesh, checkpoint=ckpt)
    assert resumed["model.embed_tokens.weight"].addressable_shards[0].data.shape[0] * 2 == embed.shape[0]
    for name, value in split.items():
        np.testing.assert_allclose(np.asarray(resumed[name]), np.asarray(value), atol=2e-5, err_msg=name)
    for name, value in whole.items():
        np.testing.assert_allclose(np.asarray(split[name]), np.asarray(value), atol=2e-5, err_msg=name)
    adam = optax.adam(1e-3)  # a scalar step count in its state, placed over the mesh as the step returns it:
    jax_train(jax_model, rows, optimizer=adam, steps=2, accumulate=2, mesh=mesh)  # one compile for every step
    assert _make_step(jax_model.card, jax_model.dtype, 0.0, adam, 1.0, False, 0.0)._cache_size() == 1


def test_dpo_steps_equal_pytorch(jx, tmp_path):
    """LoRA DPO, the model's own starting log-probabilities as the reference: the losses,
    gradient norms, accuracies and margins of linnet.train.dpo.dpo."""
    import optax

    from linnet.jax.dpo import dpo as jax_dpo
    from linnet.train.dpo import dpo

    torch_model, jax_model = _lora_pair(jx, tmp_path)
    g = np.random.default_rng(6)
    pairs = [Pair(g.integers(3, 96, 4).tolist(), g.integers(3, 96, int(g.integers(1, 6))).tolist(),
                  g.integers(3, 96, int(g.integers(1, 6))).tolist()) for _ in range(8)]
    adapters = [p for p in torch_model.parameters() if p.requires_grad]
    history = dpo(torch_model, pairs, optimizer=torch.optim.SGD(adapters, lr=1.0), steps=2, pairs_per_step=4,
                  beta=0.5, label_smoothing=0.1, tokens=32)
    _, jhistory = jax_dpo(jax_model, pairs, optimizer=optax.sgd(1.0), steps=2, pairs_per_step=4, beta=0.5,
                          label_smoothing=0.1, tokens=32)
    assert jhistory.losses == pytest.approx(history.losses, rel=1e-5)
    for got, want in zip(jhistory.steps, history.steps):
        assert got.grad_norm == pytest.approx(want.grad_norm, rel=1e-4)
        assert got.metrics["rewards/margins"] == pytest.approx(want.metrics["rewards/margins"], rel=1e-4, abs=1e-6)
    # step 1's margins are zero up to rounding (policy = reference); step 2's are not
    assert abs(jhistory.steps[1].metrics["rewards/margins"]) > 1e-3
    assert jhistory.steps[1].metrics["rewards/accuracies"] == history.steps[1].metrics["rewards/accuracies"]
    jax, _ = jx
    if len(jax.devices()) >= 2:  # rows split over two devices (a third row filled out), layers recomputed
        from jax.sharding import Mesh

        _, split = jax_dpo(jax_model, pairs, optimizer=optax.sgd(1.0), steps=2, pairs_per_step=4, beta=0.5,
                           label_smoothing=0.1, tokens=32, mesh=Mesh(np.array(jax.devices()[:2]), ("data",)),
                           remat=True)
        assert split.losses == pytest.approx(jhistory.losses, rel=1e-5)


def test_linnet_jax_runs_the_sft_config(jx, tmp_path, monkeypatch):
    """`linnet jax` on an sft config, layers kept (--no-remat): the run directory, metrics
    with held-out loss, the final weights; again over every device with --fully-shard,
    each row's positions over two of them (training.context) and layers recomputed (the
    default), the same losses; a PyTorch-only field and contradicting remat settings are
    refused by name; lora.dropout trains, seeded by the run."""
    import json

    from linnet.cli import main
    from linnet.commands import quickstart
    from linnet.jax import train as jax_train

    quickstart_model(tmp_path / "model")
    lines = [json.dumps({"prompt": p, "completion": a})
             for p, a in quickstart.problems(np.random.default_rng(0), 120, 2)]
    (tmp_path / "train.jsonl").write_text("\n".join(lines) + "\n")
    common = [f"model.card={tmp_path / 'model'}", f"data.path={tmp_path / 'train.jsonl'}", "data.chat=false",
              "training.context_length=128", "data.eval_share=0.1", "lora.enabled=false", "optimizer.lr=3e-3",
              "lr_schedule.warmup_steps=1", "training.steps=3", "training.accumulation=4", "evaluation.every=2"]
    sets = lambda *extra: [a for o in common + list(extra) for a in ("--set", o)]
    remats, seeds, train = [], [], jax_train.train

    def recording(model, *args, remat, **options):
        remats.append(remat)
        seeds.append((model.lora and model.lora["dropout"], options["seed"]))
        if model.lora:  # the dropout run: what `linnet jax` hands the trainer is checked, not a second compile
            from linnet.run import History

            return model.params, History()
        return train(model, *args, remat=remat, **options)

    monkeypatch.setattr(jax_train, "train", recording)
    assert main(["jax", "--no-remat", *sets(f"runtime.output_dir={tmp_path / 'one'}")]) == 0
    four = len(jx[0].devices()) == 4  # two rows a micro-step, each row's positions over two devices
    every = ["training.context=2", "training.accumulation=2"] if four else ["training.accumulation=1"]
    assert main(["jax", "--fully-shard", *sets(f"runtime.output_dir={tmp_path / 'all'}", *every)]) == 0
    assert remats == [False, True]
    one, every = ([json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
                  for d in ("one", "all"))
    assert [m["step"] for m in one] == [1, 2, 3] and one[-1]["loss"] < one[0]["loss"]
    assert ["held_out_loss" in m for m in one] == [False, True, True]
    assert 0 < one[1]["lr"] <= 3e-3 * (1 + 1e-6) and (tmp_path / "one" / "final" / "model.safetensors").is_file()
    if four:  # the rows of accumulate=4, two at a time, the same steps
        assert [m["loss"] for m in every] == pytest.approx([m["loss"] for m in one], rel=1e-4)
        assert main(["jax", *sets(f"runtime.output_dir={tmp_path / 'no'}", "training.context=3",
                                  "training.context_length=126")]) == 2  # 3 does not divide 4 devices
        assert not (tmp_path / "no").exists()
    assert main(["jax", *sets(f"runtime.output_dir={tmp_path / 'no'}", "training.shard=fsdp")]) == 2
    assert main(["jax", "--no-remat", *sets(f"runtime.output_dir={tmp_path / 'no'}",
                                            "training.activation_checkpointing=true")]) == 2
    assert main(["jax", "--remat", "--no-remat", *sets(f"runtime.output_dir={tmp_path / 'no'}")]) == 2
    assert not (tmp_path / "no").exists() and remats == [False, True]
    assert main(["jax", *sets(f"runtime.output_dir={tmp_path / 'drop'}", "lora.enabled=true", "lora.dropout=0.1",
                              "runtime.seed=5")]) == 0  # adapter dropout, seeded by the run
    assert seeds[-1] == (0.1, 5)


def test_engine_greedy_equals_pytorch_and_log_probs_are_the_models(jx, tmp_path, monkeypatch):
    """Greedy completions of prompts of mixed lengths equal the PyTorch engine's, tokens
    and log-probabilities, a stop token ending some; sampled completions repeat with the
    seed, and their log-probabilities are what the model gives the whole sequence (each
    prompt prefilled once for its n completions)."""
    import linnet.jax.engine as jax_engine
    from linnet.jax.engine import Engine as JaxEngine
    from linnet.packing import pack
    from linnet.serve import Engine

    torch_model, jax_model = _pair(jx, {"qkv_bias": True, "tied_embeddings": False}, tmp_path)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14]]
    want = Engine(torch_model).sample(prompts, max_new_tokens=9, temperature=0.0, stop=[95, 61])
    engine = JaxEngine(jax_model)
    got = engine.sample(prompts, max_new_tokens=9, temperature=0.0, stop=[95, 61])
    assert [c.tokens for c in got] == [c.tokens for c in want]
    assert [c.stopped for c in got] == [c.stopped for c in want] == [True, True, False]
    for a, b in zip(got, want):
        np.testing.assert_allclose(a.logprobs, b.logprobs.numpy(), atol=2e-5)
    prefilled = []
    real_prefill = jax_engine._prefill
    monkeypatch.setattr(jax_engine, "_prefill", lambda params, card, tokens, *a: prefilled.append(tokens.shape[0])
                        or real_prefill(params, card, tokens, *a))
    sampled = engine.sample(prompts, n=3, max_new_tokens=6, temperature=1.0, top_k=20, top_p=0.9, seed=3)
    assert prefilled == [len(prompts)]
    again = engine.sample(prompts, n=3, max_new_tokens=6, temperature=1.0, top_k=20, top_p=0.9, seed=3)
    assert [c.tokens for c in sampled] == [c.tokens for c in again] and len(sampled) == 9
    assert len({tuple(c.tokens) for c in sampled}) > 3  # the samples differ
    for c in sampled:
        row = next(pack([Example.prompted(prompts[c.prompt], c.tokens)], tokens=32))
        logp = np.asarray(jax_model.log_probs_packed(row))[np.asarray(row.weights) > 0]
        np.testing.assert_allclose(c.logprobs, logp, atol=2e-5)


def test_engine_takes_a_policy_with_adapters_merged(jx, tmp_path):
    from linnet.jax.engine import Engine
    from linnet.jax.model import merge_lora

    _, policy = _lora_pair(jx, tmp_path)
    engine = Engine(nest.load(policy.card, backend="jax", weights=str(tmp_path / "w.safetensors")))
    plain = engine.sample([[5, 6, 7]], max_new_tokens=8, temperature=0.0)
    engine.load_weights(policy)
    adapted = engine.sample([[5, 6, 7]], max_new_tokens=8, temperature=0.0)
    merged = merge_lora(policy)
    direct = Engine(nest.load(policy.card, backend="jax", weights=str(tmp_path / "w.safetensors")))
    direct.params = merged
    assert adapted[0].tokens == direct.sample([[5, 6, 7]], max_new_tokens=8, temperature=0.0)[0].tokens
    assert adapted[0].tokens != plain[0].tokens or not np.allclose(adapted[0].logprobs, plain[0].logprobs)


def test_an_engine_split_over_a_mesh_takes_a_split_policy_in_place(jx, tmp_path):
    """model.shard(mesh) splits the engine's model as training splits the policy; weights
    copied in from a split policy (adapters merged) stay split the engine's way, and it
    samples what a whole engine samples."""
    jax, _ = jx
    if len(jax.devices()) < 2:
        pytest.skip("needs two devices (tests/conftest.py sets XLA_FLAGS; it was overridden)")
    from jax.sharding import Mesh

    from linnet.jax.engine import Engine
    from linnet.jax.sharding import part

    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    _, policy = _lora_pair(jx, tmp_path)
    split_policy = {k: jax.device_put(v, part(v, mesh)) for k, v in policy.params.items()}

    def engine():
        return nest.load(policy.card, backend="jax", weights=str(tmp_path / "w.safetensors"))

    split, whole = Engine(engine().shard(mesh)), Engine(engine())
    placed = {k: v.sharding for k, v in split.params.items()}
    assert len(placed["model.layers.0.mlp.up_proj.weight"].device_set) == 2
    split.load_weights(policy, split_policy)
    whole.load_weights(policy)
    assert {k: v.sharding for k, v in split.params.items()} == placed
    prompts = [[5, 6, 7], [8, 9]]
    a, b = (e.sample(prompts, max_new_tokens=8, temperature=0.0) for e in (split, whole))
    assert [c.tokens for c in a] == [c.tokens for c in b]
    for x, y in zip(a, b):
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)
    other = nest.load(policy.card.replace(layers=1), backend="jax", weights="random")
    with pytest.raises(ValueError, match="card differs"):
        split.load_weights(other)


def test_grpo_skipping_zero_advantages_changes_nothing_but_the_work(jx, monkeypatch):
    """As in PyTorch (tests/test_grpo.py): passing every completion through the policy
    ends with the same parameters and losses as skipping those whose advantage is 0."""
    import optax

    import linnet.jax.grpo as G
    from linnet.jax.engine import Engine
    from linnet.jax.model import load_model
    from linnet.train.grpo import Prompt

    card = nest.resolve("debug").replace(vocab=16, hidden=32, intermediate=64, heads=4, kv_heads=2, head_dim=8,
                                         eos_token_ids=(2,))
    prompts = [Prompt(ids) for ids in ([4, 5], [3, 9], [6], [7, 7, 3])]

    def half_uniform(prompt, completion):  # even first token: always 1, so a uniform group
        return 1.0 if prompt.ids[0] % 2 == 0 else sum(t == 7 for t in completion) / len(completion)

    def run():
        policy = load_model(card, weights="random", seed=1)
        engine = Engine(load_model(card, weights="random", seed=1))
        return G.grpo(policy, engine, prompts, half_uniform, optimizer=optax.adamw(2e-2, weight_decay=0.1),
                      steps=2, group=8, prompts_per_step=4, max_new_tokens=6, tokens=64)

    params, skipping = run()
    monkeypatch.setattr(G, "to_train", lambda scored, beta: scored.keep.copy())
    params_all, every = run()
    assert all(s.metrics["skipped"] == 0.5 for s in skipping.steps)
    assert all(s.metrics["skipped"] == 0 for s in every.steps)
    for s, e in zip(skipping.steps, every.steps):
        assert s.learned == e.learned and s.real < e.real
        assert s.loss == pytest.approx(e.loss, abs=1e-6) and s.grad_norm == pytest.approx(e.grad_norm, rel=1e-4)
    for name in params:  # Adam divides by each gradient's own size: rounding of the other packing shows ~1e-6
        np.testing.assert_allclose(np.asarray(params[name]), np.asarray(params_all[name]), rtol=1e-4, atol=1e-5)


def _sevens_grpo(steps, split_engine=None, **kw):
    """JAX GRPO on the 'sevens' task (the share of 7s in a completion) for `steps` steps: its History."""
    import optax

    from linnet.jax.engine import Engine
    from linnet.jax.grpo import grpo
    from linnet.jax.model import load_model
    from linnet.train.grpo import Prompt

    card = nest.resolve("debug").replace(vocab=16, hidden=32, intermediate=64, heads=4, kv_heads=2, head_dim=8,
                                         eos_token_ids=(2,))
    g = np.random.default_rng(0)
    prompts = [Prompt(g.integers(3, 16, size=int(g.integers(1, 5))).tolist()) for _ in range(16)]

    def sevens(prompt, completion):
        return sum(t == 7 for t in completion) / len(completion)

    policy = load_model(card, weights="random", seed=1)
    engine_model = load_model(card, weights="random", seed=1)
    engine = Engine(engine_model if split_engine is None else engine_model.shard(split_engine))
    if kw.pop("reference", None):
        kw["reference"] = load_model(card, weights="random", seed=1).params
    options = dict(group=8, prompts_per_step=4, max_new_tokens=6, tokens=64) | kw
    return grpo(policy, engine, prompts, sevens, optimizer=optax.adamw(2e-2), steps=steps, **options)[1]


@pytest.mark.slow  # test_grpo_options_run_and_resume trains JAX GRPO in the default run
def test_grpo_reward_rises_and_the_engine_agrees_with_the_policy(jx):
    """GRPO on the 'sevens' task: the mean reward rises, the first iteration is unclipped,
    and the engine's log-probabilities equal the policy's; split over two devices, the
    first steps are the same."""
    history = _sevens_grpo(12)
    rewards = [s.metrics["reward"] for s in history.steps]
    assert np.mean(rewards[-3:]) > np.mean(rewards[:3]) + 0.2, rewards
    assert all(s.metrics["clip_fraction"] == 0 and s.metrics["mismatch"] < 1e-4 for s in history.steps)
    jax, _ = jx
    if len(jax.devices()) >= 2:  # the same first steps with the rows, then the engine too, split over two devices
        from jax.sharding import Mesh

        mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
        for split in (_sevens_grpo(1, mesh=mesh, remat=True), _sevens_grpo(2, mesh=mesh, split_engine=mesh)):
            assert split.steps[0].metrics["reward"] == history.steps[0].metrics["reward"]
            assert split.steps[0].loss == pytest.approx(history.steps[0].loss, rel=1e-4, abs=1e-6)
            assert split.steps[0].grad_norm == pytest.approx(history.steps[0].grad_norm, rel=1e-4)
        # step 2 samples with the split policy's updated weights, copied part to part
        assert split.steps[1].metrics["mismatch"] < 1e-4


def test_grpo_options_run_and_resume(jx, tmp_path):
    """The other GRPO options run, a checkpointed run resumes, and beta adds a KL term."""
    each = dict(iterations=2, clip=(0.1, 0.1), drop_uniform=True, correction_cap=2.0, sequence_level=True,
                checkpoint=tmp_path / "ckpt", checkpoint_every=1)
    options = _sevens_grpo(2, **each)
    assert len(options) == 2 and all(np.isfinite(s.loss) for s in options.steps)
    resumed = _sevens_grpo(3, **each, dr_grpo=True)
    assert [s.step for s in resumed.steps] == [3]
    with pytest.raises(ValueError, match="needs reference"):
        _sevens_grpo(1, beta=0.1)
    kl = _sevens_grpo(2, beta=0.1, iterations=2, reference=True)
    assert kl.steps[0].metrics["kl"] > 0 and all(np.isfinite(s.metrics["kl"]) for s in kl.steps)


def test_numerics_set_jax_matmul_precision_on_accelerators_only(jx):
    jax, model = jx
    before = jax.config.jax_default_matmul_precision
    for numerics in ("fast", "exact"):  # this CPU: nothing changes
        nest.load("debug", backend="jax_source", weights="random", numerics=numerics)
        assert jax.config.jax_default_matmul_precision == before
    try:
        model.set_numerics("exact", "gpu")
        assert jax.config.jax_default_matmul_precision == "highest"
        model.set_numerics("fast", "gpu")
        assert jax.config.jax_default_matmul_precision == "default"
    finally:
        jax.config.update("jax_default_matmul_precision", before)


@pytest.mark.parametrize("damage, message", [
    ("reshaped", "model.norm.weight has shape (16,) but card"),
    ("extra", "1 tensors have no place in card"),
    ("missing", "1 parameters of card 'debug' are missing (e.g. model.norm.weight)"),
])
def test_both_backends_refuse_a_bad_checkpoint_alike(jx, tmp_path, damage, message):
    """Both loaders locate a checkpoint's tensors through linnet.files.weights: a wrong shape,
    a tensor without a place and a missing parameter each stop either one, with the same
    message naming the file or directory and the tensor."""
    from safetensors.torch import load_file, save_file

    card = BASE.replace(tied_embeddings=False)
    nest.load(card, weights="random").save_weights(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    if damage == "reshaped":
        tensors["model.norm.weight"] = torch.ones(16)
    elif damage == "extra":
        tensors["model.layers.0.extra.weight"] = torch.ones(3)
    else:
        del tensors["model.norm.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    errors = []
    for backend in ("torch", "jax"):
        with pytest.raises(ValueError, match=re.escape(message)) as caught:
            nest.load(card, backend, weights=tmp_path)
        errors.append(str(caught.value))
    assert errors[0] == errors[1]


@pytest.mark.slow  # 50 s; adapter dropout parity: test_lora, JAX resume: test_resume_equals_an_uninterrupted_run
def test_adapter_dropout_drops_each_layer_apart_and_resumes_alike(jx, tmp_path):
    """add_lora(dropout=) drops the adapters' input while train() trains: about `rate` of the
    values drop and the rest are scaled by 1 / (1 - rate), each layer with its own mask; the
    masks come from (seed, step, row), so another seed trains otherwise and a stopped and
    resumed run equals an uninterrupted one; DPO alike; GRPO draws new masks each iteration,
    the first's also its `old` log-probabilities' (every first ratio 1)."""
    import jax.numpy as jnp
    import optax

    from linnet.jax.dpo import dpo as jax_dpo
    from linnet.jax.grpo import grpo as jax_grpo
    from linnet.jax.lora import dropout
    from linnet.jax.train import train as jax_train

    x, key = jnp.ones((200, 50)), jnp.asarray([1, 2], dtype=jnp.uint32)
    up, down = (np.asarray(dropout(x, 0.3, key, f"model.layers.0.mlp.{p}_proj")) for p in ("up", "down"))
    assert abs((up == 0).mean() - 0.3) < 0.02 and np.allclose(up[up != 0], 1 / 0.7) and (up != down).any()
    np.testing.assert_array_equal(up, np.asarray(dropout(x, 0.3, key, "model.layers.0.mlp.up_proj")))

    rows = _rows(8, seed=4)
    adamw = optax.adamw(1e-2)  # one object: the runs share one compiled step

    def run(rate, seed, steps, ckpt=None):
        _, model = _pair(jx, {}, tmp_path)
        model.add_lora(["model.layers.*.self_attn.*_proj", "model.layers.*.mlp.*_proj"], rank=4, dropout=rate)
        return jax_train(model, rows, optimizer=adamw, steps=steps, accumulate=2, seed=seed, checkpoint=ckpt,
                         checkpoint_every=2)[1]

    straight, other = run(0.2, 0, 4), run(0.2, 1, 4)  # B starts at zero: the masks show from the second step
    assert other.losses[0] == pytest.approx(straight.losses[0], rel=1e-6) and other.losses[1:] != straight.losses[1:]
    run(0.2, 0, 2, tmp_path / "ckpt")  # the same run, stopped and resumed: the same masks
    rest = run(0.2, 0, 4, tmp_path / "ckpt")
    assert [s.step for s in rest.steps] == [3, 4] and rest.losses == straight.losses[2:]
    g = np.random.default_rng(6)  # DPO drops them too (its reference takes no dropout)
    pairs = [Pair(g.integers(3, 96, 4).tolist(), g.integers(3, 96, 3).tolist(), g.integers(3, 96, 4).tolist())
             for _ in range(8)]

    def preferred(rate, seed):
        _, model = _pair(jx, {}, tmp_path)
        model.add_lora(["model.layers.*.mlp.*_proj"], rank=4, dropout=rate)
        return jax_dpo(model, pairs, optimizer=adamw, steps=2, pairs_per_step=4, tokens=32, seed=seed)[1].losses

    assert preferred(0.3, 1)[1:] != preferred(0.3, 0)[1:]
    # GRPO: each iteration new masks, the first's also those of the `old` log-probabilities
    from linnet.jax.engine import Engine
    from linnet.jax.model import load_model
    from linnet.train.grpo import Prompt

    card = BASE.replace(vocab=16, eos_token_ids=(2,))
    prompts = [Prompt(g.integers(3, 16, size=3).tolist()) for _ in range(8)]

    def sampled(seed, iterations):  # with dropout 0.5 the policy's ratios would clip if `old` had other masks
        policy = load_model(card, weights="random", seed=1)
        policy.add_lora(["model.layers.*.mlp.*_proj"], rank=4, dropout=0.5)
        return jax_grpo(policy, Engine(load_model(card, weights="random", seed=1)), prompts,
                        lambda prompt, completion: sum(t == 7 for t in completion) / len(completion),
                        optimizer=optax.adamw(5e-2), steps=2, group=4, prompts_per_step=4, max_new_tokens=4,
                        tokens=64, iterations=iterations, seed=seed)[1]

    assert all(s.metrics["clip_fraction"] == 0 for s in sampled(0, 1).steps)  # the same masks: every ratio 1
