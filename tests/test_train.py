"""The training loop: loss scaling under accumulation, resume, determinism, failures."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from linnet import nest
from linnet.files.checkpoints import checkpoints
from linnet.packing import Example, pack
from linnet.train import (
    constant_schedule,
    cosine_schedule,
    load_checkpoint,
    save_checkpoint,
    train,
    wsd_schedule,
)

torch.set_num_threads(1)
CARD = nest.resolve("debug").replace(vocab=64, layers=2, hidden=32, intermediate=64, heads=4, kv_heads=2, head_dim=8)


def _examples(n=24, seed=0):
    g = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        prompt = g.integers(3, 64, size=g.integers(2, 8)).tolist()
        answer = g.integers(3, 64, size=g.integers(1, 10)).tolist()
        out.append(Example.prompted(prompt, answer))
    return out


def _model(seed=0, **kw):
    return nest.load(CARD, weights="random", seed=seed, **kw)


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_accumulation_equals_one_big_batch():
    """Four uneven batches accumulated give the update of the same tokens in one row."""
    examples = _examples(12, seed=1)
    groups = [examples[0:2], examples[2:3], examples[3:8], examples[8:12]]
    small = [next(pack(g, tokens=64)) for g in groups]
    learned = [b.learned for b in small]
    assert len(set(learned)) > 1  # batches differ in learned counts
    big = next(pack(examples, tokens=256))
    assert big.examples == 12

    a, b = _model(trainable=True), _model(trainable=True)
    for model, batches, accumulate in ((a, small, 4), (b, [big], 1)):
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
        hist = train(model, batches, optimizer=opt, steps=1, accumulate=accumulate, clip=None)
        assert hist.steps[0].learned == sum(learned)
    pa, pb = _params(a), _params(b)
    for name in pa:
        torch.testing.assert_close(pa[name], pb[name], atol=1e-6, rtol=0)


def _run(tmp_path, steps, checkpoint=None, lora=False):
    torch.manual_seed(0)  # adapters' A and dropout draw from the global generator
    model = _model(seed=3, trainable=not lora)
    if lora:
        model.add_lora("model.layers.*", rank=2, dropout=0.1)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    sched = cosine_schedule(opt, 2, 10, floor=0.1)
    rows = list(pack(_examples(60, seed=2), tokens=48))
    hist = train(model, rows, optimizer=opt, steps=steps, schedule=sched, checkpoint=checkpoint, checkpoint_every=3)
    return model, hist


@pytest.mark.parametrize("lora", [False, True])
def test_resume_gives_identical_losses_and_weights(tmp_path, lora):
    whole, h_whole = _run(tmp_path, 10, lora=lora)
    _, h_first = _run(tmp_path, 5, checkpoint=tmp_path / "ckpt", lora=lora)
    assert [p.name for p in checkpoints(tmp_path / "ckpt")] == ["step-00000003", "step-00000005"]
    resumed, h_rest = _run(tmp_path, 10, checkpoint=tmp_path / "ckpt", lora=lora)
    assert [s.step for s in h_rest.steps] == list(range(6, 11))
    assert h_first.losses + h_rest.losses == h_whole.losses
    for name, p in _params(whole).items():
        assert torch.equal(p, _params(resumed)[name]), name
    from safetensors import safe_open

    with safe_open(str(checkpoints(tmp_path / "ckpt")[-1] / "trained.safetensors"), "pt") as f:
        names = list(f.keys())
    assert all(n.endswith(("lora_a", "lora_b")) for n in names) == lora


def test_same_seed_is_bitwise_reproducible_and_loss_falls(tmp_path):
    _, a = _run(tmp_path, 10)
    _, b = _run(tmp_path, 10)
    assert a.losses == b.losses
    assert a.losses[-1] < a.losses[0]
    s = a.steps[-1]
    assert s.real > s.learned > 0 and s.grad_norm > 0 and s.seconds > 0


def test_a_non_finite_loss_before_any_checkpoint_names_none(tmp_path):
    """The stop names the checkpoint that is there, and says when none was written yet."""
    model = _model(trainable=True)
    real_loss = model.loss_packed
    model.loss_packed = lambda batch: (real_loss(batch)[0] * float("nan"), real_loss(batch)[1])
    with pytest.raises(FloatingPointError, match=r"step 1: .*no checkpoint was written before it"):
        train(model, list(pack(_examples(8), tokens=48)), optimizer=torch.optim.SGD(model.parameters(), lr=1e-3),
              steps=2, checkpoint=tmp_path / "ckpt", checkpoint_every=100)


def test_non_finite_loss_stops_and_keeps_the_checkpoint(tmp_path):
    model = _model(trainable=True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    rows = list(pack(_examples(40), tokens=48))
    real_loss, calls = model.loss_packed, []

    def poisoned(batch):  # the third step's loss is not finite
        calls.append(1)
        loss, count = real_loss(batch)
        return (loss * float("nan"), count) if len(calls) == 3 else (loss, count)

    model.loss_packed = poisoned
    with pytest.raises(FloatingPointError, match=r"step 3: .*last good checkpoint, .*step-00000002, is intact"):
        train(model, rows, optimizer=opt, steps=4, checkpoint=tmp_path, checkpoint_every=1)
    assert [p.name for p in checkpoints(tmp_path)] == ["step-00000001", "step-00000002"]
    before = _params(model)  # the failed step changed nothing
    fresh = _model(trainable=True)
    state = load_checkpoint(tmp_path, model=fresh)
    assert state["step"] == 2
    for name, p in _params(fresh).items():
        assert torch.equal(p, before[name])


def test_checkpoint_from_another_setup_is_refused(tmp_path):
    model = _model(trainable=True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    save_checkpoint(tmp_path, model=model, optimizer=opt, step=1)
    other = _model()
    other.add_lora("model.layers.*", rank=2)
    with pytest.raises(ValueError, match="other parameters"):
        load_checkpoint(tmp_path, model=other)


def test_interrupted_write_leaves_no_checkpoint(tmp_path, monkeypatch):
    model = _model(trainable=True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    save_checkpoint(tmp_path, model=model, optimizer=opt, step=1)

    def crash(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, model=model, optimizer=opt, step=2)
    monkeypatch.undo()
    assert [p.name for p in checkpoints(tmp_path)] == ["step-00000001"]
    assert load_checkpoint(tmp_path, model=model, optimizer=opt)["step"] == 1


def test_batches_running_out_warns_and_end_the_run_there(tmp_path):
    """The step the batches run out after is the run's end: its checkpoint and its
    held-out evaluation happen there, as at `steps`."""
    model = _model(trainable=True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    rows = list(pack(_examples(6), tokens=48))
    with pytest.warns(UserWarning, match="ran out"):
        hist = train(model, rows, optimizer=opt, steps=len(rows) + 3, checkpoint=tmp_path, checkpoint_every=100,
                     evaluate=lambda m: {"held": 1.0}, evaluate_every=100)
    assert len(hist) == len(rows)
    assert [p.name for p in checkpoints(tmp_path)] == [f"step-{len(rows):08d}"]
    assert ["held" in s.metrics for s in hist.steps] == [False] * (len(rows) - 1) + [True]


def test_nothing_to_train_is_an_error():
    model = _model()
    with pytest.raises(ValueError, match="nothing to train"):
        train(model, [], optimizer=None, steps=1)


def _lrs(schedule, opt, n):
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        schedule.step()
    return out


def test_schedules():
    p = [torch.nn.Parameter(torch.zeros(1))]
    opt = torch.optim.SGD(p, lr=1.0)
    lrs = _lrs(cosine_schedule(opt, 2, 10, floor=0.1), opt, 12)
    assert lrs[:3] == [0.5, 1.0, 1.0]
    assert lrs[6] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 4 / 8)))
    assert lrs[10] == pytest.approx(0.1) and lrs[11] == pytest.approx(0.1)
    opt = torch.optim.SGD(p, lr=1.0)
    lrs = _lrs(wsd_schedule(opt, 1, 10, decay=0.2), opt, 10)
    assert lrs[:8] == [1.0] * 8 and lrs[8] == pytest.approx(0.5) and lrs[9] == 0.0
    opt = torch.optim.SGD(p, lr=1.0)
    assert _lrs(constant_schedule(opt, 4), opt, 6) == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="floor"):
        cosine_schedule(opt, 1, 10, floor=2.0)


def test_a_damaged_checkpoint_is_refused_and_the_rngs_come_back(tmp_path):
    import random

    model = _model(trainable=True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    save_checkpoint(tmp_path, model=model, optimizer=opt, step=1)
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    save_checkpoint(tmp_path, model=model, optimizer=opt, step=2)
    drawn = (random.random(), np.random.random(), torch.rand(()).item())
    load_checkpoint(tmp_path, model=model)  # Python's, NumPy's and torch's generators rewind
    assert (random.random(), np.random.random(), torch.rand(()).item()) == drawn
    latest = checkpoints(tmp_path)[-1]
    data = bytearray((latest / "optimizer.pt").read_bytes())
    data[len(data) // 2] ^= 1
    (latest / "optimizer.pt").write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"optimizer.pt: corrupt or truncated .*previous checkpoint is .*step-00000001"):
        load_checkpoint(tmp_path, model=model, optimizer=opt)
    assert load_checkpoint(checkpoints(tmp_path)[0], model=model, optimizer=opt)["step"] == 1
