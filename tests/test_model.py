"""The torch decoder against transformers on tiny random models of every family."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from linnet import nest
from linnet.packing import Example, pack
from tests.conftest import make_hf_model

torch.set_num_threads(1)


def _tokens(seed=0, shape=(2, 23), vocab=97):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def test_logits_match_transformers(hf_dir):
    family, hf, directory = hf_dir
    model = nest.load(directory)
    tokens = _tokens()
    with torch.no_grad():
        ours = model(tokens)
        theirs = hf(tokens).logits
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() <= 1e-4, family


def test_card_reads_family_fields(hf_dir):
    family, hf, directory = hf_dir
    card = nest.resolve(directory)
    c = hf.config
    assert card.family == c.model_type
    assert (card.vocab, card.hidden, card.layers, card.heads, card.kv_heads) == (
        c.vocab_size, c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads)
    assert card.tied_embeddings == c.tie_word_embeddings
    assert card.qk_norm == (family == "qwen3")
    assert card.qkv_bias == (family in ("qwen2", "llama-tied-bias"))
    assert (card.rope_scaling is not None) == (family == "llama3-scaled")
    assert card.params() == sum(p.numel() for p in hf.parameters())


def test_save_weights_loads_back_into_transformers(hf_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    family, hf, directory = hf_dir
    model = nest.load(directory)
    with torch.no_grad():  # change the weights so a stale copy cannot pass
        model.model.norm.weight.mul_(1.5)
    out = tmp_path / "saved"
    model.save_weights(out)
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = _tokens(1)
    with torch.no_grad():
        assert (back(tokens).logits - model(tokens)).abs().max().item() <= 1e-4, family


def _documents(seed=3):
    g = np.random.default_rng(seed)
    return [g.integers(3, 97, size=n).tolist() for n in (7, 19, 4, 11)]


@pytest.mark.parametrize("attention", ["documents", "dense", "flex"])
def test_packed_row_equals_documents_alone(attention):
    docs = _documents()
    card = nest.resolve("debug")
    model = nest.load(card.replace(vocab=97), weights="random", attention=attention, seed=1)
    (row,) = pack([Example.prompted(d[:3], d[3:]) for d in docs], tokens=48)
    assert row.examples == len(docs) and row.real == sum(map(len, docs))
    with torch.no_grad():
        total, count = model.loss_packed(row)
        alone = []
        for d in docs:
            logp = torch.log_softmax(model(torch.tensor(d))[:-1], -1)
            alone.append(-logp.gather(-1, torch.tensor(d[1:])[:, None])[2:].sum())
        assert count.item() == sum(len(d) - 3 for d in docs)
        assert torch.allclose(total, torch.stack(alone).sum(), rtol=1e-5)


def test_log_probs_packed_equal_transformers_per_document(tmp_path):
    hf = make_hf_model("llama3-scaled")
    hf.save_pretrained(tmp_path)
    model = nest.load(tmp_path)
    docs = _documents(5)
    (row,) = pack([Example.plain(d) for d in docs], tokens=64)
    with torch.no_grad():
        ours = model.log_probs_packed(row)
        for (s, e), d in zip(zip(row.bounds[:-1], row.bounds[1:]), docs):
            logp = torch.log_softmax(hf(torch.tensor([d])).logits[0, :-1], -1)
            theirs = logp.gather(-1, torch.tensor(d[1:])[:, None])[:, 0]
            assert (ours[s : e - 1] - theirs).abs().max().item() <= 1e-5


def test_packed_gradients_do_not_leak_across_documents():
    model = nest.load("debug", weights="random", trainable=True)
    docs = _documents(7)
    (row,) = pack([Example.plain(d) for d in docs], tokens=48)
    embeds = []

    def keep_embeddings(module, args, out):
        out.retain_grad()
        embeds.append(out)

    block0 = model.model.layers[0]
    handle = block0.input_layernorm.register_forward_hook(keep_embeddings)
    logp = model.log_probs_packed(row)
    handle.remove()
    s1, e1 = int(row.bounds[1]), int(row.bounds[2])
    logp[e1 - 2].backward()  # the last learned position of the second document
    grad = embeds[0].grad.abs().sum(-1)
    assert grad[s1:e1].sum() > 0
    assert grad[:s1].sum() == 0 and grad[e1:].sum() == 0


def test_padding_is_not_computed():
    """A row's trailing padding never enters the layers; the entries keep the row's shape."""
    model = nest.load("debug", weights="random")
    docs = _documents(7)
    (row,) = pack([Example.plain(d) for d in docs], tokens=64)
    (full,) = pack([Example.plain(d) for d in docs], tokens=row.real)
    assert row.real < 64 and full.real == len(full.tokens)
    seen = []
    handle = model.model.layers[0].register_forward_hook(lambda m, args, out: seen.append(out.shape[0]))
    with torch.no_grad():
        padded, unpadded = model.log_probs_packed(row), model.log_probs_packed(full)
        hidden = model.hidden_packed(row)
    handle.remove()
    assert seen[0] == row.real and padded.shape == (64,) and hidden.shape[0] == 64
    assert torch.equal(padded[: row.real], unpadded) and not padded[row.real :].any()
    assert not hidden[row.real :].any()


@pytest.mark.parametrize("attention", ["documents", "dense", "flex"])
def test_shared_prompts_give_the_same_log_probs_and_gradients(attention):
    """Completions attending to one copy of their prompt: each learned position's
    log-probability and the weights' gradient equal those of prompt + completion rows."""
    from linnet.packing import pack_prompted

    g = np.random.default_rng(11)
    groups = [(g.integers(3, 97, size=n).tolist(), [g.integers(3, 97, size=m).tolist() for m in ms])
              for n, ms in ((9, (4, 7, 1)), (1, (5, 2)), (2, (3,)), (13, (6, 6)))]
    train = attention != "flex"  # flex has no backward on CPU
    model = nest.load(nest.resolve("debug").replace(vocab=97), weights="random", attention=attention,
                      trainable=train, seed=4)
    results = []
    for share in (True, False):
        (row,) = pack_prompted(groups, tokens=128, share=share)
        assert row.examples == 8 and (row.prefix is not None) == share
        model.zero_grad()
        with torch.set_grad_enabled(train):
            logp = model.log_probs_packed(row)
        learned = logp[torch.as_tensor(np.flatnonzero(row.weights > 0))]
        if train:
            (learned * torch.linspace(0.5, 1.5, len(learned))).sum().backward()
        grad = model.model.layers[0].self_attn.k_proj.weight.grad
        results.append((learned.detach(), None if grad is None else grad.clone()))
    (shared, g_shared), (alone, g_alone) = results
    assert len(shared) == sum(len(c) for _, cs in groups for c in cs)
    torch.testing.assert_close(shared, alone, rtol=1e-5, atol=1e-5)
    if train:
        torch.testing.assert_close(g_shared, g_alone, rtol=1e-4, atol=1e-6)


def test_head_runs_on_learned_positions_only(monkeypatch):
    """A prompted row: the head and the last block's MLP see only the positions with a
    weight, and the loss, the learned log-probabilities, the gradients and the hidden
    states there (with activation checkpointing too) equal those over every position."""
    from linnet.packing import pack_prompted
    from linnet.torch.model import Decoder

    g = np.random.default_rng(5)
    groups = [(g.integers(3, 97, size=n).tolist(), [g.integers(3, 97, size=m).tolist() for m in (3, 4)])
              for n in (12, 20, 9)]
    (row,) = pack_prompted(groups, tokens=96, share=True)
    learned = np.flatnonzero(row.weights > 0)
    model = nest.load(nest.resolve("debug").replace(vocab=97), weights="random", trainable=True, seed=2)
    import linnet.torch.model as decoder_module

    head_rows, mlp_rows = [], []
    model.model.layers[-1].mlp.register_forward_hook(lambda m, args, out: mlp_rows.append(len(args[0])))
    for name in ("linear_cross_entropy", "linear_token_log_probs"):
        real = getattr(decoder_module, name)
        monkeypatch.setattr(decoder_module, name, lambda h, *a, real=real, **k: head_rows.append(len(h)) or real(h, *a, **k))
    results = []
    for selected in (True, False):
        if not selected:
            monkeypatch.setattr(Decoder, "_learned", lambda self, batch, n: None)
        model.zero_grad()
        loss, count = model.loss_packed(row)
        logp = model.log_probs_packed(row)
        (loss + (logp[learned] * torch.linspace(0.5, 1.5, len(learned))).sum()).backward()
        grad = model.model.layers[0].mlp.up_proj.weight.grad.clone()
        results.append((loss.detach(), count, logp.detach()[learned], grad))
    assert len(learned) < 0.9 * row.real and head_rows == [len(learned)] * 2 + [row.real] * 2
    assert mlp_rows == head_rows
    (loss_a, n_a, lp_a, g_a), (loss_b, n_b, lp_b, g_b) = results
    assert n_a == n_b == len(learned)
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lp_a, lp_b, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(g_a, g_b, rtol=1e-5, atol=1e-7)
    for mode in (False, True):  # recomputation runs with gradients on
        model.checkpoint_activations(mode)
        at = model.hidden_packed(row, at=learned)
        at.sum().backward()
        torch.testing.assert_close(at.detach(), model.hidden_packed(row)[learned].detach(), rtol=1e-5, atol=1e-6)


def test_trainable_patterns_and_master_dtype():
    model = nest.load("debug", weights="random", dtype="bfloat16", trainable=["model.layers.*.mlp.*"])
    for name, p in model.named_parameters():
        if ".mlp." in name:
            assert p.requires_grad and p.dtype == torch.float32
        else:
            assert not p.requires_grad and p.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="matches no parameter"):
        model.set_trainable(["model.layers.*.mpl.*"])


def test_random_init_is_seeded():
    a = nest.load("debug", weights="random", seed=3)
    b = nest.load("debug", weights="random", seed=3)
    c = nest.load("debug", weights="random", seed=4)
    wa, wb, wc = (m.model.layers[1].mlp.up_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)


def test_sharded_checkpoint_loads(tmp_path):
    hf = make_hf_model("llama")
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    model = nest.load(tmp_path)
    tokens = _tokens(2)
    with torch.no_grad():
        assert (model(tokens) - hf(tokens).logits).abs().max().item() <= 1e-4


def test_equal_documents_batched_attention_matches_dense():
    """Rows of equal documents take one batched SDPA call; it must equal the mask path."""
    from linnet.torch import attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 24, 8, generator=g) for h in (4, 2, 2))
    bounds = [0, 6, 12, 18, 24]
    torch.testing.assert_close(attention.documents(q, k, v, bounds), attention.dense(q, k, v, bounds))
    uneven = [0, 5, 12, 18, 24]
    torch.testing.assert_close(attention.documents(q, k, v, uneven), attention.dense(q, k, v, uneven))


def test_flex_builds_one_block_mask_a_row():
    from linnet.torch import attention

    attention._flex_mask.cache_clear()
    model = nest.load("debug", weights="random", attention="flex")
    (row,) = pack([Example.plain(d) for d in _documents(9)], tokens=48)
    with torch.no_grad():
        model.loss_packed(row)
    info = attention._flex_mask.cache_info()
    assert model.card.layers > 1 and (info.misses, info.hits) == (1, model.card.layers - 1)


def test_documents_attention_runs_low_precision_in_f32_on_cpu():
    from linnet.torch import attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 40, 16, generator=g) for h in (4, 2, 2))
    bounds = [0, 9, 30, 40]
    low = attention.documents(q.bfloat16(), k.bfloat16(), v.bfloat16(), bounds)
    assert low.dtype == torch.bfloat16
    assert torch.equal(low, attention.documents(q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(),
                                                bounds).bfloat16())


def test_varlen_is_called_as_each_torch_version_spells_causal_attention(monkeypatch):
    """varlen_attn's keywords moved between torch versions (2.10: is_causal; 2.11: window_size;
    2.13: enable_gqa before fewer key/value heads are taken): the call takes what this torch
    has, and "auto" on CUDA falls back to the per-document path where torch has no varlen."""
    from linnet.torch import attention

    def v210(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, return_aux=None): ...
    def v211(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)): ...
    def v213(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False): ...

    assert attention.varlen_causal(v210, gqa=True) == {"is_causal": True}
    assert attention.varlen_causal(v211, gqa=True) == {"window_size": (-1, 0)}
    assert attention.varlen_causal(v213, gqa=True) == {"window_size": (-1, 0), "enable_gqa": True}
    cuda = torch.device("cuda")
    monkeypatch.setattr(attention, "has_varlen", lambda: True)
    assert attention.choose("auto", cuda) is attention.varlen
    monkeypatch.setattr(attention, "has_varlen", lambda: False)
    assert attention.choose("auto", cuda) is attention.documents
    with pytest.raises(ValueError, match="attention='varlen' needs torch 2.10 or later"):
        attention.choose("varlen", cuda)
