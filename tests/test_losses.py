"""Chunked output-head losses against the plain ones: values and gradients."""

from __future__ import annotations

import pytest
import torch

from linnet.torch import losses

torch.set_num_threads(1)


def _case(N=11, D=6, V=13, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g, dtype=dtype, requires_grad=True)
    w = torch.randn(V, D, generator=g, dtype=dtype, requires_grad=True)
    t = torch.randint(0, V, (N,), generator=g)
    wt = (torch.rand(N, generator=g) > 0.3).to(dtype)
    return h, w, t, wt


def _rows_bytes(rows, V):
    return rows * 4 * V  # block_bytes that gives `rows` rows per block


@pytest.mark.parametrize("rows", [1, 4, 11, 100])
def test_linear_cross_entropy_matches_plain(rows):
    h, w, t, wt = _case()
    plain = losses.cross_entropy(h @ w.T, t, wt)
    gh, gw = torch.autograd.grad(plain, (h, w))
    chunked = losses.linear_cross_entropy(h, w, t, wt, block_bytes=_rows_bytes(rows, 13))
    ch, cw = torch.autograd.grad(chunked, (h, w))
    torch.testing.assert_close(chunked, plain)
    torch.testing.assert_close(ch, gh)
    torch.testing.assert_close(cw, gw)


@pytest.mark.parametrize("rows", [1, 4, 100])
def test_linear_token_log_probs_matches_plain(rows):
    h, w, t, _ = _case(seed=1)
    plain = losses.token_log_probs(h @ w.T, t)
    chunked = losses.linear_token_log_probs(h, w, t, block_bytes=_rows_bytes(rows, 13))
    torch.testing.assert_close(chunked, plain)
    g = torch.randn(plain.shape, dtype=plain.dtype)
    torch.testing.assert_close(
        torch.autograd.grad(chunked, (h, w), g), torch.autograd.grad(plain, (h, w), g)
    )


@pytest.mark.parametrize("rows", [1, 4, 100])
def test_frozen_head_token_log_probs_matches_plain(rows):
    """A frozen head takes the path that computes the hidden gradient in forward."""
    h, w, t, _ = _case(seed=3)
    w = w.detach()
    plain = losses.token_log_probs(h @ w.T, t)
    chunked = losses.linear_token_log_probs(h, w, t, block_bytes=_rows_bytes(rows, 13))
    assert isinstance(chunked.grad_fn, torch.autograd.function.BackwardCFunction)
    assert type(chunked.grad_fn).__name__.startswith("_FrozenHead")
    torch.testing.assert_close(chunked, plain)
    g = torch.randn(plain.shape, dtype=plain.dtype)
    torch.testing.assert_close(torch.autograd.grad(chunked, h, g), torch.autograd.grad(plain, h, g))
    assert torch.autograd.gradcheck(
        lambda h: losses.linear_token_log_probs(h, w, t, block_bytes=_rows_bytes(rows, 13)), (h,)
    )


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")
def test_float32_blocks_on_a_cpu_run_the_head_through_onednn(monkeypatch):
    """From REORDER_MIN_ROWS rows a float32 head of REORDER_MIN_ELEMENTS or more is reordered for
    oneDNN once a call; values and gradients stay those of the plain product (float64)."""
    calls = []
    product = losses.onednn_linear
    monkeypatch.setattr(losses, "onednn_linear", lambda h, p: calls.append(len(h)) or product(h, p))
    N, V, D = losses.REORDER_MIN_ROWS + 44, 4096, 256  # a head of REORDER_MIN_ELEMENTS
    h64, w64, t, wt = _case(N=N, D=D, V=V, seed=4)
    with torch.no_grad():  # logits of order one
        h64.mul_(0.25), w64.mul_(0.25)
    h, w = (x.detach().float().requires_grad_() for x in (h64, w64))
    block = _rows_bytes(128, V)
    check = dict(rtol=1e-4, atol=1e-5)

    loss = losses.linear_cross_entropy(h, w, t, wt.float(), block_bytes=block)
    plain = losses.cross_entropy(h64 @ w64.T, t, wt)
    torch.testing.assert_close(loss.double(), plain, **check)
    for ours, ref in zip(torch.autograd.grad(loss, (h, w)), torch.autograd.grad(plain, (h64, w64))):
        torch.testing.assert_close(ours.double(), ref, **check)
    assert calls == [128, 128, N - 256]

    g = torch.randn(N, dtype=torch.float64)
    ref = losses.token_log_probs(h64 @ w64.T, t)
    for head in (w, w.detach()):  # trained (recomputed in backward) and frozen
        calls.clear()
        logp = losses.linear_token_log_probs(h, head, t, block_bytes=block)
        torch.testing.assert_close(logp.double(), ref, **check)
        torch.testing.assert_close(torch.autograd.grad(logp, h, g.float())[0].double(),
                                   torch.autograd.grad(ref, h64, g, retain_graph=True)[0], **check)
        assert len(calls) == (6 if head.requires_grad else 3)  # the trained head's backward recomputes
    calls.clear()
    losses.linear_token_log_probs(h[: losses.REORDER_MIN_ROWS - 1], w, t[: losses.REORDER_MIN_ROWS - 1])
    assert calls == []  # too few rows for the reordering to pay
    losses.linear_token_log_probs(h, w[:1000], t % 1000)
    assert calls == []  # nor a head that fits in cache


def test_block_size_follows_the_device():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert losses.rows_per_block(8192, cpu) == 512  # 16 MiB of f32 logits
    assert losses.rows_per_block(1024, cpu) == 4096
    assert losses.rows_per_block(128256, cpu) == losses.CPU_MIN_ROWS  # not 32 rows
    assert losses.rows_per_block(128256, cuda) == 2092  # 1 GiB
    assert losses.rows_per_block(13, cpu, block_bytes=4 * 13 * 3) == 3


def test_gradcheck_chunked_losses():
    h, w, t, wt = _case(N=5, D=3, V=7)
    block = _rows_bytes(2, 7)
    assert torch.autograd.gradcheck(
        lambda h, w: losses.linear_cross_entropy(h, w, t, wt, block_bytes=block), (h, w)
    )
    assert torch.autograd.gradcheck(
        lambda h, w: losses.linear_token_log_probs(h, w, t, block_bytes=block), (h, w)
    )


def test_low_precision_hidden_with_f32_master_head():
    """bf16 hidden states against an f32 master head: the gradient reaches the head in
    f32, close to the f32 computation."""
    h, w, t, wt = _case(N=64, D=32, V=50, dtype=torch.float32, seed=2)
    exact = losses.linear_cross_entropy(h, w, t, wt)
    (gw_exact,) = torch.autograd.grad(exact, (w,))
    hb = h.detach().bfloat16().requires_grad_()
    low = losses.linear_cross_entropy(hb, w, t, wt, block_bytes=_rows_bytes(8, 50))
    gh, gw = torch.autograd.grad(low, (hb, w))
    assert low.dtype == torch.float32 and gw.dtype == torch.float32 and gh.dtype == torch.bfloat16
    assert torch.allclose(low, exact, rtol=2e-2)
    assert (gw - gw_exact).abs().max() <= 0.05 * gw_exact.abs().max()


def test_frozen_head_gets_no_gradient_and_no_grad_mode_works():
    h, w, t, wt = _case()
    w = w.detach()
    loss = losses.linear_cross_entropy(h, w, t, wt)
    (gh,) = torch.autograd.grad(loss, (h,))
    assert gh.shape == h.shape and w.grad is None
    with torch.no_grad():
        assert torch.allclose(losses.linear_cross_entropy(h, w, t, wt), loss)


def test_entropy_and_log_softmax():
    logits = torch.tensor([[0.0, 0.0], [100.0, 0.0]], dtype=torch.bfloat16)
    ent = losses.entropy(logits)
    assert ent.dtype == torch.float32
    torch.testing.assert_close(ent, torch.tensor([0.6931472, 0.0]), atol=1e-6, rtol=0)
    lsm = losses.log_softmax(logits)
    torch.testing.assert_close(lsm.exp().sum(-1), torch.ones(2))
