"""Model cards: the architecture of a Llama-family decoder as plain data.

A `Card` is everything the model code needs to build a decoder (shapes, RoPE, norms,
biases) plus where its weights and tokenizer live and its chat template. Cards come from
the registry below (architecture numbers as published in each model's config.json) or
from a local Hugging Face model directory. This module imports no backend: the backends
import it, and `linnet.nest.load` (above both) builds a card's model.

    card = resolve("qwen2.5-0.5b-instruct")   # registered name
    card = resolve("path/to/hf-model-dir")     # config.json + safetensors + tokenizer

Families differ only through a few card fields (qkv bias, qk-norm, tied head), never
through subclasses: Llama (with Llama 3 RoPE scaling), Qwen2 (q/k/v bias), Qwen3 (q/k
RMSNorm), Mistral (without a sliding window).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from linnet.errors import SettingError
from linnet.experts import PARTS, Experts, experts_config, experts_from_config

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "qwen2_moe", "mixtral")


ROPE_KINDS = ("linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """How RoPE stretches past the context a model was pretrained on (`kind`):

    linear  every frequency divided by `factor` (position interpolation)
    llama3  wavelengths longer than original/low_freq_factor divided by `factor`, those
            shorter than original/high_freq_factor kept, a linear blend between
    yarn    frequencies that turn fewer than `beta_slow` times over the original context
            divided by `factor`, those turning more than `beta_fast` times kept, a linear
            ramp between; cos and sin multiplied by `attention_factor` (by default
            0.1 ln(factor) + 1), which sharpens attention over the longer context

    `original_max_positions` is the pretrained context (llama3 and yarn)."""

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int | None = None
    kind: str = "llama3"
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    truncate: bool = True  # yarn: the ramp's ends rounded outwards to whole dimensions

    def __post_init__(self):
        if self.kind not in ROPE_KINDS:
            raise ValueError(f"rope scaling: kind {self.kind!r} is not one of {', '.join(ROPE_KINDS)}")
        if not self.factor >= 1.0:
            raise ValueError(f"rope scaling: factor={self.factor}; it stretches the context, so it is at least 1")
        if self.kind != "linear" and not self.original_max_positions:
            raise ValueError(f"rope scaling: {self.kind} needs original_max_positions, the pretrained context")

    @property
    def cos_sin_scale(self) -> float:
        """What cos and sin are multiplied by: YaRN's attention factor, else 1."""
        if self.kind != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        return 0.1 * math.log(self.factor) + 1.0

    def hf(self) -> dict[str, Any]:
        """The `rope_parameters` keys transformers reads for this scaling (rope_theta aside)."""
        out: dict[str, Any] = {"rope_type": self.kind, "factor": self.factor}
        if self.kind != "linear":
            out["original_max_position_embeddings"] = self.original_max_positions
        if self.kind == "llama3":
            out.update(low_freq_factor=self.low_freq_factor, high_freq_factor=self.high_freq_factor)
        if self.kind == "yarn":
            out.update(beta_fast=self.beta_fast, beta_slow=self.beta_slow, truncate=self.truncate)
            if self.attention_factor is not None:
                out["attention_factor"] = self.attention_factor
        return out


def rope_cos_sin_scale(card: Card) -> float:
    """What RoPE's cos and sin are multiplied by: YaRN's attention factor, else 1."""
    return 1.0 if card.rope_scaling is None else card.rope_scaling.cos_sin_scale


def rope_frequencies(card: Card, xp) -> Any:
    """[head_dim / 2] float32 inverse frequencies of the card's RoPE, its scaling applied,
    computed with the array module `xp` (torch or numpy) in float32 as transformers
    computes them: one formula for both backends and the GGUF export."""
    d = card.head_dim
    wavelengths = card.rope_base ** (xp.arange(0, d, 2, dtype=xp.float32) / d)  # over 2 pi
    inv = 1.0 / wavelengths
    s = card.rope_scaling
    if s is None:
        return inv
    if s.kind == "linear":
        return inv / s.factor
    if s.kind == "llama3":
        wavelength = 2 * math.pi / inv
        original = s.original_max_positions
        low, high = original / s.low_freq_factor, original / s.high_freq_factor
        blend = (original / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        blended = (1 - blend) * inv / s.factor + blend * inv
        return xp.where(wavelength > low, inv / s.factor, xp.where(wavelength < high, inv, blended))

    def dimension(turns: float) -> float:  # the dimension whose frequency turns `turns` times over the context
        return d * math.log(s.original_max_positions / (turns * 2 * math.pi)) / (2 * math.log(card.rope_base))

    low, high = dimension(s.beta_fast), dimension(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    high = high + 0.001 if low == high else high
    kept = 1 - xp.clip((xp.arange(0, d // 2, dtype=xp.float32) - low) / (high - low), 0, 1)
    return 1.0 / (s.factor * wavelengths) * (1 - kept) + inv * kept


@dataclass(frozen=True)
class Location:
    """Where files live: a local directory (`path`) and/or a hub repository (`repo`)."""

    repo: str | None = None
    path: str | None = None


@dataclass(frozen=True)
class Card:
    """A decoder's architecture, its weights and tokenizer location, and chat template."""

    name: str
    family: str
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_base: float = 10000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-5
    tied_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    max_positions: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    dtype: str = "bfloat16"
    weights: Location = field(default_factory=Location)
    tokenizer: Location = field(default_factory=Location)
    chat_template: str | None = None
    source: str = ""
    # PEFT adapter directories folded into the weights as they are read, in order: the runs
    # this model was trained through (a run directory named as a card; `trained_card`)
    adapters: tuple[str, ...] = ()
    experts: Experts | None = None  # a mixture-of-experts family's (linnet.experts); None: dense MLPs

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"card {self.name!r}: unknown family {self.family!r}; linnet builds {', '.join(FAMILIES)}")
        if self.heads % self.kv_heads:
            raise ValueError(f"card {self.name!r}: heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        for name in ("vocab", "hidden", "intermediate", "layers", "heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"card {self.name!r}: {name} must be positive")
        if (self.experts is not None) != (self.family in PARTS):
            raise ValueError(f"card {self.name!r}: family {self.family!r} " + (
                "is a mixture of experts: give its experts" if self.experts is None else "has no experts"))

    def replace(self, **changes: Any) -> Card:
        return dataclasses.replace(self, **changes)

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(out, in) of each linear projection in one block, by its checkpoint name (the
        experts' stacked tensors, their router and a shared expert's gate are no linear
        layers; a shared expert's projections are)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = {
            "self_attn.q_proj": (q, self.hidden),
            "self_attn.k_proj": (kv, self.hidden),
            "self_attn.v_proj": (kv, self.hidden),
            "self_attn.o_proj": (self.hidden, q),
        }
        if self.experts is not None:
            s = self.experts.shared
            return {**attention, **({"mlp.shared_expert.gate_proj": (s, self.hidden),
                                     "mlp.shared_expert.up_proj": (s, self.hidden),
                                     "mlp.shared_expert.down_proj": (self.hidden, s)} if s else {})}
        return {**attention, "mlp.gate_proj": (self.intermediate, self.hidden),
                "mlp.up_proj": (self.intermediate, self.hidden), "mlp.down_proj": (self.hidden, self.intermediate)}

    def block_params(self) -> int:
        """Parameters of one decoder block, biases and norms included (every expert's)."""
        shapes = self.linear_shapes()
        n = sum(o * i for o, i in shapes.values())
        if self.experts is not None:  # the router and three matrices an expert (and a shared expert's gate)
            n += self.experts.count * (self.hidden + 3 * self.experts.intermediate * self.hidden)
            n += self.hidden if self.experts.shared else 0
        if self.qkv_bias:
            n += sum(shapes[f"self_attn.{p}_proj"][0] for p in "qkv")
        if self.o_bias:
            n += self.hidden
        if self.mlp_bias:
            n += 2 * self.intermediate + self.hidden
        if self.qk_norm:
            n += 2 * self.head_dim
        return n + 2 * self.hidden

    def params(self) -> int:
        """Every parameter, a tied head counted once."""
        embed = self.vocab * self.hidden
        head = 0 if self.tied_embeddings else embed
        return embed + head + self.layers * self.block_params() + self.hidden

    def active_params(self) -> int:
        """The parameters a token computes with: every one, but of each block's experts only
        the `per_token` it goes through (what its FLOPs count)."""
        e = self.experts
        idle = 0 if e is None else self.layers * (e.count - e.per_token) * 3 * e.intermediate * self.hidden
        return self.params() - idle

    def hf_config(self) -> dict[str, Any]:
        """The config.json transformers reads back for this architecture."""
        model_type = self.family
        arch = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral", "qwen3_moe": "Qwen3Moe",
                "qwen2_moe": "Qwen2Moe", "mixtral": "Mixtral"}[self.family] + "ForCausalLM"
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_base}
        if self.rope_scaling is not None:
            rope = {**self.rope_scaling.hf(), "rope_theta": self.rope_base}
        config: dict[str, Any] = {
            "architectures": [arch],
            "model_type": model_type,
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_positions,
            "rms_norm_eps": self.norm_eps,
            "tie_word_embeddings": self.tied_embeddings,
            "rope_theta": self.rope_base,
            "rope_scaling": None if self.rope_scaling is None else rope,
            "rope_parameters": rope,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) or None,
            "pad_token_id": self.pad_token_id,
            "torch_dtype": self.dtype,
        }
        if self.family == "llama":
            config["attention_bias"] = self.qkv_bias
            config["mlp_bias"] = self.mlp_bias
        elif self.family in ("qwen3", "qwen3_moe"):
            config["attention_bias"] = self.qkv_bias
        elif self.family in ("qwen2", "mistral", "mixtral", "qwen2_moe"):
            config["sliding_window"] = None
            config["use_sliding_window"] = False
            if self.family == "qwen2_moe":
                config["qkv_bias"] = self.qkv_bias
        if self.experts is not None:
            config.update(experts_config(self.family, self.experts))
        return config


# ---------------------------------------------------------------------------------------
# Reading a Hugging Face config.json


def _rope(config: dict, where: str) -> tuple[float, RopeScaling | None]:
    """RoPE base and scaling from either transformers 4 (`rope_theta` + `rope_scaling`)
    or transformers 5 (`rope_parameters`) spelling."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    base = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return base, None
    if kind not in ROPE_KINDS:
        raise ValueError(f"{where}: rope scaling type {kind!r} is not supported (linnet implements the default RoPE "
                         f"and {', '.join(ROPE_KINDS)}); remove it or use a model without it")
    if kind == "yarn" and (params.get("mscale") or params.get("mscale_all_dim")):
        raise ValueError(f"{where}: YaRN's mscale / mscale_all_dim (DeepSeek's variant) is not supported; give "
                         "attention_factor instead")
    known = {"factor": float, "low_freq_factor": float, "high_freq_factor": float, "beta_fast": float,
             "beta_slow": float, "attention_factor": float, "truncate": bool}
    given = {k: cast(params[k]) for k, cast in known.items() if params.get(k) is not None}
    original = params.get("original_max_position_embeddings")
    if kind == "yarn" and "factor" not in given and original:  # transformers: the two contexts' ratio
        given["factor"] = config["max_position_embeddings"] / original
    try:
        return base, RopeScaling(kind=kind, original_max_positions=int(original) if original else None, **given)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: rope_scaling: {e}") from None


def configured(model: dict, run: Path | None = None) -> Card:
    """The card a fine-tuning config's `model` group names (its fields as a dict, from a
    config or the config.json of the run `run`), with the group's RoPE changes (`with_rope`)."""
    name = model.get("card") or ""
    if run is not None and name not in REGISTRY and not Path(name).exists():
        raise ValueError(f"{run / 'config.json'}: model.card {name!r} is not a registered card nor a path from here "
                         "or from where the run trained; write the base's path there")
    try:
        card = resolve(name)
    except ValueError as e:
        if run is None and str(e).startswith("unknown card"):  # named as the config field that gave it
            raise ValueError(f"config: model.card: {e}") from None
        raise
    return with_rope(card, model.get("rope_base"), model.get("rope_scaling"), model.get("max_positions"))


def with_rope(card: Card, base: float | None = None, scaling: dict | None = None,
              max_positions: int | None = None, where: str = "config: model") -> Card:
    """`card` with its RoPE changed for a longer context (the config's model.rope_base,
    model.rope_scaling and model.max_positions; None keeps the card's own). `scaling` is
    {kind, factor, original_max_positions, ...} (RopeScaling's fields; original defaults
    to the card's max_positions), or {kind: none} for plain RoPE; a scaling stretches
    max_positions to factor x original unless max_positions is given."""
    changes: dict[str, Any] = {}
    if base is not None:
        changes["rope_base"] = float(base)
    if scaling is not None:
        fields = {f.name for f in dataclasses.fields(RopeScaling)}
        if unknown := sorted(set(scaling) - fields):
            raise ValueError(f"{where}.rope_scaling: unknown key(s) {', '.join(unknown)}; use {', '.join(sorted(fields))}")
        if scaling.get("kind") == "none":
            changes["rope_scaling"] = None
        else:
            try:
                s = RopeScaling(**{"original_max_positions": card.max_positions, **scaling})
            except (ValueError, TypeError) as e:
                raise ValueError(f"{where}.rope_scaling: {e}") from None
            changes["rope_scaling"] = s
            changes["max_positions"] = int(s.factor * s.original_max_positions)
    if max_positions is not None:
        changes["max_positions"] = int(max_positions)
    return card.replace(**changes) if changes else card


def _refuse_unsupported(config: dict, family: str, where: str) -> None:
    """Fields that change the computation in ways the decoder does not implement."""
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act {config['hidden_act']!r} is not supported (silu only)")
    if config.get("quantization_config"):
        raise ValueError(f"{where}: quantized checkpoints are not supported; use unquantized weights")
    for key in ("attention_dropout", "hidden_dropout", "mlp_dropout"):
        if float(config.get(key) or 0.0) != 0.0:
            raise ValueError(f"{where}: {key}={config[key]} is not supported; set it to 0.0")
    window = config.get("sliding_window")
    uses_window = config.get("use_sliding_window", family in ("mistral", "mixtral"))
    positions = config.get("max_position_embeddings", 2048)
    if uses_window and window is not None and window < positions:
        raise ValueError(
            f"{where}: sliding-window attention (sliding_window={window}) is not supported; "
            "linnet attends over the whole context"
        )
    if any(t != "full_attention" for t in config.get("layer_types") or []) and uses_window:
        raise ValueError(f"{where}: per-layer sliding-window attention is not supported")
    for key in ("num_experts", "num_local_experts", "no_rope_layers"):
        if config.get(key) and family not in PARTS:
            raise ValueError(f"{where}: {key} is not supported by the dense decoder")


def card_from_config(config: dict, *, name: str, where: str = "config.json") -> Card:
    """A Card from the fields of a Hugging Face config.json (a dict)."""
    family = config.get("model_type")
    if family not in FAMILIES:
        raise ValueError(
            f"{where}: unknown model_type {family!r}; linnet builds {', '.join(FAMILIES)}"
        )
    _refuse_unsupported(config, family, where)
    base, scaling = _rope(config, where)

    def number(key: str, default=None, kind: type = int):
        """config[key], which must be a number (an integer where `kind` is int)."""
        if key not in config or config[key] is None:
            if default is None:
                raise ValueError(f"{where}: missing field {key!r}")
            return default
        value = config[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
            raise ValueError(f"{where}: {key} is {value!r}; it must be {'an integer' if kind is int else 'a number'}")
        return kind(value)

    hidden, heads = number("hidden_size"), number("num_attention_heads")
    card_fields = dict(
        vocab=number("vocab_size"),
        hidden=hidden,
        intermediate=number("intermediate_size"),
        layers=number("num_hidden_layers"),
        heads=heads,
        kv_heads=number("num_key_value_heads", heads),
        head_dim=number("head_dim", hidden // heads if heads else 0),
    )
    attention_bias = bool(config.get("attention_bias", False))
    eos = config.get("eos_token_id")
    return Card(
        name=name,
        family=family,
        **card_fields,
        rope_base=base,
        rope_scaling=scaling,
        norm_eps=number("rms_norm_eps", 1e-6, float),
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=attention_bias or family == "qwen2" or (family == "qwen2_moe" and bool(config.get("qkv_bias", True))),
        o_bias=attention_bias,
        mlp_bias=bool(config.get("mlp_bias", False)),
        qk_norm=family in ("qwen3", "qwen3_moe"),
        max_positions=number("max_position_embeddings", 2048),
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
        pad_token_id=config.get("pad_token_id"),
        dtype=str(config.get("dtype") or config.get("torch_dtype") or "bfloat16"),
        experts=experts_from_config(config, family, where),
    )


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def card_from_directory(directory: str | os.PathLike) -> Card:
    """A Card for a local Hugging Face model directory (config.json, safetensors,
    tokenizer.json, tokenizer_config.json, optional generation_config.json)."""
    root = Path(directory)
    config_path = root / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{root}: no config.json; is this a Hugging Face model directory?")
    card = card_from_config(_read_json(config_path), name=root.name, where=str(config_path))
    eos = list(card.eos_token_ids)
    generation = root / "generation_config.json"
    if generation.is_file():
        more = _read_json(generation).get("eos_token_id")
        for token in more if isinstance(more, list) else [] if more is None else [more]:
            if token not in eos:
                eos.append(token)
    tokenizer_config = root / "tokenizer_config.json"
    template = _read_json(tokenizer_config).get("chat_template") if tokenizer_config.is_file() else None
    if (root / "chat_template.jinja").is_file():
        template = (root / "chat_template.jinja").read_text()
    return card.replace(
        eos_token_ids=tuple(eos),
        weights=Location(path=str(root)),
        tokenizer=Location(path=str(root)) if (root / "tokenizer.json").is_file() else Location(),
        chat_template=template,
        source=str(config_path),
    )


# ---------------------------------------------------------------------------------------
# The registry: architecture numbers as published in each repository's config.json.


def _hub(repo: str) -> dict[str, Any]:
    where = Location(repo=repo)
    return dict(weights=where, tokenizer=where, source=f"https://huggingface.co/{repo}/blob/main/config.json")


_LLAMA3_8K = dict(low_freq_factor=1.0, high_freq_factor=4.0, original_max_positions=8192)

REGISTRY: dict[str, Card] = {
    card.name: card
    for card in [
        # meta-llama/Llama-3.1-8B-Instruct
        Card("llama-3.1-8b-instruct", "llama", 128256, 4096, 14336, 32, 32, 8, 128,
             rope_base=500000.0, rope_scaling=RopeScaling(factor=8.0, **_LLAMA3_8K),
             norm_eps=1e-5, max_positions=131072, bos_token_id=128000,
             eos_token_ids=(128001, 128008, 128009), **_hub("meta-llama/Llama-3.1-8B-Instruct")),
        # meta-llama/Llama-3.1-70B-Instruct
        Card("llama-3.1-70b-instruct", "llama", 128256, 8192, 28672, 80, 64, 8, 128,
             rope_base=500000.0, rope_scaling=RopeScaling(factor=8.0, **_LLAMA3_8K),
             norm_eps=1e-5, max_positions=131072, bos_token_id=128000,
             eos_token_ids=(128001, 128008, 128009), **_hub("meta-llama/Llama-3.1-70B-Instruct")),
        # meta-llama/Llama-3.2-1B-Instruct
        Card("llama-3.2-1b-instruct", "llama", 128256, 2048, 8192, 16, 32, 8, 64,
             rope_base=500000.0, rope_scaling=RopeScaling(factor=32.0, **_LLAMA3_8K),
             norm_eps=1e-5, tied_embeddings=True, max_positions=131072, bos_token_id=128000,
             eos_token_ids=(128001, 128008, 128009), **_hub("meta-llama/Llama-3.2-1B-Instruct")),
        # TinyLlama/TinyLlama-1.1B-Chat-v1.0
        Card("tinyllama-1.1b-chat", "llama", 32000, 2048, 5632, 22, 32, 4, 64,
             norm_eps=1e-5, max_positions=2048, bos_token_id=1, eos_token_ids=(2,),
             **_hub("TinyLlama/TinyLlama-1.1B-Chat-v1.0")),
        # Qwen/Qwen2.5-0.5B-Instruct
        Card("qwen2.5-0.5b-instruct", "qwen2", 151936, 896, 4864, 24, 14, 2, 64,
             rope_base=1000000.0, norm_eps=1e-6, tied_embeddings=True, qkv_bias=True,
             max_positions=32768, bos_token_id=151643, eos_token_ids=(151645, 151643),
             **_hub("Qwen/Qwen2.5-0.5B-Instruct")),
        # Qwen/Qwen3-0.6B
        Card("qwen3-0.6b", "qwen3", 151936, 1024, 3072, 28, 16, 8, 128,
             rope_base=1000000.0, norm_eps=1e-6, tied_embeddings=True, qk_norm=True,
             max_positions=40960, bos_token_id=151643, eos_token_ids=(151645, 151643),
             **_hub("Qwen/Qwen3-0.6B")),
        # HuggingFaceTB/SmolLM2-135M-Instruct
        Card("smollm2-135m-instruct", "llama", 49152, 576, 1536, 30, 9, 3, 64,
             rope_base=100000.0, norm_eps=1e-5, tied_embeddings=True, max_positions=8192,
             bos_token_id=1, eos_token_ids=(2,), **_hub("HuggingFaceTB/SmolLM2-135M-Instruct")),
        # mistralai/Mistral-7B-Instruct-v0.3
        Card("mistral-7b-instruct-v0.3", "mistral", 32768, 4096, 14336, 32, 32, 8, 128,
             rope_base=1000000.0, norm_eps=1e-5, max_positions=32768, bos_token_id=1,
             eos_token_ids=(2,), **_hub("mistralai/Mistral-7B-Instruct-v0.3")),
        # A tiny debug decoder for tests, the quickstart and CPU runs (no published weights).
        Card("debug", "llama", 512, 64, 192, 2, 4, 2, 16, norm_eps=1e-5,
             tied_embeddings=True, max_positions=1024, bos_token_id=1, eos_token_ids=(2,),
             pad_token_id=0, dtype="float32", source="linnet"),
    ]
}


def resolve(x: str | os.PathLike | Card) -> Card:
    """A Card from a Card, a registered name, or a local Hugging Face model directory."""
    if isinstance(x, Card):
        return x
    text = os.fspath(x)
    if text in REGISTRY:
        return REGISTRY[text]
    path = Path(text)
    if path.is_file() and path.name == "config.json":
        path = path.parent
    if (path / "run.json").is_file() or (path / "adapter_config.json").is_file() or run_checkpoint(path):
        return trained_card(path)
    if path.is_dir():
        return card_from_directory(path)
    raise ValueError(
        f"unknown card {text!r}: not a registered name ({', '.join(sorted(REGISTRY))}), a local model directory "
        "with a config.json, a linnet run directory or a PEFT adapter"
    )


def trained_card(path: str | os.PathLike) -> Card:
    """The model a linnet run trained, named by its run directory (its final/), its final/
    (a PEFT adapter directory names its base in adapter_config.json) or one of its
    checkpoints (checkpoints/step-…): a run of adapters is its base's card (followed back
    when the base is a run itself) with the adapters to fold into the weights as they are
    read (`Card.adapters`); a full fine-tune's is its weights. The run's own data.tokenizer
    and data.chat_template come with it, so the next stage renders the records as this one
    learned them."""
    path = Path(path)
    if (path / "adapter_config.json").is_file() and not (path / "run.json").is_file():
        info = _read_json(path / "adapter_config.json")
        base = info.get("base_model_name_or_path")
        if not base:
            raise ValueError(f"{path / 'adapter_config.json'}: base_model_name_or_path is empty, so the adapter's "
                             "base is unknown; fill it in (a card, a model directory or a linnet run)")
        return _adapted(resolve(base), path, None).replace(source=str(path))
    checkpoint = path if run_checkpoint(path) else None
    run = path.parent.parent if checkpoint else path
    weights = checkpoint / "trained.safetensors" if checkpoint else run / "final"
    if not weights.exists():
        raise ValueError(f"{run}: the run has not finished (no final/); resume it with --resume, or name one of "
                         f"its checkpoints ({run / 'checkpoints'}/step-…)")
    config = run_config(run)
    model, data = config.get("model", {}), config.get("data", {})
    if (config.get("lora", {}).get("enabled", False) if checkpoint else (weights / "adapter_config.json").is_file()):
        if model.get("weights") == "random":
            raise ValueError(f"{run}: its base was initialised from a seed (model.weights: random), not read from "
                             "files; export the run (`linnet export --merge`) and name that directory")
        card = _adapted(configured(model, run), checkpoint or weights, model.get("weights"))
    elif checkpoint:  # every weight trained: the checkpoint's are the model's
        card = configured(model, run).replace(weights=Location(path=str(weights)), adapters=())
    else:
        card = card_from_directory(weights)
        if model.get("card") and card.tokenizer.path is None:  # final/ holds the weights alone
            base = configured(model, run)
            card = card.replace(tokenizer=base.tokenizer, chat_template=card.chat_template or base.chat_template)
    return with_run_data(card, data).replace(source=str(path))


def run_config(run: Path) -> dict:
    """A run's config.json, with a relative model.card, model.weights or data.tokenizer
    that is not found from here read from where the run trained (run.json's `directory`)."""
    config = _read_json(run / "config.json") if (run / "config.json").is_file() else {}
    started = Path(_read_json(run / "run.json").get("directory") or ".") if (run / "run.json").is_file() else None
    for group, key in (("model", "card"), ("model", "weights"), ("data", "tokenizer")):
        value = config.get(group, {}).get(key)
        if started and isinstance(value, str) and value not in REGISTRY and not Path(value).exists() \
                and (started / value).exists():
            config[group][key] = str(started / value)
    return config


def with_run_data(card: Card, data: dict) -> Card:
    """`card` with a run's own data.tokenizer and data.chat_template (`data`, the data group
    of its config.json): the next stage renders the records as this one learned them."""
    if data.get("tokenizer"):
        name = str(data["tokenizer"])
        card = card.replace(tokenizer=REGISTRY[name].tokenizer if name in REGISTRY else Location(path=name))
    if data.get("chat_template"):
        card = card.replace(chat_template=data["chat_template"])
    return card


def run_checkpoint(path: Path) -> bool:
    """A checkpoint directory (checkpoints/step-…) of a linnet fine-tuning run."""
    return path.name.startswith("step-") and path.parent.name == "checkpoints" and \
        (path.parent.parent / "run.json").is_file()


def _adapted(base: Card, adapter: Path, weights: str | None) -> Card:
    """`base` with one more adapter to fold in (its weights from `weights`, a directory,
    when the run read them from there)."""
    if weights:
        base = base.replace(weights=Location(path=str(weights)))
    return base.replace(adapters=(*base.adapters, str(adapter)))


def weights_directory(card: Card) -> Path:
    """The local directory holding the card's safetensors: its own path, else the
    Hugging Face cache or hub (needs `huggingface_hub`, and the network for a download)."""
    if card.weights.path is None and card.weights.repo is None:
        raise SettingError(f"card {card.name!r} has no published weights; {{random}} to initialise from a seed, or "
                           "{weights_dir}", python={"random": "pass weights='random'", "weights_dir": "weights=DIR"})
    return local_directory(card.weights, ["*.safetensors", "*.json", "*.jinja"],
                           f"card {card.name!r}: weights", "pass weights=DIR (a local copy), or weights='random'")


def local_directory(where: Location, patterns: list[str], what: str, instead: str) -> Path:
    """`where`'s local path, else its hub repository's files matching `patterns` from the
    Hugging Face cache, else downloaded. `what` and `instead` word the errors."""
    if where.path is not None:
        return Path(where.path)
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ValueError(f"{what} live in the hub repository {where.repo}; {instead}, or install "
                         "huggingface_hub") from None
    with contextlib.suppress(Exception):  # not in the cache: downloaded below
        return Path(snapshot_download(where.repo, allow_patterns=patterns, local_files_only=True))
    try:
        return Path(snapshot_download(where.repo, allow_patterns=patterns))
    except Exception as e:
        raise ValueError(f"{what}: cannot fetch {where.repo} ({type(e).__name__}); {instead}") from None
