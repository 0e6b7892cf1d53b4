"""Curves of a run from its metrics.jsonl (`linnet plot RUN_DIR` writes curves.png)."""

from __future__ import annotations

from pathlib import Path

PANELS = (  # (title, metric keys drawn in it)
    ("loss (nats per learned token)", ("loss", "held_out_loss", "dpo_loss")),
    ("learning rate", ("lr",)),
    ("real tokens / s", ("tokens_per_second",)),
    ("gradient norm", ("grad_norm",)),
    ("reward (GRPO)", ("reward",)),
    ("held-out exact match", ("held_out_accuracy",)),
)


def plot_metrics(metrics: list[dict], path: str | Path, *, title: str | None = None) -> Path:
    """Draw every panel that has data into a PNG; needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("plotting needs matplotlib: pip install 'linnet[plot]'") from None
    panels = [(t, keys) for t, keys in PANELS if any(k in m for m in metrics for k in keys)]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    for ax, (panel_title, keys) in zip(axes[0], panels):
        for key in keys:
            points = [(m["step"], m[key]) for m in metrics if key in m]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, "o-" if len(points) < 30 else "-", lw=1.2, ms=3, label=key.replace("_", " "))
        ax.set(title=panel_title, xlabel="step")
        if panel_title.startswith("loss"):
            ax.set_yscale("log")
            ax.legend()
        if panel_title.endswith("exact match"):
            ax.set_ylim(0, 1.02)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
