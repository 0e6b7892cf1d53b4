"""Context parallelism: one packed row's positions split across a process group, attention
computed as a ring.

Each of the group's C processes holds 2 of the row's 2C equal chunks, chunk r and chunk
2C-1-r (`shard_positions`): under a causal mask the early chunks see little and the late
ones much, so pairing them gives every process the same work. Everything but attention
works position by position and runs on the process's own positions. Attention
(`ring_attention`) keeps each process's queries where they are and passes the keys and
values around the ring, one process's block a step, C steps; each block's scores are
masked by the row's documents (a query sees keys of its own document at or before it) and
merged into the output with a running log-sum-exp. Backward goes round again: each block
comes back with the gradients of its keys and values summed over every process's queries,
and ends where it started. PyTorch's own `context_parallel` has no CPU rule, so this is
written on torch.distributed's point-to-point calls (any backend: gloo, NCCL).

On a CPU each block goes through PyTorch's fused flash-attention kernel, which takes the
documents' mask and returns each query's log-sum-exp (and its backward, given the whole
output and log-sum-exp, each block's share of the gradients); elsewhere a block's scores
are computed in float32 with an explicit mask. Either way a tile of queries at a time, its
mask or scores about SCORE_BYTES, and a tile that sees none of a block is skipped; on a
CPU a chunk of one document needs no mask against an earlier chunk's keys of that
document, nor (causal) against itself.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from linnet.packing import segments, shard_positions
from linnet.torch.distributed import reduced_by_shards

SCORE_BYTES = 16 << 20  # float32 scores a query tile holds (linnet.plan.ring.RING_SCORE_BYTES)
# where PyTorch's fused attention kernel takes an arbitrary mask and returns the log-sum-exp
# the ring merges by (its flash kernel for CPUs); elsewhere each block's scores in float32
FUSED_DEVICES = ("cpu",)


def _ring(group) -> tuple[int, int]:
    """(the global rank this process sends to, the one it receives from)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    return dist.get_global_rank(group, (rank + 1) % size), dist.get_global_rank(group, (rank - 1) % size)


def _pass_on(tensors: list[torch.Tensor], group) -> list[torch.Tensor]:
    """Send `tensors` to the next process of the ring and return the previous one's."""
    send_to, receive_from = _ring(group)
    received = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), send_to, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, receive_from, group) for r in received]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return received


def _visible(q_index, q_doc, k_index, k_doc, q_prompt=None) -> torch.Tensor:
    """[Pq, Pk] which keys each query sees: its own document's, at or before it, and every
    key of its document's shared prompt (`q_prompt`: that document's id, -1 for none)."""
    own = (q_doc[:, None] == k_doc[None, :]) & (k_index[None, :] <= q_index[:, None])
    return own if q_prompt is None else own | (q_prompt[:, None] == k_doc[None, :])


def _runs(index: torch.Tensor) -> list[slice]:
    """The runs of consecutive row positions in `index` (a process's two chunks)."""
    breaks = (torch.nonzero(index[1:] != index[:-1] + 1).flatten() + 1).tolist()
    edges = [0, *breaks, len(index)]
    return [slice(a, b) for a, b in zip(edges, edges[1:], strict=False)]


def _tiles(rows: slice, keys: int, heads: int) -> list[slice]:
    """`rows` of queries cut into tiles whose [tile, keys] float32 mask (the fused kernel's)
    or [heads, tile, keys] float32 scores (heads > 1) hold about SCORE_BYTES."""
    size = max(1, SCORE_BYTES // (4 * keys * heads))
    return [slice(i, min(i + size, rows.stop)) for i in range(rows.start, rows.stop, size)]


def _parts(q, q_index, q_doc, k_index, k_doc, q_prompt=None):
    """(queries, keys, causal, visible) for each piece of one block of keys some of the
    queries see: a run of queries against a run of keys (two chunks against two). On a
    CPU a run of one document wholly after the keys' needs no mask, nor, causal, the run
    against itself; any other piece goes a tile of queries at a time with its mask of
    visible keys (`visible` [tile, keys], None for none needed)."""
    fused = q.device.type in FUSED_DEVICES
    for qs in _runs(q_index):
        for ks in _runs(k_index):
            first, last = int(q_index[qs.start]), int(q_index[qs.stop - 1])
            if int(k_index[ks.start]) > last:  # every key after every query (a shared prompt comes first)
                continue
            docs = torch.cat([q_doc[qs], k_doc[ks]])
            if fused and bool((docs == docs[0]).all()):
                if int(k_index[ks.stop - 1]) < first:  # every key before every query
                    yield qs, ks, False, None
                    continue
                if int(k_index[ks.start]) == first and ks.stop - ks.start == qs.stop - qs.start:
                    yield qs, ks, True, None  # the run against itself
                    continue
            for t in _tiles(qs, ks.stop - ks.start, 1 if fused else q.shape[0]):
                visible = _visible(q_index[t], q_doc[t], k_index[ks], k_doc[ks],
                                   None if q_prompt is None else q_prompt[t])
                if visible.any():
                    yield t, ks, False, visible


def _finite(x: torch.Tensor) -> torch.Tensor:
    """x with -inf (a query that has seen no key yet) as 0, so exp(score - x) stays 0."""
    return torch.where(torch.isinf(x), torch.zeros_like(x), x)


def _mask(visible: torch.Tensor | None, dtype) -> torch.Tensor | None:
    """The fused kernel's additive mask (0 where a key is visible, -inf elsewhere); None
    when every key is."""
    if visible is None or bool(visible.all()):
        return None
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, float("-inf"))


def _scores(q, k, visible, scale: float) -> torch.Tensor:
    """[H, Pq, Pk] float32 scores, -inf where a key is not visible (k repeated per head)."""
    return (torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale).masked_fill(~visible, float("-inf"))


def _block(q, k, v, causal: bool, visible, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of queries q [H, T, d] over keys and values repeated to H heads: (output
    [H, T, d] float32, log-sum-exp [H, T], -inf for a query that sees none of them). On a
    CPU PyTorch's fused flash kernel (`causal`: the run against itself); elsewhere float32
    scores (`visible` always given)."""
    if q.device.type in FUSED_DEVICES:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q[None], k[None], v[None], 0.0, causal, attn_mask=_mask(visible, q.dtype), scale=scale)
        lse = lse[0] if visible is None else lse[0].masked_fill(~visible.any(-1), float("-inf"))  # kernel: 0 there
        return out[0].float(), lse
    s = _scores(q, k, visible, scale)
    lse = torch.logsumexp(s, -1)
    return torch.matmul(torch.exp(s - _finite(lse)[..., None]), v.float()), lse


def _block_backward(g, q, k, v, out, lse, causal: bool, visible, scale: float) -> tuple[torch.Tensor, ...]:
    """One piece's share of dq, dk and dv (k, v and theirs repeated to every head) from the
    whole output and log-sum-exp of the queries: exactly its share."""
    if q.device.type in FUSED_DEVICES:
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            g[None], q[None], k[None], v[None], out[None], lse[None], 0.0, causal,
            attn_mask=_mask(visible, q.dtype), scale=scale)
        return tuple(x[0].float() for x in grads)
    g = g.float()
    p = torch.exp(_scores(q, k, visible, scale) - _finite(lse)[..., None])
    ds = p * (torch.matmul(g, v.float().transpose(-1, -2)) - (g * out.float()).sum(-1, keepdim=True)) * scale
    return torch.matmul(ds, k.float()), torch.matmul(ds.transpose(-1, -2), q.float()), torch.matmul(p.transpose(-1, -2), g)


class _RingAttention(torch.autograd.Function):
    """Each block of keys and values attended to (`_block`) and merged into the running
    output by log-sum-exp; backward takes each block's share of the gradients from the
    whole output and log-sum-exp (`_block_backward`)."""

    @staticmethod
    def forward(ctx, q, k, v, q_index, q_doc, q_prompt, group, scale):
        size = dist.get_world_size(group)
        groups = q.shape[0] // k.shape[0]
        lse = torch.full(q.shape[:2], float("-inf"), device=q.device)  # [H, P] over the keys seen so far
        acc = torch.zeros(q.shape, device=q.device)
        block = [k, v, q_index, q_doc]
        for step in range(size):
            if step:
                block = _pass_on(block, group)
            k_b, v_b, k_index, k_doc = block
            k_all, v_all = (x.repeat_interleave(groups, dim=0) for x in (k_b, v_b))
            for t, ks, causal, visible in _parts(q, q_index, q_doc, k_index, k_doc, q_prompt):
                out_b, lse_b = _block(q[:, t], k_all[:, ks], v_all[:, ks], causal, visible, scale)
                merged = torch.logaddexp(lse[:, t], lse_b)
                acc[:, t] = (acc[:, t] * torch.exp(lse[:, t] - _finite(merged))[..., None]
                             + out_b * torch.exp(lse_b - _finite(merged))[..., None])
                lse[:, t] = merged
        out = acc.to(q.dtype)
        ctx.save_for_backward(q, k, v, q_index, q_doc, out, lse)
        ctx.q_prompt = q_prompt
        ctx.group, ctx.scale = group, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, q_index, q_doc, out, lse = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        size = dist.get_world_size(group)
        K = k.shape[0]
        groups = q.shape[0] // K
        g = grad_out.to(q.dtype).contiguous()
        dq = torch.zeros(q.shape, device=q.device)
        block = [k, v, q_index, q_doc, torch.zeros(k.shape, device=k.device), torch.zeros(v.shape, device=v.device)]
        for step in range(size):
            if step:
                block = _pass_on(block, group)
            k_b, v_b, k_index, k_doc, dk_b, dv_b = block
            k_all, v_all = (x.repeat_interleave(groups, dim=0) for x in (k_b, v_b))
            for t, ks, causal, visible in _parts(q, q_index, q_doc, k_index, k_doc, ctx.q_prompt):
                dq_t, dk_t, dv_t = _block_backward(g[:, t], q[:, t], k_all[:, ks], v_all[:, ks], out[:, t],
                                                   lse[:, t], causal, visible, scale)
                dq[:, t] += dq_t
                dk_b[:, ks] += dk_t.view(K, groups, -1, k.shape[2]).sum(1)
                dv_b[:, ks] += dv_t.view(K, groups, -1, v.shape[2]).sum(1)
            block = [k_b, v_b, k_index, k_doc, dk_b, dv_b]
        # each block's gradients back to the process that holds it
        dk, dv = _pass_on(block[4:], group) if size > 1 else block[4:]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def ring_attention(q, k, v, index, document, group, scale: float | None = None, prompt=None) -> torch.Tensor:
    """Causal attention of this process's positions over the whole row, the row's keys
    and values passed around `group`'s ring: q [H, P, d], k and v [K, P, d] (K divides H),
    `index` [P] the positions' places in the row and `document` [P] their documents' ids
    (a query sees keys of its own document at or before it, and with `prompt` [P], the id
    of its document's shared prompt or -1, every key of that prompt). Returns [H, P, d].
    Differentiable in q, k and v: backward passes the gradients round the ring too."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _RingAttention.apply(q, k, v, index, document, prompt, group, scale)


class _SumOver(torch.autograd.Function):
    """The sum of every process's `x` over `group`; backward hands each process the
    gradient unchanged, for its own part (each process then holds the gradient of the
    parameters through its own positions, summed over the group by `split_context`'s hooks)."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Gather(torch.autograd.Function):
    """A whole row's [length, ...] from every process's positions; backward hands each
    process its own positions' gradient (every process computes the same loss from it)."""

    @staticmethod
    def forward(ctx, x, length, group):
        size = dist.get_world_size(group)
        parts = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        out = x.new_empty((length, *x.shape[1:]))
        for rank, part in enumerate(parts):
            out[torch.as_tensor(shard_positions(length, size, rank), device=x.device)] = part
        ctx.mine = torch.as_tensor(shard_positions(length, size, dist.get_rank(group)), device=x.device)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.mine], None, None


def sum_over(x: torch.Tensor, group) -> torch.Tensor:
    """`x` summed over `group`, differentiable: each process's part gets the gradient."""
    return _SumOver.apply(x, group)


def gather_row(x: torch.Tensor, length: int, group) -> torch.Tensor:
    """The whole row's values (this process's `x` at its positions, the others' at theirs),
    differentiable: each process's part gets its positions' gradient."""
    return _Gather.apply(x, length, group)


def sum_gradients_over(model, group) -> None:
    """Every trained parameter's gradient summed over `group` as backward makes it, before
    it accumulates: each process's is its own positions' part (a split parameter's, its
    part's). Parameters sharded by fully_shard over every process are left to it: it sums
    over the group with the rest."""
    def summed(grad):
        grad = grad.clone()
        dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=group)
        return grad

    for p in model.parameters():
        if p.requires_grad and not (isinstance(p, DTensor) and reduced_by_shards(p, group)):
            p.register_hook(summed)


def context_row(length: int, bounds: list[int], group, device, prefix: list[int] | None = None) -> tuple:
    """(this process's positions of a row of `length` whose documents start at `bounds`,
    the attention function over them that the decoder's blocks call). `prefix`: each
    document's shared prompt document (-1 for none), as `Packed.prefix`."""
    mine = shard_positions(length, dist.get_world_size(group), dist.get_rank(group))
    index = torch.as_tensor(mine, device=device)
    documents = segments(bounds)[mine]
    document = torch.as_tensor(documents, device=device)
    prompt = None if prefix is None else torch.as_tensor(np.asarray(prefix)[documents], device=device)

    def attend(q_1HPd, k_1KPd, v_1KPd, bounds):
        return ring_attention(q_1HPd[0], k_1KPd[0], v_1KPd[0], index, document, group, prompt=prompt)[None]

    return mine, attend
