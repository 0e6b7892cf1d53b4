"""How a run divides one copy of the model among its processes, as linnet builds it: the
planner's parts (`linnet.plan` and `linnet.plan.memory` count each part's memory).

A whole model is one part; a split (tensor parallel, `training.split`) gives each process
1/T of every block; pipeline stages (`training.pipeline`) give each process consecutive
blocks, the first the embedding, the last the norm and head, and say how many
micro-batches each keeps in flight under its schedule. Stdlib only, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from linnet import cards
from linnet.errors import SettingError


def _require(condition: bool, message: str) -> None:
    """Raise SettingError(message) unless `condition`; `message` names settings {so}."""
    if not condition:
        raise SettingError(message)


# linnet's pipeline schedules (training.pipeline_schedule), the last two two chunks a stage
SCHEDULES = ("1f1b", "interleaved", "zero-bubble")


@dataclass(frozen=True)
class Part:
    """What one process holds of the model: all of it, or its share of a copy split
    `split` ways (tensor parallel) and cut into pipeline stages (`model_parts`).

    `card` describes its blocks: how many it holds (`layers`) and its share of each (heads,
    kv heads and the MLP's width divided by the split; a column-split projection's adapter
    B and a row-split one's A split alike, so the card's shapes count them too). The first
    stage holds the embedding (`embeds`), the last the final norm and `head_rows` rows of
    the head (the vocabulary divided by the split when it divides: its losses are then
    linnet.torch.losses' split ones, `split_head`). A head tied to the embedding stays one
    tensor only in a whole model. `in_flight`: micro-batches whose activations the part
    keeps at once (a fraction where an interleaved stage keeps some through one of its
    chunks only); of those, `awaiting` passes through one of its `chunks` (of blocks)
    whose backward for the weights waits, on the zero-bubble schedule, each keeping its
    whole graph. A later stage `receives` its input, an earlier one `sends` its output on, each through a buffer a micro-batch of the step (`micro_batches`) that the
    pipeline keeps for the whole run: as many of each as its chunks that do (interleaved,
    two a stage). `sequence`: the processes of a sequence-parallel split, among which the
    blocks' norms share each row's positions (1: none). `experts_held`: of each block's
    experts, how many the part holds (expert parallel: E / its processes; None: every one)."""

    name: str
    card: cards.Card
    embeds: bool = True
    head_rows: int = 0
    tied: bool = False
    split_head: bool = False
    in_flight: float = 1
    chunks: int = 1
    awaiting: int = 0
    receives: int = 0
    sends: int = 0
    micro_batches: int = 1
    sequence: int = 1
    experts_held: int | None = None

    def block_params(self) -> int:
        """Parameters of one block held: the card's, but of a mixture's experts (3·I·H each) those held."""
        c, e = self.card, self.card.experts
        if e is None or self.experts_held is None:
            return c.block_params()
        return c.block_params() - (e.count - self.experts_held) * 3 * e.intermediate * c.hidden

    def params(self) -> int:
        """Parameters held; a tied head counted once."""
        c = self.card
        n = c.layers * self.block_params() + (c.vocab * c.hidden if self.embeds else 0)
        if self.head_rows:
            n += c.hidden + (0 if self.tied else self.head_rows * c.hidden)
        return n


def whole(card: cards.Card) -> Part:
    """The whole model, as one process holds it."""
    return Part("whole model", card, head_rows=card.vocab, tied=card.tied_embeddings)


def model_parts(card: cards.Card, split: int = 1, stages: int = 1, micro_batches: int = 1,
                schedule: str = "1f1b", sequence: bool = False, expert: int = 1) -> list[Part]:
    """The part each process of one copy holds, stage by stage (the processes of a stage's
    split hold alike): linnet.torch.sharding.tensor_parallel (`sequence`: sequence
    parallel) and linnet.torch.stages, as `linnet sft` builds them. Stage i holds blocks [i L / P, (i + 1) L / P), or
    interleaved the chunks i and i + P of the 2P chunks [c L / 2P, (c + 1) L / 2P); what it
    keeps in flight is `_in_flight`'s. `expert` > 1: a mixture's experts split over that many
    processes (linnet.torch.moe.expert_parallel), each holding the rest of the model."""
    if expert > 1:
        return [Part(f"whole model, 1/{expert} of the experts", card, head_rows=card.vocab, tied=card.tied_embeddings,
                     experts_held=card.experts.count // expert)]
    if split == stages == 1:
        return [whole(card)]
    for name in ("heads", "kv_heads", "intermediate"):
        _require(getattr(card, name) % split == 0,
                 f"{{split}} {split}: card {card.name!r} has {name}={getattr(card, name)}, which {split} processes "
                 "cannot split evenly")
    _require(schedule in SCHEDULES, f"{{pipeline_schedule}} {schedule!r}: use one of {', '.join(SCHEDULES)}")
    chunks = stages * (1 if schedule == "1f1b" else 2)
    _require(card.layers >= chunks, f"{{pipeline}} {stages}: card {card.name!r} has {card.layers} layers, fewer than "
                                    f"the {'chunks (two a stage)' if chunks > stages else 'stages'}")
    share = card.replace(heads=card.heads // split, kv_heads=card.kv_heads // split,
                         intermediate=card.intermediate // split)
    split_head = split > 1 and card.vocab % split == 0
    parts = []
    for i in range(stages):
        mine = range(i, chunks, stages)  # this stage's chunks of blocks
        held = sum((c + 1) * card.layers // chunks - c * card.layers // chunks for c in mine)
        last = i == stages - 1
        name = f"stage {i + 1} of {stages}" if stages > 1 else "split"
        parts.append(Part(name + (f", 1/{split} of each block" if split > 1 and stages > 1 else ""),
                          share.replace(layers=held), embeds=i == 0,
                          head_rows=(card.vocab // split if split_head else card.vocab) if last else 0,
                          split_head=split_head and last,
                          in_flight=_in_flight(i, stages, micro_batches, len(mine), schedule == "zero-bubble"),
                          chunks=len(mine), awaiting=_awaiting(i, stages, micro_batches, schedule == "zero-bubble"),
                          receives=sum(c > 0 for c in mine), sends=sum(c < chunks - 1 for c in mine),
                          micro_batches=micro_batches, sequence=split if sequence else 1))
    return parts


def _in_flight(i: int, stages: int, micro_batches: int, chunks: int, zero_bubble: bool = False) -> float:
    """Micro-batches whose activations stage i keeps at once, a chunk's pass counting as
    1/chunks of one. With fewer micro-batches than stages, GPipe: every one. 1F1B: P - i.
    Interleaved 1F1B (PyTorch's ScheduleInterleaved1F1B): the forwards of its warm-up,
    (chunks - 1) rounds' micro-batches and two a stage it is away from the last, and the
    one in hand; where the micro-batches do not divide into rounds of P, each chunk takes
    them all in turn (ScheduleLoopedBFS): every one. Zero bubble
    (ScheduleInterleavedZeroBubble): a warm-up of (chunks - 1) rounds and one a stage from
    the last, the one in hand, and the i passes whose weights' half of the backward waits
    (a pass keeps its activations until then)."""
    M, P = micro_batches, stages
    if M < P:
        return M
    if chunks == 1:
        return min(P - i, M)
    rounds = max(1, M // P)
    if M % rounds:
        return M
    rounds_kept = (chunks - 1) * (M // rounds)
    passes = rounds_kept + P if zero_bubble else rounds_kept + 2 * (P - 1 - i) + 1
    return min(passes, chunks * M) / chunks


def _awaiting(i: int, stages: int, micro_batches: int, zero_bubble: bool) -> int:
    """Passes (through one chunk) of stage i whose backward for the weights waits when the
    most are in flight, on the zero-bubble schedule: the i + 1 whose input's gradient has
    gone back (ScheduleInterleavedZeroBubble defers stage i's weights by i passes); 0 on
    the other schedules, or where the micro-batches fall back to each chunk in turn."""
    M, P = micro_batches, stages
    return i + 1 if zero_bubble and M >= P and M % max(1, M // P) == 0 else 0
