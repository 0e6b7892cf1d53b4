"""Causal attention within the documents of a packed row, in JAX, only the blocks that meet.

    out = attend(q, k, v, row)      # q [P, K, G, d], k and v [P, K, d]; row: see `model.row_arrays`

A query may see a key when the key is not later, lies in the query's document or its
shared prompt (`row["shared"]`), and is not before the first position it may see
(`row["first"]`: its prompt's or its document's start; its own position in the padding,
which so attends to itself alone). A masked P x P product spends almost all its work on
pairs that mask out. Here the row is cut into N blocks of B positions; query block i needs
key blocks lo_i .. i only, lo_i the block of the earliest position any of its queries may
see. Every (query block, key block) pair below the diagonal is listed in one static order
with the needed pairs first, and a lax.while_loop takes them CHUNK pairs a turn until the
needed ones are done, so rows of any documents share one compiled shape and a row of short
documents computes a few pairs a block (one document filling the row computes the whole
lower triangle of blocks, about half the masked product's work).

Rows of at most DENSE_UP_TO positions take the masked product instead: there it is small,
and it compiles and runs faster than the loop.

Each turn folds its pairs into each query block's running softmax (flash attention's online
max and sum, gathered and scattered by block), and backward (a custom_vjp) recomputes each
pair's probabilities from the saved log-sum-exp, so nothing of size P x P is held.
Everything runs in float32.

Shapes: P positions, N blocks of B positions, C pairs a turn, K key/value heads, G query
heads a key head, d head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 32  # positions a block, and
CHUNK = 32  # block pairs a turn: both measured best of 16-128 on a 2-core AVX2 CPU (bench/jax_vs_torch.py)
DENSE_UP_TO = 256  # positions: shorter rows compile and run faster as one masked product
FLOOR = -1e30  # a running maximum before any key: finite, so exp(FLOOR - FLOOR) = 1, not nan


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


def attend(q_PKGd, k_PKd, v_PKd, row: dict, block: int = BLOCK, dense_up_to: int = DENSE_UP_TO):
    """[P, K, G, d] float32 attention of each query over the keys it may see (see the
    module docstring), within documents, in blocks of `block` positions; a row of at most
    `dense_up_to` positions takes the masked product, cheaper there."""
    P, K, G, d = q_PKGd.shape
    if P <= dense_up_to:
        return dense(*(x.astype(jnp.float32) for x in (q_PKGd, k_PKd, v_PKd)), row)
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
    q_NKGBd = blocks(q_PKGd.astype(jnp.float32) / jnp.sqrt(jnp.float32(d))).transpose(0, 2, 3, 1, 4)
    k_NKBd, v_NKBd = (blocks(x.astype(jnp.float32)).transpose(0, 2, 1, 3) for x in (k_PKd, v_PKd))
    out_NKGBd = _paired(q_NKGBd, k_NKBd, v_NKBd, meta, _pairs(meta[3], B, N))
    return out_NKGBd.transpose(0, 3, 1, 2, 4).reshape(N * B, K, G, d)[:P]


def _pairs(first_NB, B: int, N: int):
    """(query blocks [T, C], key blocks [T, C], turns): every pair below the diagonal in
    turns of C = CHUNK pairs, the needed ones first. The others that share
    the last needed turn are masked out whole by `_mask`: their key blocks lie before the
    query block's reach, or (the spare pairs filling the last turn) after it."""
    C = CHUNK
    i_M, j_M = np.tril_indices(N)
    lo_N = first_NB.min(axis=1) // B
    needed = jnp.asarray(j_M) >= lo_N[i_M]
    order = jnp.argsort(~needed, stable=True)
    spare = -len(i_M) % C
    qi, ki = (jnp.pad(jnp.asarray(x, jnp.int32)[order], (0, spare), constant_values=fill).reshape(-1, C)
              for x, fill in ((i_M, 0), (j_M, N - 1)))  # spare pairs: key block N - 1 is later than query block 0
    return qi, ki, (needed.sum() + C - 1) // C


def _mask(meta, qi_C, ki_C):
    """[C, B, B] which (query, key) pairs of each listed block pair may meet."""
    index, seg, shared, first = meta
    return allowed(index[qi_C][:, :, None], index[ki_C][:, None, :], seg[ki_C][:, None, :], seg[qi_C][:, :, None],
                   shared[qi_C][:, :, None], first[qi_C][:, :, None])


def _scores(q_CKGBd, k_CKBd, mask_CBB):
    return jnp.where(mask_CBB[:, None, None], jnp.einsum("ckgqd,cktd->ckgqt", q_CKGBd, k_CKBd), -jnp.inf)


def _forward(q_NKGBd, k_NKBd, v_NKBd, meta, pairs):
    """(out, log-sum-exp [N, K, G, B]) over the needed pairs, softmax kept online."""
    qi_TC, ki_TC, turns = pairs

    def turn(carry):
        t, m, total, acc = carry
        qi, ki = qi_TC[t], ki_TC[t]
        s = _scores(q_NKGBd[qi], k_NKBd[ki], _mask(meta, qi, ki))
        m_new = m.at[qi].max(s.max(axis=-1))
        p = jnp.exp(s - m_new[qi][..., None])
        scale = jnp.exp(m - m_new)
        total = (total * scale).at[qi].add(p.sum(axis=-1))
        acc = (acc * scale[..., None]).at[qi].add(jnp.einsum("ckgqt,cktd->ckgqd", p, v_NKBd[ki]))
        return t + 1, m_new, total, acc

    stats = jnp.zeros(q_NKGBd.shape[:-1], jnp.float32)
    _, m, total, acc = jax.lax.while_loop(lambda c: c[0] < turns, turn,
                                          (jnp.int32(0), stats + FLOOR, stats, jnp.zeros_like(q_NKGBd)))
    return acc / total[..., None], m + jnp.log(total)


@jax.custom_vjp
def _paired(q_NKGBd, k_NKBd, v_NKBd, meta, pairs):
    return _forward(q_NKGBd, k_NKBd, v_NKBd, meta, pairs)[0]


def _paired_forward(q_NKGBd, k_NKBd, v_NKBd, meta, pairs):
    out, lse = _forward(q_NKGBd, k_NKBd, v_NKBd, meta, pairs)
    return out, (q_NKGBd, k_NKBd, v_NKBd, meta, pairs, out, lse)


def _paired_backward(saved, dout_NKGBd):
    q_NKGBd, k_NKBd, v_NKBd, meta, pairs, out, lse = saved
    qi_TC, ki_TC, turns = pairs
    delta = (dout_NKGBd * out).sum(axis=-1)  # [N, K, G, B]: sum_t p * dp, per query

    def turn(carry):
        t, dq, dk, dv = carry
        qi, ki = qi_TC[t], ki_TC[t]
        q, k, dout = q_NKGBd[qi], k_NKBd[ki], dout_NKGBd[qi]
        p = jnp.exp(_scores(q, k, _mask(meta, qi, ki)) - lse[qi][..., None])
        ds = p * (jnp.einsum("ckgqd,cktd->ckgqt", dout, v_NKBd[ki]) - delta[qi][..., None])
        return (t + 1, dq.at[qi].add(jnp.einsum("ckgqt,cktd->ckgqd", ds, k)),
                dk.at[ki].add(jnp.einsum("ckgqt,ckgqd->cktd", ds, q)),
                dv.at[ki].add(jnp.einsum("ckgqt,ckgqd->cktd", p, dout)))

    _, dq, dk, dv = jax.lax.while_loop(lambda c: c[0] < turns, turn,
                                       (jnp.int32(0), jnp.zeros_like(q_NKGBd), jnp.zeros_like(k_NKBd),
                                        jnp.zeros_like(v_NKBd)))
    return dq, dk, dv, None, None


_paired.defvjp(_paired_forward, _paired_backward)


CONTEXT = "context"  # the mesh axis context parallel splits a row's positions over


def ring(q_PKGd, k_PKd, v_PKd, row: dict, size: int):
    """`attend` for a row whose positions are split over the mesh's "context" axis of
    `size` devices, inside jax.shard_map: each device holds its queries and passes its
    keys and values round the ring (lax.ppermute), one device's block a turn, folding
    each block into a running softmax. The row's arrays carry `index`, each position's
    place in the row (`linnet.packing.context_order` reorders a row so that device r holds
    chunks r and 2·size-1-r of its 2·size chunks, the same causal work on every device). Each turn's
    block is recomputed in backward (jax.checkpoint), so no device holds more than one
    block's scores; JAX differentiates the ring, its gradients passing the other way."""
    d = q_PKGd.shape[-1]
    q = q_PKGd.astype(jnp.float32) / jnp.sqrt(jnp.float32(d))
    mine = (row["index"], row["segments"], row["shared"], row["first"])
    m = jnp.full(q.shape[:-1], FLOOR, jnp.float32)
    total, acc = jnp.zeros_like(m), jnp.zeros_like(q)
    block = (k_PKd.astype(jnp.float32), v_PKd.astype(jnp.float32), row["index"], row["segments"])
    after = [(i, (i + 1) % size) for i in range(size)]
    for turn in range(size):
        m, total, acc = jax.checkpoint(_fold)(q, *block, *mine, m, total, acc)
        if turn < size - 1:
            block = tuple(jax.lax.ppermute(x, CONTEXT, after) for x in block)
    return acc / total[..., None]


def _fold(q_PKGd, k_TKd, v_TKd, k_index, k_segment, index, segment, shared, first, m, total, acc):
    """One block of keys folded into the running max `m`, sum `total` [P, K, G] and
    output `acc` [P, K, G, d] of the queries (every query sees its own position, so
    `total` ends above 0)."""
    mask_PT = allowed(index[:, None], k_index[None, :], k_segment[None, :], segment[:, None], shared[:, None],
                      first[:, None])
    s = jnp.where(mask_PT[:, None, None, :], jnp.einsum("pkgd,tkd->pkgt", q_PKGd, k_TKd), -jnp.inf)
    m_new = jnp.maximum(m, s.max(axis=-1))
    p = jnp.exp(s - m_new[..., None])
    scale = jnp.exp(m - m_new)
    return m_new, total * scale + p.sum(axis=-1), acc * scale[..., None] + jnp.einsum("pkgt,tkd->pkgd", p, v_TKd)


def context_attend(q_PKGd, k_PKd, v_PKd, row: dict):
    """`ring` over the "context" axis of the mesh in force (jax.set_mesh), the row's
    position axis split over it; the mesh's other axes stay the partitioner's."""
    from jax.sharding import PartitionSpec

    mesh = jax.sharding.get_abstract_mesh()
    size = mesh.shape[CONTEXT]
    names = ("index", "segments", "shared", "first")
    split = PartitionSpec(CONTEXT)

    def local(q, k, v, *arrays):
        return ring(q, k, v, dict(zip(names, arrays, strict=True)), size)

    return jax.shard_map(local, in_specs=(split,) * 7, out_specs=split, axis_names={CONTEXT})(
        q_PKGd, k_PKd, v_PKd, *(row[name] for name in names))
