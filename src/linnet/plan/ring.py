"""Context parallel's ring in the planner: what its buffers hold in a block's backward on
one GPU (linnet.torch.context computes it so)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from linnet import cards
    from linnet.plan.memory import Workload

# linnet.torch.context.SCORE_BYTES (a test keeps them equal): the float32 scores one tile of
# a process's queries holds against a neighbour's block of keys, in context parallel.
RING_SCORE_BYTES = 2**24


def ring_bytes(card: cards.Card, mine: Workload, context: int) -> float:
    """What context parallel's ring holds in a block's backward (while attention's runs, after
    the MLP's: `estimate` takes the larger of the two) on one GPU holding `mine`'s
    positions of each row (n of them): the neighbour's keys and values with their float32
    gradients, sent and received (8 x 4·kv·n), and on a GPU a tile's scores, probabilities,
    their gradient and the product before it (4 x RING_SCORE_BYTES, or the whole block of
    scores when smaller) with the keys and values repeated to every query head in float32
    (2 x 4·q·n); on a CPU, whose fused kernel computes the scores in small blocks of its
    own, a tile's float32 mask (RING_SCORE_BYTES, or the whole block's) with the keys and
    values repeated to every head and the kernel's gradients for them (16·q·n).
    Nothing without context parallel."""
    if context == 1:
        return 0.0
    n = mine.positions
    q, kv = card.heads * card.head_dim, card.kv_heads * card.head_dim
    if mine.device == "cpu":
        return min(RING_SCORE_BYTES, 4 * n * n) + 8 * 4 * kv * n + 16 * q * n
    return 4 * min(RING_SCORE_BYTES, 4 * card.heads * n * n) + 8 * 4 * kv * n + 2 * 4 * q * n
