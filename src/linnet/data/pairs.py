"""Preference records to `Pair`s of token ids, for DPO, and unpaired ones to `Unpaired`, for
KTO ({"prompt": ..., "completion": ..., "label": true | false}: one answer, desirable or not).

A record holds a prompt and two answers. Accepted shapes:
  {"prompt": str | messages, "chosen": str | message | messages, "rejected": …}
                                  TRL's explicit prompt, text or conversational
  {"chosen": messages, "rejected": messages}  full dialogues sharing all but the last
                                              assistant turn (TRL's implicit prompt)
  {"chosen": "\n\nHuman: … \n\nAssistant: …", "rejected": …}  Anthropic's hh-rlhf text:
                                  read as the dialogue its Human/Assistant markers spell
  {"chosen": str, "rejected": str}  texts sharing a prefix: the prompt is that prefix
                                    (TRL's implicit prompt for text)
With a chat template the conversation is rendered and masked as `chat_example` does;
the answer is the last learned span (the final assistant turn and its end-of-turn
token), the prompt everything before it. Both answers must share that prompt exactly.

`pairs_from_records(..., tokens=T)` checks that each pair fits a packed row of T
positions (its prompt twice, once before each answer, when a model does not share it),
listing every one that does not; with `truncate` it cuts the prompt first, keeping its
end (TRL's max_prompt_length keeps the end too), then the answers, keeping their start.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from linnet.data.examples import chat_example
from linnet.data.readers import Record, kind_of, option_name
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


HH_TURN = re.compile(r"\n\n(Human|Assistant): ")


def hh_dialogue(text: str) -> list[dict] | None:
    """The dialogue of an hh-rlhf text ("\n\nHuman: … \n\nAssistant: …"), or None when
    the text is not one."""
    if not text.startswith("\n\nHuman: ") and not text.startswith("Human: "):
        return None
    parts = HH_TURN.split("\n\n" + text.removeprefix("\n\n"))
    turns = [{"role": "user" if who == "Human" else "assistant", "content": said.strip()}
             for who, said in zip(parts[1::2], parts[2::2])]
    return turns if turns and turns[-1]["role"] == "assistant" else None


def _read_as_dialogues(data: dict, prompt: str, chosen: str, rejected: str) -> dict:
    """A record in hh-rlhf's text with its answers as the dialogues they spell; else as it is."""
    if prompt in data or not all(isinstance(data.get(n), str) for n in (chosen, rejected)):
        return data
    dialogues = [hh_dialogue(data[n]) for n in (chosen, rejected)]
    return {**data, chosen: dialogues[0], rejected: dialogues[1]} if all(dialogues) else data


def implicit_prompt(chosen: str, rejected: str) -> tuple[str, str, str]:
    """(prompt, chosen answer, rejected answer) of two texts that share their beginning: the
    prompt is the shared prefix, ending before a space where one separates the two (as
    TRL's extract_prompt does)."""
    end = next((i for i, (a, b) in enumerate(zip(chosen, rejected)) if a != b), min(len(chosen), len(rejected)))
    if 0 < end and chosen[end - 1] == " ":
        end -= 1
    return chosen[:end], chosen[end:], rejected[end:]


def _pair_from_chat(record: Record, tokenizer: Tokenizer, prompt: str, chosen: str, rejected: str,
                    names: Mapping[str, str] | None = None) -> Pair:
    record = Record(record.where, _read_as_dialogues(record.data, prompt, chosen, rejected))
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
    if prompt not in data and all(isinstance(data.get(n), str) for n in (chosen, rejected)):
        shared, *answers = implicit_prompt(data[chosen], data[rejected])
        turn = shared.rfind("\n\nAssistant:")
        if turn >= 0 and hh_dialogue(data[chosen]) and hh_dialogue(data[rejected]):  # up to the last answer's turn
            end = turn + len("\n\nAssistant:")
            shared, answers = shared[:end], [data[chosen][end:], data[rejected][end:]]
        if not shared.strip():
            raise ValueError(f"{where}: no {prompt!r} field, and {chosen!r} and {rejected!r} share no beginning to take "
                             f"as the prompt; name the prompt field with {option_name(names, 'prompt')}")
        data = {**data, prompt: shared, chosen: answers[0], rejected: answers[1]}
    for name, option in ((prompt, "prompt"), (chosen, "chosen"), (rejected, "rejected")):
        if name not in data:
            raise ValueError(f"{where}: field {name!r} is missing (the record has {', '.join(map(repr, data))}); add "
                             f"it, or set {option_name(names, option)} to the field that holds the {option} text")
        if not isinstance(data[name], str):
            raise ValueError(f"{where}: field {name!r} holds {kind_of(data[name])}; with chat off it must be text")
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
                       tokens: int | None = None, truncate: bool = False,
                       names: Mapping[str, str] | None = None) -> list[Pair]:
    """One Pair a record, every record checked before any is returned (see the module
    docstring for the shapes, `tokens` and `truncate`); `names`: how errors name these
    keywords (linnet.data.examples_from_records)."""
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
    if tokens is not None:
        pairs = fit_pairs(records, pairs, tokens, truncate, bos=tokenizer.bos_id, names=names)
    return pairs


def fit_pairs(records: list[Record], pairs: list[Pair], tokens: int, truncate: bool, *, bos: int | None = None,
              names: Mapping[str, str] | None = None) -> list[Pair]:
    """The pairs as packed rows of `tokens` positions hold them (the prompt twice, once
    before each answer): every pair that does not fit is listed in one error, unless
    `truncate`, which cuts the prompt first, keeping its end (and a leading `bos`), then
    the answers, keeping their start; a pair left with nothing to compare is dropped, with a
    warning."""
    out, long, cut, dropped = [], [], 0, []
    for record, pair in zip(records, pairs):
        need = 2 * len(pair.prompt) + len(pair.chosen) + len(pair.rejected)
        if need <= tokens:
            out.append(pair)
        elif not truncate:
            long.append(f"{record.where} ({need})")
        else:
            fitted = _truncated(pair, tokens, bos)
            if fitted is None:
                dropped.append(record.where)
            else:
                out.append(fitted)
                cut += 1
    if long:
        more = f"; and {len(long) - 5} more" if len(long) > 5 else ""
        raise ValueError(f"{len(long)} pair(s), {'; '.join(long[:5])}{more}: each needs more positions (its prompt "
                         f"twice and both answers) than a row of {tokens}; raise {option_name(names, 'tokens')} (the "
                         f"row length), shorten or drop these records, or set {option_name(names, 'truncate')} to cut "
                         "them (the prompt first, keeping its end)")
    if cut or dropped:
        warnings.warn(f"cut {cut} pair(s) to rows of {tokens} positions (prompts first, keeping their end)"
                      + (f"; dropped {len(dropped)} whose answers alone fill a row, e.g. {dropped[0]}" if dropped else ""),
                      stacklevel=3)
    if not out:
        raise ValueError(f"no pair fits a row of {tokens} positions; raise {option_name(names, 'tokens')}")
    return out


def _truncated(pair: Pair, tokens: int, bos: int | None) -> Pair | None:
    """`pair` cut to fit `tokens` positions: its prompt to its end (keeping a leading bos),
    then its answers to their start; None when no answer token would be left."""
    head = [bos] if bos is not None and len(pair.prompt) and pair.prompt[0] == bos else []
    body = list(pair.prompt[len(head):])
    room = (tokens - len(pair.chosen) - len(pair.rejected)) // 2 - len(head)  # prompt tokens the answers leave
    if room >= 1:
        return Pair(head + body[len(body) - room:], pair.chosen, pair.rejected)
    prompt = head + body[-max(1, tokens // 8):]  # the answers too long: a short prompt, then the answers cut
    each = (tokens - 2 * len(prompt)) // 2
    if each < 1:
        return None
    chosen, rejected = list(pair.chosen)[:each], list(pair.rejected)[:each]
    return None if chosen == rejected else Pair(prompt, chosen, rejected)


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
