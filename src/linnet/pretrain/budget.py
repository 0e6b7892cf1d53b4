"""The training budget: prediction targets, updates, and virtual epochs.

    budget = plan_budget(card.params(), context=1024, sequences_per_update=128)
    budget.steps, budget.boundaries[:3], budget.epoch_of(step)

The default budget is 20 prediction targets per unique trainable parameter (a tied
embedding counted once), split into 40 virtual epochs. Each update trains on one global
batch of `sequences_per_update x context` targets. Epoch k (1-based) ends after update

    boundary(k) = round_half_up(k x targets / (epochs x batch_targets))

a rounding of the cumulative nominal target count to whole global batches, each boundary
on its own (no carried rounding error); the difference of consecutive boundaries is an
epoch's update count. The total is boundary(epochs). Computed in integers, so every
process and every resume agrees exactly.
"""

from __future__ import annotations

from dataclasses import dataclass


def epoch_boundaries(targets: int, epochs: int, batch_targets: int) -> list[int]:
    """Cumulative updates at the end of each epoch: round(k*targets / (epochs*batch)),
    halfway ties upward, for k = 1..epochs."""
    if targets < 1 or epochs < 1 or batch_targets < 1:
        raise ValueError(f"budget: targets={targets}, epochs={epochs} and batch_targets={batch_targets} must be positive")
    denominator = epochs * batch_targets
    return [(2 * k * targets + denominator) // (2 * denominator) for k in range(1, epochs + 1)]


@dataclass(frozen=True)
class Budget:
    parameters: int  # unique trainable parameters
    targets: int  # nominal prediction targets
    context: int
    sequences_per_update: int
    boundaries: tuple[int, ...]  # updates completed at the end of each epoch

    @property
    def epochs(self) -> int:
        return len(self.boundaries)

    @property
    def batch_targets(self) -> int:
        return self.sequences_per_update * self.context

    @property
    def steps(self) -> int:
        return self.boundaries[-1]

    @property
    def sequences(self) -> int:
        """Training sequences the whole budget draws from the loader."""
        return self.steps * self.sequences_per_update

    @property
    def trained_targets(self) -> int:
        """Targets actually trained: whole global batches."""
        return self.steps * self.batch_targets

    def epoch_of(self, step: int) -> int:
        """The 1-based epoch that update `step` (1-based) belongs to."""
        for epoch, end in enumerate(self.boundaries, start=1):
            if step <= end:
                return epoch
        raise ValueError(f"budget: step {step} is past the last update {self.steps}")

    def epoch_steps(self, epoch: int) -> range:
        start = self.boundaries[epoch - 2] if epoch > 1 else 0
        return range(start + 1, self.boundaries[epoch - 1] + 1)

    def table(self) -> list[tuple[str, str]]:
        sizes = [b - a for a, b in zip((0, *self.boundaries[:-1]), self.boundaries)]
        return [
            ("trainable parameters", f"{self.parameters:,}"),
            ("budget", f"{self.targets:,} targets ({self.targets / self.parameters:.1f} per parameter)"),
            ("global batch", f"{self.sequences_per_update} sequences x {self.context} = {self.batch_targets:,} targets"),
            ("updates", f"{self.steps:,} ({self.trained_targets:,} targets trained)"),
            ("epochs", f"{self.epochs} of {min(sizes)}-{max(sizes)} updates"),
        ]


def plan_budget(parameters: int, *, context: int, sequences_per_update: int, targets_per_parameter: float = 20.0,
                total_targets: int | None = None, epochs: int = 40) -> Budget:
    """The budget of a model with `parameters` unique trainable parameters."""
    targets = total_targets if total_targets is not None else round(targets_per_parameter * parameters)
    boundaries = epoch_boundaries(targets, epochs, sequences_per_update * context)
    sizes = [b - a for a, b in zip((0, *boundaries[:-1]), boundaries)]
    if min(sizes) < 1:
        empty = sizes.index(min(sizes)) + 1
        raise ValueError(
            f"budget: {targets:,} targets in {epochs} epochs of global batches of {sequences_per_update * context:,} "
            f"targets leaves epoch {empty} without a whole batch; lower training.epochs, the batch "
            "(training.micro_batch_size, training.accumulation) or raise the budget"
        )
    return Budget(parameters, targets, context, sequences_per_update, tuple(boundaries))


def cache_tokens(sequences: int, context: int, group_tokens: int) -> int:
    """Training tokens a cache needs to serve the first `sequences` sequences of the
    loader's stream from whole shard groups of `group_tokens` tokens: through the end of
    the group that holds the last sequence's first token, up to the end of that group's
    last sequence, plus its one token of lookahead. Any larger cache of the same corpus
    and settings starts with the same whole groups, so its stream starts the same."""
    group_end = ((sequences - 1) * context // group_tokens + 1) * group_tokens
    return -(-group_end // context) * context + 1
