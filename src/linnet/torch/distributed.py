"""Across processes (torchrun): sums that keep every copy of the model in step.

With one process (or no process group) every function here is a no-op over its input,
so the trainers call them unconditionally.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) outside torchrun."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def join() -> bool:
    """Join the process group torchrun describes in the environment (WORLD_SIZE > 1),
    unless already in one: gloo for CPU tensors, NCCL for CUDA ones where CUDA is
    present. Returns whether it joined (the caller then leaves it: `leave`)."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1 or (dist.is_available() and dist.is_initialized()):
        return False
    # torch._dynamo imported after the group is made (the model's attention paths import it)
    # keeps gloo's worker threads alive past destroy_process_group; one may then free a
    # finished collective's tensors while the interpreter shuts down, and the process aborts
    # at exit ("terminate called without an active exception"; torch 2.13, about 1 run in 5)
    import torch._dynamo  # noqa: F401

    dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
    return True


@contextmanager
def process_group():
    """Join the process group torchrun describes for a command's duration and leave it
    after (nothing in one process, or when already in a group)."""
    joined = join()
    try:
        yield
        if joined:
            leave()
    finally:
        if joined and dist.is_initialized():  # a failure: the others may be gone, leave alone
            dist.destroy_process_group()


def leave() -> None:
    """Leave the process group together: a barrier, then destroy_process_group. Groups a
    model still holds (a mesh, a pipeline's stages, a split's copies) keep gloo's worker
    threads running after destroy_process_group; the barrier's wait lets them free their
    last collective's tensors while Python still runs (freed during interpreter shutdown,
    the process aborts at exit, "terminate called without an active exception": torch 2.13,
    about 1 run in 3 of a pipeline's). Call it at the end of a script that joined."""
    dist.barrier()
    dist.destroy_process_group()


def data_share(per_copy: int = 1) -> tuple[int, int]:
    """(this process's share, shares) of the data when `per_copy` processes at a time hold
    one model between them (tensor parallel, pipeline stages) and take the same batches:
    one share a copy."""
    rank, processes = world()
    if processes % per_copy:
        raise ValueError(f"config: {per_copy} processes a copy of the model (training.split x pipeline x context) "
                         f"do not divide {processes} processes")
    return rank // per_copy, processes // per_copy


def barrier() -> None:
    """Wait for every process (a no-op alone)."""
    if world()[1] > 1:
        dist.barrier()


def from_first(value):
    """The first process's `value`, on every process (any picklable object)."""
    if world()[1] == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _device() -> torch.device:
    """Where collectives want their tensors: the GPU for NCCL, the CPU for gloo."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def sum_across(values: list[float], group=None) -> list[float]:
    """Element-wise sum of host numbers over every process, or over `group` (one collective)."""
    if world()[1] == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=_device())
    dist.all_reduce(t, group=group)
    return t.tolist()


def merged_at_first(entries: dict) -> dict:
    """Every process's `entries` merged at the first process (the others get their own
    back): the stages of a pipeline each hold part of a model's tensors."""
    if world()[1] == 1:
        return entries
    parts = [None] * world()[1] if world()[0] == 0 else None
    dist.gather_object(entries, parts, dst=0)
    return {k: v for part in parts for k, v in part.items()} if parts is not None else entries


def union_across(names: set) -> set:
    """The union of every process's `names`, on every process."""
    if world()[1] == 1:
        return set(names)
    every: list = [None] * world()[1]
    dist.all_gather_object(every, set(names))
    return set().union(*every)


def most_across(value: int, group=None) -> int:
    """The largest `value` of any process (of `group`)."""
    if world()[1] == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t)


def _sharded(models) -> bool:
    return any(isinstance(p, DTensor) for m in models if m is not None for p in m.parameters())


def passes_short(passes: int, *models) -> int:
    """How many passes this process must add to a step's `passes` to make as many as the
    busiest process: a sharded model's (fully_shard) every forward and backward gathers
    and reduces across the processes, so each must make every one. 0 unless a model is
    sharded. A collective itself: call it before the step's first pass."""
    return most_across(passes) - passes if _sharded(models) else 0


def matched(rows: Sequence, *models) -> Iterator:
    """`rows`, then the idle passes that bring this process's forward passes through the
    models to the busiest process's count (see `passes_short`): for loops of passes outside
    a training step (reference log-probabilities, scores, evaluation). Every process must
    iterate it together."""
    short = passes_short(len(rows), *models)
    yield from rows
    idle_passes(short, *models, row=rows[0] if rows else None)


def idle_passes(count: int, *models, row=None) -> None:
    """`count` passes of `row` (by default a two-token row) through every model given,
    adding zero to the gradients (see `passes_short`)."""
    if count and row is None:
        from linnet.packing import Example, pack

        row = next(pack([Example.plain([0, 0])], tokens=2))
    for _ in range(count):
        for m in models:
            if m is None:
                continue
            if getattr(m, "pipe", None) is not None:  # its stages together, forward only (a held-out pass)
                m.pipe.loss(row)
                continue
            out = m.log_probs_packed(row)
            if out.requires_grad:
                (out.sum() * 0).backward()


# Gradients are summed in flat buffers of at most this many bytes (one larger is summed in
# place): a buffer of every gradient would hold them all twice at the end of backward.
BUCKET_BYTES = 32 << 20


def reduce_gradients(parameters: list[torch.nn.Parameter], group=None) -> None:
    """Sum gradients over processes, in flat buffers of up to BUCKET_BYTES per dtype. Each
    process has already divided by the global count of learned positions, so the sum is
    the mean over every token of the step. A parameter without a gradient counts as zero.
    Without `group`, over every process, skipping sharded parameters (fully_shard has
    reduced them already; expert parallel's experts are summed over their copies alone);
    with it (a split, pipelined or context-parallel model's copies), over the group,
    skipping those fully_shard split over processes that include it, each process summing
    its own part of a split parameter (a whole adapter's partial sums joined across its
    split first); no sum when the group is this process alone."""
    if world()[1] == 1:
        return
    alone = group is not None and dist.get_world_size(group) == 1
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in parameters:
        if isinstance(p, DTensor) and (group is None or reduced_by_shards(p, group)):
            if group is None:
                _sum_replicas(p)
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if isinstance(p.grad, DTensor) and any(place.is_partial() for place in p.grad.placements):
            # a whole (replicated) adapter of a split layer: each process of the split holds a partial sum
            p.grad = p.grad.redistribute(placements=p.placements)
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        if not alone:
            by_dtype.setdefault(grad.dtype, []).append(grad)
    for grads in by_dtype.values():
        bucket: list[torch.Tensor] = []
        for g in grads:
            if g.nbytes >= BUCKET_BYTES and g.is_contiguous():
                dist.all_reduce(g, group=group)
                continue
            if bucket and sum(b.nbytes for b in bucket) + g.nbytes > BUCKET_BYTES:
                _reduce_flat(bucket, group)
                bucket = []
            bucket.append(g)
        if bucket:
            _reduce_flat(bucket, group)


def _sum_replicas(p: DTensor) -> None:
    """A split parameter's gradient summed along the mesh dimensions that hold copies of it
    (expert parallel inside data parallel), each copy's having its own rows' share."""
    for axis, place in enumerate(p.placements):
        if place.is_replicate():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad.to_local(), group=p.device_mesh.get_group(axis))


def reduced_by_shards(t: DTensor, group) -> bool:
    """Whether fully_shard has summed `t`'s gradient over `group` already: `t` is cut along
    a dimension whose processes include all of the group's (the copies of a sharded stage
    or split part, or every process, context groups included)."""
    ranks = set(dist.get_process_group_ranks(group))
    return any(cuts(place) and ranks <= set(dist.get_process_group_ranks(t.device_mesh.get_group(axis)))
               for axis, place in enumerate(t.placements))


def cuts(place) -> bool:
    """Whether a DTensor placement splits the tensor along a dimension: a Shard, or the
    strided shard FSDP places on a tensor-parallel part."""
    return place.is_shard() or isinstance(place, _StridedShard)


def sharded_over(t: torch.Tensor, group) -> bool:
    """Whether `t` is a DTensor split over exactly the processes of `group` (a pipeline
    stage's parameter fully_shard split over its copies), not over a tensor-parallel split."""
    if not isinstance(t, DTensor) or group is None:
        return False
    ranks = dist.get_process_group_ranks(group)
    return any(cuts(place) and dist.get_process_group_ranks(t.device_mesh.get_group(axis)) == ranks
               for axis, place in enumerate(t.placements))


def _reduce_flat(grads: list[torch.Tensor], group) -> None:
    """Sum `grads` over `group` through one flat buffer, written back in place."""
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def clip_gradients(parameters: list[torch.nn.Parameter], max_norm: float | None, across=None) -> torch.Tensor:
    """The global gradient norm (float32), after scaling gradients down to `max_norm`
    when it is exceeded; None only measures. Sharded gradients (fully_shard, a split
    layer's, expert_parallel's experts) add their parts' squares across processes; whole
    ones, replicated ones included, count once, unless `across` (a pipeline's stages, each
    holding other parameters) adds every process's squares."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads and across is None:
        return torch.zeros(())
    by_cut: dict[tuple, list] = {}  # the mesh dimensions a gradient is cut along -> (their groups, its parts)
    whole = []  # replicated ones count once
    for g in grads:
        axes = [a for a, place in enumerate(g.placements) if cuts(place)] if isinstance(g, DTensor) else []
        if not axes:
            whole.append(g.to_local() if isinstance(g, DTensor) else g)
            continue
        names = tuple(g.device_mesh.mesh_dim_names[a] if g.device_mesh.mesh_dim_names else str(a) for a in axes)
        by_cut.setdefault(names, ([g.device_mesh.get_group(a) for a in axes], []))[1].append(g.to_local())
    squares = _squares(whole, grads[0].device if grads else _device())
    for names in sorted(by_cut):  # the same order on every process
        groups, parts = by_cut[names]
        summed = _squares(parts, squares.device)
        for group in groups:  # summed along each dimension in turn: over the whole grid of parts
            dist.all_reduce(summed, group=group)
        squares = squares + summed
    parts = [p for _, ps in by_cut.values() for p in ps]
    if across is not None:
        dist.all_reduce(squares, group=across)
    norm = squares.sqrt()
    if max_norm is not None:
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for g in parts + whole:
            g.mul_(scale.to(g.device))
    return norm


def _squares(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of the squares of every element, in float32."""
    if not tensors:
        return torch.zeros((), device=device)
    return torch.stack([torch.linalg.vector_norm(t, dtype=torch.float32) ** 2 for t in tensors]).sum()
