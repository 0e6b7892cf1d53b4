"""The CUDA-only paths (skipped without a GPU; bench/gpu_check.py runs them on one):
varlen attention against the per-document path, the pinned-memory loader, bf16 training,
compiled blocks against eager ones, offloaded checkpointing, packed decentralized training, fully_shard over NCCL
in one process (an NF4 base loaded on the CPU too), the context-parallel ring's blocks,
the compiled engine (CUDA graphs) against the eager one."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from linnet import nest
from linnet.packing import Example, pack
from linnet.train import train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CARD = nest.resolve("debug").replace(vocab=256, hidden=128, intermediate=256, heads=4, kv_heads=2, head_dim=32)


def _rows(n=12, tokens=256, seed=0):
    g = np.random.default_rng(seed)
    examples = [Example.prompted(g.integers(3, 256, size=int(g.integers(4, 30))).tolist(),
                                 g.integers(3, 256, size=int(g.integers(4, 40))).tolist()) for _ in range(n)]
    return list(pack(examples, tokens))


def test_varlen_attention_equals_the_per_document_path():
    rows = _rows()
    for dtype, tol in (("float32", 1e-4), ("bfloat16", 3e-2)):
        a = nest.load(CARD, device="cuda", dtype=dtype, weights="random", attention="documents")
        b = nest.load(CARD, device="cuda", dtype=dtype, weights="random", attention="varlen")
        for row in rows:
            torch.testing.assert_close(b.log_probs_packed(row), a.log_probs_packed(row), atol=tol, rtol=tol)


def test_offloaded_checkpointing_keeps_the_blocks_inputs_off_the_gpu():
    """activation_checkpointing='offload': the loss and gradients of full checkpointing, and
    a lower peak of GPU memory over one long row (each block's input waits in host memory)."""
    card = CARD.replace(layers=8, hidden=256, intermediate=512, heads=4, kv_heads=2, head_dim=64)
    row = _rows(n=120, tokens=4096)[0]
    results = {}
    for mode in ("full", "offload"):
        model = nest.load(card, device="cuda", weights="random", trainable=True, activation_checkpointing=mode)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        loss, _ = model.loss_packed(row)
        loss.backward()
        torch.cuda.synchronize()
        results[mode] = (loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()},
                         torch.cuda.max_memory_allocated() - before)
    (full, grads, peak), (offloaded, offloaded_grads, offloaded_peak) = results["full"], results["offload"]
    assert offloaded == pytest.approx(full, rel=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(offloaded_grads[name], grad, atol=1e-5, rtol=1e-5, msg=name)
    assert offloaded_peak < peak


def test_the_pinned_loader_hands_the_cpu_loaders_batches_to_the_gpu(tmp_path):
    from linnet.pretrain.loader import Rows

    x = np.random.default_rng(0).integers(0, 256, size=(4, 65))
    cpu, gpu = Rows(64).from_array(x), Rows(64, device="cuda").from_array(x)
    assert gpu.tokens.device.type == "cuda" and torch.equal(gpu.tokens.cpu(), torch.as_tensor(cpu.tokens))
    assert torch.equal(gpu.targets.cpu(), torch.as_tensor(cpu.targets))


def test_bf16_training_learns_and_compiled_blocks_match_eager():
    rows = _rows(24)
    losses = {}
    for compile_ in (False, "inductor"):
        model = nest.load(CARD, device="cuda", dtype="bfloat16", weights="random", trainable=True, seed=0,
                          compile=compile_)
        history = train(model, rows * 3, optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3), steps=8)
        losses[compile_] = [s.loss for s in history.steps]
    assert losses[False][-1] < losses[False][0]
    np.testing.assert_allclose(losses["inductor"], losses[False], rtol=2e-2)


def test_packed_decentralized_workers_train_on_the_gpu():
    from linnet.config import PretrainConfig, load
    from linnet.pretrain.decentralized import PackedLlama, local_mean_losses
    from linnet.pretrain.decentralized_optimizer import PackedAdamW

    config = load(PretrainConfig, None, ["training.accumulation=1", "decentralized.num_models=4",
                                         "decentralized.topology=one_peer_ring"])
    model = PackedLlama(CARD, 4, seed=0).to("cuda")
    optimizer = PackedAdamW(model, config)
    x = torch.randint(0, CARD.vocab, (4, 2, 65), device="cuda")
    first = None
    for _ in range(5):
        loss = local_mean_losses(model, x[..., :-1], x[..., 1:])
        loss.sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        first = float(loss.sum()) if first is None else first
    assert float(loss.sum()) < first and model.consensus_distance() > 0


@contextlib.contextmanager
def _nccl_group_of_one():
    import os
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        os.environ.setdefault("LOCAL_RANK", "0")
        yield
    finally:
        dist.destroy_process_group()


def test_fully_shard_over_nccl_in_one_process():
    from linnet.torch.sharding import fully_shard

    with _nccl_group_of_one():
        model = nest.load(CARD, device="cuda", dtype="bfloat16", weights="random", trainable=True, seed=0)
        fully_shard(model)
        history = train(model, _rows(8) * 2, optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3), steps=4)
        assert all(np.isfinite(s.loss) for s in history.steps)


def test_the_rings_blocks_on_the_gpu_equal_the_whole_rows_attention():
    """linnet.torch.context on a GPU (float32 scores, a tile of queries at a time) over a
    group of one: the whole row's attention within its documents and its gradients."""
    import torch.distributed as dist

    from linnet.packing import segments
    from linnet.torch.context import ring_attention
    from tests.test_context_parallel import BOUNDS, P, _inputs, _whole

    q, k, v, weight = _inputs()
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    (_whole(*whole, segments(BOUNDS)) * weight).sum().backward()
    with _nccl_group_of_one():
        local = [t.cuda().requires_grad_() for t in (q, k, v)]
        document = torch.as_tensor(segments(BOUNDS), device="cuda")
        out = ring_attention(*local, torch.arange(P, device="cuda"), document, dist.group.WORLD)
        (out * weight.cuda()).sum().backward()
    torch.testing.assert_close(out.detach().cpu(), _whole(q, k, v, segments(BOUNDS)), atol=1e-5, rtol=0)
    for got, want in zip(local, whole, strict=True):
        torch.testing.assert_close(got.grad.cpu(), want.grad, atol=1e-5, rtol=0)


def test_an_nf4_model_loaded_on_the_cpu_is_split_onto_the_gpu():
    """fully_shard moves an NF4 base's codes and their quantization state to the GPU: a model
    too large for one GPU whole loads on the CPU and is split onto the GPUs."""
    pytest.importorskip("bitsandbytes", reason="quantize='nf4' needs bitsandbytes")
    from linnet.torch.sharding import fully_shard

    row = _rows(1)[0]
    with _nccl_group_of_one():
        model = nest.load(CARD, quantize="nf4", dtype="float32", weights="random", seed=0)
        model.add_lora("*_proj", rank=4)
        fully_shard(model)
        layer = model.model.layers[0].mlp.up_proj
        assert layer.weight.device.type == layer.quant_state.absmax.device.type == layer.lora_a.device.type == "cuda"
        loss, n = model.loss_packed(row)
    whole = nest.load(CARD, device="cuda", quantize="nf4", dtype="float32", weights="random", seed=0)
    whole.add_lora("*_proj", rank=4)
    assert loss.item() / n == pytest.approx(whole.loss_packed(row)[0].item() / n, rel=1e-3)


def test_an_nf4_model_with_adapters_loads_sharded_on_the_gpu():
    """nest.load(quantize="nf4", lora=, fully_shard=True) on the GPU: each weight quantized
    there as it arrives (bitsandbytes' CUDA kernels), its codes split, the adapters drawn after:
    the loss of a whole model given the same adapters."""
    pytest.importorskip("bitsandbytes", reason="quantize='nf4' needs bitsandbytes")
    row = _rows(1)[0]
    adapters = dict(patterns="*_proj", rank=4)
    with _nccl_group_of_one():
        torch.manual_seed(0)
        model = nest.load(CARD, device="cuda", quantize="nf4", dtype="float32", weights="random", seed=0,
                          lora=adapters, fully_shard=True)
        layer = model.model.layers[0].mlp.up_proj
        assert layer.quant_state.absmax.device.type == layer.lora_a.device.type == "cuda"
        loss, n = model.loss_packed(row)
    torch.manual_seed(0)
    whole = nest.load(CARD, device="cuda", quantize="nf4", dtype="float32", weights="random", seed=0, lora=adapters)
    assert loss.item() / n == pytest.approx(whole.loss_packed(row)[0].item() / n, rel=1e-5)


def test_compiled_engine_with_cuda_graphs_equals_eager():
    """The engine's compiled passes (decode captured as CUDA graphs) against the eager ones:
    the same greedy and seeded tokens, log-probabilities within 1e-5 in f32, with rows
    stopping between the 8-step stop checks."""
    import warnings

    from linnet.serve import Engine

    g = np.random.default_rng(1)
    prompts = [g.integers(3, 256, size=n).tolist() for n in (5, 17, 9, 30)]
    eager = Engine(nest.load(CARD, device="cuda", weights="random", seed=0))
    compiled = Engine(nest.load(CARD, device="cuda", weights="random", seed=0), compile=True)
    assert compiled.stop_every == 8
    full = eager.sample(prompts, n=4, max_new_tokens=24, temperature=0.0, stop=())
    stop = full[5].tokens[3]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback to eager warns
        compiled.warmup([len(p) for p in prompts], n=4)
        for kw in (dict(temperature=0.0, stop=()), dict(temperature=0.0, stop=[stop]), dict(stop=[stop], seed=3)):
            a = eager.sample(prompts, n=4, max_new_tokens=24, **kw)
            b = compiled.sample(prompts, n=4, max_new_tokens=24, **kw)
            assert [(c.tokens, c.stopped) for c in b] == [(c.tokens, c.stopped) for c in a]
            for x, y in zip(a, b):
                torch.testing.assert_close(y.logprobs, x.logprobs, atol=1e-5, rtol=0)
    assert compiled.compiled
