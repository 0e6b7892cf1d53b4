"""The JAX decoder's linear layers and their low-rank adapters, as in PyTorch
(linnet.torch.lora): a matching linear layer computes x @ W.T + (x @ A.T) @ B.T * scale,
with A and B stored beside W as `<layer>.lora_a` [r, in] and `<layer>.lora_b` [out, r] (B
zero, so a fresh adapter changes nothing). Adding, merging and saving a model's adapters
(PEFT's format, linnet.files.adapters) are linnet.jax.model's."""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np

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
