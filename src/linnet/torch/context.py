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

Each block is computed in float32 with an explicit mask, a tile of queries at a time
(about SCORE_BYTES of scores), so a process never holds more than one tile's scores
beside its share of the row.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

SCORE_BYTES = 16 << 20  # float32 scores a query tile holds (linnet.plan.memory.RING_SCORE_BYTES)


def shard_positions(length: int, ranks: int, rank: int) -> np.ndarray:
    """The row positions process `rank` of `ranks` holds, in order: chunks rank and
    2·ranks-1-rank of the row cut into 2·ranks equal chunks."""
    if length % (2 * ranks):
        raise ValueError(f"context parallel: a row of {length} positions does not cut into {2 * ranks} equal chunks "
                         f"(2 x {ranks} processes); use a row length (training.context_length) that is a multiple "
                         f"of {2 * ranks}")
    size = length // (2 * ranks)
    chunks = (rank, 2 * ranks - 1 - rank)
    return np.concatenate([np.arange(c * size, (c + 1) * size) for c in chunks])


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


def _visible(q_index, q_doc, k_index, k_doc) -> torch.Tensor:
    """[Pq, Pk] which keys each query sees: its own document's, at or before it."""
    return (q_doc[:, None] == k_doc[None, :]) & (k_index[None, :] <= q_index[:, None])


def _tiles(q, keys: int) -> list[slice]:
    """Slices of the queries whose [heads, rows, keys] float32 scores hold about SCORE_BYTES."""
    rows = max(1, SCORE_BYTES // (4 * q.shape[0] * keys))
    return [slice(i, min(i + rows, q.shape[1])) for i in range(0, q.shape[1], rows)]


def _scores(q, k, visible, scale: float) -> torch.Tensor:
    """[H, Pq, Pk] float32 scores, -inf where a key is not visible (k repeated for GQA)."""
    groups = q.shape[0] // k.shape[0]
    s = torch.matmul(q.float(), k.float().repeat_interleave(groups, dim=0).transpose(-1, -2)) * scale
    return s.masked_fill(~visible, float("-inf"))


def _finite(x: torch.Tensor) -> torch.Tensor:
    """x with -inf (a query that has seen no key yet) as 0, so exp(score - x) stays 0."""
    return torch.where(torch.isinf(x), torch.zeros_like(x), x)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, q_index, q_doc, group, scale):
        size = dist.get_world_size(group)
        groups = q.shape[0] // k.shape[0]
        top = torch.full(q.shape[:2], float("-inf"), device=q.device)  # running max of the scores
        total = torch.zeros(q.shape[:2], device=q.device)  # running sum of exp(score - top)
        acc = torch.zeros(q.shape, device=q.device)
        block = [k, v, q_index, q_doc]
        for step in range(size):
            if step:
                block = _pass_on(block, group)
            k_b, v_b, k_index, k_doc = block
            v_all = v_b.float().repeat_interleave(groups, dim=0)
            for t in _tiles(q, k_b.shape[1]):
                visible = _visible(q_index[t], q_doc[t], k_index, k_doc)
                if not visible.any():  # a later chunk's keys, or another document's: nothing to add
                    continue
                s = _scores(q[:, t], k_b, visible, scale)
                new_top = torch.maximum(top[:, t], s.amax(-1))
                p = torch.exp(s - _finite(new_top)[..., None])
                shrink = torch.exp(top[:, t] - _finite(new_top))
                total[:, t] = total[:, t] * shrink + p.sum(-1)
                acc[:, t] = acc[:, t] * shrink[..., None] + torch.matmul(p, v_all)
                top[:, t] = new_top
        out = acc / total[..., None]
        lse = torch.where(torch.isinf(top), top, top + torch.log(total))
        ctx.save_for_backward(q, k, v, q_index, q_doc, out, lse)
        ctx.group, ctx.scale = group, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, q_index, q_doc, out, lse = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        size = dist.get_world_size(group)
        K = k.shape[0]
        groups = q.shape[0] // K
        g = grad_out.float()
        delta = (g * out).sum(-1)  # [H, Pq]
        dq = torch.zeros(q.shape, device=q.device)
        block = [k, v, q_index, q_doc, torch.zeros(k.shape, device=k.device), torch.zeros(v.shape, device=v.device)]
        for step in range(size):
            if step:
                block = _pass_on(block, group)
            k_b, v_b, k_index, k_doc, dk_b, dv_b = block
            k_all = k_b.float().repeat_interleave(groups, dim=0)
            v_all = v_b.float().repeat_interleave(groups, dim=0)
            for t in _tiles(q, k_b.shape[1]):
                visible = _visible(q_index[t], q_doc[t], k_index, k_doc)
                if not visible.any():
                    continue
                s = _scores(q[:, t], k_b, visible, scale)
                p = torch.exp(s - _finite(lse[:, t])[..., None])
                dv_b = dv_b + torch.matmul(p.transpose(-1, -2), g[:, t]).view(K, groups, *v.shape[1:]).sum(1)
                ds = p * (torch.matmul(g[:, t], v_all.transpose(-1, -2)) - delta[:, t, None]) * scale
                dq[:, t] += torch.matmul(ds, k_all)
                dk_b = dk_b + torch.matmul(ds.transpose(-1, -2), q[:, t].float()).view(K, groups, *k.shape[1:]).sum(1)
            block = [k_b, v_b, k_index, k_doc, dk_b, dv_b]
        # each block's gradients back to the process that holds it
        dk, dv = _pass_on(block[4:], group) if size > 1 else block[4:]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def ring_attention(q, k, v, index, document, group, scale: float | None = None) -> torch.Tensor:
    """Causal attention of this process's positions over the whole row, the row's keys
    and values passed around `group`'s ring: q [H, P, d], k and v [K, P, d] (K divides H),
    `index` [P] the positions' places in the row and `document` [P] their documents' ids
    (a query sees keys of its own document at or before it). Returns [H, P, d].
    Differentiable in q, k and v: backward passes the gradients round the ring too."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _RingAttention.apply(q, k, v, index, document, group, scale)


def documents_of(length: int, bounds: list[int]) -> np.ndarray:
    """[length] each position's document (its index among `bounds`, the documents'
    starts then the row's end, as `Decoder._layout` gives them)."""
    out = np.zeros(length, dtype=np.int64)
    for i, start in enumerate(bounds[1:-1], start=1):
        out[start:] = i
    return out


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
    it accumulates: each process's is its own positions' part. Parameters sharded by
    fully_shard over every process are left to it: it sums over the group with the rest."""
    def summed(grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad

    for p in model.parameters():
        if p.requires_grad and not isinstance(p, DTensor):
            p.register_hook(summed)


def context_row(length: int, bounds: list[int], group, device) -> tuple[np.ndarray, object]:
    """(this process's positions of a row of `length` whose documents start at `bounds`,
    the attention function over them that the decoder's blocks call)."""
    mine = shard_positions(length, dist.get_world_size(group), dist.get_rank(group))
    index = torch.as_tensor(mine, device=device)
    document = torch.as_tensor(documents_of(length, bounds)[mine], device=device)

    def attend(q_1HPd, k_1KPd, v_1KPd, bounds):
        return ring_attention(q_1HPd[0], k_1KPd[0], v_1KPd[0], index, document, group)[None]

    return mine, attend
