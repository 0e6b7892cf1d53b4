"""`linnet plan --suggest`: every way linnet can lay a run over a cluster's GPUs, planned,
the ones that fit first, the fastest (by an estimate of the step) first among them.

A layout is how the GPUs share the work: whole copies (`shard` none, zero or fsdp over the
copies), a model split `split` ways (tensor parallel), cut in `pipeline` stages, each row
split over `context` GPUs (context parallel), or a mixture of experts' experts split over
groups of `expert` GPUs (expert parallel). Each is planned with `estimate`; a layout linnet
refuses (a card that does not split evenly, zero beside a split, ...) is left out.

Those that fit come first, the fastest first: each layout's step is estimated from its
FLOPs at the cluster's MFU, the pipeline's idle turns and what it sends between GPUs
(linnet.plan.traffic, which says what it counts), and the table gives the whole cluster's
tokens a second and where most of the rest of a step goes; then those that do not fit, by
peak per GPU. The estimate ranks layouts; it does not predict a step to the second: one
MFU for all of them leaves out what splitting costs in kernel efficiency, and a layout with
room to spare may take a larger micro-batch that pays for its traffic.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

from linnet.plan.parts import SettingError
from linnet.plan.traffic import step_time

SHARDS = ("none", "zero", "fsdp")


@dataclasses.dataclass(frozen=True)
class Layout:
    """One layout over the cluster's GPUs and its plan."""

    shard: str
    split: int
    pipeline: int
    context: int
    plan: Any  # linnet.plan.Plan
    sequence_parallel: bool = False
    expert: int = 1
    time: Any = None  # linnet.plan.traffic.StepTime

    @property
    def peak(self) -> float:
        return self.plan.total

    @property
    def fits(self) -> bool:
        return self.plan.total <= self.plan.cluster.usable_bytes

    @property
    def settings(self) -> str:
        """The config's training fields for it (defaults left out)."""
        out = [f"shard={self.shard}"] if self.shard != "none" else []
        out += [f"{name}={value}" for name, value in (("split", self.split), ("pipeline", self.pipeline),
                                                      ("context", self.context), ("expert", self.expert))
                if value > 1]
        out += ["sequence_parallel=true"] if self.sequence_parallel else []
        return " ".join(f"training.{s}" for s in out) or "whole copies (the defaults)"

    @property
    def tokens_per_second(self) -> float:
        """The whole cluster's, estimated (linnet.plan.traffic)."""
        return self.time.tokens_per_second

    @property
    def cost(self) -> tuple:
        """Those that fit first, the fastest first; then by peak."""
        return (False, -self.tokens_per_second, self.peak) if self.fits else (True, 0.0, self.peak)

    @property
    def waits(self) -> str:
        """Where most of a step goes besides compute, with its share of the step."""
        t = self.time
        parts = {"idle stages": t.idle, "split": t.split, "context ring": t.context, "stage hand-offs": t.stages,
                 "gradient sums" if self.shard != "fsdp" else "fsdp gathers": t.copies, "all-to-all": t.expert}
        name, seconds = max(parts.items(), key=lambda kv: kv[1])
        return f"{name} {seconds / t.seconds:.0%}" if seconds >= 0.005 * t.seconds else "-"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _layout(card, method, workload, cluster, sequence: bool = False) -> Layout:
    from linnet.plan import estimate

    return Layout(cluster.shard, cluster.split, cluster.pipeline, cluster.context,
                  estimate(card, method, workload, cluster), sequence, cluster.expert,
                  step_time(card, method, workload, cluster))


def suggest(card, method, workload, cluster) -> list[Layout]:
    """Every layout of `cluster.gpus` GPUs that linnet runs, planned, sorted: those that fit
    first, the fastest first, then by peak."""

    found = []
    n = cluster.gpus
    for split in _divisors(n):
        for pipeline in _divisors(n // split):
            for context in _divisors(n // (split * pipeline)):
                for shard, sequence in itertools.product(SHARDS, (False, True)):
                    if shard != "none" and n == split * pipeline:
                        continue  # each GPU its own part: nothing to shard over (a context group shards)
                    try:
                        found.append(_layout(card, method, workload, dataclasses.replace(
                            cluster, shard=shard, split=split, pipeline=pipeline, context=context,
                            sequence_parallel=sequence, expert=1), sequence))
                    except (SettingError, ValueError):
                        continue
    groups = [d for d in _divisors(n)[1:] if card.experts is not None and card.experts.count % d == 0]
    for expert, shard in itertools.product(groups, ("none", "fsdp")):
        try:  # the experts split over groups of `expert` GPUs, the rest whole or sharded
            found.append(_layout(card, method, workload, dataclasses.replace(
                cluster, shard=shard, split=1, pipeline=1, context=1, expert=expert)))
        except (SettingError, ValueError):
            continue
    return sorted(found, key=lambda layout: layout.cost)


def render(layouts: Sequence[Layout], title: str) -> str:
    """The suggestions as a table, in `suggest`'s order."""
    head = ("layout", "GPUs a copy", "copies", "peak per GPU", "fits", "tokens/s (est.)", "besides compute")
    rows = [(layout.settings, str(layout.split * layout.pipeline * layout.context),
             str(layout.plan.cluster.gpus // (layout.split * layout.pipeline * layout.context)),
             f"{layout.peak / 1e9:.1f} GB", "yes" if layout.fits else "no",
             f"{layout.tokens_per_second:,.0f}", layout.waits) for layout in layouts]
    widths = [max(len(r[i]) for r in (head, *rows)) for i in range(len(head))]
    lines = [title, "  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    if not any(layout.fits for layout in layouts):
        lines.append("none fits: add GPUs (--gpus), checkpoint activations, tile the MLP, or train adapters")
    return "\n".join(lines)
