"""Model and hardware FLOPs utilization of a run: what share of the device's peak the
training steps use.

    peak, where = device_peak(torch.device("cpu"), torch.float32)   # measured here
    mfu = flops_per_token(card, 4096, frozen_base=True) * tokens_per_second / peak

Model FLOPs (MFU) count the work the method needs (N: the parameters a token computes
with, a mixture of experts' chosen experts alone): 6N a token for full training (2N
forward, 4N backward), 4N when the base is frozen (adapters: no weight gradients for the
base), plus attention's 12·L·d·s (PaLM's convention; s the packed row's length, an upper
bound where documents are shorter). Hardware FLOPs (HFU) add what activation
checkpointing computes again: a second forward, 2N and a third of attention's.

A GPU's peak is the planner's table (dense bf16; TF32, half of it, for float32), found by
the device's name; a CPU's is measured: the best of a few matmuls in the run's dtype on
the threads torch uses.
"""

from __future__ import annotations

import time
from functools import cache

import torch

from linnet.plan import ACCELERATORS


def flops_per_token(card, context: int, *, frozen_base: bool = False, recompute: bool = False) -> float:
    """Training FLOPs a token: model FLOPs, or with `recompute` hardware FLOPs (see the
    module docstring)."""
    n, attention = card.active_params(), 12 * card.layers * card.heads * card.head_dim * context
    flops = (4 if frozen_base else 6) * n + attention
    return flops + (2 * n + attention / 3 if recompute else 0)


@cache
def device_peak(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """(peak FLOP/s, where the figure comes from) of matmuls in `dtype` on `device`."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device).lower()
        found = [a for key, a in ACCELERATORS.items() if key.split("-")[0] in name]
        if found:
            gpu = max(found, key=lambda a: len(a.name))
            half = dtype in (torch.bfloat16, torch.float16)
            return gpu.bf16_tflops * 1e12 / (1 if half else 2), f"{gpu.name}'s {'bf16' if half else 'TF32'} peak"
    return _measured(device, dtype), f"{device.type} matmuls measured in {str(dtype).removeprefix('torch.')}"


def _measured(device: torch.device, dtype: torch.dtype, size: int = 1024) -> float:
    """The best rate of a few [size, size] matmuls (a CPU's, or a GPU the table lacks). The
    operands come from a generator of their own: a run's global RNG (its dropout masks)
    must not depend on whether this process measured before (a resumed run measures again)."""
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, generator=g).to(dtype)
    b = torch.randn(size, size, device=device, generator=g).to(dtype)
    best = float("inf")
    for _ in range(4):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def utilization(card, context: int, tokens_per_second: float, device: torch.device, dtype: torch.dtype, *,
                frozen_base: bool, recompute: bool) -> dict[str, float]:
    """{"mfu", "hfu"}: model and hardware FLOPs of `tokens_per_second` over the device's peak."""
    peak, _ = device_peak(device, dtype)
    rate = tokens_per_second / peak
    return {"mfu": flops_per_token(card, context, frozen_base=frozen_base) * rate,
            "hfu": flops_per_token(card, context, frozen_base=frozen_base, recompute=recompute) * rate}
