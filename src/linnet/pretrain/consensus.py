"""How packed workers mix their parameters: topologies and adaptive consensus.

    W = mixing_matrix("one_peer_ring", 4, step)          # [4, 4], doubly stochastic
    schedule = AdaptiveConsensus.plan(start_frac=0.5, p=1.0, total=600, lr_at=lambda r: ...)
    gamma = schedule.gamma(r, lr)                         # 1 before activation

Topologies (worker i's new parameters are row i of W times the old ones):

- complete: every worker takes the global average (W = 1/N everywhere).
- one_peer_ring: half its own, half one neighbour's, the left one (i - 1 mod N) on even
  steps and the right one (i + 1 mod N) on odd steps.
- one_peer_exponential: half its own, half the incoming neighbour's at offset 2^k,
  worker (i - 2^k) mod N, with k = step mod ceil(log2 N), cycling through the powers
  of two below N.

Each is doubly stochastic, so mixing keeps the global average. Adaptive consensus (seed
002) weakens mixing late in training: W' = gamma W + (1 - gamma) I with gamma =
(lr / lr_max)^p from the update `ceil(start_frac * total)` on, lr_max the largest rate the
original schedule assigns to an active update (warmup included).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from linnet.config.groups import check_consensus

TOPOLOGIES = ("complete", "one_peer_ring", "one_peer_exponential")


def peer(topology: str, n: int, step: int, i: int) -> int:
    """The worker whose parameters worker i takes half of at `step` (one-peer topologies)."""
    if topology == "one_peer_ring":
        return (i - 1) % n if step % 2 == 0 else (i + 1) % n
    if topology == "one_peer_exponential":
        rounds = max(1, math.ceil(math.log2(n))) if n > 1 else 1
        return (i - 2 ** (step % rounds)) % n
    raise ValueError(f"topology {topology!r} has no single peer; one of {', '.join(TOPOLOGIES)}")


def mixing_matrix(topology: str, n: int, step: int, *, gamma: float = 1.0) -> torch.Tensor:
    """[n, n] float64 mixing matrix of `topology` at (zero-based) `step`, blended with the
    identity by `gamma` (1: the topology's own, 0: no mixing)."""
    if topology not in TOPOLOGIES:
        raise ValueError(f"decentralized.topology={topology!r}; use one of {', '.join(TOPOLOGIES)}")
    if topology == "complete":
        W = torch.full((n, n), 1.0 / n, dtype=torch.float64)
    else:
        W = torch.zeros((n, n), dtype=torch.float64)
        for i in range(n):
            W[i, i] += 0.5
            W[i, peer(topology, n, step, i)] += 0.5
    return W if gamma == 1.0 else gamma * W + (1.0 - gamma) * torch.eye(n, dtype=torch.float64)


@dataclass(frozen=True)
class AdaptiveConsensus:
    """The gamma of every update of a run (see the module docstring)."""

    total_steps: int
    start_step: int
    lr_max: float | None  # None: no update is active
    p: float

    @classmethod
    def plan(cls, *, start_frac: float, p: float, total: int, lr_at: Callable[[int], float]) -> AdaptiveConsensus:
        """`lr_at(r)`: the rate the original schedule assigns to zero-based update r."""
        check_consensus(start_frac, p)
        start = math.ceil(start_frac * total)
        lr_max = max((lr_at(r) for r in range(start, total)), default=None)
        if lr_max is not None and lr_max <= 0 and p > 0:
            raise ValueError(f"decentralized.adaptive_consensus: the learning rate is 0 over every active update "
                             f"({start} to {total - 1}), so gamma = (lr / lr_max)^p is undefined; start earlier "
                             "(start_frac), use p = 0, or a schedule with a positive rate there")
        return cls(total, start, lr_max, p)

    def gamma(self, r: int, lr: float) -> float:
        """Mixing strength of zero-based update r, trained at rate `lr`."""
        if r < self.start_step or self.lr_max is None or self.p == 0:
            return 1.0
        return (lr / self.lr_max) ** self.p

    def metadata(self) -> dict:
        return {"total_steps": self.total_steps, "start_step": self.start_step, "lr_max": self.lr_max, "p": self.p}
