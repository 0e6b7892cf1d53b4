"""Held-out records that repeat training records: exact duplicates (the same text once
normalized) and near duplicates (MinHash with locality-sensitive hashing over the words,
datasketch's, then the candidates' true Jaccard similarity checked).

What is compared is a record's question: its prompt fields (prompt, instruction, input,
question), the user and system turns of a chat, a pretraining document's text; failing
those, every text field. An eval question seen in training with another answer is still a
leak. Normalizing lowercases, folds Unicode (NFKC), drops punctuation and collapses
whitespace; a text is its set of word n-grams (`ngram` 1: its words, so a reordering is
still a duplicate; raise it for long documents, whose vocabularies overlap by chance).

    found = overlap(train_records, eval_records)          # an Overlap
    found.pairs                                           # [Match(held_out, training, similarity, exact)]
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from linnet.data.readers import Record

QUESTION_FIELDS = ("prompt", "instruction", "input", "question", "query", "problem", "text")
CHAT_FIELDS = ("messages", "conversations")
ASKING = {"user", "system", "human"}  # the turns of a chat that pose its question
MIN_WORDS = 4  # shorter texts are compared exactly only: a handful of words matches by chance
PERMUTATIONS = 128
RECALL = 0.7  # the LSH index looks for pairs from this share of the threshold up


def question_text(data: dict) -> str:
    """The text of a record that poses its question (see the module docstring)."""
    for name in CHAT_FIELDS:
        turns = data.get(name)
        if isinstance(turns, list):
            return "\n".join(str(t.get("content", t.get("value", ""))) for t in turns if isinstance(t, dict)
                             and str(t.get("role", t.get("from", ""))).lower() in ASKING)
    found = [str(data[name]) for name in QUESTION_FIELDS if isinstance(data.get(name), str) and data[name]]
    return "\n".join(found) if found else "\n".join(str(v) for v in data.values() if isinstance(v, str))


def normalize(text: str) -> str:
    text = unicodedata.normalize("NFKC", text).lower()
    return " ".join(re.sub(r"[^\w\s]", " ", text).split())


def shingles(text: str, ngram: int) -> set[str]:
    words = text.split()
    return {" ".join(words[i:i + ngram]) for i in range(max(1, len(words) - ngram + 1))} if words else set()


class Match(NamedTuple):
    """A held-out record (its index) that repeats a training record: the Jaccard
    similarity of their word n-gram sets, and whether their normalized texts are equal."""

    held_out: int
    training: int
    similarity: float
    exact: bool


@dataclass
class Overlap:
    """Held-out records that repeat training ones: one Match a held-out record (its
    closest training record), the exact ones first."""

    pairs: list[Match] = field(default_factory=list)
    exact: int = 0
    near: int = 0
    near_checked: bool = True  # False when datasketch is missing: exact duplicates only

    def __bool__(self) -> bool:
        return bool(self.pairs)


def overlap(train: Sequence[Record | dict | str], held_out: Sequence[Record | dict | str], *, threshold: float = 0.7,
            ngram: int = 1, near: bool = True) -> Overlap:
    """Which of `held_out` repeat an item of `train` (records, their data, or texts): exact
    duplicates, and with `near` those whose word n-gram sets have a Jaccard similarity of
    at least `threshold` (found by MinHash LSH; needs datasketch, else exact only with
    `near_checked` False)."""
    if not 0 < threshold <= 1:
        raise ValueError(f"overlap: threshold={threshold}; a Jaccard similarity in (0, 1]")
    if ngram < 1:
        raise ValueError(f"overlap: ngram={ngram}; n-grams of at least one word")
    train_texts, held_texts = _texts(train), _texts(held_out)
    found = Overlap()
    seen: dict[str, int] = {}
    for i, text in enumerate(train_texts):
        seen.setdefault(_digest(text), i)
    exact = set()
    for j, text in enumerate(held_texts):
        i = seen.get(_digest(text))
        if i is not None and text:
            found.pairs.append(Match(j, i, 1.0, True))
            exact.add(j)
    found.exact = len(exact)
    if not near:
        return found
    try:
        from datasketch import MinHash, MinHashLSH
    except ImportError:
        found.near_checked = False
        return found
    train_sets = [shingles(t, ngram) for t in train_texts]
    # the index's threshold below the caller's: LSH finds a pair at its threshold half the time, and
    # the true similarity of each candidate decides anyway
    index = MinHashLSH(threshold=threshold * RECALL, num_perm=PERMUTATIONS)
    indexed = [i for i, t in enumerate(train_texts) if len(t.split()) >= MIN_WORDS]
    with index.insertion_session() as session:
        for i, m in zip(indexed, _minhashes(MinHash, [train_sets[i] for i in indexed])):
            session.insert(i, m)
    asked = [j for j, t in enumerate(held_texts) if j not in exact and len(t.split()) >= MIN_WORDS]
    held_sets = [shingles(held_texts[j], ngram) for j in asked]
    for j, words, m in zip(asked, held_sets, _minhashes(MinHash, held_sets)):
        scored = [(len(words & train_sets[i]) / len(words | train_sets[i]), i) for i in index.query(m)]
        best = max(scored, default=(0.0, -1))
        if best[0] >= threshold:  # the estimate found a candidate: the true similarity decides
            found.pairs.append(Match(j, best[1], round(best[0], 4), False))
            found.near += 1
    return found


def _texts(items: Iterable) -> list[str]:
    out = []
    for item in items:
        data = item.data if isinstance(item, Record) else item
        out.append(normalize(data if isinstance(data, str) else question_text(data)))
    return out


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _minhashes(cls, sets: list[set[str]]) -> list:
    """One MinHash a set of shingles, made together (datasketch's bulk: a third of the time
    of one at a time)."""
    return cls.bulk([[w.encode() for w in words] for words in sets], num_perm=PERMUTATIONS, seed=1) if sets else []
