"""Learning-rate schedules as pure functions of the step: each is a small picklable object
whose call gives the multiplier of the peak rate at a step, for PyTorch (a `LambdaLR`
over it, whose state saves with a checkpoint) and JAX (a table of rates) alike.

    factor = schedule_factor(config.lr_schedule, total=200)    # a config's group
    factor(0), factor(9), factor(199)     # 0.1, 1.0, ~0.1
    schedule = cosine_schedule(optimizer, 10, 200, floor=0.1)   # the same, as a LambdaLR

Warmup is linear from lr/warmup at the first step to the peak at step `warmup`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


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


def cosine(warmup: int, total: int, *, floor: float = 0.0) -> Cosine:
    """Linear warmup, then a half cosine from the peak down to `floor` x peak at `total`."""
    _check(warmup, total, floor)
    return Cosine(warmup, total, floor)


def wsd(warmup: int, total: int, *, decay: float = 0.2, floor: float = 0.0) -> WarmupStableDecay:
    """Warmup-stable-decay: warmup, the peak held, then a linear decay to `floor` x peak
    over the last `decay` share of `total` (a share in (0, 1], or a step count)."""
    _check(warmup, total, floor)
    steps = round(decay * total) if decay <= 1 else int(decay)
    if not 0 < steps <= total - warmup:
        raise ValueError(f"wsd_schedule: decay={decay} gives {steps} steps; it must fit after the warmup")
    return WarmupStableDecay(warmup, total, steps, floor)


def constant(warmup: int = 0) -> Constant:
    """Linear warmup, then the peak lr."""
    _check(warmup)
    return Constant(warmup)


def schedule_factor(lr_schedule, total: int):
    """The factor of a config's `lr_schedule` group (its name, warmup_steps, min_lr_ratio and
    decay_fraction; linnet.config's LRScheduleConfig) over `total` steps; a schedule that
    cannot fit raises, naming the fields to change."""
    s = lr_schedule
    try:
        if s.name == "cosine":
            return cosine(s.warmup_steps, total, floor=s.min_lr_ratio)
        if s.name == "wsd":
            return wsd(s.warmup_steps, total, decay=s.decay_fraction, floor=s.min_lr_ratio)
        if s.name == "constant":
            return constant(s.warmup_steps)
    except ValueError as e:
        if s.warmup_steps > total:
            raise ValueError(f"config: lr_schedule.warmup_steps={s.warmup_steps} is more than the run's {total} "
                             "steps; lower lr_schedule.warmup_steps (0: no warmup) or train for more steps") from None
        raise ValueError(f"config: lr_schedule ({s.name}) over {total} steps: {e}") from None
    raise ValueError(f"config: lr_schedule.name={s.name!r}; use cosine, wsd or constant")


def lambda_schedule(optimizer, factor):
    """A PyTorch `LambdaLR` stepping `optimizer`'s rates by `factor`."""
    from torch.optim.lr_scheduler import LambdaLR

    return LambdaLR(optimizer, factor)


def cosine_schedule(optimizer, warmup: int, total: int, *, floor: float = 0.0):
    """`cosine` as a PyTorch schedule of `optimizer`."""
    return lambda_schedule(optimizer, cosine(warmup, total, floor=floor))


def wsd_schedule(optimizer, warmup: int, total: int, *, decay: float = 0.2, floor: float = 0.0):
    """`wsd` as a PyTorch schedule of `optimizer`."""
    return lambda_schedule(optimizer, wsd(warmup, total, decay=decay, floor=floor))


def constant_schedule(optimizer, warmup: int = 0):
    """`constant` as a PyTorch schedule of `optimizer`."""
    return lambda_schedule(optimizer, constant(warmup))
