"""`linnet plan --suggest`: every way linnet can lay a run over a cluster's GPUs, planned,
the ones that fit first, the cheapest in communication first among them.

A layout is how the GPUs share the work: whole copies (`shard` none, zero or fsdp over the
copies), a model split `split` ways (tensor parallel), cut in `pipeline` stages, each row
split over `context` GPUs (context parallel), or a mixture of experts' experts split over
groups of `expert` GPUs (expert parallel). Each is planned with `estimate`; a layout linnet
refuses (a card that does not split evenly, zero beside a split, ...) is left out.

The order among those that fit follows what a step sends between GPUs, least first:

  copies      the gradients once a step (all-reduce)
  zero        the same; optimizer states split, the updated weights gathered once
  expert      the gradients once a step, and every block's routed rows sent to their
              experts' GPUs and back (all-to-all), forward and backward
  fsdp        weights gathered for every block forward and backward, gradients scattered
              (beside expert parallel: its all-to-alls too)
  context     every block's keys and values passed round the ring, forward and backward
  pipeline    activations handed between stages, and the stages idle at a step's ends
  split       activations all-reduced twice in every block, forward and backward

then by the peak per GPU. It is an ordering by kind, not a timing: on a fast interconnect
the differences shrink, and a layout that fits with room to spare may allow a larger
micro-batch that more than pays for its traffic.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

from linnet.plan.parts import SettingError

COST = {"none": 0, "zero": 1, "fsdp": 3}  # shard's rank in the order above (expert parallel adds 1.5); context,
# pipeline and split come after


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
    def cost(self) -> tuple:
        return (not self.fits, self.split > 1, self.pipeline > 1, self.context > 1,
                COST[self.shard] + 1.5 * (self.expert > 1), self.peak)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def suggest(card, method, workload, cluster) -> list[Layout]:
    """Every layout of `cluster.gpus` GPUs that linnet runs, planned, sorted: those that fit
    first, then by COST's order, then by peak."""
    from linnet.plan import estimate

    found = []
    n = cluster.gpus
    for split in _divisors(n):
        for pipeline in _divisors(n // split):
            for context in _divisors(n // (split * pipeline)):
                for shard, sequence in itertools.product(COST, (False, True)):
                    if shard != "none" and n == split * pipeline:
                        continue  # each GPU its own part: nothing to shard over (a context group shards)
                    try:
                        layout = dataclasses.replace(cluster, shard=shard, split=split, pipeline=pipeline,
                                                     context=context, sequence_parallel=sequence, expert=1)
                        found.append(Layout(shard, split, pipeline, context, estimate(card, method, workload, layout),
                                            sequence))
                    except (SettingError, ValueError):
                        continue
    groups = [d for d in _divisors(n)[1:] if card.experts is not None and card.experts.count % d == 0]
    for expert, shard in itertools.product(groups, ("none", "fsdp")):
        try:  # the experts split over groups of `expert` GPUs, the rest whole or sharded
            layout = dataclasses.replace(cluster, shard=shard, split=1, pipeline=1, context=1, expert=expert)
            found.append(Layout(shard, 1, 1, 1, estimate(card, method, workload, layout), expert=expert))
        except (SettingError, ValueError):
            continue
    return sorted(found, key=lambda layout: layout.cost)


def render(layouts: Sequence[Layout], title: str) -> str:
    """The suggestions as a table, cheapest first."""
    head = ("layout", "GPUs a copy", "copies", "peak per GPU", "fits")
    rows = [(layout.settings, str(layout.split * layout.pipeline * layout.context),
             str(layout.plan.cluster.gpus // (layout.split * layout.pipeline * layout.context)),
             f"{layout.peak / 1e9:.1f} GB", "yes" if layout.fits else "no") for layout in layouts]
    widths = [max(len(r[i]) for r in (head, *rows)) for i in range(len(head))]
    lines = [title, "  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    if not any(layout.fits for layout in layouts):
        lines.append("none fits: add GPUs (--gpus), checkpoint activations, tile the MLP, or train adapters")
    return "\n".join(lines)
