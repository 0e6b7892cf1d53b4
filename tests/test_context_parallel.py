"""Context parallelism: a packed row's positions split across gloo processes, attention as a
ring (linnet.torch.context), against the whole row's attention on one process."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from linnet.packing import segments, shard_positions
from linnet.torch import context
from linnet.torch.context import ring_attention
from tests.conftest import in_processes, same_metrics

BOUNDS = [0, 3, 23, 27, 32]  # four documents; the second longer than any process's share
H, K, D, P = 4, 2, 8, 32


def _whole(q, k, v, document):
    """The row's causal attention within documents, computed whole in float64."""
    index = torch.arange(q.shape[1])
    doc = torch.as_tensor(document)
    visible = (doc[:, None] == doc[None, :]) & (index[None, :] <= index[:, None])
    s = q.double() @ k.double().repeat_interleave(H // K, 0).transpose(-1, -2) / D ** 0.5
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), -1)
    return (p @ v.double().repeat_interleave(H // K, 0)).float()


def _inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(n, P, D, generator=g) for n in (H, K, K)] + [torch.randn(H, P, D, generator=g)]


def _ring_rank(rank, processes, bounds):
    import torch.distributed as dist

    q, k, v, weight = _inputs()
    mine = torch.as_tensor(shard_positions(P, processes, rank))
    document = torch.as_tensor(segments(bounds))
    local = [t[:, mine].clone().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*local, mine, document[mine], dist.group.WORLD)
    (out * weight[:, mine]).sum().backward()
    return mine.numpy(), out.detach().numpy(), [t.grad.numpy() for t in local]


def test_shards_cover_the_row_once_with_equal_causal_work():
    for ranks in (1, 2, 4):
        shards = [shard_positions(64, ranks, r) for r in range(ranks)]
        assert sorted(np.concatenate(shards).tolist()) == list(range(64))
        assert len({int((s + 1).sum()) for s in shards}) == 1  # keys each shard's queries see
    with pytest.raises(ValueError, match="multiple of 8"):
        shard_positions(60, 4, 0)


@pytest.mark.parametrize("processes, score_bytes, fused, bounds", [
    (2, None, True, BOUNDS), (4, None, True, BOUNDS), (2, 400, True, BOUNDS), (2, None, False, BOUNDS),
    (4, 400, False, BOUNDS), (2, None, True, [0, P]), (4, None, True, [0, P])])
def test_ring_attention_equals_the_whole_rows_attention_and_its_gradients(processes, score_bytes, fused, bounds,
                                                                          monkeypatch):
    """2 and 4 processes, each block whole, or a few queries at a time (a mask or scores of
    400 bytes), through the CPU's fused kernel or float32 scores (what other devices run),
    four documents in the row or one (whose chunks need no mask: the kernel's causal and
    unmasked calls), against the whole row in float64."""
    if score_bytes is not None:
        monkeypatch.setattr(context, "SCORE_BYTES", score_bytes)  # the forked processes inherit it
    if not fused:
        monkeypatch.setattr(context, "FUSED_DEVICES", ())
    q, k, v, weight = _inputs()
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    out = _whole(*whole, segments(bounds))
    (out * weight).sum().backward()
    for mine, ring_out, grads in in_processes(_ring_rank, processes, bounds, processes=processes):
        np.testing.assert_allclose(ring_out, out.detach().numpy()[:, mine], atol=1e-5, rtol=0)
        for got, t in zip(grads, whole, strict=True):
            np.testing.assert_allclose(got, t.grad.numpy()[:, mine], atol=1e-5, rtol=0)


def _model_rank(rank, processes, checkpointing):
    from torch.distributed.device_mesh import init_device_mesh

    model = _debug_model(checkpointing)
    model.split_context(init_device_mesh("cpu", (processes,), mesh_dim_names=("context",)))
    (row,) = _rows()
    total, count = model.loss_packed(row)
    logp = model.log_probs_packed(row)
    (total + (logp * _ramp(row)).sum()).backward()
    with torch.no_grad():
        hidden = model.hidden_packed(row)
    return (float(total), float(count), logp.detach().numpy(), hidden.numpy(),
            {n: p.grad.numpy() for n, p in model.named_parameters()})


def _ramp(row):
    """A weight for each learned position's log-probability (the others' are meaningless)."""
    return torch.linspace(0, 1, len(row.tokens)) * torch.as_tensor(row.weights > 0)


def _debug_model(checkpointing):
    from linnet import nest

    card = nest.resolve("debug").replace(vocab=96, hidden=32, intermediate=64, heads=4, kv_heads=2, head_dim=8)
    return nest.load(card, weights="random", seed=1, trainable=True, activation_checkpointing=checkpointing)


def _rows():
    """One row of 48 positions: documents of 5, 30 and 9 tokens and padding, prompts unlearned."""
    from linnet.packing import Example, pack

    g = np.random.default_rng(0)
    docs = [Example.prompted(g.integers(3, 96, 2).tolist(), g.integers(3, 96, n - 2).tolist()) for n in (5, 30, 9)]
    return list(pack(docs, tokens=48))


def _prompted_row():
    """Two prompts, each once, with three and two completions that see it (`Packed.prefix`)."""
    from linnet.packing import pack_prompted

    g = np.random.default_rng(1)
    groups = [(g.integers(3, 96, 7).tolist(), [g.integers(3, 96, n).tolist() for n in (4, 9, 3)]),
              (g.integers(3, 96, 5).tolist(), [g.integers(3, 96, n).tolist() for n in (6, 2)])]
    (row,) = pack_prompted(groups, tokens=48)
    assert row.prefix is not None and (np.asarray(row.prefix) >= 0).sum() == 5
    return row


def _prompted_rank(rank, processes):
    from torch.distributed.device_mesh import init_device_mesh

    model = _debug_model(False)
    model.split_context(init_device_mesh("cpu", (processes,), mesh_dim_names=("context",)))
    assert model.shares_prompts
    logp = model.log_probs_packed(_prompted_row())
    (logp * _ramp(_prompted_row())).sum().backward()
    return logp.detach().numpy(), {n: p.grad.numpy() for n, p in model.named_parameters()}


@pytest.mark.parametrize("processes", [2, 4])
def test_rows_whose_completions_share_their_prompt_split_over_the_ring(processes):
    """A row packed with shared prompts (GRPO's and DPO's groups): each completion's queries
    see its prompt's keys across the ring; the log-probabilities and gradients of one
    process taking the row whole."""
    model, row = _debug_model(False), _prompted_row()
    assert model.shares_prompts
    logp = model.log_probs_packed(row)
    (logp * _ramp(row)).sum().backward()
    learned = np.asarray(row.weights) > 0
    for got, grads in in_processes(_prompted_rank, processes, processes=processes):
        np.testing.assert_allclose(got[learned], logp.detach().numpy()[learned], atol=1e-5, rtol=0)
        for name, p in model.named_parameters():
            np.testing.assert_allclose(grads[name], p.grad.numpy(), atol=1e-5, rtol=1e-5, err_msg=name)


@pytest.mark.parametrize("processes, checkpointing", [(2, False), (4, "full")])
def test_a_context_parallel_decoder_gives_the_rows_results_and_gradients(processes, checkpointing):
    """A debug decoder's row split across 2 and 4 processes: every process gets the whole
    row's loss, count, log-probabilities and hidden states, and the gradients of a loss
    built from them equal one process's, to 1e-5."""
    model = _debug_model(checkpointing)
    (row,) = _rows()
    total, count = model.loss_packed(row)
    logp = model.log_probs_packed(row)
    (total + (logp * _ramp(row)).sum()).backward()
    with torch.no_grad():
        hidden = model.hidden_packed(row).numpy()
    for got_total, got_count, got_logp, got_hidden, grads in in_processes(_model_rank, processes, checkpointing,
                                                                          processes=processes):
        assert got_count == float(count)
        assert got_total == pytest.approx(float(total.detach()), rel=1e-5)
        learned = row.weights > 0
        np.testing.assert_allclose(got_logp[learned], logp.detach().numpy()[learned], atol=1e-5)
        np.testing.assert_allclose(got_hidden[:row.real], hidden[:row.real], atol=1e-5)
        for name, p in model.named_parameters():
            np.testing.assert_allclose(grads[name], p.grad.numpy(), atol=1e-5, rtol=1e-5, err_msg=name)


@pytest.mark.parametrize("shard", ["none", "zero", "fsdp"])
def test_linnet_sft_with_context_2_in_4_processes_takes_one_process_steps(tmp_path, shard):
    """`linnet sft` with training.context=2 in 4 processes (two copies, each row split over
    two of them; the optimizer's states whole or split over all four, or every state
    sharded over all four: CP x FSDP) takes the steps of one process with twice the rows:
    the same losses, held-out losses and final weights, written once."""
    import json

    from safetensors.torch import load_file

    from linnet.commands import quickstart
    from linnet.commands.sft import run
    from linnet.config import SFTConfig, load
    from tests.conftest import quickstart_model
    from tests.test_sft import _sft_process

    quickstart_model(tmp_path / "model")
    rows = quickstart.problems(np.random.default_rng(0), 120, 2)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"prompt": p, "completion": a}) + "\n" for p, a in rows))
    common = [f"model.card={tmp_path / 'model'}", f"data.path={tmp_path / 'train.jsonl'}", "data.chat=false",
              "training.context_length=64", "data.eval_share=0.1", "lora.enabled=false", "optimizer.lr=3e-3",
              "lr_schedule.warmup_steps=1", "evaluation.every=2", "training.steps=3"]
    four = common + [f"runtime.output_dir={tmp_path / 'four'}", "training.context=2", f"training.shard={shard}"]
    assert in_processes(_sft_process, four, processes=4) == [0] * 4
    run(load(SFTConfig, None, common + [f"runtime.output_dir={tmp_path / 'one'}", "training.accumulation=2"]))
    same_metrics(tmp_path / "four", tmp_path / "one", ("loss", "grad_norm", "held_out_loss", "learned"), steps=3,
                 rel=1e-5)
    x, y = (load_file(str(tmp_path / d / "final" / "model.safetensors")) for d in ("four", "one"))
    for key in y:  # AdamW magnifies rounding where a gradient is tiny (the ring sums its blocks in another order)
        torch.testing.assert_close(x[key], y[key], atol=5e-5, rtol=0, msg=lambda m, key=key: f"{key}: {m}")


def test_context_settings_are_checked_before_anything_runs():
    from linnet.config import SFTConfig, load
    from linnet.config.groups import TrainingConfig

    with pytest.raises(ValueError, match="does not cut into 8 equal chunks"):
        load(SFTConfig, None, ["training.context=4", "training.context_length=100"])
    TrainingConfig(context=2, split=2)  # a split, each row over two of them
    TrainingConfig(context=2, split=2, shard="fsdp")  # its parts sharded over the copies and the context group
    TrainingConfig(context=2, split=2, sequence_parallel=True)  # its norms on a share of each process's positions
    TrainingConfig(context=2, pipeline=2)  # each stage's row over two processes
