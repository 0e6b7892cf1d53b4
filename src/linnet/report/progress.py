"""A progress bar for long loops: a redrawn line with the rate and the time left on a
terminal; nothing when the output is not a terminal (logs, CI, pipes: the command's
summary says how it went) or under `linnet --quiet` (LINNET_QUIET=1)."""

from __future__ import annotations

import os
import sys
import time


def quiet() -> bool:
    """Whether bars are off for this process (`linnet --quiet …` sets LINNET_QUIET=1)."""
    return os.environ.get("LINNET_QUIET", "") not in ("", "0")


class Progress:
    def __init__(self, total: int, label: str, *, stream=None, width: int = 24, unit: str = "it"):
        self.total, self.label, self.width, self.unit = max(1, total), label, width, unit
        self.stream = stream or sys.stderr
        self.shown = self.stream.isatty() and not quiet()
        self.start = time.perf_counter()

    def update(self, done: int, **values: float) -> None:
        if not self.shown:
            return
        frac = min(1.0, done / self.total)
        elapsed = time.perf_counter() - self.start
        eta = elapsed / frac - elapsed if frac > 0 else 0.0
        rate = done / elapsed if elapsed > 0 else 0.0
        shown = " ".join(f"{k} {v:.4g}" for k, v in values.items())
        filled = int(frac * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(f"\r{self.label} [{bar}] {done:,}/{self.total:,} {shown} {rate:,.3g} {self.unit}/s "
                          f"eta {eta:.0f}s ")
        self.stream.flush()

    def close(self) -> None:
        if self.shown:
            self.stream.write("\n")
            self.stream.flush()
