"""A progress bar for long loops: a redrawn line on a terminal, a line every few
percent in a log file (CI, nohup), and nothing the caller has to set up."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, label: str, *, stream=None, width: int = 24):
        self.total, self.label, self.width = max(1, total), label, width
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.start = time.perf_counter()
        self.last_logged = -1

    def update(self, done: int, **values: float) -> None:
        frac = min(1.0, done / self.total)
        elapsed = time.perf_counter() - self.start
        eta = elapsed / frac - elapsed if frac > 0 else 0.0
        shown = " ".join(f"{k} {v:.4g}" for k, v in values.items())
        if self.tty:
            filled = int(frac * self.width)
            bar = "#" * filled + "." * (self.width - filled)
            self.stream.write(f"\r{self.label} [{bar}] {done}/{self.total} {shown} eta {eta:.0f}s ")
        else:
            decile = int(frac * 10)
            if decile == self.last_logged and done != self.total:
                return
            self.last_logged = decile
            self.stream.write(f"{self.label} {done}/{self.total} {shown} ({elapsed:.0f}s)\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
