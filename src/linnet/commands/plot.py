"""`linnet plot RUN_DIR`: curves.png from a run's metrics.jsonl."""

from __future__ import annotations

import argparse
from pathlib import Path

from linnet.report.metrics import read_metrics
from linnet.report.plots import plot_metrics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="linnet plot", description="Write curves.png for a run directory.")
    parser.add_argument("run", help="a run directory holding metrics.jsonl")
    parser.add_argument("--out", help="PNG path (default: RUN/curves.png)")
    args = parser.parse_args(argv)
    out = plot_metrics(read_metrics(args.run), args.out or Path(args.run) / "curves.png", title=Path(args.run).name)
    print(out)
    return 0
