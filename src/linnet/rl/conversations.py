"""The host's side of multi-turn sampling: one environment a completion, and the tokens
inserted between the model's turns.

The engine samples a conversation as one completion. When a row samples a stop token the
engine asks `Conversations.ended`; the row's environment reads the turn and answers (a
`linnet.rl.environments.Turn`); its messages, rendered by the chat template as the turns
that follow an assistant turn (the next assistant header included), are queued, and the
engine feeds them to the row one a step in place of sampled tokens. They pass the model
as sampled tokens do, so the KV cache grows by them and nothing is recomputed. They are
marked not learned (`Completion.learned`), their log-probabilities left 0, and GRPO's
rewards grade the last turn (`last_turn`); the environment's turn rewards are summed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from linnet.rl.environments import Turn, environment_factory

MARK = "\u2063LINNET-TURN\u2063"  # stands for the model's turn when the template is rendered


def inserted_text(tokenizer, messages: Sequence[Mapping[str, Any]] | str) -> str:
    """The text that follows a model turn's stop token: `messages` as the chat template
    renders them after an assistant turn, with the generation prompt; a str as it is."""
    if isinstance(messages, str):
        return messages
    if tokenizer.chat_template is None:
        raise ValueError("an environment answered with chat messages, but the tokenizer has no chat template; "
                         "answer with text, or give data.chat_template")
    full = tokenizer.apply_chat_template([{"role": "user", "content": "?"}, {"role": "assistant", "content": MARK},
                                          *messages], add_generation_prompt=True)
    after = full.index(MARK) + len(MARK)
    ends = [(full.find(text, after), text) for text in map(tokenizer.decode, ([i] for i in tokenizer.eos_ids))]
    ends = [(at, text) for at, text in ends if at >= 0]
    if not ends:
        raise ValueError("the chat template ends an assistant turn with none of the tokenizer's stop tokens, so where "
                         "a tool turn starts is unknown; give the tokenizer the template's end-of-turn token as eos")
    at, text = min(ends)
    return full[at + len(text):]


def last_turn(tokens: Sequence[int], learned: np.ndarray | None) -> list[int]:
    """A conversation's last model turn: its tokens after the last inserted one."""
    if learned is None or learned.all():
        return list(tokens)
    return list(tokens[int(np.flatnonzero(~learned)[-1]) + 1:])


class Conversations:
    """The environments of one `Engine.sample` call, one a completion (prompt-major, n of
    each prompt), reset from their prompts. `make()` builds one environment; `max_turns`
    ends a conversation after that many model turns."""

    def __init__(self, prompts: Sequence, n: int, make: Callable[[], Any], tokenizer, max_turns: int):
        self.tokenizer, self.max_turns = tokenizer, max_turns
        self.environments = []
        for prompt in prompts:
            for _ in range(n):
                environment = make()
                environment.reset(prompt)
                self.environments.append(environment)
        rows = len(self.environments)
        self.queued: list[deque[int]] = [deque() for _ in range(rows)]
        self.inserted: list[list[tuple[int, int]]] = [[] for _ in range(rows)]  # [start, end) of each insertion
        self.rewards: list[list[float]] = [[] for _ in range(rows)]
        self.starts = [0] * rows  # where each row's current model turn starts

    def next_tokens(self, rows: Sequence[int]) -> list[int | None]:
        """Each row's next inserted token, None where the model samples."""
        return [self.queued[r].popleft() if self.queued[r] else None for r in rows]

    def ended(self, row: int, tokens: Sequence[int], room: int) -> bool:
        """Row `row` sampled a stop token (the last of `tokens`, its completion so far);
        True when its conversation goes on (the answer queued), False when it ends: the
        environment is done, max_turns is reached, or the answer and one more token would
        not fit the `room` positions left."""
        text = self.tokenizer.decode(list(tokens[self.starts[row]:-1]))
        turn = self.environments[row].step(text)
        if not isinstance(turn, Turn):
            raise TypeError(f"environment {type(self.environments[row]).__name__}.step returned "
                            f"{type(turn).__name__}; return a linnet.rl.environments.Turn")
        self.rewards[row].append(float(turn.reward))
        if turn.done or len(self.rewards[row]) >= self.max_turns:
            return False
        ids = self.tokenizer.encode(inserted_text(self.tokenizer, turn.messages))
        if not ids or len(ids) + 1 > room:
            return False
        start = len(tokens)
        self.queued[row].extend(ids)
        self.inserted[row].append((start, start + len(ids)))
        self.starts[row] = start + len(ids)
        return True

    def learned(self, row: int, length: int) -> np.ndarray:
        """[length] False at the row's inserted tokens."""
        mask = np.ones(length, bool)
        for start, end in self.inserted[row]:
            mask[start:end] = False
        return mask


def conversations_for(environment, tools: Sequence[str], tokenizer, max_turns: int) -> Callable | None:
    """(prompts, n) -> Conversations over the environment (a class or function, or its
    "module:Class") or the built-in tools; None when neither (single-turn sampling)."""
    make = environment_factory(environment, tools)
    if make is None:
        return None
    if tokenizer is None:
        raise ValueError("grpo: an environment (environment= or tools=) reads and answers text: pass tokenizer=")
    return lambda prompts, n: Conversations(prompts, n, make, tokenizer, max_turns)
