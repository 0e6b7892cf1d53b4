"""Sampling from the JAX decoder with a KV cache, as `linnet.serve.Engine` samples from the
PyTorch one:

    engine = Engine(model)                                  # a linnet.jax.JaxModel
    done = engine.sample([ids_a, ids_b], n=8, max_new_tokens=128, temperature=1.0, seed=0)
    done[0].tokens, done[0].logprobs, done[0].stopped       # completion 0 of prompt 0
    engine.load_weights(policy, params)                     # a policy's parameters, adapters merged
    Engine(model.shard(mesh))                               # over a mesh: split as the policy is

Every completion is a cache row holding its prompt right-padded to the longest one. One
compiled prefill runs each prompt once and copies its cache rows and last logits to its n
completions (a GRPO group's prompt passes the model once, not n times); then one
compiled decode step a token writes each row's new key and value at its own next slot
and attends to the slots up to it (slots past a row's prompt hold padding until the row
overwrites them, and are masked until then). Rows that sampled a stop token keep running
but take no more tokens; the loop ends when every row has stopped or reached
`max_new_tokens`. Cache lengths round up to 64 slots, so few shapes compile.

Log-probabilities: each sampled token's log-probability under the model's unmodified
distribution (temperature 1, before top-k/top-p), as in the PyTorch engine.
Shapes: B rows, T prompt slots, S cache slots, K kv heads, d head dim, V vocabulary.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from linnet.jax.lora import Params, linear
from linnet.jax.model import JaxModel, cos_sin, head_weight, merge_lora, mlp, project, rms_norm
from linnet.rl.rollouts import Completion

SLOTS = 64  # cache lengths round up to a multiple of this


def _layers(params: Params, card, x, positions, cache, write, mask, dtype):
    """Run every layer over x [B, Q, D] at `positions` [B, Q]: each layer's keys and values
    go into its cache through `write(cache_layer, new) -> cache_layer`, and queries attend
    to the cache where `mask` [B, Q, S] allows. Returns (final-normed x, the cache)."""
    c = card
    B, Q, _ = x.shape
    cos, sin = cos_sin(card, positions, dtype)
    groups = c.heads // c.kv_heads
    keys, values = cache
    for i in range(c.layers):
        h = rms_norm(x, params[f"model.layers.{i}.input_layernorm.weight"], c.norm_eps)
        q, k, v = project(params, card, i, h, cos, sin, 0.0)
        keys = keys.at[i].set(write(keys[i], k))
        values = values.at[i].set(write(values[i], v))
        q = q.reshape(B, Q, c.kv_heads, groups, c.head_dim).astype(jnp.float32)
        scores = jnp.einsum("bqkgd,bskd->bkgqs", q, keys[i].astype(jnp.float32)) / np.sqrt(c.head_dim)
        scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
        out = jnp.einsum("bkgqs,bskd->bqkgd", jax.nn.softmax(scores, axis=-1), values[i].astype(jnp.float32))
        x = x + linear(params, f"model.layers.{i}.self_attn.o_proj", out.reshape(B, Q, -1).astype(dtype), c.o_bias,
                       0.0)
        x = x + mlp(params, c, i, rms_norm(x, params[f"model.layers.{i}.post_attention_layernorm.weight"],
                                           c.norm_eps), 0.0)
    return rms_norm(x, params["model.norm.weight"], c.norm_eps), (keys, values)


def _logits(params: Params, card, h):
    return (h @ head_weight(params, card).astype(h.dtype).T).astype(jnp.float32)


@functools.partial(jax.jit, static_argnums=(1, 4, 5, 6))
def _prefill(params: Params, card, tokens, lengths, slots: int, dtype, n: int):
    """Each prompt's logits after it [P, V] and its cache [L, P, S, K, d] (keys, values),
    each repeated for its n completions: [P * n, ...], prompt-major."""
    B, T = tokens.shape
    shape = (card.layers, B, slots, card.kv_heads, card.head_dim)
    cache = (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    mask = jnp.arange(slots)[None, None, :] <= positions[:, :, None]
    x = params["model.embed_tokens.weight"][tokens].astype(dtype)
    h, cache = _layers(params, card, x, positions, cache, lambda old, new: old.at[:, :T].set(new), mask, dtype)
    last = h[jnp.arange(B), lengths - 1]
    return jnp.repeat(_logits(params, card, last), n, axis=0), tuple(jnp.repeat(c, n, axis=1) for c in cache)


@functools.partial(jax.jit, static_argnums=(1, 5), donate_argnums=(4,))
def _decode(params: Params, card, tokens, positions, cache, dtype):
    """One token a row at `positions` [B]: logits [B, V] and the cache with its keys and values."""
    B = tokens.shape[0]
    slots = cache[0].shape[2]
    rows = jnp.arange(B)
    mask = (jnp.arange(slots)[None, :] <= positions[:, None])[:, None, :]
    x = params["model.embed_tokens.weight"][tokens][:, None, :].astype(dtype)
    h, cache = _layers(params, card, x, positions[:, None], cache,
                       lambda old, new: old.at[rows, positions].set(new[:, 0]), mask, dtype)
    return _logits(params, card, h[:, 0]), cache


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _pick(logits, key, temperature: float, top_k: int, top_p: float):
    """Sampled ids [B] and the model's (temperature 1, unfiltered) log-probabilities of them."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    if temperature == 0:
        tok = jnp.argmax(logits, axis=-1)
    else:
        z = logits / temperature
        if top_k:
            kth = jax.lax.top_k(z, top_k)[0][:, -1:]
            z = jnp.where(z < kth, -jnp.inf, z)
        if top_p < 1.0:
            order = jnp.argsort(-z, axis=-1)
            sorted_z = jnp.take_along_axis(z, order, axis=-1)
            probs = jax.nn.softmax(sorted_z, axis=-1)
            before = jnp.cumsum(probs, axis=-1) - probs  # mass of the more likely tokens
            sorted_z = jnp.where(before >= top_p, -jnp.inf, sorted_z)  # the first always stays
            z = jnp.zeros_like(z).at[jnp.arange(z.shape[0])[:, None], order].set(sorted_z)
        tok = jax.random.categorical(key, z, axis=-1)
    return tok, jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]


class Engine:
    """See the module docstring. The engine keeps its own parameters (adapters merged)."""

    def __init__(self, model: JaxModel):
        self.model = model
        self.params = merge_lora(model)

    def load_weights(self, policy: JaxModel, params: Params | None = None) -> None:
        """Take `params` (default the policy's own), adapters merged in (W + scale * B @ A),
        placed as the engine's model's are (`JaxModel.copy_weights`; split over a mesh after
        `model.shard(mesh)`, so that no copy goes through one device)."""
        self.model.copy_weights(policy, params)
        self.params = self.model.params

    def sample(self, prompts: Sequence[Sequence[int]], n: int = 1, *, max_new_tokens: int = 256,
               temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
               stop: Iterable[int] | None = None, seed: int = 0) -> list[Completion]:
        """Sample n completions of each prompt (prompt-major: completion j of prompt i is at
        i * n + j); the options are the PyTorch engine's."""
        card = self.model.card
        prompts = [list(map(int, p)) for p in prompts]
        if not prompts or any(not p for p in prompts) or n < 1 or max_new_tokens < 1:
            raise ValueError("Engine.sample: needs prompts that are not empty, n >= 1 and max_new_tokens >= 1")
        stop_ids = set(card.eos_token_ids if stop is None else stop)
        lengths = np.repeat([len(p) for p in prompts], n)
        T = max(lengths)
        slots = -(-(T + max_new_tokens) // SLOTS) * SLOTS
        if slots > card.max_positions:
            raise ValueError(f"Engine.sample: a prompt of {T} tokens and {max_new_tokens} new ones pass the card's "
                             f"{card.max_positions} positions")
        tokens = np.zeros((len(prompts), T), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = p
        key = jax.random.key(seed)
        options = (float(temperature), int(top_k or 0), float(1.0 if top_p is None else top_p))
        logits, cache = _prefill(self.params, card, jnp.asarray(tokens), jnp.asarray(lengths[::n]), slots,
                                 self.model.dtype, n)
        out = [[] for _ in lengths]
        logps = [[] for _ in lengths]
        running = np.ones(len(lengths), bool)
        positions = lengths.copy()
        for step in range(max_new_tokens):
            key, sub = jax.random.split(key)
            tok, logp = (np.asarray(x) for x in _pick(logits, sub, *options))
            for r in np.flatnonzero(running):
                out[r].append(int(tok[r]))
                logps[r].append(float(logp[r]))
                if int(tok[r]) in stop_ids:
                    running[r] = False
            if not running.any() or step == max_new_tokens - 1:
                break
            logits, cache = _decode(self.params, card, jnp.asarray(tok, jnp.int32), jnp.asarray(positions), cache,
                                    self.model.dtype)
            positions = positions + 1
        return [Completion(r // n, toks, np.asarray(lp, np.float32), bool(toks and toks[-1] in stop_ids))
                for r, (toks, lp) in enumerate(zip(out, logps))]
