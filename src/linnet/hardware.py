"""What the machine computes natively, read from its flags rather than its name.

A CPU with AMX (`amx_bf16`) or AVX-512 BF16 (`avx512_bf16`) multiplies bfloat16 faster
than float32; one without them (AVX2 only) emulates bfloat16, and there an SFT-LoRA step
of a 7M model took 44 s in bf16 against 2.1 s in f32 (21x, on this project's AVX2 machine). No torch here.
"""

from __future__ import annotations

import functools
import os
import platform

BF16_FLAGS = ("amx_bf16", "avx512_bf16")
EMULATED_BF16_SLOWDOWN = 21  # the step above, f32 2.1 s against bf16 44 s


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo; empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_bf16_flag() -> str | None:
    """The flag that gives this CPU fast bfloat16 matmuls, or None. Apple silicon has
    bf16 dot products too, but torch's CPU kernels there are float32's: None."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    return next((flag for flag in BF16_FLAGS if flag in cpu_flags()), None)


def cpu_reorders_projections() -> bool:
    """Whether a float32 sampling engine on this CPU runs its projections through weights
    reordered for oneDNN (`linnet.torch.passes.reorder_weights`): with AVX-512, where that was
    1.09x sampling 4 prompts x 8 x 64 at 7M (AMD EPYC Zen 4; the 60M model's fused
    [32, 512] x [512, 3072] gate and up at 105 GFLOP/s reordered against 64 plain); not with
    AVX2 alone (0.91-0.99x on an AVX2 EPYC, where weights laid out transposed gained)."""
    return platform.machine() in ("x86_64", "AMD64") and "avx512f" in cpu_flags()


def cpu_prefers_bf16() -> bool:
    """What dtype "auto" takes on this CPU: bfloat16 when it has the flag for it.
    LINNET_CPU_BF16=0 or 1 decides instead (a virtual machine that hides its flags; runs
    that must compute alike on every machine, as the test suite does)."""
    forced = os.environ.get("LINNET_CPU_BF16")
    if forced in ("0", "1"):
        return forced == "1"
    return cpu_bf16_flag() is not None
