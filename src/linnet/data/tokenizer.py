"""A tokenizer with the few things training needs: text to ids without special tokens
added, the chat template, and the ids that start, stop and pad a sequence.

Ids always come from a `tokenizers.Tokenizer` (tokenizer.json, or one built in code): the
fast tokenizer that transformers wraps too. The chat template is rendered by transformers'
`PreTrainedTokenizerFast.apply_chat_template` when transformers is installed, so a template
behaves exactly as it does there, and otherwise by jinja2 in the same sandbox settings.

    tok = load_tokenizer("qwen2.5-0.5b-instruct")           # a card: its tokenizer files
    tok = load_tokenizer("path/to/hf-model-dir")             # tokenizer.json (+ tokenizer_config.json)
    tok = load_tokenizer(tokenizers_obj, chat_template=T, bos="<s>", eos="</s>")  # built in code
"""

from __future__ import annotations

import json
import os
import string
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from linnet.cards import Card, local_directory, resolve
from linnet.errors import SettingError
from linnet.files.atomic import tokenizer_file

BACKENDS = ("auto", "transformers", "tokenizers")
UNKNOWN_REFUSED = 0.01  # data with more unknown tokens than this share is refused

# What a tokenizer needs from a hub repository (not the weights).
_TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "*.jinja"]

# The special tokens a chat template sees by name ({{ bos_token }}), as in transformers.
_TEMPLATE_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

Render = Callable[[list[dict], bool], str]


@dataclass(frozen=True)
class Tokenizer:
    """Text <-> ids and the chat template of one model.

    bos_id     the id every sequence starts with, or None where the model has none (ChatML)
    eos_ids    stop tokens: generation ends at any; eos_ids[0] ends a raw-text completion
    pad_id     filler for padded positions (never learned)
    """

    raw: Any = field(repr=False)  # tokenizers.Tokenizer
    chat_template: str | None = field(repr=False)
    render: Render | None = field(repr=False)
    bos_id: int | None
    eos_ids: tuple[int, ...]
    pad_id: int
    source: str

    @property
    def vocab_size(self) -> int:
        return self.raw.get_vocab_size(with_added_tokens=True)

    @property
    def unk_id(self) -> int | None:
        """The id text the vocabulary cannot spell becomes (None: it spells everything, as
        byte-level BPE does)."""
        name = getattr(self.raw.model, "unk_token", None)
        return None if name is None else self.raw.token_to_id(name)

    def check_known(self, token_lists: Iterable[Sequence[int]], where: str) -> None:
        """Warn when encoded text holds the unknown token (text this tokenizer cannot spell,
        which would be trained on as that one token), with its share; refuse more than
        UNKNOWN_REFUSED of the tokens."""
        unk = self.unk_id
        if unk is None:
            return
        total = unknown = 0
        for ids in token_lists:
            total += len(ids)
            unknown += sum(1 for t in ids if t == unk)
        if not unknown:
            return
        share = unknown / total
        message = (f"{where}: {share:.2%} of the tokens ({unknown:,} of {total:,}) are the unknown token "
                   f"{self.raw.id_to_token(unk)!r}: text {self.source} cannot encode")
        if share > UNKNOWN_REFUSED:
            raise ValueError(message + "; use a tokenizer whose vocabulary covers the data (data.tokenizer), or "
                             "clean the data")
        warnings.warn(message + "; it is trained on as that token", stacklevel=3)

    def encode(self, text: str) -> list[int]:
        """Ids of `text` with no special tokens added: a rendered chat carries its own."""
        return self.raw.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode` over many texts, on all cores."""
        return [e.ids for e in self.raw.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.raw.decode(list(ids), skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        if self.render is None:
            raise ValueError(
                f"{self.source}: no chat template; pass chat_template= to load_tokenizer, "
                "or use prompt/completion records with chat off (raw text)"
            )
        return self.render(list(messages), add_generation_prompt)


def load_tokenizer(
    source: Card | str | os.PathLike | Any,
    *,
    chat_template: str | None = None,
    bos: str | None = None,
    eos: str | Sequence[str] = (),
    pad: str | None = None,
    backend: str = "auto",
) -> Tokenizer:
    """The tokenizer of a card, a registered card name, a local model or tokenizer
    directory, or a `tokenizers.Tokenizer` built in code.

    chat_template: overrides the card's and the tokenizer's own.
    bos: the token every sequence starts with (default: the one the tokenizer's
        post-processor adds, if any).
    eos: stop tokens, after the tokenizer's own eos token and the card's.
    pad: the padding token (default: the tokenizer's, the card's, else the first stop token).
    backend: who renders the chat template: "transformers", "tokenizers" (jinja2), or
        "auto" (transformers when installed).
    """
    import tokenizers

    if backend not in BACKENDS:
        raise ValueError(f"load_tokenizer: unknown backend {backend!r}; use one of {', '.join(BACKENDS)}")
    if backend == "auto":
        try:
            import transformers  # noqa: F401
        except ImportError:
            backend = "tokenizers"
        else:
            backend = "transformers"
    eos = [eos] if isinstance(eos, str) else list(eos)
    card = None
    if isinstance(source, tokenizers.Tokenizer):
        raw, own_template = source, None
        probed = _probe_bos(raw)
        bos_name = bos if bos is not None or probed is None else raw.id_to_token(probed)
        names = {"bos_token": bos_name, "eos_token": eos[0] if eos else None, "pad_token": pad}
        where = "tokenizer built in code"
    else:
        path = Path(source) if isinstance(source, (str, os.PathLike)) else None
        if path is not None and path.is_dir() and not (path / "config.json").is_file():
            root = path  # a tokenizer directory without a model
        else:
            card = resolve(source)
            root = _tokenizer_directory(card)
        raw, names, own_template = _read_directory(root)
        where = str(root)
    template = chat_template or (card.chat_template if card is not None else None) or own_template
    names = {k: v for k, v in names.items() if k in _TEMPLATE_TOKENS and v is not None}
    if backend == "transformers":
        render = _transformers_renderer(raw, names, template) if template else None
    else:
        render = _jinja_renderer(template, names, where) if template else None

    def lookup(token: str) -> int:
        i = raw.token_to_id(token)
        if i is None:
            raise ValueError(f"{where}: token {token!r} is not in the vocabulary; name a token it has")
        return i

    named = {k: lookup(v) for k, v in names.items() if k in ("eos_token", "pad_token")}
    own_eos = [named["eos_token"]] if "eos_token" in named else []
    card_eos = list(card.eos_token_ids) if card is not None else []
    eos_ids = tuple(dict.fromkeys([*own_eos, *card_eos, *(lookup(t) for t in eos)]))
    pads = [
        lookup(pad) if pad is not None else named.get("pad_token"),
        card.pad_token_id if card is not None else None,
        *eos_ids,
    ]
    tok = Tokenizer(
        raw=raw,
        chat_template=template,
        render=render,
        bos_id=lookup(bos) if bos is not None else _probe_bos(raw),
        eos_ids=eos_ids,
        pad_id=next((p for p in pads if p is not None), 0),  # padding is never learned
        source=where,
    )
    if card is not None and tok.vocab_size > card.vocab:
        raise ValueError(
            f"{where}: the tokenizer has {tok.vocab_size} tokens but card {card.name!r} has "
            f"vocab={card.vocab} embeddings; use the tokenizer that belongs to this model"
        )
    return tok


def _tokenizer_directory(card: Card) -> Path:
    """The local directory of the card's tokenizer files: its own path, else the Hugging
    Face cache or hub (needs `huggingface_hub`, and the network for a download)."""
    if card.tokenizer.path is None and card.tokenizer.repo is None:
        raise SettingError(f"card {card.name!r} has no tokenizer; {{tokenizer}}", python={
            "tokenizer": "build one with the tokenizers library and pass it: "
                         "load_tokenizer(tokenizers.Tokenizer(...), chat_template=..., eos=...)"})
    return local_directory(card.tokenizer, _TOKENIZER_FILES, f"card {card.name!r}: the tokenizer files",
                           "pass a local model directory instead")


def _read_directory(root: Path) -> tuple[Any, dict[str, str | None], str | None]:
    """tokenizer.json, the special-token names and the chat template of a directory."""
    path = root / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{root}: no tokenizer.json; linnet reads fast-tokenizer files (save a "
            "sentencepiece tokenizer with transformers' AutoTokenizer to convert it)"
        )
    config_path = root / "tokenizer_config.json"
    config = _read_json(config_path) if config_path.is_file() else {}
    # older repositories keep the names in special_tokens_map.json; tokenizer_config.json wins
    mapping = root / "special_tokens_map.json"
    spelled = {**(_read_json(mapping) if mapping.is_file() else {}), **config}
    # a token is spelled "text" or {"content": "text", ...}
    names = {
        k: (v.get("content") if isinstance(v, dict) else v)
        for k, v in spelled.items()
        if k.endswith("_token")
    }
    template = config.get("chat_template")
    if isinstance(template, list):  # several named templates; the chat's is "default"
        template = {t["name"]: t["template"] for t in template}.get("default")
    if (root / "chat_template.jinja").is_file():
        template = (root / "chat_template.jinja").read_text()
    return tokenizer_file(path), names, template


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e}); fix or replace the file") from None


def _probe_bos(raw) -> int | None:
    """The token the tokenizer's post-processor puts before a text, if any."""
    plain = raw.encode("a", add_special_tokens=False).ids
    full = raw.encode("a").ids
    if len(full) > len(plain) and full[1 : 1 + len(plain)] == plain:
        return full[0]
    return None


def _transformers_renderer(raw, names: dict[str, str], template: str) -> Render:
    """Render through transformers' `apply_chat_template`, so a template behaves exactly as
    it does there (the ids still come from `raw`: transformers adds missing special tokens
    to its own copy)."""
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        raise ValueError(
            "load_tokenizer: backend='transformers' needs transformers; pip install linnet[hf]"
        ) from None
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, **names)

    def render(messages: list[dict], add_generation_prompt: bool) -> str:
        return hf.apply_chat_template(
            messages, chat_template=template, add_generation_prompt=add_generation_prompt, tokenize=False
        )

    return render


def _jinja_renderer(template: str, names: dict[str, str], where: str) -> Render:
    """Render a chat template as transformers does (same sandbox, trimming, filters and
    globals), for installs without transformers."""
    try:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ValueError(
            f"{where}: rendering the chat template needs transformers or jinja2; "
            "pip install jinja2 (or linnet[hf])"
        ) from None

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    compiled = env.from_string(template)

    def render(messages: list[dict], add_generation_prompt: bool) -> str:
        return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, **names)

    return render


def character_tokenizer(specials: Sequence[str] = (), *, chat_template: str | None = None,
                        eos: str | Sequence[str] = (), bos: str | None = None,
                        characters: str = string.printable) -> Tokenizer:
    """A tokenizer of one token a character (`characters`, then `specials` whole), for toy
    tasks and tests that build their own model: it spells any text in those characters and
    needs no file. Ids: <unk> 0, the specials, then the characters."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Raw

    vocab = {t: i for i, t in enumerate(dict.fromkeys(["<unk>", *specials, *characters]))}
    raw = Raw(models.WordLevel(vocab, unk_token="<unk>"))
    raw.add_special_tokens([AddedToken(s, special=True) for s in specials])
    raw.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    raw.decoder = decoders.Fuse()
    return load_tokenizer(raw, chat_template=chat_template, eos=eos, bos=bos)
