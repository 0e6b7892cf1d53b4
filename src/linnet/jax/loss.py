"""The output head's losses in JAX, a block of rows at a time: the [N, V] logits are never
held whole. Forward keeps each row's log-sum-exp; backward (a custom_vjp) recomputes one
block's logits at a time and accumulates the head's gradient in float32.

Shapes: N rows (positions), V vocabulary, D hidden; `rows` positions a block.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp


def _blocked(x, rows: int):
    """[blocks, rows, ...]: x padded with zeros to a whole number of blocks."""
    pad = -x.shape[0] % rows
    x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
    return x.reshape(-1, rows, *x.shape[1:])


def _logits(h, w):
    return (h @ w.astype(h.dtype).T).astype(jnp.float32)


def _picked_and_lse(h, w, targets, rows: int):
    """Each row's target logit and log-sum-exp, [N] float32, one block in memory at a time."""
    def block(args):
        hb, tb = args
        z = _logits(hb, w)
        return jnp.take_along_axis(z, tb[:, None], axis=-1)[:, 0], jax.nn.logsumexp(z, axis=-1)

    picked, lse = jax.lax.map(block, (_blocked(h, rows), _blocked(targets, rows)))
    n = h.shape[0]
    return picked.reshape(-1)[:n], lse.reshape(-1)[:n]


def _grads(h, w, targets, lse, coef, rows: int):
    """(dh, dW) of sum_n coef[n] * -log p(targets[n]): block by block, dW in float32."""
    n = h.shape[0]

    def block(grad_w, args):
        hb, tb, lb, cb = args
        g = jnp.exp(_logits(hb, w) - lb[:, None])  # softmax
        g = g.at[jnp.arange(g.shape[0]), tb].add(-1.0) * cb[:, None]
        g = g.astype(h.dtype)
        return grad_w + (g.T @ hb).astype(jnp.float32), g @ w.astype(h.dtype)

    grad_w, grad_h = jax.lax.scan(block, jnp.zeros(w.shape, jnp.float32),
                                  (_blocked(h, rows), _blocked(targets, rows), _blocked(lse, rows),
                                   _blocked(coef, rows)))
    return grad_h.reshape(-1, h.shape[1])[:n], grad_w.astype(w.dtype)


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def linear_cross_entropy(h, w, targets, weights, rows: int = 1024):
    """sum_n weights[n] * -log softmax(h @ w.T)[n, targets[n]], float32, without the [N, V] logits."""
    picked, lse = _picked_and_lse(h, w, targets, rows)
    return jnp.sum((lse - picked) * weights.astype(jnp.float32))


def _lce_forward(h, w, targets, weights, rows):
    picked, lse = _picked_and_lse(h, w, targets, rows)
    return jnp.sum((lse - picked) * weights.astype(jnp.float32)), (h, w, targets, weights, lse)


def _lce_backward(rows, saved, g):
    h, w, targets, weights, lse = saved
    grad_h, grad_w = _grads(h, w, targets, lse, weights.astype(jnp.float32) * g, rows)
    return grad_h, grad_w, None, None


linear_cross_entropy.defvjp(_lce_forward, _lce_backward)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def linear_token_log_probs(h, w, targets, rows: int = 1024):
    """[N] log softmax(h @ w.T)[n, targets[n]], float32, without the [N, V] logits."""
    picked, lse = _picked_and_lse(h, w, targets, rows)
    return picked - lse


def _ltl_forward(h, w, targets, rows):
    picked, lse = _picked_and_lse(h, w, targets, rows)
    return picked - lse, (h, w, targets, lse)


def _ltl_backward(rows, saved, g):
    h, w, targets, lse = saved
    grad_h, grad_w = _grads(h, w, targets, lse, -g, rows)  # d log p = -d(-log p)
    return grad_h, grad_w, None


linear_token_log_probs.defvjp(_ltl_forward, _ltl_backward)
