"""A pairwise judge: which of two answers to a prompt is better, by a reward model's scores
or by a local language model asked to pick A or B.

A language model judge is asked twice, the answers swapped the second time, and gives a
tie when its two verdicts disagree: a judge that prefers whatever comes first (the
commonest bias of LLM judges) then counts for nothing. Verdicts are +1 (the first answer
wins), 0 (a tie) or -1 (the second wins); `agreement` is their accord with human labels.

    judge = Judge(model, tokenizer)                         # a reward model or a causal LM
    verdicts = judge.compare(prompts, firsts, seconds)      # np.ndarray of +1 / 0 / -1
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from linnet.data.prompts import encode_prompt

QUESTION = ("Which answer to the question is better?\n\nQuestion: {prompt}\n\nAnswer A: {a}\n\nAnswer B: {b}\n\n"
            "Reply with one letter, A or B.")


class Judge:
    """`model`: a reward model (one with a score head, `linnet.train.reward`) or a causal
    language model; `chat`: render the question with the tokenizer's chat template."""

    def __init__(self, model, tokenizer, *, chat: bool = True, tokens: int = 4096):
        self.model, self.tokenizer, self.chat, self.tokens = model, tokenizer, chat, tokens
        self.rewards = getattr(model, "score", None) is not None
        if not self.rewards:
            letters = [tokenizer.encode(x) for x in ("A", "B")]
            if any(len(ids) != 1 for ids in letters) or letters[0] == letters[1]:
                raise ValueError(f"judge: its tokenizer does not spell 'A' and 'B' as one distinct token each "
                                 f"(it gives {letters[0]} and {letters[1]}), and the verdict is read from those two "
                                 "tokens; give a judge whose vocabulary holds 'A' and 'B' as tokens, or a reward model")
            self.letters = [ids[0] for ids in letters]

    def compare(self, prompts: Sequence[str], firsts: Sequence[str], seconds: Sequence[str]) -> np.ndarray:
        """[n] verdicts: +1 where the first answer is better, -1 the second, 0 a tie
        (equal answers are a tie without asking; an empty answer loses to any other)."""
        verdicts = np.zeros(len(prompts))
        asked = []
        for i, (a, b) in enumerate(zip(firsts, seconds, strict=True)):
            if a.strip() == b.strip():
                continue
            if not a.strip() or not b.strip():
                verdicts[i] = 1.0 if a.strip() else -1.0
                continue
            asked.append(i)
        if asked:
            pick = self._rewarded if self.rewards else self._asked
            verdicts[asked] = pick([prompts[i] for i in asked], [firsts[i] for i in asked],
                                   [seconds[i] for i in asked])
        return verdicts

    def _rewarded(self, prompts, firsts, seconds) -> np.ndarray:
        from linnet.train.reward import score_answers

        groups = [(encode_prompt(self.tokenizer, p, self.chat), self._answer(x))
                  for p, a, b in zip(prompts, firsts, seconds) for x in (a, b)]
        scores = score_answers(self.model, groups, tokens=self.tokens).reshape(-1, 2)
        return np.sign(scores[:, 0] - scores[:, 1])

    def _answer(self, text: str) -> list[int]:
        eos = list(self.tokenizer.eos_ids)[:1]
        return self.tokenizer.encode(text) + eos

    @torch.no_grad()
    def _asked(self, prompts, firsts, seconds) -> np.ndarray:
        """Both orders: A-first says +1 when A's letter is likelier; the swapped question's
        verdict is negated; the two must agree."""
        verdicts = []
        for prompt, a, b in zip(prompts, firsts, seconds):
            both = [self._letter(prompt, a, b), -self._letter(prompt, b, a)]
            verdicts.append(both[0] if both[0] == both[1] else 0.0)
        return np.array(verdicts)

    def _letter(self, prompt: str, a: str, b: str) -> float:
        ids = encode_prompt(self.tokenizer, QUESTION.format(prompt=prompt, a=a, b=b), self.chat)
        logits = self.model(torch.tensor(ids[-self.model.card.max_positions:]))[-1]
        first, second = (float(logits[t]) for t in self.letters)
        return float(np.sign(first - second))


def agreement(verdicts, labels) -> float:
    """The share of pairs where the judge agrees with the human label (+1: the first
    answer is the better one), a tie counting half."""
    verdicts, labels = np.asarray(verdicts, dtype=np.float64), np.asarray(labels, dtype=np.float64)
    return float(np.mean(np.where(verdicts == 0, 0.5, verdicts == labels)))
