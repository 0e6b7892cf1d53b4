"""Two processes (gloo, forked) train like one process over both their batches, with
the optimizer whole on each or split across them (ZeroRedundancyOptimizer)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

from linnet import nest
from linnet.packing import Example, pack
from linnet.train import train
from tests.conftest import in_processes

CARD = nest.resolve("debug").replace(vocab=64, hidden=32, intermediate=64, heads=4, kv_heads=2, head_dim=8)


def _batches(n=2):
    g = np.random.default_rng(0)
    docs = [Example.prompted(g.integers(3, 64, 4).tolist(), g.integers(3, 64, int(n)).tolist())
            for n in g.integers(1, 12, size=12 * n)]
    rows = list(pack(docs, tokens=40))[:n]
    assert len({r.learned for r in rows[:2]}) == 2  # the processes' counts differ
    return rows


def _train(batches, accumulate):
    model = nest.load(CARD, weights="random", seed=0, trainable=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    history = train(model, batches, optimizer=opt, steps=1, accumulate=accumulate, clip=0.5)
    return history.steps[0], {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def _one_batch_each(rank):
    step, params = _train([_batches()[rank]], accumulate=1)
    return step.loss, step.learned, step.grad_norm, params


def test_two_processes_equal_one_process_over_both_batches():
    step, params = _train(_batches(), accumulate=2)
    for loss, learned, norm, rank_params in in_processes(_one_batch_each):
        assert learned == step.learned
        assert abs(loss - step.loss) < 1e-6 and abs(norm - step.grad_norm) < 1e-5
        for name, value in params.items():
            np.testing.assert_allclose(rank_params[name], value, atol=1e-6, rtol=0, err_msg=name)


def _adamw(model, zero: bool):
    params = list(model.parameters())
    if zero:
        return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _zero_run(rank, checkpoint, steps):
    model = nest.load(CARD, weights="random", seed=0, trainable=True)
    history = train(model, _batches(8)[rank::2], optimizer=_adamw(model, zero=True), steps=steps, clip=0.5,
                    checkpoint=checkpoint, checkpoint_every=2)
    return [(s.loss, s.grad_norm) for s in history.steps]


def test_zero_redundancy_optimizer_trains_and_resumes_like_one_process(tmp_path):
    """The optimizer state split across two processes: the same steps as AdamW whole in
    one process, and a run stopped at step 2 resumes to the same steps 3 and 4."""
    model = nest.load(CARD, weights="random", seed=0, trainable=True)
    whole = train(model, _batches(8), optimizer=_adamw(model, zero=False), steps=4, accumulate=2, clip=0.5)
    straight = in_processes(_zero_run, tmp_path / "straight", 4)[0]
    in_processes(_zero_run, tmp_path / "resumed", 2)
    resumed = in_processes(_zero_run, tmp_path / "resumed", 4)[0]
    assert [round(n, 5) for _, n in straight] == [round(s.grad_norm, 5) for s in whole.steps]
    assert [loss for loss, _ in straight] == pytest.approx(whole.losses, rel=1e-6)
    assert [x for step in resumed for x in step] == pytest.approx([x for step in straight[2:] for x in step], rel=1e-6)


# matrices of at least 4096 values: bitsandbytes keeps smaller tensors' moments in float32
CARD_8BIT = CARD.replace(vocab=128, hidden=64, intermediate=128, head_dim=16)


def _eight_bit_states(optimizer) -> int:
    return sum(s["state1"].dtype == torch.uint8 for s in optimizer.state.values())


def _eight_bit_run(rank, checkpoint, steps):
    from linnet.train.optimizer import adamw

    model = nest.load(CARD_8BIT, weights="random", seed=0, trainable=True)
    optimizer = adamw(model, lr=1e-2, weight_decay=0.1, kind="adamw8bit", shard="zero")
    history = train(model, _batches(8)[rank::2], optimizer=optimizer, steps=steps, clip=0.5,
                    checkpoint=checkpoint, checkpoint_every=2)
    return [(s.loss, s.grad_norm) for s in history.steps], _eight_bit_states(optimizer.optim)


def test_eight_bit_states_split_by_zero_train_and_resume_like_one_process(tmp_path):
    """8-bit AdamW states split across two processes (each parameter's whole on one, so
    its quantization blocks are one process's): the steps of 8-bit AdamW whole in one
    process, and a run stopped at step 2 resumes to the same steps 3 and 4 (the 8-bit
    states nested in the checkpoint reach each process's optimizer taken apart)."""
    pytest.importorskip("bitsandbytes", reason="8-bit AdamW needs bitsandbytes (the qlora extra)")
    from linnet.train.optimizer import adamw

    model = nest.load(CARD_8BIT, weights="random", seed=0, trainable=True)
    optimizer = adamw(model, lr=1e-2, weight_decay=0.1, kind="adamw8bit")
    whole = train(model, _batches(8), optimizer=optimizer, steps=4, accumulate=2, clip=0.5)
    whole_8bit = _eight_bit_states(optimizer)
    straight = in_processes(_eight_bit_run, tmp_path / "straight", 4)
    in_processes(_eight_bit_run, tmp_path / "resumed", 2)
    resumed = in_processes(_eight_bit_run, tmp_path / "resumed", 4)
    assert whole_8bit > 0 and sum(n for _, n in straight) == whole_8bit  # the states split, none twice
    steps = straight[0][0]
    assert [n for _, n in steps] == pytest.approx([s.grad_norm for s in whole.steps], rel=1e-5)
    assert [loss for loss, _ in steps] == pytest.approx(whole.losses, rel=1e-6)
    assert [x for step in resumed[0][0] for x in step] == pytest.approx([x for step in steps[2:] for x in step],
                                                                      rel=1e-6)


LEFT_RUNNING = """
import os, torch, torch.distributed as dist
from linnet.torch.distributed import join
join()
import linnet.torch.model  # the attention paths import torch._dynamo
t = torch.ones(4)
dist.all_reduce(t)
dist.destroy_process_group()
names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
print(sorted(n for n in names if "gloo" in n))
"""


def test_leaving_the_group_stops_its_threads(tmp_path):
    """After join() and the model's imports (torch._dynamo among them), destroying the
    group stops gloo's worker threads, so none can free a collective's tensors while the
    interpreter shuts down (the process then aborted at exit, about 1 run in 5)."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", OMP_NUM_THREADS="1")
    ranks = [subprocess.Popen([sys.executable, "-c", LEFT_RUNNING], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    for rank in ranks:
        out, err = rank.communicate(timeout=120)
        assert rank.returncode == 0, err[-2000:]
        assert out.strip().splitlines()[-1] == "[]", out


def _reduced(rank):
    import torch.distributed as dist

    from linnet.torch import distributed

    distributed.BUCKET_BYTES = 64  # 16 f32 values a buffer: small gradients share one, a large one goes alone
    shapes = [(3,), (2, 2), (5, 7), (4,), (40,), (2, 3)]
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    for i, p in enumerate(params):
        p.grad = torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) * (rank + 1) + i
    params[3].grad = None  # no gradient: counts as zero
    alone = torch.nn.Parameter(torch.zeros(3))
    alone.grad = torch.full((3,), float(rank))
    distributed.reduce_gradients(params)
    distributed.reduce_gradients([alone], group=dist.new_group([rank], use_local_synchronization=True))
    return [p.grad.numpy() for p in params] + [alone.grad.numpy()]


def test_gradients_are_summed_in_bounded_buffers():
    """reduce_gradients sums every gradient over the processes through buffers of at most
    BUCKET_BYTES (a larger gradient in place), a missing gradient as zeros; over a group of
    one process (one copy of a split or pipelined model) it changes nothing."""
    first, second = in_processes(_reduced)
    shapes = [(3,), (2, 2), (5, 7), (4,), (40,), (2, 3)]
    for i, (a, b, shape) in enumerate(zip(first, second, shapes)):
        n = int(np.prod(shape))
        expected = 0 if i == 3 else (np.arange(n).reshape(shape) * 3 + 2 * i)
        np.testing.assert_array_equal(a, expected)
        np.testing.assert_array_equal(b, expected)
    np.testing.assert_array_equal(first[-1], [0, 0, 0])
    np.testing.assert_array_equal(second[-1], [1, 1, 1])
