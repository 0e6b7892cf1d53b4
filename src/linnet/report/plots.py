"""Curves of a run from its metrics.jsonl: `linnet plot RUN_DIR` writes curves.png, and every
training command writes it at the end of a run (with matplotlib installed)."""

from __future__ import annotations

import math
from pathlib import Path

PANELS = (  # (title, metric keys drawn in it); a panel shows when the run has one of its keys
    ("loss (nats per learned token)", ("loss", "held_out_loss", "held_out_general_loss", "dpo_loss", "grpo_loss")),
    ("learning rate", ("lr",)),
    ("gradient norm", ("grad_norm",)),
    ("real tokens / s", ("tokens_per_second",)),
    ("reward", ("reward", "held_out_reward", "mean_reward")),
    ("reward margin", ("rewards/margins", "margin", "held_out_margin")),
    ("accuracy, pass@1 (share)", ("rewards/accuracies", "accuracy", "held_out_accuracy", "held_out_pass@1")),
    ("divergence from the teacher", ("held_out_divergence",)),
)
COLUMNS = 3  # panels a row: the grid fits a screen


def plot_metrics(metrics: list[dict], path: str | Path, *, title: str | None = None, source: str | None = None) -> Path:
    """Draw every panel that has data into a PNG, three panels a row; needs matplotlib. The
    loss axis is logarithmic only when the loss spans more than a factor of 20 (a first
    steps' drop), with plain numbers on it. `source`: the file the rows came from, named
    when none of them holds a metric."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import LogLocator, ScalarFormatter
    except ImportError:
        raise ValueError("plotting needs matplotlib: pip install 'linnet[plot]'") from None
    panels = [(t, keys) for t, keys in PANELS if any(k in m for m in metrics for k in keys)]
    if not panels:
        raise ValueError(f"{source + ': ' if source else ''}no metric to plot (no loss, learning rate, reward or "
                         "held-out metric in the rows)")
    columns = min(COLUMNS, len(panels))
    rows = math.ceil(len(panels) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.4 * columns, 3.3 * rows), squeeze=False)
    for ax, (panel_title, keys) in zip(axes.flat, panels):
        values = []
        for key in keys:
            points = [(m["step"], m[key]) for m in metrics if key in m and _finite(m[key])]
            if points:
                xs, ys = zip(*points)
                values += ys
                ax.plot(xs, ys, "o-" if len(points) < 30 else "-", lw=1.2, ms=3, label=key.replace("_", " "))
        ax.set(title=panel_title, xlabel="step")
        ax.grid(alpha=0.3)
        if panel_title.startswith("loss") and values and min(values) > 0 and max(values) / min(values) > 20:
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(ScalarFormatter())
        if panel_title.startswith("accuracy"):
            ax.set_ylim(0, 1.02)
        if len(ax.get_lines()) > 1:
            ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")  # the name may be a temporary one
    plt.close(fig)
    return Path(path)


def write_curves(metrics: list[dict], path: str | Path, *, title: str | None = None) -> Path | None:
    """curves.png at the end of a run, written whole or not at all; None (nothing written)
    without matplotlib or a metric to draw: a run never fails for its picture."""
    from linnet.files.atomic import atomic_path

    try:
        with atomic_path(path) as tmp:
            plot_metrics(metrics, tmp, title=title)
    except ValueError:
        return None
    return Path(path)


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)
