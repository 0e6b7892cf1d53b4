"""Learning-rate schedules: a multiplier of each parameter group's peak lr per step.

Each is a `LambdaLR` over a small picklable object, so its state saves with a checkpoint.
Warmup is linear from lr/warmup at the first step to the peak at step `warmup`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch.optim.lr_scheduler import LambdaLR


def _warmup(step: int, warmup: int) -> float | None:
    return (step + 1) / warmup if step < warmup else None


@dataclass
class Cosine:
    warmup: int
    total: int
    floor: float

    def __call__(self, step: int) -> float:
        rising = _warmup(step, self.warmup)
        if rising is not None:
            return rising
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.floor + (1 - self.floor) * 0.5 * (1 + math.cos(math.pi * progress))


@dataclass
class WarmupStableDecay:
    warmup: int
    total: int
    decay: int
    floor: float

    def __call__(self, step: int) -> float:
        rising = _warmup(step, self.warmup)
        if rising is not None:
            return rising
        start = self.total - self.decay
        if step < start:
            return 1.0
        progress = min(1.0, (step - start + 1) / max(1, self.decay))
        return self.floor + (1 - self.floor) * (1 - progress)


@dataclass
class Constant:
    warmup: int

    def __call__(self, step: int) -> float:
        rising = _warmup(step, self.warmup)
        return 1.0 if rising is None else rising


def _check(warmup: int, total: int | None = None, floor: float = 0.0) -> None:
    if warmup < 0:
        raise ValueError(f"schedule: warmup={warmup}; it must be >= 0")
    if total is not None and total < max(1, warmup):
        raise ValueError(f"schedule: total={total} must be at least warmup={warmup} (and 1)")
    if not 0.0 <= floor <= 1.0:
        raise ValueError(f"schedule: floor={floor} is a fraction of the peak lr, in [0, 1]")


def cosine_schedule(optimizer, warmup: int, total: int, *, floor: float = 0.0) -> LambdaLR:
    """Linear warmup, then a half cosine from the peak down to `floor` x peak at `total`."""
    _check(warmup, total, floor)
    return LambdaLR(optimizer, Cosine(warmup, total, floor))


def wsd_schedule(optimizer, warmup: int, total: int, *, decay: float = 0.2, floor: float = 0.0) -> LambdaLR:
    """Warmup-stable-decay: warmup, the peak held, then a linear decay to `floor` x peak
    over the last `decay` share of `total` (a share in (0, 1], or a step count)."""
    _check(warmup, total, floor)
    steps = round(decay * total) if decay <= 1 else int(decay)
    if not 0 < steps <= total - warmup:
        raise ValueError(f"wsd_schedule: decay={decay} gives {steps} steps; it must fit after the warmup")
    return LambdaLR(optimizer, WarmupStableDecay(warmup, total, steps, floor))


def constant_schedule(optimizer, warmup: int = 0) -> LambdaLR:
    """Linear warmup, then the peak lr."""
    _check(warmup)
    return LambdaLR(optimizer, Constant(warmup))
