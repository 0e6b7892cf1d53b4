"""Token losses over flattened positions, in float32.

Shapes: N rows (positions), V vocabulary, D hidden.

The `linear_` forms take the hidden states and the output head's weight and never hold
the [N, V] logits: they run a block of rows at a time (about `block_bytes` of f32
logits) and recompute or pre-compute what backward needs block by block. The head
weight may be stored in another dtype than the hidden states (an f32 master weight
beside bf16 compute): the products run in the hidden states' dtype, and the weight's
gradient is accumulated across blocks in float32 and returned in the weight's dtype.
In float32 on a CPU the blocks' logits come from oneDNN with the head reordered once a call
(`REORDER_MIN_ROWS`, `REORDER_MIN_ELEMENTS`).
"""

from __future__ import annotations

import torch

BLOCK_BYTES = 1 << 30  # f32 logits per block on accelerators: 1 GiB, about 2K rows of Llama 3's vocabulary
# On a CPU a 1 GiB block streams through DRAM in six passes (matmul out, cast, max, exp,
# divide, cast back); blocks that stay in cache made SFT-LoRA bf16 steps 1.25x faster. But
# never fewer than CPU_MIN_ROWS rows: a trainable head's f32 gradient [V, D] is updated
# once a block, and a few-row matmul is slow.
CPU_BLOCK_BYTES = 16 << 20
CPU_MIN_ROWS = 512


def rows_per_block(V: int, device: torch.device, block_bytes: int | None = None) -> int:
    """Rows of f32 [rows, V] logits a loss block holds: about `block_bytes`, or by device."""
    if block_bytes is not None:
        return max(1, block_bytes // (4 * V))
    if device.type == "cpu":
        return max(CPU_MIN_ROWS, CPU_BLOCK_BYTES // (4 * V))
    return max(1, BLOCK_BYTES // (4 * V))


def _f32(x: torch.Tensor) -> torch.Tensor:
    """float32, or float64 when given (so gradcheck can run in double precision)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def log_softmax(logits_NV: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(_f32(logits_NV), dim=-1)


def entropy(logits_NV: torch.Tensor) -> torch.Tensor:
    """[N] entropy of each row's distribution, in nats."""
    logp = log_softmax(logits_NV)
    return -(logp.exp() * logp).sum(-1)


def token_log_probs(logits_NV: torch.Tensor, targets_N: torch.Tensor) -> torch.Tensor:
    """[N] each row's log-probability of its target."""
    return log_softmax(logits_NV).gather(-1, targets_N[:, None].long())[:, 0]


def cross_entropy(logits_NV, targets_N, weights_N) -> torch.Tensor:
    """sum_n weights[n] * -log p(targets[n]): divide by the count you want a mean over."""
    return -(token_log_probs(logits_NV, targets_N) * _f32(weights_N)).sum()


def _blocks(N: int, rows: int):
    for s in range(0, N, rows):
        yield slice(s, min(s + rows, N))


# Rows from which reordering the head for oneDNN pays: a float32 [512, 256] x [256, 8192] block
# ran at 56-58 GFLOP/s reordered against 32-36 plain (one thread, AMD EPYC with AVX2), and
# reordering costs about as much as a 50-row product. The [rows, V] x [V, D] products of the
# gradients gained nothing and stay plain.
REORDER_MIN_ROWS = 256
# Heads smaller than this (elements) stay plain: while the weight fits in a core's cache
# oneDNN ran no faster (V <= 2048 at D = 128 or 256), and reordering costs 0.3 ms however small.
REORDER_MIN_ELEMENTS = 1 << 20


def onednn_reorder(w_VD: torch.Tensor, rows: int):
    """w in oneDNN's blocked layout for `onednn_linear` (`rows`: a product's rows, a hint
    for the layout), or None where that does not pay or apply: a head under
    REORDER_MIN_ELEMENTS, not a float32 CPU tensor, or a torch built without oneDNN."""
    if (w_VD.numel() < REORDER_MIN_ELEMENTS or w_VD.device.type != "cpu" or w_VD.dtype != torch.float32
            or not torch.backends.mkldnn.is_available()):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(w_VD.detach().contiguous(), rows)


def onednn_linear(h_ND: torch.Tensor, reordered, bias: torch.Tensor | None = None) -> torch.Tensor:
    """h @ w.T (+ bias) through oneDNN, w reordered by `onednn_reorder`."""
    return torch.ops.mkldnn._linear_pointwise(h_ND, reordered, bias, "none", [], "")


def _block_logits(h_ND, w_VD, rows: int):
    """The f32 logits of a block of rows, `sl` -> h[sl] @ w.T: with the head reordered once
    for oneDNN when the call has at least REORDER_MIN_ROWS rows in float32 on a CPU."""
    if h_ND.shape[0] >= REORDER_MIN_ROWS and (reordered := onednn_reorder(w_VD, min(rows, h_ND.shape[0]))) is not None:
        return lambda sl: onednn_linear(h_ND[sl], reordered)
    return lambda sl: _f32(h_ND[sl] @ w_VD.T)


def _shifted_exp_(z_NV):
    """(log-sum-exp of each row, sum of exp) leaving exp(z - row max) in z: in place,
    so a block holds one [rows, V] buffer, not a second one for logsumexp's temporary."""
    top = z_NV.amax(dim=-1, keepdim=True)
    sums = z_NV.sub_(top).exp_().sum(dim=-1)
    return top[:, 0] + sums.log(), sums


def _add_weight_grad_(grad_VD, g_NV, h_ND) -> None:
    """grad += g.T @ h, accumulated in grad's float32 without a [V, D] temporary: in place
    when the dtypes agree, else through vocabulary slices of about 64 MiB."""
    if g_NV.dtype == grad_VD.dtype:
        grad_VD.addmm_(g_NV.T, h_ND)
        return
    rows = max(1, (1 << 26) // (4 * h_ND.shape[1]))
    for v in range(0, grad_VD.shape[0], rows):
        grad_VD[v : v + rows] += (g_NV[:, v : v + rows].T @ h_ND).to(grad_VD.dtype)


def _zeros_f32(w_VD):
    return torch.zeros(w_VD.shape, dtype=_f32(w_VD).dtype, device=w_VD.device)


class _LinearCrossEntropy(torch.autograd.Function):
    """Forward computes the loss and, block by block, both gradients at once (the
    logits are already in hand, so backward needs no second pass): three head matmuls
    a block rather than four. Backward only scales them by the incoming gradient."""

    @staticmethod
    def forward(ctx, h_ND, w_VD, targets_N, weights_N, rows, need_h, need_w):
        N, wc_VD = h_ND.shape[0], w_VD.to(h_ND.dtype)
        total = h_ND.new_zeros((), dtype=_f32(h_ND).dtype)
        grad_h = torch.zeros_like(h_ND) if need_h else None
        grad_w = _zeros_f32(w_VD) if need_w else None
        arange = torch.arange(min(rows, N), device=h_ND.device)
        logits = _block_logits(h_ND, wc_VD, rows)
        for sl in _blocks(N, rows):
            z = logits(sl)
            t, wt = targets_N[sl].long(), _f32(weights_N[sl])
            picked = z.gather(-1, t[:, None])[:, 0]
            lse, sums = _shifted_exp_(z)
            total += ((lse - picked) * wt).sum()
            if need_h or need_w:
                g = z.div_(sums[:, None])  # softmax, in place of the logits
                g[arange[: g.shape[0]], t] -= 1.0
                g.mul_(wt[:, None])
                g = g.to(h_ND.dtype)
                if need_h:
                    grad_h[sl] = g @ wc_VD
                if need_w:
                    _add_weight_grad_(grad_w, g, h_ND[sl])
                del g
            del z  # before the next block's logits: one block alive at a time
        ctx.save_for_backward(grad_h, grad_w)
        ctx.w_dtype = w_VD.dtype
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        # scale in f32: 1/count rounded to bf16 would bias every step's gradient
        gh = None if grad_h is None else (grad_h.float() * grad_out).to(grad_h.dtype)
        gw = None if grad_w is None else (grad_w * grad_out).to(ctx.w_dtype)
        return gh, gw, None, None, None, None, None


def linear_cross_entropy(h_ND, w_VD, targets_N, weights_N, *, block_bytes: int | None = None):
    """cross_entropy(h @ w.T, targets, weights) without holding the [N, V] logits;
    block_bytes defaults by device (rows_per_block)."""
    rows = rows_per_block(w_VD.shape[0], h_ND.device, block_bytes)
    grad = torch.is_grad_enabled()
    need_h, need_w = grad and h_ND.requires_grad, grad and w_VD.requires_grad
    return _LinearCrossEntropy.apply(h_ND, w_VD, targets_N, weights_N, rows, need_h, need_w)


class _LinearTokenLogProbs(torch.autograd.Function):
    """The incoming gradient is per row, so backward recomputes each block's softmax
    from the saved log-sum-exp."""

    @staticmethod
    def forward(ctx, h_ND, w_VD, targets_N, rows):
        out, lses, wc_VD = [], [], w_VD.to(h_ND.dtype)
        logits = _block_logits(h_ND, wc_VD, rows)
        for sl in _blocks(h_ND.shape[0], rows):
            z = logits(sl)
            picked = z.gather(-1, targets_N[sl, None].long())[:, 0]
            lse, _ = _shifted_exp_(z)
            out.append(picked - lse)
            lses.append(lse)
            del z  # one block alive at a time
        ctx.save_for_backward(h_ND, w_VD, targets_N, torch.cat(lses))
        ctx.rows = rows
        return torch.cat(out)

    @staticmethod
    def backward(ctx, grad_N):
        h_ND, w_VD, targets_N, lse_N = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[:2]
        grad_h = torch.zeros_like(h_ND) if need_h else None
        grad_w = _zeros_f32(w_VD) if need_w else None
        wc_VD = w_VD.to(h_ND.dtype)
        logits = _block_logits(h_ND, wc_VD, ctx.rows)
        for sl in _blocks(h_ND.shape[0], ctx.rows):
            z = logits(sl)
            # d log p(t) / d z = onehot(t) - softmax(z), scaled by each row's gradient
            g = z.sub_(lse_N[sl, None]).exp_().neg_()
            g.scatter_add_(-1, targets_N[sl, None].long(), torch.ones_like(g[:, :1]))
            g.mul_(_f32(grad_N[sl])[:, None])
            g = g.to(h_ND.dtype)
            if need_h:
                grad_h[sl] = g @ wc_VD
            if need_w:
                _add_weight_grad_(grad_w, g, h_ND[sl])
            del z, g  # one block alive at a time
        return grad_h, None if grad_w is None else grad_w.to(w_VD.dtype), None, None


class _FrozenHeadTokenLogProbs(torch.autograd.Function):
    """For a frozen head (LoRA): d log p(t_n) / d h_n = (onehot(t_n) - softmax(z_n)) @ W
    does not depend on the incoming gradient, which only scales each row. Forward
    computes it while each block's logits are in hand, so backward is one multiply: two
    head matmuls a block instead of three (DPO steps 1.16x faster, bench/RESULTS.md)."""

    @staticmethod
    def forward(ctx, h_ND, w_VD, targets_N, rows):
        out, wc_VD = [], w_VD.to(h_ND.dtype)
        grad_h = torch.empty_like(h_ND)
        logits = _block_logits(h_ND, wc_VD, rows)
        for sl in _blocks(h_ND.shape[0], rows):
            z = logits(sl)
            t = targets_N[sl, None].long()
            picked = z.gather(-1, t)[:, 0]
            lse, sums = _shifted_exp_(z)
            out.append(picked - lse)
            g = z.div_(sums[:, None]).neg_()  # -softmax, in place of the logits
            g.scatter_add_(-1, t, torch.ones_like(g[:, :1]))
            grad_h[sl] = g.to(h_ND.dtype) @ wc_VD
            del z, g  # one block alive at a time
        ctx.save_for_backward(grad_h)
        return torch.cat(out)

    @staticmethod
    def backward(ctx, grad_N):
        (grad_h,) = ctx.saved_tensors
        return (grad_h.float() * _f32(grad_N)[:, None]).to(grad_h.dtype), None, None, None


def linear_token_log_probs(h_ND, w_VD, targets_N, *, block_bytes: int | None = None):
    """token_log_probs(h @ w.T, targets) without holding the [N, V] logits;
    block_bytes defaults by device (rows_per_block)."""
    rows = rows_per_block(w_VD.shape[0], h_ND.device, block_bytes)
    if torch.is_grad_enabled() and h_ND.requires_grad and not w_VD.requires_grad:
        return _FrozenHeadTokenLogProbs.apply(h_ND, w_VD, targets_N, rows)
    return _LinearTokenLogProbs.apply(h_ND, w_VD, targets_N, rows)


# -- a head split by vocabulary rows across processes (tensor parallel) ------------------------------
# Each process holds rows [offset, offset + V_local) of the head. A row's maximum, sum of exponentials
# and target logit are combined across the processes (three all-reduces a block); the logits are not.


def _split_stats(h_ND, wc_VD, targets_N, offset: int, group, rows: int):
    """[N] target logit and log-sum-exp over the whole vocabulary, one block at a time."""
    import torch.distributed as dist

    picked_all, lse_all = [], []
    logits = _block_logits(h_ND, wc_VD, rows)
    for sl in _blocks(h_ND.shape[0], rows):
        z = logits(sl)
        local = targets_N[sl].long() - offset
        mine = (local >= 0) & (local < z.shape[1])
        picked = torch.where(mine, z.gather(-1, local.clamp(0, z.shape[1] - 1)[:, None])[:, 0], 0.0)
        top = z.amax(dim=-1)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        sums = z.sub_(top[:, None]).exp_().sum(dim=-1)
        dist.all_reduce(sums, group=group)
        dist.all_reduce(picked, group=group)
        picked_all.append(picked)
        lse_all.append(top + sums.log())
        del z
    return torch.cat(picked_all), torch.cat(lse_all)


def _split_grads(h_ND, w_VD, targets_N, lse_N, coef_N, offset: int, group, rows: int, need_w: bool):
    """(dh, dW_local) of sum_n coef[n] * -log p(targets[n]): dh summed across the processes;
    dW None unless `need_w` (a frozen head, under LoRA, takes none)."""
    import torch.distributed as dist

    wc_VD = w_VD.to(h_ND.dtype)
    grad_h = torch.zeros_like(h_ND)
    grad_w = _zeros_f32(w_VD) if need_w else None
    logits = _block_logits(h_ND, wc_VD, rows)
    for sl in _blocks(h_ND.shape[0], rows):
        g = logits(sl).sub_(lse_N[sl, None]).exp_()  # softmax over the local rows
        local = targets_N[sl].long() - offset
        mine = torch.nonzero((local >= 0) & (local < g.shape[1]))[:, 0]
        g[mine, local[mine]] -= 1.0
        g.mul_(coef_N[sl, None])
        g = g.to(h_ND.dtype)
        grad_h[sl] = g @ wc_VD
        if need_w:
            _add_weight_grad_(grad_w, g, h_ND[sl])
        del g
    dist.all_reduce(grad_h, group=group)
    return grad_h, None if grad_w is None else grad_w.to(w_VD.dtype)


class _SplitCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_ND, w_VD, targets_N, weights_N, offset, group, rows):
        picked, lse = _split_stats(h_ND, w_VD.to(h_ND.dtype), targets_N, offset, group, rows)
        ctx.save_for_backward(h_ND, w_VD, targets_N, weights_N, lse)
        ctx.split = (offset, group, rows)
        return ((lse - picked) * _f32(weights_N)).sum()

    @staticmethod
    def backward(ctx, grad_out):
        h_ND, w_VD, targets_N, weights_N, lse = ctx.saved_tensors
        coef = _f32(weights_N) * grad_out
        return (*_split_grads(h_ND, w_VD, targets_N, lse, coef, *ctx.split, ctx.needs_input_grad[1]),
                None, None, None, None, None)


class _SplitTokenLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_ND, w_VD, targets_N, offset, group, rows):
        picked, lse = _split_stats(h_ND, w_VD.to(h_ND.dtype), targets_N, offset, group, rows)
        ctx.save_for_backward(h_ND, w_VD, targets_N, lse)
        ctx.split = (offset, group, rows)
        return picked - lse

    @staticmethod
    def backward(ctx, grad_N):
        h_ND, w_VD, targets_N, lse = ctx.saved_tensors
        return (*_split_grads(h_ND, w_VD, targets_N, lse, -_f32(grad_N), *ctx.split, ctx.needs_input_grad[1]),
                None, None, None, None)


def split_cross_entropy(h_ND, w_VD, targets_N, weights_N, *, offset: int, group, block_bytes: int | None = None):
    """linear_cross_entropy against the rows [offset, offset + len(w)) of a head split by
    vocabulary across `group`; every process of the group calls it with the same h."""
    rows = rows_per_block(w_VD.shape[0], h_ND.device, block_bytes)
    return _SplitCrossEntropy.apply(h_ND, w_VD, targets_N, weights_N, offset, group, rows)


def split_token_log_probs(h_ND, w_VD, targets_N, *, offset: int, group, block_bytes: int | None = None):
    """linear_token_log_probs against a head split by vocabulary (see split_cross_entropy)."""
    rows = rows_per_block(w_VD.shape[0], h_ND.device, block_bytes)
    return _SplitTokenLogProbs.apply(h_ND, w_VD, targets_N, offset, group, rows)
