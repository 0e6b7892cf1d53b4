"""Records to `Example`s for supervised fine-tuning: token ids and which of them are learned.

A chat's loss mask comes from token ids, never from searching the text. Each prefix of
the conversation is rendered with the chat template and tokenized; an assistant turn's
learned span is the ids between the rendering of the messages before it (with the
generation prompt, so the role header is context) and the rendering that includes it,
up to and including its last stop token (`<|eot_id|>`, `<|im_end|>`): the model learns
to answer and to stop, not what the template writes after the stop (ChatML's newline).
Each prefix's ids must begin the whole conversation's ids, or the template is refused.

Chats come as OpenAI's `messages` (role/content) or ShareGPT's `conversations` (from/value
with human/gpt/system), recognised by field; either becomes the same role/content turns.
Prompt/completion records go through the chat template as a user turn and an assistant
turn when the tokenizer has one and `chat` is on; otherwise the prompt and completion
texts are tokenized one after the other (add any separator to the data) and the
completion ends with the first stop token, learned.

A sequence starts with exactly one BOS where the tokenizer has one: it is added when the
template leaves it out, and a doubled one (template plus tokenizer) is cut to one.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from linnet.data.readers import Record, kind_of, option_name, read_records
from linnet.data.tokenizer import Tokenizer
from linnet.errors import SettingError
from linnet.packing import Example

# The roles a chat may hold: the template renders them, and only assistant turns are learned.
ROLES = ("system", "user", "assistant", "tool")

# Chat fields recognised when the caller names none: OpenAI's messages (role/content) and
# ShareGPT's conversations (from/value, human/gpt/system), either spelling in either field.
CHAT_FIELDS = ("messages", "conversations")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "tool": "tool", "function": "tool", "observation": "tool"}

# Field names tried, in order, when the caller names none (Alpaca and its relatives).
PROMPT_FIELDS = ("prompt", "instruction")
COMPLETION_FIELDS = ("completion", "output", "response")

_CHUNK = 1024  # records rendered, then tokenized together

# (messages field, [], None) for chats; (None, prompt fields, completion field) otherwise.
Layout = tuple[str | None, list[str], str | None]

# Makes a record's example from the ids of its texts.
Build = Callable[[list[list[int]]], Example]


def load_examples(
    source: str | os.PathLike | Any,
    tokenizer: Tokenizer,
    *,
    tokens: int,
    messages: str | None = None,
    prompt: str | Sequence[str] | None = None,
    completion: str | None = None,
    chat: bool = True,
    truncate: bool = False,
    names: Mapping[str, str] | None = None,
) -> list[Example]:
    """`read_records` then `examples_from_records`: a data file to examples."""
    return examples_from_records(
        read_records(source),
        tokenizer,
        tokens=tokens,
        messages=messages,
        prompt=prompt,
        completion=completion,
        chat=chat,
        truncate=truncate,
        names=names,
    )


def text_examples(records: Sequence[Record], tokenizer: Tokenizer, *, tokens: int, field: str = "text") -> list[Example]:
    """Documents to learn whole (a `field` of text a record, as pretraining reads them):
    BOS where the tokenizer has one, the text, EOS; cut to a row of `tokens`."""
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    eos = list(tokenizer.eos_ids)[:1]
    out = []
    for record in records:
        text = record.data.get(field)
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{record.where}: field {field!r} must be non-empty text")
        ids = tokenizer.encode(text)
        ids = (ids if bos and ids[:1] == bos else bos + ids) + eos
        out.append(Example.plain(ids[:tokens]))
    return out


def examples_from_records(
    records: Iterable[Record | dict],
    tokenizer: Tokenizer,
    *,
    tokens: int,
    messages: str | None = None,
    prompt: str | Sequence[str] | None = None,
    completion: str | None = None,
    chat: bool = True,
    truncate: bool = False,
    names: Mapping[str, str] | None = None,
) -> list[Example]:
    """One `Example` a record, every record checked before any is returned.

    messages: the field holding a chat (a list of {role, content}).
    prompt: the field(s) holding the prompt; several are joined by a blank line, empty
        ones skipped (Alpaca: ["instruction", "input"]).
    completion: the field holding the answer.
    With none named, a record's "messages" field makes a chat, else the first of
    PROMPT_FIELDS (with "input" after "instruction" when present) and COMPLETION_FIELDS
    that the first record has.
    chat: format prompt/completion records with the chat template (when there is one).
    tokens: the row length; a longer record is an error naming it, unless `truncate`
        cuts it to the row (one with nothing learned left is dropped, with a warning).
    names: how errors name these keywords, where the caller's user spells them otherwise
        (`linnet sft` passes the YAML's: {"tokens": "training.context_length", ...});
        default the keywords themselves (`tokens=`).
    """
    name = functools.partial(option_name, names)
    if tokens < 2:
        raise ValueError(f"a row of {tokens} positions ({name('tokens')}) is too short; it needs at least 2")
    records = [r if isinstance(r, Record) else Record(f"record {i}", r) for i, r in enumerate(records)]
    if not records:
        raise ValueError("examples_from_records: no records; the data holds nothing to learn")
    for record in records:
        if not isinstance(record.data, dict):
            kind = type(record.data).__name__
            raise TypeError(f"{record.where}: a {kind}, not a record (a dict of fields)")
    layout = _layout(records[0], messages, prompt, completion, names)
    examples, long, dropped = [], [], []
    for chunk in range(0, len(records), _CHUNK):
        plans = [(r, *_plan(r, tokenizer, layout, chat, names)) for r in records[chunk : chunk + _CHUNK]]
        encoded = iter(tokenizer.encode_batch([text for _, texts, _ in plans for text in texts]))
        for record, texts, build in plans:
            example = build([next(encoded) for _ in texts])
            if len(example) > tokens:
                if not truncate:
                    long.append(f"{record.where} ({len(example)} tokens)")
                    continue
                if not example.learned[1:tokens].any():
                    dropped.append(record.where)
                    continue
                example = Example(example.tokens[:tokens], example.learned[:tokens])
            examples.append(example)
    if long:
        more = f"; and {len(long) - 5} more" if len(long) > 5 else ""
        raise ValueError(
            f"{len(long)} record(s) longer than a row of {tokens} tokens: "
            f"{'; '.join(long[:5])}{more}. Raise the row length ({name('tokens')}), shorten or drop these "
            f"records, or set {name('truncate')} to cut them to the row"
        )
    if dropped:
        warnings.warn(
            f"dropped {len(dropped)} record(s) with nothing learned in their first {tokens} "
            f"tokens, e.g. {dropped[0]}",
            stacklevel=2,
        )
    if not examples:
        raise ValueError(f"no record has anything learned within {tokens} tokens; raise the row length "
                         f"({name('tokens')})")
    tokenizer.check_known((ex.tokens for ex in examples), records[0].where.rsplit(" ", 2)[0])
    return examples


def chat_example(messages: list[dict], tokenizer: Tokenizer, *, where: str = "conversation",
                 names: Mapping[str, str] | None = None) -> Example:
    """A conversation as one example that learns exactly its assistant turns and the stop
    token ending each (see the module docstring for how the mask is found); `names` as in
    `examples_from_records`."""
    texts, build = _chat(messages, tokenizer, where, names)
    return build(tokenizer.encode_batch(texts))


def prompt_answer_records(records: Sequence[Record]) -> list[Record] | None:
    """Records of a prompt and its completion (prompt/completion, Alpaca's instruction,
    input and output, ...) as {"prompt": text, "answer": completion} records, the prompt
    fields joined as training joins them, to complete and score the completions; None for
    chats, which hold no single answer."""
    messages, prompt_fields, completion = _layout(records[0], None, None, None)
    if messages is not None:
        return None
    return [Record(r.where, {"prompt": "\n\n".join(str(r.data[f]) for f in prompt_fields if r.data.get(f)),
                             "answer": r.data.get(completion)}) for r in records]


def _layout(first: Record, messages, prompt, completion, names: Mapping[str, str] | None = None) -> Layout:
    """Which fields hold the text: the caller's names, else found in the first record."""
    spelled = functools.partial(option_name, names)
    if messages is not None:
        if prompt is not None or completion is not None:
            raise ValueError(f"name either {spelled('messages')} (chats) or {spelled('prompt')}/"
                             f"{spelled('completion')}, not both")
        return messages, [], None
    fields = first.data
    if prompt is None and completion is None:
        for name in CHAT_FIELDS:  # OpenAI's messages, ShareGPT's conversations
            if name in fields:
                return name, [], None
    if prompt is None:
        prompt = [f for f in PROMPT_FIELDS if f in fields][:1]
        if prompt == ["instruction"] and "input" in fields:
            prompt.append("input")
    if completion is None:
        completion = next((f for f in COMPLETION_FIELDS if f in fields), None)
    if not prompt or completion is None:
        raise ValueError(
            f"{first.where}: cannot tell which fields hold the text (the record has "
            f"{', '.join(map(repr, fields)) or 'no fields'}); name them: {spelled('messages')} for chats, "
            f"or {spelled('prompt')} and {spelled('completion')}"
        )
    return None, [prompt] if isinstance(prompt, str) else list(prompt), completion


def _field(record: Record, name: str, option: str, names: Mapping[str, str] | None = None) -> Any:
    value = record.data.get(name)
    if value is None:
        have = ", ".join(map(repr, record.data)) or "no fields"
        state = "is null" if name in record.data else "is missing"
        raise ValueError(
            f"{record.where}: field {name!r} {state} (the record has {have}); add it, or set "
            f"{option_name(names, option)} to the field that holds the {option}"
        )
    return value


def _text(record: Record, name: str, option: str, names: Mapping[str, str] | None = None) -> str:
    value = _field(record, name, option, names)
    if not isinstance(value, str):
        raise ValueError(f"{record.where}: field {name!r} holds {kind_of(value)}; the {option} must be text")
    return value


def _plan(record: Record, tokenizer: Tokenizer, layout: Layout, chat: bool,
          names: Mapping[str, str] | None = None) -> tuple[list[str], Build]:
    """The texts a record needs tokenized, and how their ids make its example (tokenizing
    many records' texts at once uses every core)."""
    messages_field, prompt_fields, completion_field = layout
    if messages_field is not None:
        return _chat(_field(record, messages_field, "messages", names), tokenizer, record.where, names)
    prompt = "\n\n".join(t for t in (_text(record, f, "prompt", names) for f in prompt_fields) if t)
    completion = _text(record, completion_field, "completion", names)
    if not completion.strip():
        raise ValueError(f"{record.where}: field {completion_field!r} is empty, so the record teaches nothing; fill "
                         "or drop it")
    if chat and tokenizer.render is not None:
        turns = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
        return _chat(turns, tokenizer, record.where, names)
    if not tokenizer.eos_ids:
        source = str(tokenizer.source).replace("{", "{{").replace("}", "}}")
        raise SettingError(f"{source}: no stop token to end a completion; {{eos}}",
                           python={"eos": "pass eos= to load_tokenizer"})
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    return [prompt, completion], lambda ids: Example.prompted(bos + ids[0], ids[1] + [tokenizer.eos_ids[0]])


def _chat(messages: Any, tokenizer: Tokenizer, where: str,
          names: Mapping[str, str] | None = None) -> tuple[list[str], Build]:
    """Render the whole conversation, and for each assistant turn the messages before it
    with the generation prompt and the messages through it; the learned span of the turn
    lies between those two renderings' ids. ShareGPT turns are read as OpenAI's."""
    messages = openai_messages(messages, where)
    _check_messages(messages, where)
    if tokenizer.render is None:
        raise ValueError(
            f"{where}: a chat needs a chat template and {tokenizer.source} has none; "
            f"set {option_name(names, 'chat_template')}"
        )
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
        raise ValueError(
            f"{where}: no assistant turn, so nothing to learn; a conversation needs a message "
            "with role 'assistant'"
        )
    if turns[0] == 0:
        raise ValueError(
            f"{where}: messages[0] is an assistant turn; open the conversation with a system or user message"
        )
    prefixes = [(messages, False)]  # (messages rendered, with the generation prompt)
    for i in turns:
        prefixes.append((messages[:i], True))
        if i + 1 < len(messages):  # through the last message: the whole conversation
            prefixes.append((messages[: i + 1], False))
    texts = [_render(tokenizer, m, generation_prompt, where) for m, generation_prompt in prefixes]

    def build(encoded: list[list[int]]) -> Example:
        full, *rest = (_one_bos(ids, tokenizer.bos_id) for ids in encoded)
        prefix = iter(
            _check_prefix(ids, full, text, texts[0], tokenizer, len(m), g, where)
            for ids, text, (m, g) in zip(rest, texts[1:], prefixes[1:], strict=True)
        )
        learned = np.zeros(len(full), bool)
        for i in turns:
            start = len(next(prefix))
            end = len(next(prefix)) if i + 1 < len(messages) else len(full)
            stops = [k for k in range(start, end) if full[k] in tokenizer.eos_ids]
            if not stops:
                names = ", ".join(repr(tokenizer.decode([t])) for t in tokenizer.eos_ids) or "none"
                raise ValueError(
                    f"{where}: assistant turn messages[{i}] renders as "
                    f"{tokenizer.decode(full[start:end])!r}, with no stop token (the tokenizer's: "
                    f"{names}), so the model would never learn to stop; add the template's end-of-turn "
                    "token to the stop tokens (load_tokenizer(..., eos=...) or the card's eos_token_ids)"
                )
            learned[start : stops[-1] + 1] = True
        return Example(full, learned)

    return texts, build


def openai_messages(messages: Any, where: str) -> Any:
    """ShareGPT's turns ({"from": "human" | "gpt" | "system", "value": ...}) as OpenAI's
    ({"role", "content"}); anything else is returned as it is (and checked later)."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "from" in m and "value" in m
                                                 and "role" not in m for m in messages):
        return messages
    out = []
    for k, m in enumerate(messages):
        role = SHAREGPT_ROLES.get(m["from"])
        if role is None:
            raise ValueError(f"{where}: turn {k} is from {m['from']!r}; ShareGPT turns come from "
                             f"{', '.join(SHAREGPT_ROLES)}")
        out.append({"role": role, "content": m["value"]})
    return out


def _check_messages(messages: Any, where: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: messages must be a non-empty list of {{'role', 'content'}} objects")
    for k, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(
                f"{where}: messages[{k}] is a {type(m).__name__}; a message is {{'role': .., 'content': ..}}"
            )
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                state = "is missing" if key not in m else f"is a {type(m[key]).__name__}, not text"
                hint = " (ShareGPT turns need 'from' and 'value' on every turn; OpenAI's 'role' and 'content')"
                raise ValueError(
                    f"{where}: messages[{k}] field {key!r} {state}; each message needs a role and "
                    f"text content{hint if 'from' in m else ''}"
                )
        if m["role"] not in ROLES:
            raise ValueError(f"{where}: messages[{k}] has the role {m['role']!r}, which is never learned and which "
                             f"templates render differently; use one of {', '.join(ROLES)}")
        if m["role"] == "assistant" and not m["content"].strip():
            raise ValueError(f"{where}: messages[{k}] is an empty assistant turn, which teaches nothing; fill or "
                             "drop it")


def _render(tokenizer: Tokenizer, messages: list[dict], generation_prompt: bool, where: str) -> str:
    try:
        return tokenizer.render(messages, generation_prompt)
    except Exception as e:  # jinja2's TemplateError, and what a template's raise_exception raises
        raise ValueError(
            f"{where}: the chat template fails on messages[:{len(messages)}] ({type(e).__name__}: {e}); "
            "fix the conversation or the template"
        ) from e


def _one_bos(ids: list[int], bos: int | None) -> list[int]:
    """Exactly one BOS first where the tokenizer has one: added when the template leaves
    it out, cut to one when the template writes it twice."""
    if bos is None:
        return ids
    n = next((k for k, t in enumerate(ids) if t != bos), len(ids))
    if n > 1:
        warnings.warn(f"the chat template's rendering starts with {n} BOS tokens; keeping one", stacklevel=2)
    return [bos] + ids[n:]


def _check_prefix(
    ids: list[int],
    full: list[int],
    text: str,
    full_text: str,
    tokenizer: Tokenizer,
    count: int,
    generation_prompt: bool,
    where: str,
) -> list[int]:
    """A prefix's ids must begin the whole conversation's ids, or its length says nothing."""
    if full[: len(ids)] == ids:
        return ids
    k = next((k for k, (a, b) in enumerate(zip(ids, full, strict=False)) if a != b), min(len(ids), len(full)))
    prompt = " with the generation prompt" if generation_prompt else ""
    found = (
        f"{where}: messages[:{count}]{prompt} tokenizes to {tokenizer.decode(ids[k : k + 8])!r} at "
        f"token {k}, where the whole conversation has {tokenizer.decode(full[k : k + 8])!r}"
    )
    if full_text.startswith(text):
        raise ValueError(
            f"{found}: the template's text is prefix-stable but the tokenizer merges text across the "
            "end of the prefix, so the turn boundary falls inside a token. Use a template whose turn "
            "headers end where this tokenizer splits (e.g. at a special token), or its own template"
        )
    raise ValueError(
        f"{found}: the chat template is not prefix-stable (it renders earlier turns differently "
        "once more follow). The loss mask is read from the ids of each prefix, so use a template "
        "that renders earlier turns the same whatever follows (pass chat_template=)"
    )
