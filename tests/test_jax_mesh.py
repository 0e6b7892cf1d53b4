"""The JAX trainers over a two-axis ("data", "model") mesh on four host devices (the
XLA_FLAGS that tests/test_jax.py's fixture sets): full fine-tuning, LoRA and DPO steps
equal one device's, the weights laid out tensor-parallel over "model" and fully sharded
over "data", the loader reading each device's slice alone, an engine over the mesh
sampling what a whole one does, and bad meshes refused."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from linnet import nest
from linnet.packing import Pair
from tests import test_jax
from tests.test_jax import BASE, _rows

pytestmark = pytest.mark.jax  # last in the run: see tests/conftest.py

jx = test_jax.jx  # the fixture: (jax, linnet.jax.model), four host devices set before JAX starts

CARD = BASE.replace(tied_embeddings=False, qkv_bias=True)  # a head of its own; biases placed as their weights


def _mesh(jax, how: str):
    """A 2x2 ("data", "model") mesh as the seed builds it (jax.make_mesh: Explicit axes by
    default in JAX 0.10) or from the devices (Auto axes)."""
    from jax.sharding import Mesh

    if len(jax.devices()) < 4:
        pytest.skip("needs four devices (tests/conftest.py sets XLA_FLAGS; it was overridden)")
    if how == "make_mesh":
        return jax.make_mesh((2, 2), ("data", "model"))
    return Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))


def _weights(tmp_path, seed=3):
    """Random weights with norms and biases away from their init, as safetensors."""
    from linnet.jax.model import save_weights

    g = np.random.default_rng(seed)
    params = {k: np.asarray(v) + (g.normal(0, 0.1, v.shape).astype(np.float32) if "norm" in k or "bias" in k else 0)
              for k, v in nest.load(CARD, backend="jax", weights="random", seed=seed).params.items()}
    save_weights(params, tmp_path / "w.safetensors")
    return str(tmp_path / "w.safetensors")


def _spec(array):
    return tuple(array.sharding.spec) + (None,) * (array.ndim - len(array.sharding.spec))


TENSOR_PARALLEL = {  # q, k, v, gate, up by output rows; o, down by input columns; vocabulary rows; norms whole
    "model.embed_tokens.weight": ("model", "data"), "lm_head.weight": ("model", "data"),
    "model.layers.0.self_attn.q_proj.weight": ("model", "data"), "model.layers.0.self_attn.q_proj.bias": ("model",),
    "model.layers.0.self_attn.k_proj.weight": ("model", "data"), "model.layers.1.mlp.up_proj.weight": ("model", "data"),
    "model.layers.0.self_attn.o_proj.weight": ("data", "model"), "model.layers.1.mlp.down_proj.weight": ("data", "model"),
    "model.layers.0.input_layernorm.weight": (None,), "model.norm.weight": (None,),
}
ADAPTERS = {  # A [r, in] on its weight's input axis, B [out, r] on its output axis
    "model.layers.0.self_attn.q_proj.lora_a": (None, "data"), "model.layers.0.self_attn.q_proj.lora_b": ("model", None),
    "model.layers.0.self_attn.o_proj.lora_a": (None, "model"), "model.layers.0.self_attn.o_proj.lora_b": ("data", None),
}


@pytest.mark.parametrize("lora,how", [(False, "make_mesh"), (True, "Mesh")])
def test_two_axis_mesh_trains_like_one_device(jx, tmp_path, lora, how):
    """Two steps of two accumulated micro-steps, each a row for each "data" index, the
    weights split over both axes (loaded straight into their parts): the losses and the
    parameters of one device accumulating the four rows a step."""
    jax, _ = jx
    import optax

    from linnet.jax.train import train

    mesh, weights = _mesh(jax, how), _weights(tmp_path)
    rows = _rows(8, seed=5)

    def run(mesh):
        model = nest.load(CARD, backend="jax", weights=weights, mesh=mesh)
        if lora:
            model.add_lora(["model.layers.*.self_attn.*_proj", "model.layers.*.mlp.*_proj"], rank=4, alpha=8)
            g = np.random.default_rng(0)  # B away from zero, so the adapters count from the first step
            model.params.update({k: jax.numpy.asarray(g.normal(0, 0.05, v.shape), np.float32)
                                 for k, v in model.params.items() if k.endswith("lora_b")})
        # momentum SGD: a split optimizer state, without Adam's amplifying of rounding where gradients are tiny
        return train(model, rows, optimizer=optax.sgd(0.5, momentum=0.9), steps=2, clip=1.0,
                     accumulate=2 if mesh is not None else 4, mesh=mesh)

    (split, history), (whole, reference) = run(mesh), run(None)
    assert history.losses == pytest.approx(reference.losses, rel=1e-5)
    assert [s.grad_norm for s in history.steps] == pytest.approx([s.grad_norm for s in reference.steps], rel=1e-5)
    for name, value in whole.items():
        np.testing.assert_allclose(np.asarray(split[name]), np.asarray(value), rtol=1e-5, atol=1e-6, err_msg=name)
    for name, spec in (TENSOR_PARALLEL | (ADAPTERS if lora else {})).items():
        assert _spec(split[name]) == spec, name
        assert len(split[name].sharding.device_set) == 4, name


@pytest.mark.parametrize("shape,names,lora", [
    ((2, 2), ("data", "context"), False),
    pytest.param((1, 4), ("data", "context"), True, marks=pytest.mark.slow),  # the ring: the other two; LoRA on a
    ((1, 2, 2), ("data", "context", "model"), False)])                      # mesh: test_two_axis_mesh_trains_...
def test_context_axis_splits_each_rows_positions_and_trains_like_one_device(jx, tmp_path, shape, names, lora,
                                                                           monkeypatch):
    """A "context" axis: each row's positions split over its devices (rows of 24 positions
    with one to three documents, some longer than a device's share), attention as a ring passing
    keys and values round them, beside "data" (FSDP) and "model" (tensor parallel): the
    losses, gradient norms and parameters of one device taking the same rows."""
    jax, _ = jx
    import optax
    from jax.sharding import Mesh

    from linnet.jax import attention
    from linnet.jax.train import train
    from linnet.packing import context_order

    turns = []  # the ring's, as the step compiles: a block of keys from each device of the axis
    ring = attention.ring
    monkeypatch.setattr(attention, "ring", lambda *a: turns.append(a[-1]) or ring(*a))

    if len(jax.devices()) < 4:
        pytest.skip("needs four devices (tests/conftest.py sets XLA_FLAGS; it was overridden)")
    mesh, weights = Mesh(np.array(jax.devices()[:4]).reshape(shape), names), _weights(tmp_path)
    rows = _rows(8, tokens=24, seed=7)
    size = dict(zip(names, shape, strict=True))["context"]
    assert max(np.diff(r.bounds).max() for r in rows) > 24 // size  # a document wider than a device's share
    assert sorted(context_order(24, size)) == list(range(24))

    def run(mesh):
        model = nest.load(CARD, backend="jax", weights=weights, mesh=mesh)
        if lora:
            model.add_lora(["model.layers.*.self_attn.*_proj", "model.layers.*.mlp.*_proj"], rank=4, alpha=8)
            g = np.random.default_rng(0)
            model.params.update({k: jax.numpy.asarray(g.normal(0, 0.05, v.shape), np.float32)
                                 for k, v in model.params.items() if k.endswith("lora_b")})
        data = 1 if mesh is None else mesh.shape["data"]
        return train(model, rows, optimizer=optax.sgd(0.5, momentum=0.9), steps=2, clip=1.0, accumulate=4 // data,
                     mesh=mesh)

    (split, history), (whole, reference) = run(mesh), run(None)
    assert turns and set(turns) == {size}  # every layer's attention went round the ring
    assert history.losses == pytest.approx(reference.losses, rel=1e-5)
    assert [s.grad_norm for s in history.steps] == pytest.approx([s.grad_norm for s in reference.steps], rel=1e-5)
    for name, value in whole.items():
        np.testing.assert_allclose(np.asarray(split[name]), np.asarray(value), rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("axis", ["model", "context"])
def test_dpo_on_a_two_axis_mesh_equals_one_device(jx, tmp_path, axis, monkeypatch):
    """Full fine-tuning DPO steps, the rows split over "data" (a row filled out) and the
    weights over both axes, or each row's positions over "context" (a pair's answers and
    their prompt wherever the chunks put them): the losses, margins and parameters of one
    device."""
    jax, _ = jx
    import optax
    from jax.sharding import Mesh

    from linnet.jax import attention
    from linnet.jax.dpo import dpo

    mesh, weights = _mesh(jax, "Mesh"), _weights(tmp_path)
    if axis == "context":
        mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "context"))
    turns, ring = [], attention.ring
    monkeypatch.setattr(attention, "ring", lambda *a: turns.append(a[-1]) or ring(*a))
    g = np.random.default_rng(6)
    pairs = [Pair(g.integers(3, 96, 4).tolist(), g.integers(3, 96, int(g.integers(1, 6))).tolist(),
                  g.integers(3, 96, int(g.integers(1, 6))).tolist()) for _ in range(6)]

    def run(mesh):
        return dpo(nest.load(CARD, backend="jax", weights=weights), pairs, optimizer=optax.sgd(0.5), steps=2,
                   pairs_per_step=3, beta=0.5, tokens=32, mesh=mesh)

    (split, history), (whole, reference) = run(mesh), run(None)
    assert history.losses == pytest.approx(reference.losses, rel=1e-5)
    assert abs(reference.steps[1].metrics["rewards/margins"]) > 1e-3  # the second step's policy has moved
    for got, want in zip(history.steps, reference.steps):
        assert got.metrics["rewards/margins"] == pytest.approx(want.metrics["rewards/margins"], rel=1e-4, abs=1e-6)
    for name, value in whole.items():
        np.testing.assert_allclose(np.asarray(split[name]), np.asarray(value), rtol=1e-5, atol=1e-6, err_msg=name)
    if axis == "model":
        assert _spec(split["model.layers.0.self_attn.o_proj.weight"]) == ("data", "model") and not turns
    else:
        assert turns and set(turns) == {2}  # the policy's attention went round the ring


def test_grpo_over_a_context_axis_takes_one_devices_steps(jx, monkeypatch):
    """JAX GRPO with each packed row of prompts and completions split over a "context"
    axis (beside "data"): the rewards, losses and gradient norms of one device, the
    policy's log-probabilities (old, and trained) taken round the ring."""
    jax, _ = jx
    from jax.sharding import Mesh

    from linnet.jax import attention
    from tests.test_jax import _sevens_grpo

    _mesh(jax, "Mesh")
    turns, ring = [], attention.ring
    monkeypatch.setattr(attention, "ring", lambda *a: turns.append(a[-1]) or ring(*a))
    split = _sevens_grpo(1, mesh=Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "context")))
    assert turns and set(turns) == {2}
    whole = _sevens_grpo(1)
    for got, want in zip(split.steps, whole.steps, strict=True):
        assert got.metrics["reward"] == want.metrics["reward"]
        assert got.loss == pytest.approx(want.loss, rel=1e-4, abs=1e-6)
        assert got.grad_norm == pytest.approx(want.grad_norm, rel=1e-4)
        assert got.metrics["mismatch"] < 1e-4  # the engine's and the ring's log-probabilities agree


def test_loading_over_a_mesh_reads_each_devices_slice_alone(jx, tmp_path, monkeypatch):
    """nest.load(mesh=) gives the arrays a load without one gives, placed as the trainers
    place them (one axis: today's largest-axis split; two: tensor parallel), each tensor
    read a device's slice at a time and never whole."""
    jax, _ = jx
    from jax.sharding import Mesh

    from linnet.files import atomic
    from linnet.jax.sharding import part

    mesh, weights = _mesh(jax, "make_mesh"), _weights(tmp_path)
    whole = nest.load(CARD, backend="jax", weights=weights).params
    reads: dict[str, list[tuple[int, ...]]] = {}
    opened = atomic.safetensors_file

    class Counted:
        def __init__(self, f):
            self.f = f

        def keys(self):
            return self.f.keys()

        def get_tensor(self, key):
            raise AssertionError(f"{key} read whole")

        def get_slice(self, key):
            tensor = self.f.get_slice(key)

            class Slice:
                def get_shape(self):
                    return tensor.get_shape()

                def __getitem__(self, index):
                    out = tensor[index]
                    reads.setdefault(key, []).append(out.shape)
                    return out

            return Slice()

    @contextlib.contextmanager
    def counted(path, framework, **options):
        with opened(path, framework, **options) as f:
            yield Counted(f)

    monkeypatch.setattr(atomic, "safetensors_file", counted)
    split = nest.load(CARD, backend="jax", weights=weights, mesh=mesh).params
    line = Mesh(np.array(jax.devices()[:4]), ("data",))
    fsdp = nest.load(CARD, backend="jax", weights=weights, mesh=line).params
    assert list(split) == list(whole)
    for name, value in whole.items():
        np.testing.assert_array_equal(np.asarray(split[name]), np.asarray(value), err_msg=name)
        np.testing.assert_array_equal(np.asarray(fsdp[name]), np.asarray(value), err_msg=name)
        assert fsdp[name].sharding.spec == part(value, line).spec, name  # a one-axis mesh: as before
    for name, spec in TENSOR_PARALLEL.items():
        assert _spec(split[name]) == spec, name
    assert _spec(fsdp["model.embed_tokens.weight"]) == ("data", None)
    assert set(reads["model.embed_tokens.weight"]) == {(48, 16), (24, 32)}  # [96, 32] in quarters: 2x2, then rows
    assert set(reads["model.layers.0.self_attn.o_proj.weight"]) == {(16, 16), (8, 32)}  # 2x2, then 4 rows each
    random = nest.load(CARD, backend="jax", weights="random", mesh=mesh).params  # drawn whole, then placed
    assert _spec(random["model.layers.1.mlp.down_proj.weight"]) == ("data", "model")


def test_an_engine_over_a_two_axis_mesh_samples_what_a_whole_one_does(jx, tmp_path):
    """model.shard(mesh) on a ("data", "model") mesh; a policy's weights copied in keep that
    placement, and greedy sampling equals an engine on one device."""
    jax, _ = jx
    from linnet.jax.engine import Engine

    mesh, weights = _mesh(jax, "make_mesh"), _weights(tmp_path)
    policy = nest.load(CARD, backend="jax", weights=weights)
    split = Engine(nest.load(CARD, backend="jax", weights=weights).shard(mesh))
    whole = Engine(nest.load(CARD, backend="jax", weights=weights))
    placed = {k: v.sharding for k, v in split.params.items()}
    assert _spec(split.params["model.layers.0.self_attn.q_proj.weight"]) == ("model", "data")
    split.load_weights(policy)
    assert {k: v.sharding for k, v in split.params.items()} == placed
    prompts = [[5, 6, 7], [8, 9]]
    a, b = (e.sample(prompts, max_new_tokens=6, temperature=0.0) for e in (split, whole))
    assert [c.tokens for c in a] == [c.tokens for c in b]
    for x, y in zip(a, b):
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)


def test_bad_meshes_are_refused_naming_the_fix(jx):
    jax, _ = jx
    import optax
    from jax.sharding import Mesh

    from linnet.jax.train import train

    _mesh(jax, "Mesh")
    devices = np.array(jax.devices()[:4])
    model = nest.load(CARD, backend="jax", weights="random")
    for mesh in (Mesh(devices.reshape(1, 2, 2), ("data", "model", "stages")),
                 Mesh(devices.reshape(2, 2), ("data", "tensor"))):
        with pytest.raises(ValueError, match=r"'data' with 'model'.*'context'.*jax.make_mesh\(\(8, 4\)"):
            train(model, _rows(4), optimizer=optax.sgd(0.1), steps=1, mesh=mesh)
        with pytest.raises(ValueError, match="'data' with 'model'"):
            nest.load(CARD, backend="jax", weights="random", mesh=mesh)
    with pytest.raises(ValueError, match="does not cut into 8 equal chunks"):
        train(model, _rows(4, tokens=20), optimizer=optax.sgd(0.1), steps=1,
              mesh=Mesh(devices.reshape(1, 4), ("data", "context")))
    with pytest.raises(ValueError, match="mesh= places a JAX model"):
        nest.load(CARD, weights="random", mesh=Mesh(devices, ("data",)))
