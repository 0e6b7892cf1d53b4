"""`linnet plot RUN_DIR`: curves.png from a run's metrics.jsonl."""

from __future__ import annotations

import argparse
from pathlib import Path

from linnet.files.atomic import atomic_path
from linnet.report.metrics import FILE, read_metrics
from linnet.report.plots import plot_metrics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="linnet plot", description="Write curves.png for a run directory.")
    parser.add_argument("run", help="a run directory holding metrics.jsonl, or that file")
    parser.add_argument("--out", help="PNG path (default: RUN/curves.png)")
    args = parser.parse_args(argv)
    source = Path(args.run)
    folder = source if source.is_dir() else source.parent  # RUN or RUN/metrics.jsonl
    out = Path(args.out or folder / "curves.png")
    with atomic_path(out) as tmp:  # a PNG already there is replaced whole or kept
        plot_metrics(read_metrics(source), tmp, title=folder.name,
                     source=str(source if source.suffix == ".jsonl" else source / FILE))
    print(out)
    return 0
