"""A progress bar for long loops: a redrawn line with the rate and the time left on a
terminal; nothing when the output is not a terminal (logs, CI, pipes: the command's
summary says how it went) or under `linnet --quiet` (LINNET_QUIET=1)."""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager


def quiet() -> bool:
    """Whether bars are off for this process (`linnet --quiet …` sets LINNET_QUIET=1)."""
    return os.environ.get("LINNET_QUIET", "") not in ("", "0")


class Progress:
    """A bar of `total` units. Its rate and time left count from the first update on, so a
    phase before it (a reference's log-probabilities, a compile) does not skew them."""

    def __init__(self, total: int, label: str, *, stream=None, width: int = 24, unit: str = "it"):
        self.total, self.label, self.width, self.unit = max(1, total), label, width, unit
        self.stream = stream or sys.stderr
        self.shown = self.stream.isatty() and not quiet()
        self.start = time.perf_counter()
        self.first: tuple[int, float] | None = None  # (done, time) at the first update

    def update(self, done: int, **values: float) -> None:
        if not self.shown:
            return
        now = time.perf_counter()
        if self.first is None:
            self.first = (done, now)
        since, then = self.first
        if done <= since:  # the first update itself: the rate since the bar began
            since, then = 0, self.start
        rate = (done - since) / (now - then) if now > then else 0.0
        eta = (self.total - done) / rate if rate > 0 else 0.0
        shown = " ".join(f"{k} {v:.4g}" for k, v in values.items())
        filled = int(min(1.0, done / self.total) * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(f"\r{self.label} [{bar}] {done:,}/{self.total:,} {shown} {rate:,.3g} {self.unit}/s "
                          f"eta {eta:.0f}s ")
        self.stream.flush()

    def close(self) -> None:
        if self.shown:
            self.stream.write("\n")
            self.stream.flush()


@contextmanager
def phase(label: str, what: str, total: int, unit: str = "it"):
    """A long stretch of work outside the training steps (a reference model's
    log-probabilities before step 1): a line when it starts and one when it ends, with its
    time, and a bar between on a terminal. The first process alone speaks (torchrun's RANK);
    `linnet --quiet` silences it. Yields the bar (`update(done)`)."""
    lead = os.environ.get("RANK", "0") == "0" and not quiet()
    started = time.perf_counter()
    if lead:
        print(f"{label}: {what} ...", file=sys.stderr, flush=True)
    bar = Progress(total, label, unit=unit)
    bar.shown = bar.shown and lead
    try:
        yield bar
    finally:
        bar.close()
        if lead:
            print(f"{label}: {what}: done in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
