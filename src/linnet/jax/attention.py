"""Causal attention within the documents of a packed row, in JAX, a band of blocks at a time.

    out = attend(q, k, v, row)      # q [P, K, G, d], k and v [P, K, d]; row: see `model.row_arrays`

A query may see a key when the key is not later, lies in the query's document or its
shared prompt (`row["shared"]`), and is not before the first position it may see
(`row["first"]`: its prompt's or its document's start; its own position in the padding,
which so attends to itself alone). A masked P x P product spends almost all its work on
pairs that mask out; here the row is cut into blocks of B positions and query block i
meets key block i - j for j = 0, 1, ... W - 1 only, all the query blocks at once each
turn, where the band W is the widest reach, in blocks, of any query block (from the
row's `first`; a lax.while_loop with that many turns, so rows of any documents share
one compiled shape). A row of short documents computes a narrow band; a row that one
document fills computes every block pair, about what the masked product does.

Each turn folds its block into the running softmax (flash attention's online max and
sum), and backward (a custom_vjp) recomputes each turn's probabilities from the saved
log-sum-exp, so nothing of size P x P is held. Everything runs in float32.

Shapes: P positions, N blocks of B positions, K key/value heads, G query heads a key
head, d head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BLOCK = 64  # positions a block: measured on a 2-core AVX2 CPU, 64 beat 32 and 128 (bench/jax_vs_torch.py)


def allowed(q_index, k_index, k_segment, segment, shared, first):
    """Whether a query may see a key, broadcasting the query's index, segment, shared
    prompt and first position against the key's index and segment."""
    own = (k_segment == segment) | (k_segment == shared)
    return own & (k_index <= q_index) & (k_index >= first)


def dense(q_PKGd, k_PKd, v_PKd, row: dict):
    """The reference: the masked P x P product (what `attend` computes, for the tests)."""
    index = jnp.arange(q_PKGd.shape[0])
    seg, shared, first = row["segments"], row["shared"], row["first"]
    mask_PP = allowed(index[:, None], index[None, :], seg[None, :], seg[:, None], shared[:, None], first[:, None])
    scores = jnp.einsum("qkgd,tkd->kgqt", q_PKGd, k_PKd) / jnp.sqrt(jnp.float32(q_PKGd.shape[-1]))
    probs = jax.nn.softmax(jnp.where(mask_PP, scores, -jnp.inf), axis=-1)
    return jnp.einsum("kgqt,tkd->qkgd", probs, v_PKd)


def attend(q_PKGd, k_PKd, v_PKd, row: dict, block: int = BLOCK):
    """[P, K, G, d] float32 attention of each query over the keys it may see (see the
    module docstring), within documents, in blocks of `block` positions."""
    P, K, G, d = q_PKGd.shape
    B = min(block, P)
    pad = -P % B
    N = (P + pad) // B
    index = jnp.arange(P + pad, dtype=jnp.int32)

    def blocks(x, fill=0):
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1), constant_values=fill)
        return x.reshape(N, B, *x.shape[1:])

    # padded positions see themselves alone (first = own index), as the row's padding does
    meta = (index.reshape(N, B), blocks(row["segments"].astype(jnp.int32), -1),
            blocks(row["shared"].astype(jnp.int32), -1),
            jnp.concatenate([row["first"].astype(jnp.int32), index[P:]]).reshape(N, B))
    band = jnp.max(jnp.arange(N) - meta[3].min(axis=1) // B) + 1  # key blocks the widest query block reaches
    q_NKGBd = blocks(q_PKGd.astype(jnp.float32) / jnp.sqrt(jnp.float32(d))).transpose(0, 2, 3, 1, 4)
    k_NKBd, v_NKBd = (blocks(x.astype(jnp.float32)).transpose(0, 2, 1, 3) for x in (k_PKd, v_PKd))
    out_NKGBd = _banded(q_NKGBd, k_NKBd, v_NKBd, meta, band)
    return out_NKGBd.transpose(0, 3, 1, 2, 4).reshape(N * B, K, G, d)[:P]


def _turn_mask(meta, j):
    """[N, B, B] which (query, key) pairs of query block i and key block i - j may meet
    (key blocks wrap around below block 0: those are later than every query, so masked)."""
    index, seg, shared, first = meta
    k_index, k_seg = jnp.roll(index, j, axis=0), jnp.roll(seg, j, axis=0)
    return allowed(index[:, :, None], k_index[:, None, :], k_seg[:, None, :], seg[:, :, None], shared[:, :, None],
                   first[:, :, None])


def _scores(q_NKGBd, k_NKBd, mask_NBB):
    return jnp.where(mask_NBB[:, None, None], jnp.einsum("nkgqd,nktd->nkgqt", q_NKGBd, k_NKBd), -jnp.inf)


def _forward(q_NKGBd, k_NKBd, v_NKBd, meta, band):
    """(out, log-sum-exp [N, K, G, B]) over the band's turns, softmax kept online."""
    def turn(carry):
        j, m, total, acc = carry
        s = _scores(q_NKGBd, jnp.roll(k_NKBd, j, axis=0), _turn_mask(meta, j))
        m_new = jnp.maximum(m, s.max(axis=-1))  # finite from turn 0 on: a query always sees itself
        p = jnp.exp(s - m_new[..., None])
        scale = jnp.exp(m - m_new)
        acc = acc * scale[..., None] + jnp.einsum("nkgqt,nktd->nkgqd", p, jnp.roll(v_NKBd, j, axis=0))
        return j + 1, m_new, total * scale + p.sum(axis=-1), acc

    stats = jnp.zeros(q_NKGBd.shape[:-1], jnp.float32)
    _, m, total, acc = jax.lax.while_loop(lambda c: c[0] < band, turn,
                                      (jnp.int32(0), stats - jnp.inf, stats, jnp.zeros_like(q_NKGBd)))
    return acc / total[..., None], m + jnp.log(total)


@jax.custom_vjp
def _banded(q_NKGBd, k_NKBd, v_NKBd, meta, band):
    return _forward(q_NKGBd, k_NKBd, v_NKBd, meta, band)[0]


def _banded_forward(q_NKGBd, k_NKBd, v_NKBd, meta, band):
    out, lse = _forward(q_NKGBd, k_NKBd, v_NKBd, meta, band)
    return out, (q_NKGBd, k_NKBd, v_NKBd, meta, band, out, lse)


def _banded_backward(saved, dout_NKGBd):
    q_NKGBd, k_NKBd, v_NKBd, meta, band, out, lse = saved
    delta = (dout_NKGBd * out).sum(axis=-1)  # [N, K, G, B]: sum_t p * dp, per query

    def turn(carry):
        j, dq, dk, dv = carry
        k_j = jnp.roll(k_NKBd, j, axis=0)
        p = jnp.exp(_scores(q_NKGBd, k_j, _turn_mask(meta, j)) - lse[..., None])
        dv_j = jnp.einsum("nkgqt,nkgqd->nktd", p, dout_NKGBd)
        ds = p * (jnp.einsum("nkgqd,nktd->nkgqt", dout_NKGBd, jnp.roll(v_NKBd, j, axis=0)) - delta[..., None])
        dq = dq + jnp.einsum("nkgqt,nktd->nkgqd", ds, k_j)
        dk_j = jnp.einsum("nkgqt,nkgqd->nktd", ds, q_NKGBd)
        return j + 1, dq, dk + jnp.roll(dk_j, -j, axis=0), dv + jnp.roll(dv_j, -j, axis=0)

    _, dq, dk, dv = jax.lax.while_loop(lambda c: c[0] < band, turn,
                                       (jnp.int32(0), jnp.zeros_like(q_NKGBd), jnp.zeros_like(k_NKBd),
                                        jnp.zeros_like(v_NKBd)))
    return dq, dk, dv, None, None


_banded.defvjp(_banded_forward, _banded_backward)
