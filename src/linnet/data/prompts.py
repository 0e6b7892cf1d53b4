"""Prompt records to `Prompt`s of token ids, for GRPO and evaluation: a prompt field
(text, wrapped as a user turn by the chat template when there is one) and the reference
answer the rewards compare with."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from linnet.data.readers import Record, option_name
from linnet.data.tokenizer import Tokenizer
from linnet.rl.rollouts import Prompt


@dataclass(frozen=True)
class Framing:
    """What goes before every prompt of an evaluation: a system prompt and few-shot
    (prompt, answer) examples, so "the base model with its best prompt" is measured on
    the same records as the tuned one. Under a chat template they are a system turn and
    user/assistant turns; as raw text they are joined by `separator`."""

    system: str | None = None
    shots: tuple[tuple[str, str], ...] = ()
    separator: str = "\n\n"

    def messages(self, text: str) -> list[dict[str, str]]:
        turns = [{"role": "system", "content": self.system}] if self.system else []
        for prompt, answer in self.shots:
            turns += [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
        return turns + [{"role": "user", "content": text}]

    def text(self, text: str) -> str:
        parts = ([self.system] if self.system else []) + [p + a for p, a in self.shots]
        return "".join(part + self.separator for part in parts) + text


def start_id(tokenizer: Tokenizer, card=None) -> int | None:
    """The id a prompt starts with: the tokenizer's BOS, else the `card`'s, which a bare
    tokenizer.json does not add but the model learned after (the quickstart's)."""
    if tokenizer.bos_id is not None or card is None:
        return tokenizer.bos_id
    return card.bos_token_id


def encode_prompt(tokenizer: Tokenizer, text: str, chat: bool, framing: Framing | None = None, *,
                  card=None) -> list[int]:
    """A prompt's ids: the chat template's user turn with the generation prompt, or BOS +
    text; `framing` (a system prompt, few-shot examples) before it. With the model's
    `card`, its BOS where the tokenizer has none (`start_id`): eval and generate encode
    alike."""
    framing = framing or Framing()
    if chat and tokenizer.chat_template:
        ids = tokenizer.encode(tokenizer.apply_chat_template(framing.messages(text), add_generation_prompt=True))
    else:
        ids = tokenizer.encode(framing.text(text))
    bos = start_id(tokenizer, card)
    return ids if bos is None or (ids and ids[0] == bos) else [bos] + ids


def prompts_from_records(records: Iterable[Record], tokenizer: Tokenizer, *, prompt: str = "prompt",
                         answer: str = "answer", chat: bool = True, framing: Framing | None = None,
                         names: Mapping[str, str] | None = None, card=None) -> list[Prompt]:
    """One Prompt a record (`framing` before each), every record checked before any is
    returned; `names`: how errors name these keywords (linnet.data.examples_from_records);
    `card`: the model's, as `encode_prompt` takes it."""
    prompts = []
    for record in records:
        for name in (prompt, answer):
            if name not in record.data:
                raise ValueError(f"{record.where}: missing field {name!r}; name it with "
                                 f"{option_name(names, 'prompt')} / {option_name(names, 'answer')}")
        text = record.data[prompt]
        if not isinstance(text, str) or not text:
            raise ValueError(f"{record.where}: field {prompt!r} must be non-empty text")
        given = record.data[answer]
        if given is None or (isinstance(given, str) and not given.strip()):
            raise ValueError(f"{record.where}: field {answer!r} is {json.dumps(given)}, no reference answer for the "
                             "rewards to compare with; give every prompt its answer, or drop this record")
        prompts.append(Prompt(encode_prompt(tokenizer, text, chat, framing, card=card), record.data[answer], text, record.data))
    if prompts:
        tokenizer.check_known((p.ids for p in prompts), record.where.rsplit(" ", 2)[0])
    return prompts
