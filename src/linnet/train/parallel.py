"""Across processes (torchrun): sums that keep every copy of the model in step.

With one process (or no process group) every function here is a no-op over its input,
so the trainers call them unconditionally.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) outside torchrun."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def join() -> bool:
    """Join the process group torchrun describes in the environment (WORLD_SIZE > 1),
    unless already in one: gloo for CPU tensors, NCCL for CUDA ones where CUDA is
    present. Returns whether it joined (the caller then destroys the group)."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1 or (dist.is_available() and dist.is_initialized()):
        return False
    dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
    return True


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


def sum_across(values: list[float]) -> list[float]:
    """Element-wise sum of host numbers over every process (one collective)."""
    if world()[1] == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=_device())
    dist.all_reduce(t)
    return t.tolist()


def reduce_gradients(parameters: list[torch.nn.Parameter]) -> None:
    """Sum gradients over processes in one flat buffer per dtype. Each process has
    already divided by the global count of learned positions, so the sum is the mean
    over every token of the step. A parameter without a gradient counts as zero."""
    if world()[1] == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for p in parameters:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        by_dtype.setdefault(p.grad.dtype, []).append(p)
    for group in by_dtype.values():
        flat = torch.cat([p.grad.reshape(-1) for p in group])
        dist.all_reduce(flat)
        offset = 0
        for p in group:
            n = p.grad.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
            offset += n


def clip_gradients(parameters: list[torch.nn.Parameter], max_norm: float | None) -> torch.Tensor:
    """The global gradient norm (float32), after scaling gradients down to `max_norm`
    when it is exceeded; None only measures."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if max_norm is not None:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
    return norm
