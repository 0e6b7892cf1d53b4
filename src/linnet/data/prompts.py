"""Prompt records to `Prompt`s of token ids, for GRPO and evaluation: a prompt field
(text, wrapped as a user turn by the chat template when there is one) and the reference
answer the rewards compare with."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

from linnet.data.readers import Record, option_name
from linnet.data.tokenizer import Tokenizer
from linnet.rl.rollouts import Prompt


def encode_prompt(tokenizer: Tokenizer, text: str, chat: bool) -> list[int]:
    """A prompt's ids: the chat template's user turn with the generation prompt, or BOS + text."""
    if chat and tokenizer.chat_template:
        ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                             add_generation_prompt=True))
    else:
        ids = tokenizer.encode(text)
    bos = tokenizer.bos_id
    return ids if bos is None or (ids and ids[0] == bos) else [bos] + ids


def prompts_from_records(records: Iterable[Record], tokenizer: Tokenizer, *, prompt: str = "prompt",
                         answer: str = "answer", chat: bool = True,
                         names: Mapping[str, str] | None = None) -> list[Prompt]:
    """One Prompt a record, every record checked before any is returned; `names`: how
    errors name these keywords (linnet.data.examples_from_records)."""
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
        prompts.append(Prompt(encode_prompt(tokenizer, text, chat), record.data[answer], text, record.data))
    if prompts:
        tokenizer.check_known((p.ids for p in prompts), record.where.rsplit(" ", 2)[0])
    return prompts
