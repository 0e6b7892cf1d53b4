"""metrics.jsonl, the record of a run: one JSON row a step, written as the run goes (with
a progress bar) and read back for summaries, resumes and plots."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from linnet.files.atomic import write_text, writing
from linnet.report.progress import Progress

FILE = "metrics.jsonl"


class MetricsFile:
    """Appends rows to a metrics file, flushing each, and moves a progress bar over
    `steps` (none with progress=False)."""

    def __init__(self, path: str | os.PathLike, label: str, steps: int, *, progress: bool = True, trackers=None):
        self.path = Path(path)
        self.file = open(path, "a")
        self.bar = Progress(steps, label) if progress else None
        self.trackers = trackers  # linnet.report.tracking.Trackers: each row goes to them too

    def write(self, row: dict[str, Any], **shown: float) -> None:
        """Append `row` (it has a "step"); the bar shows `shown`."""
        with writing(self.path):  # a full disk names this file
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()
        if self.trackers is not None:
            self.trackers.log(row)
        if self.bar is not None:
            self.bar.update(row["step"], **shown)

    def close(self) -> None:
        self.file.close()
        if self.bar is not None:
            self.bar.close()
        if self.trackers is not None:
            self.trackers.finish()


def read_metrics(run: str | os.PathLike, *, missing_ok: bool = False) -> list[dict]:
    """The rows of a run directory's metrics.jsonl (or of that file itself); a torn last
    line, the trace of a killed write, is left out."""
    path = Path(run)
    path = path / FILE if path.is_dir() or path.suffix != ".jsonl" else path
    if not path.is_file():
        if missing_ok:
            return []
        raise FileNotFoundError(f"{path}: no metrics; is {run} a linnet run directory?")
    rows = []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    for number, line in enumerate(lines, start=1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines):  # a write cut short by a kill: the step it began is not kept
                break
            raise ValueError(f"{path} line {number}: not a JSON row ({line[:40]!r}…); the metrics file is "
                             "damaged there") from None
    return rows


def keep_metrics(source: str | os.PathLike, target: str | os.PathLike, step: int) -> None:
    """`target` holds the rows of `source` up to `step`: what a run resumed from that
    step would otherwise log twice is dropped."""
    rows = [r for r in read_metrics(source, missing_ok=True) if r.get("step", 0) <= step]
    write_text(target, "".join(json.dumps(r) + "\n" for r in rows))
