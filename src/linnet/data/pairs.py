"""Preference records to `Pair`s of token ids, for DPO, and unpaired ones to `Unpaired`, for
KTO ({"prompt": ..., "completion": ..., "label": true | false}: one answer, desirable or not).

A record holds a prompt and two answers. Accepted shapes:
  {"prompt": str | messages, "chosen": str | message | messages, "rejected": …}
  {"chosen": messages, "rejected": messages}  full dialogues sharing all but the last
                                              assistant turn (hh-rlhf style)
With a chat template the conversation is rendered and masked as `chat_example` does;
the answer is the last learned span (the final assistant turn and its end-of-turn
token), the prompt everything before it. Both answers must share that prompt exactly.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from linnet.data.examples import chat_example
from linnet.data.readers import Record, option_name
from linnet.data.tokenizer import Tokenizer
from linnet.packing import Pair, Unpaired


def _messages(value: Any, where: str, field: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": "assistant" if field != "prompt" else "user", "content": value}]
    if isinstance(value, dict) and "content" in value:
        return [{"role": value.get("role", "assistant"), "content": value["content"]}]
    if isinstance(value, list) and all(isinstance(m, dict) for m in value):
        return value
    raise ValueError(f"{where}: field {field!r} must be text, a message or a list of messages")


def _split_last_answer(tokens: np.ndarray, learned: np.ndarray, where: str) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids): the answer is the last run of learned tokens."""
    ends = np.flatnonzero(learned)
    if len(ends) == 0:
        raise ValueError(f"{where}: the answer has no tokens to learn")
    end = int(ends[-1]) + 1
    start = end
    while start > 0 and learned[start - 1]:
        start -= 1
    return tokens[:start].tolist(), tokens[start:end].tolist()


def _chat_answer(record: Record, tokenizer: Tokenizer, head: list[dict], name: str,
                 names: Mapping[str, str] | None = None) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids) of the conversation `head` + the record's field `name`."""
    data, where = record.data, record.where
    conversation = head + _messages(data[name], where, name)
    if not conversation or conversation[-1].get("role") != "assistant":
        raise ValueError(f"{where}: the {name!r} conversation must end with an assistant turn")
    if not str(conversation[-1].get("content") or "").strip():
        raise ValueError(f"{where}: the {name!r} answer is empty; every example needs its answer")
    example = chat_example(conversation, tokenizer, where=f"{where} ({name})", names=names)
    return _split_last_answer(example.tokens, example.learned, f"{where} ({name})")


def _pair_from_chat(record: Record, tokenizer: Tokenizer, prompt: str, chosen: str, rejected: str,
                    names: Mapping[str, str] | None = None) -> Pair:
    data, where = record.data, record.where
    for name in (chosen, rejected):
        if name not in data:
            raise ValueError(f"{where}: missing field {name!r}; name the answer fields with "
                             f"{option_name(names, 'chosen')} / {option_name(names, 'rejected')}")
    head = _messages(data[prompt], where, "prompt") if prompt in data else []
    (prompt_c, answer_c), (prompt_r, answer_r) = (_chat_answer(record, tokenizer, head, name, names)
                                                  for name in (chosen, rejected))
    if answer_c == answer_r:
        raise ValueError(f"{where}: {chosen!r} and {rejected!r} are the same answer, which teaches nothing; fix or "
                         "drop this record")
    if prompt_c != prompt_r:
        raise ValueError(
            f"{where}: the chosen and rejected conversations do not share their prompt (everything "
            "before the last assistant turn); fix or drop this record"
        )
    return Pair(prompt_c, answer_c, answer_r)


def _pair_from_text(record: Record, tokenizer: Tokenizer, prompt: str, chosen: str, rejected: str,
                    names: Mapping[str, str] | None = None) -> Pair:
    data, where = record.data, record.where
    for name in (prompt, chosen, rejected):
        if not isinstance(data.get(name), str):
            raise ValueError(f"{where}: field {name!r} must be text when chat is off")
    for name in (chosen, rejected):
        if not data[name].strip():
            raise ValueError(f"{where}: the {name!r} answer is empty; every pair needs two answers")
    if data[chosen] == data[rejected]:
        raise ValueError(f"{where}: {chosen!r} and {rejected!r} are the same answer, which teaches nothing; fix or "
                         "drop this record")
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    stop = [tokenizer.eos_ids[0]] if tokenizer.eos_ids else []
    return Pair(bos + tokenizer.encode(data[prompt]), tokenizer.encode(data[chosen]) + stop,
                tokenizer.encode(data[rejected]) + stop)


def pairs_from_records(records: Iterable[Record | dict], tokenizer: Tokenizer, *, prompt: str = "prompt",
                       chosen: str = "chosen", rejected: str = "rejected", chat: bool = True,
                       names: Mapping[str, str] | None = None) -> list[Pair]:
    """One Pair a record, every record checked before any is returned; `names`: how errors
    name these keywords (linnet.data.examples_from_records)."""
    records = [r if isinstance(r, Record) else Record(f"record {i}", r) for i, r in enumerate(records)]
    if not records:
        raise ValueError("pairs_from_records: no records; the data holds no preference pairs")
    build = _pair_from_chat if chat and tokenizer.chat_template else _pair_from_text
    pairs = [build(r, tokenizer, prompt, chosen, rejected, names) for r in records]
    for record, pair in zip(records, pairs):
        if not pair.chosen or not pair.rejected:
            raise ValueError(f"{record.where}: an answer is empty; every pair needs two answers")
    same = [r.where for r, p in zip(records, pairs) if list(p.chosen) == list(p.rejected)]
    if same:  # texts that differ only where the tokenizer cannot encode them: nothing to prefer
        more = f" and {len(same) - 5} more" if len(same) > 5 else ""
        raise ValueError(f"{', '.join(same[:5])}{more}: {chosen!r} and {rejected!r} encode to the same tokens (they "
                         "differ only in text the tokenizer cannot encode), which teaches nothing; fix or drop "
                         f"{'this record' if len(same) == 1 else 'these records'}")
    tokenizer.check_known((ids for p in pairs for ids in (p.prompt, p.chosen, p.rejected)),
                          records[0].where.rsplit(" ", 2)[0])
    return pairs


def _label(record: Record, field: str, names: Mapping[str, str] | None = None) -> bool:
    value = record.data.get(field)
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    raise ValueError(f"{record.where}: field {field!r} must be true (a desirable answer) or false (undesirable), got "
                     f"{value!r}; name the label field with {option_name(names, 'label')}")


def unpaired_from_records(records: Iterable[Record | dict], tokenizer: Tokenizer, *, prompt: str = "prompt",
                          completion: str = "completion", label: str = "label", chat: bool = True,
                          names: Mapping[str, str] | None = None) -> list[Unpaired]:
    """One Unpaired a record (KTO), every record checked before any is returned; the
    completion is text, a message or messages (chat), the label a boolean; `names`: how
    errors name these keywords (linnet.data.examples_from_records)."""
    records = [r if isinstance(r, Record) else Record(f"record {i}", r) for i, r in enumerate(records)]
    if not records:
        raise ValueError("unpaired_from_records: no records; the data holds no labelled answers")
    out = []
    for r in records:
        if completion not in r.data:
            raise ValueError(f"{r.where}: missing field {completion!r}; name the answer field with "
                             f"{option_name(names, 'completion')}")
        desirable = _label(r, label, names)
        if chat and tokenizer.chat_template:
            head = _messages(r.data[prompt], r.where, "prompt") if prompt in r.data else []
            ids, answer = _chat_answer(r, tokenizer, head, completion, names)
        else:
            for name in (prompt, completion):
                if not isinstance(r.data.get(name), str) or not r.data[name].strip():
                    raise ValueError(f"{r.where}: field {name!r} must be non-empty text when chat is off")
            bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
            stop = [tokenizer.eos_ids[0]] if tokenizer.eos_ids else []
            ids, answer = bos + tokenizer.encode(r.data[prompt]), tokenizer.encode(r.data[completion]) + stop
        if not ids or not answer:
            raise ValueError(f"{r.where}: the prompt or the answer is empty")
        out.append(Unpaired(ids, answer, desirable))
    tokenizer.check_known((ids for u in out for ids in (u.prompt, u.completion)), records[0].where.rsplit(" ", 2)[0])
    return out
