"""Attention within documents in JAX (`linnet.jax.attention.attend`) against the masked
P x P product it replaces: outputs and gradients, on rows with documents crossing block
edges, a shared prompt, padding and one document filling the row."""

from __future__ import annotations

import numpy as np
import pytest

from linnet.packing import Example, pack, pack_prompted

pytestmark = pytest.mark.jax  # last in the run: see tests/conftest.py


def _rows():
    """Packed rows of 40 positions: short documents (several a block), a shared prompt with
    completions and padding, and one document longer than the row's blocks."""
    g = np.random.default_rng(0)
    short = next(pack([Example.plain(g.integers(3, 50, int(n)).tolist()) for n in (3, 9, 5, 12, 2, 7)], tokens=40))
    groups = [([5, 6, 7, 8, 9], [[10, 11, 12], [13, 14], [15, 16, 17, 18]]), ([20, 21], [[22, 23], [24, 25, 26]])]
    shared = next(pack_prompted(groups, 40, share=True))
    whole = next(pack([Example.plain(g.integers(3, 50, 40).tolist())], tokens=40))
    assert shared.prefix is not None and shared.real < 40
    return {"short": short, "shared prompt and padding": shared, "one document": whole}


@pytest.mark.parametrize("name", ["short", "shared prompt and padding", "one document"])
@pytest.mark.parametrize("block", [4, 16, 64])
def test_attend_equals_the_masked_product_and_its_gradients(name, block):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from linnet.jax import attention
    from linnet.jax.model import row_arrays

    row = {k: jnp.asarray(v) for k, v in row_arrays(_rows()[name]).items()}
    g = np.random.default_rng(1)
    P, K, G, d = 40, 2, 3, 8
    q, k, v, cot = (jnp.asarray(g.normal(size=s), jnp.float32) for s in ((P, K, G, d), (P, K, d), (P, K, d), (P, K, G, d)))

    def loss(fn):
        return lambda q, k, v: (fn(q, k, v, row) * cot).sum()

    mine, ref = jax.jit(loss(lambda *a: attention.attend(*a, block=block, dense_up_to=0))), loss(attention.dense)
    np.testing.assert_allclose(attention.attend(q, k, v, row, block=block, dense_up_to=0), attention.dense(q, k, v, row),
                               atol=1e-5, rtol=1e-5)
    for got, want in zip(jax.grad(mine, argnums=(0, 1, 2))(q, k, v), jax.grad(ref, argnums=(0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4)
