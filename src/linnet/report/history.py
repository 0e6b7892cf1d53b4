"""What a trainer reports, for both backends: a `Step` per optimizer step, the `History`
of a run, and `step_items`, which cuts a stream of items (rows, pairs, prompts) into
steps and skips what a resumed run's earlier steps consumed."""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Step:
    """One optimizer step, as reported to `on_step` and kept in the history."""

    step: int
    loss: float
    learned: int  # learned positions in the step (every process)
    real: int  # non-padding positions in the step (every process)
    grad_norm: float
    lr: float
    seconds: float
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        return self.real / self.seconds if self.seconds > 0 else 0.0


@dataclass
class History:
    steps: list[Step] = field(default_factory=list)

    @property
    def losses(self) -> list[float]:
        return [s.loss for s in self.steps]

    def __len__(self) -> int:
        return len(self.steps)


def step_items(items: Iterable[Any], per_step: int, *, start: int, steps: int, what: str) -> Iterator[tuple[int, list]]:
    """Yield (step, the step's items) from `start + 1` to `steps`, first skipping the
    items that steps up to `start` consumed; stop with a warning if the items run out."""
    stream = iter(items)
    for _ in itertools.islice(stream, start * per_step):
        pass
    for step in range(start + 1, steps + 1):
        chunk = list(itertools.islice(stream, per_step))
        if not chunk:
            warnings.warn(f"{what} ran out after step {step - 1} of {steps}", stacklevel=3)
            return
        yield step, chunk


def due(step: int, every: int, last: int) -> bool:
    """Whether something done every `every` steps and at the last is due at `step`."""
    return step % every == 0 or step == last
