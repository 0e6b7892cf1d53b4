"""What `linnet prepare` drops before tokenizing: documents that repeat an earlier one
(exact: the same normalized text; near: MinHash over word 5-grams, datasketch's LSH, at a
similarity of at least `dedup_threshold`) and documents the quality filters reject (too
short, too repetitive, too few letters). Each drop is counted under its reason.

    curation = Curation.of(config.data)
    kept = [t for t in texts if curation.keep(t)]
    curation.dropped                                  # {"exact duplicate": 12, "too short": 3, ...}
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from linnet.data.overlap import PERMUTATIONS, normalize, shingles

NGRAM = 5  # words a shingle for near duplicates: long documents share short n-grams by chance
REPEATED_NGRAM = 3  # words a shingle of the repetition filter


def repetition(text: str) -> float:
    """The share of a document's word 3-grams that repeat one earlier in it (boilerplate,
    loops of generated text score high; prose scores near 0)."""
    words = text.split()
    grams = [tuple(words[i:i + REPEATED_NGRAM]) for i in range(len(words) - REPEATED_NGRAM + 1)]
    return 1 - len(set(grams)) / len(grams) if grams else 0.0


def letters(text: str) -> float:
    """The share of a document's non-space characters that are letters."""
    chars = [c for c in text if not c.isspace()]
    return sum(c.isalpha() for c in chars) / len(chars) if chars else 0.0


@dataclass
class Curation:
    dedup: str = "off"
    threshold: float = 0.8
    min_characters: int = 0
    max_repetition: float = 1.0
    min_letters: float = 0.0
    dropped: Counter = field(default_factory=Counter)
    _seen: set = field(default_factory=set)
    _index: Any = None
    _signatures: dict = field(default_factory=dict)

    @classmethod
    def of(cls, d) -> Curation:
        """The curation a corpus config asks for (data.dedup, ...)."""
        return cls(dedup=d.dedup, threshold=d.dedup_threshold, min_characters=d.min_characters,
                   max_repetition=d.max_repetition, min_letters=d.min_letters)

    @property
    def active(self) -> bool:
        return (self.dedup != "off" or self.min_characters > 0 or self.max_repetition < 1
                or self.min_letters > 0)

    def settings(self) -> dict[str, Any]:
        """What decides which documents stay (a cache's identity)."""
        return {"dedup": self.dedup, "dedup_threshold": self.threshold if self.dedup == "near" else None,
                "min_characters": self.min_characters, "max_repetition": self.max_repetition,
                "min_letters": self.min_letters}

    def keep(self, text: str) -> bool:
        """Whether `text` stays; a document kept is remembered for the duplicates after it."""
        reason = self._rejected(text)
        if reason is not None:
            self.dropped[reason] += 1
            return False
        return True

    def _rejected(self, text: str) -> str | None:
        if len(text.strip()) < self.min_characters:
            return "too short"
        if self.max_repetition < 1 and repetition(text) > self.max_repetition:
            return "repetitive"
        if self.min_letters > 0 and letters(text) < self.min_letters:
            return "too few letters"
        if self.dedup == "off":
            return None
        plain = normalize(text)
        digest = hashlib.blake2b(plain.encode(), digest_size=16).digest()
        if digest in self._seen:
            return "exact duplicate"
        self._seen.add(digest)
        if self.dedup == "near" and self._near(plain, len(self._seen)):
            return "near duplicate"
        return None

    def _near(self, plain: str, key: int) -> bool:
        try:
            from datasketch import MinHash, MinHashLSH
        except ImportError:
            raise ValueError("data.dedup=near needs datasketch: pip install 'linnet[data]' (or data.dedup=exact)") \
                from None
        if self._index is None:
            self._index = MinHashLSH(threshold=self.threshold * 0.85, num_perm=PERMUTATIONS)
        m = MinHash(num_perm=PERMUTATIONS, seed=1)
        m.update_batch([s.encode() for s in shingles(plain, NGRAM)])
        signature = m.hashvalues
        for other in self._index.query(m):  # the estimate from the two signatures decides
            if np.mean(self._signatures[other] == signature) >= self.threshold:
                return True
        self._index.insert(key, m)
        self._signatures[key] = signature
        return False
