"""Parameter paths, for both backends: every parameter is named by its Hugging Face
checkpoint path (`model.layers.3.self_attn.q_proj.weight`, …), so checkpoints load by
name and adapter targets read like PEFT's. Here: a card's paths and shapes, and picking
paths by glob patterns (what trains, what is saved) and adapter targets (globs, PEFT's
`target_modules` names such as `q_proj`, or `all-linear`). Patterns may also use the
seeds' names for a decoder's parts (`layers.*.attention.*_proj.weight`)."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

from linnet.cards import Card
from linnet.errors import SettingError


def parameter_shapes(card: Card) -> dict[str, tuple[int, ...]]:
    """Every parameter path of the card's decoder and its shape, in the model's order."""
    c = card
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab, c.hidden)}
    q, kv = c.heads * c.head_dim, c.kv_heads * c.head_dim
    for i in range(c.layers):
        p = f"model.layers.{i}"
        shapes[f"{p}.input_layernorm.weight"] = (c.hidden,)
        for name, out, bias in (("q", q, c.qkv_bias), ("k", kv, c.qkv_bias), ("v", kv, c.qkv_bias)):
            shapes[f"{p}.self_attn.{name}_proj.weight"] = (out, c.hidden)
            if bias:
                shapes[f"{p}.self_attn.{name}_proj.bias"] = (out,)
        shapes[f"{p}.self_attn.o_proj.weight"] = (c.hidden, q)
        if c.o_bias:
            shapes[f"{p}.self_attn.o_proj.bias"] = (c.hidden,)
        if c.qk_norm:
            shapes[f"{p}.self_attn.q_norm.weight"] = shapes[f"{p}.self_attn.k_norm.weight"] = (c.head_dim,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (c.hidden,)
        for name, shape in (("gate", (c.intermediate, c.hidden)), ("up", (c.intermediate, c.hidden)),
                            ("down", (c.hidden, c.intermediate))):
            shapes[f"{p}.mlp.{name}_proj.weight"] = shape
            if c.mlp_bias:
                shapes[f"{p}.mlp.{name}_proj.bias"] = (shape[0],)
    shapes["model.norm.weight"] = (c.hidden,)
    if not c.tied_embeddings:
        shapes["lm_head.weight"] = (c.vocab, c.hidden)
    return shapes


# The seeds write a decoder's parts in Meta's Llama names (`layers.3.attention.q_proj.weight`,
# `embedding.weight`); every family linnet loads (Llama, Mistral, Qwen2, Qwen3) is laid out as
# transformers' Llama, so one map of path parts serves them all: the first part, then any part.
SEED_FIRST = {"layers": "model.layers", "embedding": "model.embed_tokens", "tok_embeddings": "model.embed_tokens",
              "norm": "model.norm", "output": "lm_head"}
SEED_PARTS = {"attention": "self_attn", "feed_forward": "mlp", "attention_norm": "input_layernorm",
              "ffn_norm": "post_attention_layernorm"}


def from_seed_path(path: str) -> str:
    """A path or glob in the seeds' names as the checkpoint path it means
    (`layers.*.attention.*_proj.weight` -> `model.layers.*.self_attn.*_proj.weight`); a
    checkpoint path is returned as it is."""
    first, *rest = path.split(".")
    return ".".join([SEED_FIRST.get(first, first), *(SEED_PARTS.get(part, part) for part in rest)])


def select(names: Sequence[str], spec: bool | str | Sequence[str] | None, *, what: str) -> set[str]:
    """The names a True / False / glob-pattern(s) spec picks (checkpoint paths, or the
    seeds' names: `from_seed_path`); a pattern matching nothing is an error (a typo would
    otherwise silently train nothing)."""
    if spec is True:
        return set(names)
    if spec is False or spec is None:
        return set()
    patterns = [spec] if isinstance(spec, str) else list(spec)
    chosen: set[str] = set()
    for pattern in patterns:
        hits = fnmatch.filter(names, pattern) or fnmatch.filter(names, from_seed_path(pattern))
        if not hits:
            raise ValueError(
                f"{what} pattern {pattern!r} matches no parameter; paths look like "
                f"{names[min(1, len(names) - 1)]!r}"
            )
        chosen.update(hits)
    return chosen


ALL_LINEAR = "all-linear"  # PEFT's name for every linear layer but the output head
# a PPO critic's parameters (linnet.train.ppo.value_head): its head on the policy, or a separate
# model held by the policy; trained and checkpointed with it, never part of the decoder's weights
CRITIC = ("value.", "critic.")


def target_matches(layer: str, pattern: str) -> bool:
    """Whether adapter target `pattern` picks the linear layer `layer` (its path without
    `.weight`): a glob over the layer's path or its weight's path
    (`model.layers.*.self_attn.q_proj`); a name without glob characters as PEFT's
    `target_modules` match one, the path itself or its last parts (`q_proj`,
    `self_attn.q_proj`); `all-linear`, every layer (the output head is never one). A glob
    in the seeds' names (`layers.*.attention.*_proj.weight`) picks what its checkpoint
    path picks (`from_seed_path`)."""
    if pattern == ALL_LINEAR:
        return True
    weight = f"{layer}.weight"
    if any(fnmatch.fnmatchcase(weight, p) or fnmatch.fnmatchcase(layer, p) for p in (pattern, from_seed_path(pattern))):
        return True
    return not any(c in pattern for c in "*?[") and (layer.endswith(f".{pattern}") or weight.endswith(f".{pattern}"))


def adapted_layers(layers: Sequence[str], patterns: str | Sequence[str]) -> list[str]:
    """The linear layers (paths without `.weight`) that one of `patterns` picks
    (`target_matches`: globs, PEFT's short names, all-linear), in the order the patterns
    find them. The output head is never one of `layers`: the losses read its weight
    directly, so an adapter there would not train."""
    chosen: list[str] = []
    for pattern in [patterns] if isinstance(patterns, str) else list(patterns):
        hits = [n for n in layers if target_matches(n, pattern)]
        if not hits:
            shown = repr(pattern).replace("{", "{{").replace("}", "}}")
            head = "; the output head takes no adapter ({head_in_full})" if target_matches("lm_head", pattern) else ""
            raise SettingError(
                f"{{lora_targets}}: pattern {shown} matches no linear weight; give a glob over paths such as "
                "model.layers.*.self_attn.q_proj, a layer name such as q_proj (PEFT's target_modules), or "
                f"{ALL_LINEAR}{head}",
                python={"lora_targets": "add_lora", "head_in_full": "train it in full with trainable='lm_head.weight'"})
        chosen += [n for n in hits if n not in chosen]
    return chosen
