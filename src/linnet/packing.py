"""Examples and packed rows, in numpy alone (no torch): the JAX backend, data tools and
the torch trainers all pack the same way.

A packed row holds whole examples end to end in exactly `tokens` positions, so a
compiled model sees one shape. Inside a row each example is its own document:
positions restart at 0, targets are the next token of the same document, and attention
never crosses a document boundary. Positions whose target is not learned, and the
padding after the last document, weigh 0.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PartlyLearned:
    """A completion of which only the flagged tokens are learned: a multi-turn conversation,
    whose turns inserted by its environment are context."""

    tokens: Sequence[int]
    learned: Sequence[bool]


@dataclass(frozen=True)
class Example:
    """Token ids and which of them are learned (predicted from what precedes them)."""

    tokens: np.ndarray
    learned: np.ndarray

    def __init__(self, tokens: Sequence[int], learned: Sequence[bool] | None = None):
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        learned = np.ones(len(tokens), bool) if learned is None else np.asarray(learned, bool).reshape(-1)
        if len(learned) != len(tokens):
            raise ValueError(
                f"Example: {len(tokens)} tokens but {len(learned)} learned flags; give one flag a token"
            )
        if len(tokens) < 2 or not learned[1:].any():
            raise ValueError(
                "Example: no token is learned (the first token is never predicted); "
                "an example needs at least one learned token after the first"
            )
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "learned", learned)

    @classmethod
    def prompted(cls, prompt: Sequence[int], completion: Sequence[int] | PartlyLearned) -> Example:
        """Learn the completion only: the prompt is context (and so are the tokens a
        PartlyLearned completion flags, a conversation's inserted turns)."""
        if isinstance(completion, PartlyLearned):
            return cls(list(prompt) + list(completion.tokens), [False] * len(prompt) + list(completion.learned))
        return cls(list(prompt) + list(completion), [False] * len(prompt) + [True] * len(completion))

    @classmethod
    def plain(cls, tokens: Sequence[int]) -> Example:
        """Learn every token (pretraining-style text)."""
        return cls(tokens)

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class Pair:
    """A prompt and two answers to it, the first preferred (token ids), for DPO."""

    prompt: Sequence[int]
    chosen: Sequence[int]
    rejected: Sequence[int]

    def examples(self) -> list[Example]:
        """The two answers as examples learning the answer alone."""
        return [Example.prompted(self.prompt, self.chosen), Example.prompted(self.prompt, self.rejected)]


@dataclass
class Unpaired:
    """A prompt and one answer to it, judged desirable or not (token ids), for KTO."""

    prompt: Sequence[int]
    completion: Sequence[int]
    desirable: bool


def check_pairs(pairs: Sequence[Pair]) -> None:
    for i, pair in enumerate(pairs):
        if not isinstance(pair, Pair):
            raise TypeError(f"dpo: item {i} is a {type(pair).__name__}, not a linnet.packing.Pair")
        for name in ("prompt", "chosen", "rejected"):
            if len(getattr(pair, name)) == 0:
                raise ValueError(f"dpo: pair {i} has an empty {name}; every pair needs a prompt and two answers")


@dataclass
class Packed:
    """One packed row of P positions (numpy arrays here; torch tensors from
    `linnet.train.pack`).

    tokens     [P] input ids (padding: `pad_id`)
    targets    [P] next token within the same document (0 where there is none)
    weights    [P] float32: 1 where the target is learned, 0 elsewhere and in padding
    positions  [P] position of each token inside its document
    bounds     [D+1] document offsets 0 = b0 < … < bD = P, on the host; the padding
               after the last example, if any, is the last document
    real       positions holding example tokens (P less the padding)
    examples   examples in the row
    truncated  examples cut to fit the row
    prefix     [D] for rows with shared prompts (`pack_prompted`): the document whose
               keys each document also attends to (its prompt), -1 for none; None when
               no document has one
    """

    tokens: np.ndarray
    targets: np.ndarray
    weights: np.ndarray
    positions: np.ndarray
    bounds: np.ndarray
    real: int
    examples: int
    truncated: int = 0
    prefix: np.ndarray | None = None

    @property
    def learned(self) -> int:
        """Count of learned positions."""
        return int((np.asarray(self.weights) > 0).sum())


def segments(bounds) -> np.ndarray:
    """[P] the document index of each position of a row with document offsets `bounds`."""
    bounds = np.asarray(bounds)
    return np.repeat(np.arange(len(bounds) - 1), np.diff(bounds))


def shard_positions(length: int, ranks: int, rank: int) -> np.ndarray:
    """The row positions process (or device) `rank` of `ranks` holds under context
    parallel, in order: chunks rank and 2·ranks-1-rank of the row cut into 2·ranks equal
    chunks, so that under a causal mask each holds the same work."""
    if length % (2 * ranks):
        raise ValueError(f"context parallel: a row of {length} positions does not cut into {2 * ranks} equal chunks "
                         f"(2 x {ranks} processes or devices); use a row length (training.context_length) that is "
                         f"a multiple of {2 * ranks}")
    size = length // (2 * ranks)
    chunks = (rank, 2 * ranks - 1 - rank)
    return np.concatenate([np.arange(c * size, (c + 1) * size) for c in chunks])


def context_order(length: int, ranks: int) -> np.ndarray:
    """A row's positions reordered for context parallel within one process (JAX's
    "context" mesh axis): every rank's `shard_positions` in rank order, so that device r's
    contiguous share is what process r holds under linnet.torch.context."""
    return np.concatenate([shard_positions(length, ranks, r) for r in range(ranks)])


@dataclass(frozen=True)
class _Document:
    """Tokens placed in a row as one document: learned flags, the first position, and
    where the document whose keys it continues sits (-1: the one before, …), if any."""

    tokens: np.ndarray
    learned: np.ndarray
    start: int = 0
    prefix: int | None = None

    @classmethod
    def of(cls, ex: Example, start: int = 0, prefix: int | None = None) -> _Document:
        return cls(ex.tokens, ex.learned, start, prefix)


def _row(parts: list[_Document], tokens: int, pad_id: int, truncated: int) -> Packed:
    ids = np.full(tokens, pad_id, np.int64)
    targets = np.zeros(tokens, np.int64)
    weights = np.zeros(tokens, np.float32)
    positions = np.zeros(tokens, np.int64)
    prefix = np.full(len(parts) + 1, -1, np.int64)
    bounds = [0]
    for j, doc in enumerate(parts):
        s, n = bounds[-1], len(doc.tokens)
        ids[s : s + n] = doc.tokens
        targets[s : s + n - 1] = doc.tokens[1:]
        weights[s : s + n - 1] = doc.learned[1:]
        positions[s : s + n] = np.arange(doc.start, doc.start + n)
        if doc.prefix is not None:
            prefix[j] = j + doc.prefix
        bounds.append(s + n)
    real = bounds[-1]
    if real < tokens:
        positions[real:] = np.arange(tokens - real)
        bounds.append(tokens)
    shared = prefix[: len(bounds) - 1] if (prefix >= 0).any() else None
    examples = sum(bool(doc.learned[1:].any()) for doc in parts)
    return Packed(ids, targets, weights, positions, np.asarray(bounds, np.int64), real, int(examples), truncated,
                  shared)


def _fill(groups: Iterable[tuple[list[Example | _Document], bool]], tokens: int, pad_id: int) -> Iterator[Packed]:
    """Rows of whole groups in order: a group that does not fit the space left starts
    the next row. Each group comes with whether it was cut to fit."""
    parts: list[_Document] = []
    used = cut = 0
    for group, was_cut in groups:
        group = [d if isinstance(d, _Document) else _Document.of(d) for d in group]
        size = sum(len(d.tokens) for d in group)
        if used + size > tokens:
            yield _row(parts, tokens, pad_id, cut)
            parts, used, cut = [], 0, 0
        parts.extend(group)
        used += size
        cut += was_cut
    if parts:
        yield _row(parts, tokens, pad_id, cut)


def _fitted(examples: Iterable[Example], tokens: int, counts: list[int]) -> Iterator[tuple[list[Example], bool]]:
    """Each example as a group of one, cut to a row if longer (with one warning)."""
    for ex in examples:
        if not isinstance(ex, Example):
            raise TypeError(f"pack: expected linnet.packing.Example, got {type(ex).__name__}")
        counts[0] += 1
        if len(ex) <= tokens:
            yield [ex], False
            continue
        if counts[1] == 0:
            warnings.warn(
                f"pack: an example of {len(ex)} tokens is longer than a row of {tokens}; "
                "cutting it (Packed.truncated counts these)",
                stacklevel=3,
            )
        counts[1] += 1
        if ex.learned[1:tokens].any():
            yield [Example(ex.tokens[:tokens], ex.learned[:tokens])], True


def pack(examples: Iterable[Example], tokens: int, *, pad_id: int = 0) -> Iterator[Packed]:
    """Stream rows of exactly `tokens` positions holding whole examples in their order.

    An example that does not fit the space left starts the next row; one longer than a
    row is cut to `tokens` positions (counted in `Packed.truncated`, with a warning) and
    dropped if nothing learned is left. Raises on an empty stream.
    """
    if tokens < 2:
        raise ValueError(f"pack: tokens={tokens}; a row needs at least 2 positions")
    counts = [0, 0]  # examples seen, examples cut
    produced = False
    for row in _fill(_fitted(examples, tokens, counts), tokens, pad_id):
        produced = True
        yield row
    if counts[0] == 0:
        raise ValueError("pack: no examples to pack (the example stream was empty)")
    if not produced:
        raise ValueError(
            f"pack: all {counts[0]} examples were longer than a row of {tokens} with nothing "
            f"learned in their first {tokens} tokens; raise tokens or shorten the prompts"
        )


def fitted(examples: Iterable[Example], tokens: int) -> list[Example]:
    """The examples as `pack` places them: each cut to a row if longer, dropped if
    nothing learned is left."""
    return [group[0] for group, _ in _fitted(examples, tokens, [0, 0])]


def count_rows(examples: Iterable[Example], tokens: int) -> int:
    """How many rows `pack(examples, tokens)` makes, without making them."""
    rows = used = 0
    for ex in fitted(examples, tokens):
        if rows == 0 or used + len(ex) > tokens:
            rows, used = rows + 1, 0
        used += len(ex)
    return rows


def pack_groups(groups: Iterable[Sequence[Example]], tokens: int, *, pad_id: int = 0) -> Iterator[Packed]:
    """Rows that keep each group's examples together (a preference pair's two answers):
    whole groups in order, each group's examples consecutive documents of one row. A
    group longer than a row is an error, not cut: its examples are compared."""
    def checked():
        for i, group in enumerate(groups):
            group = list(group)
            size = sum(len(ex) for ex in group)
            if size > tokens:
                raise ValueError(f"pack_groups: group {i} holds {size} tokens, more than a row of {tokens}")
            yield group, False

    return _fill(checked(), tokens, pad_id)


def _shared_prompt(prompt: Sequence[int], completions: Sequence[Sequence[int]]) -> list[_Document]:
    """The prompt once (less its last token) and each completion as a document that
    starts with that last token and attends to the prompt's keys: what every completion
    predicts is unchanged, and the prompt is computed once instead of once a completion."""
    prompt = np.asarray(prompt, np.int64)
    if len(prompt) < 2:  # nothing to share
        return [_Document.of(Example.prompted(prompt, c)) for c in completions]
    docs = [_Document(prompt[:-1], np.zeros(len(prompt) - 1, bool))]
    for i, c in enumerate(completions):
        docs.append(_Document.of(Example.prompted(prompt[-1:], c), len(prompt) - 1, -(i + 1)))
    return docs


def pack_prompted(groups: Iterable[tuple[Sequence[int], Sequence[Sequence[int] | PartlyLearned]]], tokens: int, *,
                  share: bool = True, pad_id: int = 0) -> Iterator[Packed]:
    """Rows of (prompt, completions) groups, each completion learned after its prompt,
    every group whole in one row and in order (DPO's answers, GRPO's samples; a
    PartlyLearned completion learns the tokens it flags).

    share=True places each prompt once and lets its completions attend to it
    (`Packed.prefix`): the same log-probabilities as one prompt+completion example a
    completion, with the prompt computed once. A group longer than a row is an error."""
    def laid_out():
        for i, (prompt, completions) in enumerate(groups):
            if share:
                docs = _shared_prompt(prompt, completions)
            else:
                docs = [_Document.of(Example.prompted(prompt, c)) for c in completions]
            size = sum(len(d.tokens) for d in docs)
            if size > tokens:
                raise ValueError(f"pack_prompted: group {i} (a prompt and its {len(completions)} completions) "
                                 f"holds {size} tokens, more than a row of {tokens}")
            yield docs, False

    return _fill(laid_out(), tokens, pad_id)
