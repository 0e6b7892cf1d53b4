"""Two processes (gloo, forked) train like one process over both their batches."""

from __future__ import annotations

import multiprocessing
import socket

import numpy as np
import torch
import torch.distributed as dist

from linnet import nest
from linnet.packing import Example, pack
from linnet.train import train

CARD = nest.resolve("debug").replace(vocab=64, hidden=32, intermediate=64, heads=4, kv_heads=2, head_dim=8)


def _batches():
    g = np.random.default_rng(0)
    docs = [Example.prompted(g.integers(3, 64, 4).tolist(), g.integers(3, 64, int(n)).tolist())
            for n in g.integers(1, 12, size=12)]
    rows = list(pack(docs, tokens=40))
    assert len({r.learned for r in rows[:2]}) == 2  # the processes' counts differ
    return rows[:2]


def _train(batches, accumulate):
    model = nest.load(CARD, weights="random", seed=0, trainable=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    history = train(model, batches, optimizer=opt, steps=1, accumulate=accumulate, clip=0.5)
    return history.steps[0], {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def _worker(rank, port, queue):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        step, params = _train([_batches()[rank]], accumulate=1)
        queue.put((rank, step.loss, step.learned, step.grad_norm, params))
    finally:
        dist.destroy_process_group()


def test_two_processes_equal_one_process_over_both_batches():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    workers = [ctx.Process(target=_worker, args=(rank, port, queue)) for rank in range(2)]
    for w in workers:
        w.start()
    results = sorted(queue.get(timeout=120) for _ in workers)
    for w in workers:
        w.join(timeout=60)
        assert w.exitcode == 0
    step, params = _train(_batches(), accumulate=2)
    for _rank, loss, learned, norm, rank_params in results:
        assert learned == step.learned
        assert abs(loss - step.loss) < 1e-6 and abs(norm - step.grad_norm) < 1e-5
        for name, value in params.items():
            np.testing.assert_allclose(rank_params[name], value, atol=1e-6, rtol=0, err_msg=name)
