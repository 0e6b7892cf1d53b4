"""A training run, for both backends: the `Run` (the plumbing every objective shares,
declared once), the `Step` each optimizer step reports, the run's `History`, and
`step_items`, which cuts a stream of items (rows, pairs, prompts) into steps and skips
what a resumed run's earlier steps consumed.

Every trainer (`linnet.train.train`, `dpo`, `kto`, `reward`, `distill`, `grpo`, and the
JAX ones) takes the run as `run=Run(...)` or as the Run's fields given as keywords, the
seeds' way:

    train(model, pack(examples, tokens=4096), optimizer=opt, steps=1000, accumulate=8)
    grpo(policy, engine, prompts, reward, Run(optimizer=opt, steps=200, clip=0.5), group=8)
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import math
import numbers
import os
import re
import signal
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
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


class Lookahead:
    """An iterator whose next items can be read ahead (`peek`) without taking them."""

    def __init__(self, items):
        self.items, self.buffer = iter(items), []

    def __iter__(self) -> Iterator:
        return self

    def __next__(self):
        return self.buffer.pop(0) if self.buffer else next(self.items)

    def peek(self, n: int) -> list:
        while len(self.buffer) < n:
            try:
                self.buffer.append(next(self.items))
            except StopIteration:
                break
        return self.buffer[:n]


def step_items(items: Iterable[Any], per_step: int, *, start: int, steps: int,
               what: str) -> Iterator[tuple[int, list, bool]]:
    """Yield (step, the step's items, whether it is the run's last) from `start + 1` to
    `steps`, first skipping the items that steps up to `start` consumed. The last is step
    `steps` or the one the items run out after (an item is read ahead to know, so the end's
    checkpoint and evaluation happen there too); then a warning says they ran out."""
    stream = items if isinstance(items, Lookahead) else Lookahead(items)
    for _ in itertools.islice(stream, start * per_step):
        pass
    for step in range(start + 1, steps + 1):
        chunk = list(itertools.islice(stream, per_step))
        if not chunk:
            warnings.warn(f"{what} ran out after step {step - 1} of {steps}", stacklevel=3)
            return
        yield step, chunk, step == steps or not stream.peek(1)


def due(step: int, every: int, last: bool) -> bool:
    """Whether something done every `every` steps and at the last is due at `step`."""
    return step % every == 0 or last


@dataclass
class Run:
    """The plumbing of a training run, the same for every objective and both backends.

    optimizer         a torch.optim optimizer over the trained parameters (JAX: an optax one)
    steps             optimizer steps to take
    clip              the gradient-norm clip (None: no clipping; the norm is still reported
                      and a non-finite one still stops the run)
    schedule          a torch LR scheduler stepped after every step (JAX: schedule inside
                      the optax optimizer)
    save_to           where the result goes: the adapters alone (PEFT) after add_lora,
                      else the whole model's weights
    checkpoint        a directory: resume from its latest checkpoint (skipping the items
                      its steps took), write one every `checkpoint_every` steps and at the
                      end, keeping the `keep` latest
    on_step           called with each Step, after its held-out metrics are in
    evaluate          held-out metrics (a dict, added to the Step's metrics) every
                      `evaluate_every` steps and at the last: evaluate(model) in PyTorch,
                      evaluate(params) in JAX
    """

    optimizer: Any
    steps: int
    clip: float | None = 1.0
    schedule: Any = None
    save_to: str | os.PathLike | None = None
    checkpoint: str | os.PathLike | None = None
    checkpoint_every: int = 100
    keep: int = 2
    on_step: Callable[[Step], None] | None = None
    evaluate: Callable[[Any], dict] | None = None
    evaluate_every: int = 50

    def __post_init__(self):
        def whole(value: Any) -> bool:  # an integer, or a float holding one (not a bool, nan or infinity)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                return False
            return isinstance(value, numbers.Integral) or (math.isfinite(value) and float(value).is_integer())

        counts = {"steps": (self.steps, 0), "checkpoint_every": (self.checkpoint_every, 1), "keep": (self.keep, 1),
                  "evaluate_every": (self.evaluate_every, 1)}
        for name, (value, least) in counts.items():
            if not whole(value):
                raise ValueError(f"Run: {name}={value} must be a whole number >= {least}")
            if value < least:
                raise ValueError(f"Run: {name}={value} must be >= {least}")
        if self.clip is not None and (isinstance(self.clip, bool) or not isinstance(self.clip, numbers.Real)
                                      or not (math.isfinite(self.clip) and self.clip > 0)):
            raise ValueError(f"Run: clip={self.clip}; use a positive, finite gradient-norm threshold (a negative one "
                             "would step uphill, 0 would freeze training), or None for no clipping")


RUN_FIELDS = frozenset(f.name for f in dataclasses.fields(Run))


def run_and_options(who: str, run: Run | None, options: dict[str, Any], settings: type | None = None,
                    given: Any = None) -> tuple[Run, Any]:
    """(the Run, the objective's settings) of a trainer's call: `run`, or the Run's fields
    given as keywords (both: the keywords replace the run's); the rest of `options` are the
    fields of the objective's `settings` dataclass, over `given` settings when passed. A
    name in both (GRPO's ratio `clip`) is the objective's. An unknown name is refused,
    with the names there are."""
    own = {f.name for f in dataclasses.fields(settings)} if settings is not None else set()
    plumbing = {k: v for k, v in options.items() if k in RUN_FIELDS and k not in own}
    unknown = sorted(set(options) - own - set(plumbing))
    if unknown:
        names = ", ".join(sorted(own)) or "none"
        near = sorted({m for u in unknown for m in difflib.get_close_matches(u, [*RUN_FIELDS, *own], n=1)})
        hint = f" (did you mean {', '.join(near)}?)" if near else ""
        raise TypeError(f"{who}: unknown option {', '.join(unknown)}{hint}; the run's are "
                        f"{', '.join(sorted(RUN_FIELDS))} (linnet.run.Run), the objective's {names}, and {who}'s own "
                        "keywords (its signature)")
    if run is None:
        missing = [name for name in ("optimizer", "steps") if name not in plumbing]
        if missing:
            raise TypeError(f"{who}: give run=Run(...) or {' and '.join(f'{m}=' for m in missing)}")
        run = Run(**plumbing)
    elif plumbing:
        run = dataclasses.replace(run, **plumbing)
    if settings is None:
        return run, None
    chosen = {k: v for k, v in options.items() if k in own}
    try:  # the settings check themselves as their YAML group does
        base = given if given is not None else settings()
        return run, dataclasses.replace(base, **chosen) if chosen else base
    except ValueError as e:  # ... and are told here in the Python spelling
        group = getattr(settings, "YAML", None)
        message = re.sub(r"^config: ", f"{who}: ", str(e))
        raise ValueError(re.sub(rf"\b{group}\.(\w+)", r"\1", message) if group else message) from None


class Preempted(Exception):
    """The run stopped when asked to (SIGTERM: what clusters and spot instances send before
    they take a machine back) after the step in progress, with a checkpoint of that step
    written to `checkpoint` (None when the run keeps none)."""

    def __init__(self, step: int, checkpoint: str | os.PathLike | None):
        self.step, self.checkpoint = step, checkpoint
        kept = f"; its checkpoint is in {checkpoint}" if checkpoint is not None else "; the run keeps no checkpoint"
        super().__init__(f"stopped after step {step} as asked (SIGTERM){kept}")


_STOP = threading.Event()
_ARMED = threading.Event()


@contextmanager
def stop_after_a_step(signals=(signal.SIGTERM,)):
    """Inside it, `signals` ask the run to stop once the step in progress is done: every
    trainer's fit writes that step's checkpoint and raises Preempted. The command line
    wraps each training command in it; the handlers before it come back after."""
    _STOP.clear()
    before = {s: signal.signal(s, lambda *_: _STOP.set()) for s in signals}
    _ARMED.set()
    try:
        yield
    finally:
        _ARMED.clear()
        for s, handler in before.items():
            signal.signal(s, handler)


def stop_asked() -> bool | None:
    """Whether a stop was asked for: None outside `stop_after_a_step` (nobody listens)."""
    return _STOP.is_set() if _ARMED.is_set() else None
