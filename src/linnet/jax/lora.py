"""The JAX decoder's linear layers and their low-rank adapters, as in PyTorch
(linnet.torch.lora): a matching linear layer computes x @ W.T + (x @ A.T) @ B.T * scale,
with A and B stored beside W as `<layer>.lora_a` [r, in] and `<layer>.lora_b` [out, r] (B
zero, so a fresh adapter changes nothing). The adapters save in PEFT's format
(linnet.files.adapters) and merge into the weights."""

from __future__ import annotations

import math
import os
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from linnet.files.adapters import ADAPTER_SUFFIXES, check_adapter_options, write_peft
from linnet.paths import adapted_layers

if TYPE_CHECKING:
    from linnet.jax.model import JaxModel

Params = dict[str, jax.Array]


def linear(params: Params, path: str, x, bias: bool, lora_scale: float, drop=None):
    """x @ W.T (+ b), and with an adapter (+ (x @ A.T) @ B.T * lora_scale); with DoRA's
    magnitude m the sum is rescaled by m / ||W + lora_scale * B @ A||_row (the norm held
    constant in backward), as in PyTorch. drop: (rate, key) to drop the adapter's input
    (inverted dropout, the mask drawn from `key` and the layer's path), or None."""
    y = x @ params[f"{path}.weight"].astype(x.dtype).T
    if f"{path}.lora_a" in params:
        a_in = x if drop is None else dropout(x, *drop, path)
        y = y + (a_in @ params[f"{path}.lora_a"].astype(x.dtype).T) @ params[f"{path}.lora_b"].astype(x.dtype).T \
            * lora_scale
    if f"{path}.lora_magnitude" in params:
        norm = jax.lax.stop_gradient(jnp.linalg.norm(adapted_weight(params, path, lora_scale), axis=1))
        y = y * (params[f"{path}.lora_magnitude"] / norm).astype(x.dtype)
    return y + params[f"{path}.bias"].astype(x.dtype) if bias else y


def dropout(x, rate: float, key, path: str):
    """x with each value zeroed with probability `rate` and the rest scaled by 1 / (1 - rate),
    the mask drawn from `key` folded with the layer's path (each layer its own mask)."""
    keep = jax.random.bernoulli(jax.random.fold_in(key, zlib.crc32(path.encode()) & 0x7FFFFFFF), 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


def dropout_keys(seed: int, step: int, rows: int, *more: int) -> np.ndarray:
    """[rows, 2] raw uint32 keys of the adapters' dropout masks, row i's drawn from (seed,
    step, *more, i): a resumed run draws what an uninterrupted one does."""
    return np.stack([np.random.default_rng([seed, step, *more, i]).integers(0, 2**32, 2, dtype=np.uint32)
                     for i in range(rows)])


def adapted_weight(params: Params, path: str, lora_scale: float):
    """W + lora_scale * B @ A in float32."""
    w = params[f"{path}.weight"].astype(jnp.float32)
    return w + lora_scale * (params[f"{path}.lora_b"] @ params[f"{path}.lora_a"])


def add_lora(model: JaxModel, patterns: str | Sequence[str], *, rank: int = 16, alpha: float = 32,
             dropout: float = 0.0, rslora: bool = False, dora: bool = False, seed: int = 0) -> list[str]:
    """Add adapters to `model.params` for every projection whose weight path (or layer
    path) matches a pattern (with dora=True, DoRA's magnitude per output row, starting at
    the row's norm); returns the adapted layer paths. dropout: drop the adapters' input
    while the JAX trainers (train, dpo, grpo) train, the masks drawn from their seed."""
    check_adapter_options(rank=rank, dropout=dropout)
    if model.lora:
        raise ValueError("add_lora: the model has adapters already; merge_lora first")
    chosen = adapted_layers([k.removesuffix(".weight") for k in model.params if k.endswith("_proj.weight")], patterns)
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
    model.lora = dict(rank=rank, alpha=alpha, dropout=dropout, rslora=rslora, layers=chosen, scale=scale, dora=dora)
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
    if not model.lora:
        raise ValueError("save_peft: the model has no adapters; call add_lora first")
    params = model.params if params is None else params
    adapters = {k: np.array(v, np.float32) for k, v in params.items() if k.endswith(ADAPTER_SUFFIXES)}
    card = model.card
    write_peft(directory, adapters, model.lora, card.weights.repo or card.weights.path)
