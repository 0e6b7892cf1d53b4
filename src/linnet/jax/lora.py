"""Low-rank adapters for the JAX decoder, as in PyTorch (linnet.torch.lora): a matching
linear layer computes x @ W.T + (x @ A.T) @ B.T * scale, with A and B stored beside W as
`<layer>.lora_a` [r, in] and `<layer>.lora_b` [out, r] (B zero, so a fresh adapter changes
nothing). The adapters save in PEFT's format and merge into the weights."""

from __future__ import annotations

import fnmatch
import math
import os
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from linnet.jax.model import JaxModel, Params, adapted_weight

ADAPTERS = ("*.lora_a", "*.lora_b", "*.lora_magnitude")


def add_lora(model: JaxModel, patterns: str | Sequence[str], *, rank: int = 16, alpha: float = 32,
             rslora: bool = False, dora: bool = False, seed: int = 0) -> list[str]:
    """Add adapters to `model.params` for every projection whose weight path (or layer
    path) matches a pattern (with dora=True, DoRA's magnitude per output row, starting at
    the row's norm); returns the adapted layer paths."""
    if rank < 1:
        raise ValueError(f"add_lora: rank={rank}; it must be at least 1")
    if model.lora:
        raise ValueError("add_lora: the model has adapters already; merge_lora first")
    layers = [k.removesuffix(".weight") for k in model.params if k.endswith("_proj.weight")]
    chosen: list[str] = []
    for pattern in [patterns] if isinstance(patterns, str) else list(patterns):
        hits = [n for n in layers if fnmatch.fnmatch(f"{n}.weight", pattern) or fnmatch.fnmatch(n, pattern)]
        if not hits:
            raise ValueError(f"add_lora: pattern {pattern!r} matches no projection; paths look like "
                             "model.layers.0.self_attn.q_proj.weight")
        chosen += [n for n in hits if n not in chosen]
    rng = np.random.default_rng(seed)
    for name in chosen:
        d_out, d_in = model.params[f"{name}.weight"].shape
        bound = 1.0 / math.sqrt(d_in)  # PEFT's kaiming-uniform(a=sqrt(5)) for A
        model.params[f"{name}.lora_a"] = jnp.asarray(rng.uniform(-bound, bound, (rank, d_in)), jnp.float32)
        model.params[f"{name}.lora_b"] = jnp.zeros((d_out, rank), jnp.float32)
        if dora:
            weight = model.params[f"{name}.weight"].astype(jnp.float32)
            model.params[f"{name}.lora_magnitude"] = jnp.linalg.norm(weight, axis=1)
    scale = alpha / math.sqrt(rank) if rslora else alpha / rank
    model.lora = dict(rank=rank, alpha=alpha, dropout=0.0, rslora=rslora, layers=chosen, scale=scale, dora=dora)
    return chosen


def merge_lora(model: JaxModel, params: Params | None = None) -> Params:
    """`params` (default the model's) with every adapter added into its weight
    (W + scale * B @ A, in float32) and the adapters removed."""
    params = dict(model.params if params is None else params)
    if not model.lora:
        return params
    for name in model.lora["layers"]:
        merged = adapted_weight(params, name, model.lora["scale"])
        magnitude = params.pop(f"{name}.lora_magnitude", None)
        if magnitude is not None:
            merged = merged * (magnitude / jnp.linalg.norm(merged, axis=1))[:, None]
        del params[f"{name}.lora_a"], params[f"{name}.lora_b"]
        params[f"{name}.weight"] = merged.astype(params[f"{name}.weight"].dtype)
    return params


def save_peft(model: JaxModel, directory: str | os.PathLike, params: Params | None = None) -> None:
    """The adapters of `params` (default the model's) as a PEFT adapter directory."""
    import torch

    from linnet.torch.lora import ADAPTER_SUFFIXES, write_peft

    if not model.lora:
        raise ValueError("save_peft: the model has no adapters; call add_lora first")
    params = model.params if params is None else params
    adapters = {k: torch.from_numpy(np.array(v, np.float32)) for k, v in params.items()
                if k.endswith(ADAPTER_SUFFIXES)}
    card = model.card
    write_peft(directory, adapters, model.lora, card.weights.repo or card.weights.path)
