"""The Llama-family decoder in JAX: pure functions over a dict of arrays keyed by the
Hugging Face checkpoint paths (the same paths as the PyTorch model), driven by a card.

    model = linnet.jax.load_model(card, weights="path/to/model", dtype="bfloat16")
    loss_sum, count = model.loss_packed(row)            # row: a linnet.packing.Packed
    logp = model.log_probs_packed(row)                  # [P]

Numerics as in PyTorch: parameters may be stored in float32 and are cast to the compute
dtype where used; norms, RoPE tables, attention scores and losses run in float32.
Attention stays inside each document of a packed row and computes only the blocks of
positions that documents reach (`linnet.jax.attention`). Shapes: P positions, D hidden,
H query heads, K kv heads, d head dim.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from linnet.cards import Card, rope_cos_sin_scale, rope_frequencies
from linnet.files.adapters import ADAPTER_SUFFIXES, check_adapter_options, write_peft
from linnet.jax.attention import attend, context_attend
from linnet.jax.lora import Params, adapted_weight, linear
from linnet.jax.loss import linear_cross_entropy, linear_token_log_probs
from linnet.packing import segments
from linnet.paths import adapted_layers, parameter_shapes

_DTYPES = {"float32": jnp.float32, "f32": jnp.float32, "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16,
           "float16": jnp.float16, "f16": jnp.float16}


def as_dtype(dtype: Any):
    """None: float32. "auto": bfloat16 on GPU and TPU; float32 on CPU, where XLA's bf16
    matmuls are no faster than f32 even on CPUs that have AMX."""
    if dtype is None:
        return jnp.float32
    if dtype == "auto":
        return jnp.bfloat16 if jax.default_backend() in ("gpu", "tpu") else jnp.float32
    try:
        return _DTYPES[str(dtype).removeprefix("torch.").removeprefix("jax.numpy.")]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use float32, bfloat16 or float16") from None


def row_arrays(batch) -> dict[str, np.ndarray]:
    """A packed row as the arrays the functions here take: tokens, targets, weights,
    positions, each position's document (`segments`), the document it also attends to
    (`shared`: its shared prompt, from `Packed.prefix`; -1 for none) and the first
    position it may attend to (`first`: its prompt's or its document's start; in the
    padding after `batch.real`, its own position, so the padding costs no attention)."""
    bounds = np.asarray(batch.bounds)
    arrays = {name: np.asarray(getattr(batch, name)) for name in ("tokens", "targets", "positions")}
    arrays["weights"] = np.asarray(batch.weights, dtype=np.float32)
    lengths = np.diff(bounds)
    arrays["segments"] = segments(bounds).astype(np.int32)
    prefix = getattr(batch, "prefix", None)
    prefix = np.full(len(lengths), -1) if prefix is None else np.asarray(prefix)
    arrays["shared"] = np.repeat(prefix, lengths).astype(np.int32)
    starts = bounds[:-1]
    first = np.repeat(np.where(prefix >= 0, starts[np.maximum(prefix, 0)], starts), lengths).astype(np.int32)
    real = int(getattr(batch, "real", bounds[-1]))
    first[real:] = np.arange(real, len(first))
    arrays["first"] = first
    return arrays


def rms_norm(x, weight, eps: float):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * x32.astype(x.dtype)


def rotate(x, cos, sin):
    """RoPE in the half-split layout; x [P, heads, d], cos and sin [P, 1, d]."""
    half = x.shape[-1] // 2
    return x * cos + jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1) * sin


def cos_sin(card: Card, positions, dtype):
    """RoPE tables [..., 1, d] for integer `positions` [...], computed in float32."""
    angles = positions[..., None].astype(jnp.float32) * rope_frequencies(card, np).astype(np.float32)
    angles = jnp.concatenate([angles, angles], axis=-1)[..., None, :]
    scale = rope_cos_sin_scale(card)
    return (jnp.cos(angles) * scale).astype(dtype), (jnp.sin(angles) * scale).astype(dtype)


def project(params: Params, card: Card, i: int, x, cos, sin, s: float, drop=None):
    """Layer i's q [..., H, d], k and v [..., K, d] of normed inputs x [..., D], q and k
    normed where the card says (Qwen3) and rotated; shared with the sampling engine.
    drop: the adapters' dropout (`linear`)."""
    c, path = card, f"model.layers.{i}.self_attn"
    lead = x.shape[:-1]
    q = linear(params, f"{path}.q_proj", x, c.qkv_bias, s, drop).reshape(*lead, c.heads, c.head_dim)
    k = linear(params, f"{path}.k_proj", x, c.qkv_bias, s, drop).reshape(*lead, c.kv_heads, c.head_dim)
    v = linear(params, f"{path}.v_proj", x, c.qkv_bias, s, drop).reshape(*lead, c.kv_heads, c.head_dim)
    if c.qk_norm:
        q = rms_norm(q, params[f"{path}.q_norm.weight"], c.norm_eps)
        k = rms_norm(k, params[f"{path}.k_norm.weight"], c.norm_eps)
    return rotate(q, cos, sin), rotate(k, cos, sin), v


def _attention(params: Params, card: Card, i: int, x, cos, sin, row: dict, s: float, drop=None):
    c = card
    P = x.shape[0]
    q, k, v = project(params, card, i, x, cos, sin, s, drop)
    attention = context_attend if "index" in row else attend  # a row split over the mesh's "context" axis
    out = attention(q.reshape(P, c.kv_heads, c.heads // c.kv_heads, c.head_dim), k, v, row)  # float32
    return linear(params, f"model.layers.{i}.self_attn.o_proj", out.reshape(P, -1).astype(x.dtype), c.o_bias, s,
                  drop)


def mlp(params: Params, card: Card, i: int, x, s: float, drop=None):
    path, bias = f"model.layers.{i}.mlp", card.mlp_bias
    gate = linear(params, f"{path}.gate_proj", x, bias, s, drop)
    return linear(params, f"{path}.down_proj", jax.nn.silu(gate) * linear(params, f"{path}.up_proj", x, bias, s, drop),
                  bias, s, drop)


def hidden(params: Params, card: Card, row: dict, dtype=jnp.float32, lora_scale: float = 0.0,
           remat: bool = False, lora_dropout: float = 0.0):
    """[P, D] final-normed hidden states of one packed row (see `row_arrays`);
    `lora_scale` weighs the adapters where `params` has them. remat=True recomputes each
    layer in backward instead of keeping its values (jax.checkpoint): a step then keeps
    each layer's input alone, for about a third more compute. lora_dropout > 0 drops the
    adapters' input, the masks drawn from the row's `lora_key` (a raw uint32[2] key)."""
    cos, sin = cos_sin(card, row["positions"], dtype)

    def layer(x, i: int):
        path = f"model.layers.{i}"
        drop = (lora_dropout, row["lora_key"]) if lora_dropout else None
        x = x + _attention(params, card, i, rms_norm(x, params[f"{path}.input_layernorm.weight"], card.norm_eps),
                           cos, sin, row, lora_scale, drop)
        return x + mlp(params, card, i, rms_norm(x, params[f"{path}.post_attention_layernorm.weight"],
                                                   card.norm_eps), lora_scale, drop)

    x = params["model.embed_tokens.weight"][row["tokens"]].astype(dtype)
    for i in range(card.layers):
        x = jax.checkpoint(layer, static_argnums=(1,))(x, i) if remat else layer(x, i)
    return rms_norm(x, params["model.norm.weight"], card.norm_eps)


def head_weight(params: Params, card: Card):
    return params["model.embed_tokens.weight" if card.tied_embeddings else "lm_head.weight"]


def loss_packed(params: Params, card: Card, row: dict, dtype=jnp.float32, lora_scale: float = 0.0,
                remat: bool = False, rows: int = 1024, lora_dropout: float = 0.0):
    """(sum of weighted token cross-entropies, sum of weights), both float32."""
    h = hidden(params, card, row, dtype, lora_scale, remat, lora_dropout)
    return linear_cross_entropy(h, head_weight(params, card), row["targets"], row["weights"], rows), \
        row["weights"].sum()


def log_probs_packed(params: Params, card: Card, row: dict, dtype=jnp.float32, lora_scale: float = 0.0,
                     remat: bool = False, rows: int = 1024, lora_dropout: float = 0.0):
    """[P] float32 log-probability of each position's target."""
    h = hidden(params, card, row, dtype, lora_scale, remat, lora_dropout)
    return linear_token_log_probs(h, head_weight(params, card), row["targets"], rows)


def rows_log_probs(params: Params, card: Card, rows: dict, dtype=jnp.float32, lora_scale: float = 0.0,
                   remat: bool = False, lora_dropout: float = 0.0):
    """[R, P] log_probs_packed of stacked rows (split over devices when the rows are)."""
    return jax.vmap(log_probs_packed, in_axes=(None, None, 0, None, None, None, None, None))(
        params, card, rows, dtype, lora_scale, remat, 1024, lora_dropout)


@dataclass
class JaxModel:
    """A card, its parameters (path -> array) and the compute dtype; the packed entries
    as methods over `params` (or parameters passed in, as a training step does)."""

    card: Card
    params: Params
    dtype: Any = jnp.float32
    lora: dict | None = None  # the add_lora settings, while adapters are in place

    def __post_init__(self):
        self._entries = {name: jax.jit(fn, static_argnums=(1, 3, 4)) for name, fn in
                         (("loss", loss_packed), ("log_probs", log_probs_packed), ("hidden", hidden))}

    @property
    def lora_scale(self) -> float:
        return self.lora["scale"] if self.lora else 0.0

    @property
    def lora_dropout(self) -> float:
        """The adapters' input dropout the trainers apply (0 without adapters)."""
        return self.lora["dropout"] if self.lora else 0.0

    def _call(self, entry: str, batch, params: Params | None):
        return self._entries[entry](self.params if params is None else params, self.card, row_arrays(batch),
                                    self.dtype, self.lora_scale)

    def add_lora(self, patterns: str | Sequence[str], rank: int = 16, alpha: float = 32, *, dropout: float = 0.0,
                 rslora: bool = False, dora: bool = False, seed: int = 0) -> list[str]:
        """Give each linear weight whose path matches an adapter (A [r, in] drawn as PEFT
        draws it, B [out, r] zero); `linnet.jax.train.train` then trains the adapters alone
        by default (dropping their input with `dropout`). Returns the adapted layer paths."""
        return add_lora(self, patterns, rank=rank, alpha=alpha, dropout=dropout, rslora=rslora, dora=dora, seed=seed)

    def loss_packed(self, batch, params: Params | None = None):
        """(sum of weighted token cross-entropies, sum of weights) of a packed row."""
        return self._call("loss", batch, params)

    def log_probs_packed(self, batch, params: Params | None = None):
        """[P] log-probability of each position's target."""
        return self._call("log_probs", batch, params)

    def hidden_packed(self, batch, params: Params | None = None):
        """[P, D] final hidden states."""
        return self._call("hidden", batch, params)

    def save_weights(self, path: str | os.PathLike, params: Params | None = None) -> None:
        """safetensors under the checkpoint names (a .safetensors path, or a directory
        that gets model.safetensors and config.json)."""
        save_weights(self.params if params is None else params, path, self.card)

    def shard(self, mesh) -> JaxModel:
        """Split the parameters over `mesh` as training splits a policy's
        (`linnet.jax.sharding`: one axis, or "data" and "model"): an Engine over this model
        then computes split over those devices (GSPMD), and `copy_weights` places what it
        takes the same way. Returns the model."""
        from linnet.jax.sharding import check_mesh, place

        self.params = place(self.params, check_mesh(mesh), self.card.head_dim)
        return self

    def copy_weights(self, source: JaxModel, params: Params | None = None) -> None:
        """Take `source`'s parameters (default its own; a training step's, split or not),
        adapters merged in (W + scale * B @ A), each placed where this model's is: split
        after `shard`, else whole on its device. An engine's model takes its policy's so."""
        if source.card != self.card:
            raise ValueError("copy_weights: the source's card differs from this model's; load both from one card")
        merged = merge_lora(source, params)
        self.params = {k: jax.device_put(v, self.params[k].sharding) if k in self.params else v
                       for k, v in merged.items()}
        self.lora = None


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
    check_adapter_options(rank=rank, shapes={n: model.params[f"{n}.weight"].shape for n in chosen})
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


def set_numerics(numerics: str | None, platform: str) -> None:
    """The matmul rounding `nest.load(numerics=)` asks for, as JAX's process-wide default
    precision: on a GPU or TPU "fast" takes XLA's default (TF32 or bf16 passes for float32
    matmuls), "exact" full float32. A CPU has one precision: nothing changes there, nor
    for None."""
    if numerics is not None and platform != "cpu":
        jax.config.update("jax_default_matmul_precision", "default" if numerics == "fast" else "highest")


def load_model(card, *, weights: str | os.PathLike | None = None, dtype=None, seed: int = 0,
               numerics: str | None = None, mesh=None) -> JaxModel:
    """The card's decoder in JAX. weights: a directory or .safetensors file; None takes the
    card's own; "random" draws N(0, 0.02) matrices (zero biases, unit norms) from `seed`.
    Parameters are kept in float32; `dtype` (default float32) is the compute dtype.
    numerics: see `linnet.nest.load`. mesh: place each parameter in its parts over the
    mesh as the trainers split it (`linnet.jax.sharding`), each device reading its own
    slice of each tensor from the safetensors files and never the whole model; random
    weights are drawn whole on the host, then placed."""
    from linnet.cards import resolve, weights_directory
    from linnet.jax.sharding import check_mesh, place

    card = resolve(card)
    if card.experts is not None:  # before any weight is read: they have no place in a dense decoder
        raise ValueError(f"card {card.name!r}: a mixture-of-experts model ({card.family}); the JAX backend "
                         "(`linnet jax`, linnet.jax) has no mixture-of-experts models yet: use the PyTorch "
                         "commands (`linnet sft`, `linnet dpo`, ...) or nest.load(card, backend='torch')")
    mesh = check_mesh(mesh)
    set_numerics(numerics, jax.default_backend())
    shapes = parameter_shapes(card)
    if isinstance(weights, str) and weights == "random":
        rng = np.random.default_rng(seed)
        params = {}
        for name, shape in shapes.items():
            if name.endswith("norm.weight"):
                params[name] = np.ones(shape, np.float32)
            elif name.endswith(".bias"):
                params[name] = np.zeros(shape, np.float32)
            else:
                params[name] = rng.normal(0.0, 0.02, shape).astype(np.float32)
        if mesh is not None:
            params = place(params, mesh, card.head_dim)
    else:
        params = _read_weights(card, weights_directory(card) if weights is None else weights, shapes, mesh)
    return JaxModel(card, {k: jnp.asarray(params[k]) for k in shapes}, as_dtype(dtype))  # in the model's order


def _read_weights(card: Card, source, shapes: dict[str, tuple[int, ...]], mesh=None) -> dict:
    """Every parameter from `source` in float32, checked as the PyTorch loader checks it:
    numpy arrays, or over `mesh` arrays in their parts, each device's part read alone
    (a slice of the tensor) and cast to float32."""
    from linnet.files.atomic import safetensors_file
    from linnet.files.weights import ignorable, locate_weights
    from linnet.jax.sharding import part

    found = locate_weights(source, shapes, card.name, skip=lambda name: ignorable(name, card.tied_embeddings))
    params: dict = {}
    for file in dict.fromkeys(file for file, _ in found.values()):
        with safetensors_file(file, "numpy") as f:
            for name, (where, key) in found.items():
                if where == file and mesh is None:
                    params[name] = f.get_tensor(key).astype(np.float32)
                elif where == file:  # each device's part alone: a slice of the tensor
                    tensor, shape = f.get_slice(key), jax.ShapeDtypeStruct(shapes[name], jnp.float32)
                    params[name] = jax.make_array_from_callback(
                        shape.shape, part(shape, mesh, name, card.head_dim),
                        lambda index, tensor=tensor: np.asarray(tensor[index], np.float32))
    return params


def save_weights(params: Params, path: str | os.PathLike, card: Card | None = None) -> None:
    """`params` as float32 safetensors under their paths (which `load_model` and the
    PyTorch model read back): a .safetensors path is one file; a directory gets
    model.safetensors and, given the card, the config.json transformers needs."""
    import json
    from pathlib import Path

    from safetensors.numpy import save_file

    from linnet.files.atomic import atomic_path, write_text

    path = Path(path)
    target = path if path.suffix == ".safetensors" else path / "model.safetensors"
    tensors = {k: np.asarray(jnp.asarray(v, jnp.float32)) for k, v in params.items()}
    with atomic_path(target) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    if target is not path and card is not None:
        config = card.hf_config()
        config["torch_dtype"] = "float32"
        write_text(path / "config.json", json.dumps(config, indent=2) + "\n")
