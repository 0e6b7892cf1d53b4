"""Where the JAX trainers put parameters and rows on a device mesh:

    mesh = jax.make_mesh((4,), ("data",))                # fully sharded data parallel
    mesh = jax.make_mesh((8, 4), ("data", "model"))      # FSDP over "data", tensor parallel over "model"
    mesh = jax.make_mesh((2, 4), ("data", "context"))    # FSDP over "data", each row's positions over "context"

A one-axis mesh (any name) splits every array along its largest axis the device count
divides, and the rows over the devices. A "context" axis beside "data" (and "model")
splits each row's positions over its devices (context parallel: attention as a ring,
`linnet.jax.attention.ring`; `context_rows` lays the row out), every weight whole across
it. A ("data", "model") mesh splits the rows over
"data" alone and lays each weight out as Megatron does over "model" (`LAYOUT`): q, k, v,
gate and up by output rows, o and down by input columns, the embedding and head by
vocabulary rows; "data" takes the weight's other dimension (FSDP). Norms stay whole on
every device; an adapter follows its weight (A [r, in] its input's axis, B [out, r] its
output's); a dimension an axis does not divide evenly (attention's in whole heads) stays
whole on that axis. XLA's partitioner (GSPMD) inserts the gathers and reductions.
"""

from __future__ import annotations

import contextlib

import numpy as np

from linnet.packing import context_order

# The mesh axis of each layer's weight [out, in] dimensions on a ("data", "model") mesh.
LAYOUT = {"q_proj": ("model", "data"), "k_proj": ("model", "data"), "v_proj": ("model", "data"),
          "o_proj": ("data", "model"), "gate_proj": ("model", "data"), "up_proj": ("model", "data"),
          "down_proj": ("data", "model"), "embed_tokens": ("model", "data"), "lm_head": ("model", "data")}
HEADS = ("q_proj", "k_proj", "v_proj", "o_proj")  # "model" splits their heads x head_dim dimension by whole heads
# Which of its weight's dimensions (0: out, 1: in; None: the adapter's rank) each of a layer's tensors has.
DIMENSIONS = {"weight": (0, 1), "bias": (0,), "lora_magnitude": (0,), "lora_a": (None, 1), "lora_b": (0, None)}


def check_mesh(mesh):
    """`mesh` as the trainers use it (None stays None): one axis, or "data" with "model",
    "context" or both; a mesh whose axes are Explicit or Manual (`jax.make_mesh`'s default)
    comes back as the same devices with Auto axes, so that GSPMD places every intermediate
    value."""
    if mesh is None:
        return None
    names = tuple(mesh.axis_names)
    if len(names) > 1 and ("data" not in names or not set(names) <= {"data", "model", "context"}
                           or len(set(names)) < len(names)):
        raise ValueError(f"mesh: axes {names}; the JAX trainers take one axis (data parallel, fully sharded) or "
                         "'data' with 'model' (tensor parallel), 'context' (context parallel) or both, e.g. "
                         "jax.make_mesh((8, 4), ('data', 'model'))")
    # Sharding in types (Explicit) would need an out_sharding on every matmul; older meshes have no axis types.
    if any(t.name != "Auto" for t in getattr(mesh, "axis_types", None) or ()):
        from jax.sharding import AxisType, Mesh

        mesh = Mesh(mesh.devices, names, axis_types=(AxisType.Auto,) * len(names))
    return mesh


def row_axis(mesh) -> str:
    """The mesh axis a step's rows are split over: "data", or a one-axis mesh's one axis."""
    return "data" if len(mesh.axis_names) > 1 else mesh.axis_names[0]


def context_size(mesh) -> int:
    """The devices each row's positions are split over: the "context" axis's, else 1."""
    return 1 if mesh is None or "context" not in mesh.axis_names else mesh.shape["context"]


def rows_sharding(mesh, dim: int = 0, positions: bool = True):
    """A NamedSharding splitting dimension `dim` of stacked rows over `row_axis` (whole on
    "model"), and the positions after it over "context" when the mesh has that axis
    (`positions`: arrays whose next dimension is a row's positions)."""
    from jax.sharding import NamedSharding, PartitionSpec

    split = ("context",) if positions and context_size(mesh) > 1 else ()
    return NamedSharding(mesh, PartitionSpec(*[None] * dim, row_axis(mesh), *split))


def in_force(mesh):
    """What a compiled step runs inside: `mesh` set in force (jax.set_mesh) where it has a
    "context" axis, whose ring (a jax.shard_map) reads it while the step compiles."""
    import jax

    return jax.set_mesh(mesh) if context_size(mesh) > 1 else contextlib.nullcontext()


def rows_shardings(rows: dict, mesh, dim: int = 0) -> dict:
    """Each array of stacked rows as `rows_sharding` places it, a row's dropout key
    (`lora_key`, not a position's) with its row."""
    return {name: rows_sharding(mesh, dim, positions=name != "lora_key") for name in rows}


def context_rows(arrays: dict, mesh) -> dict:
    """A row's arrays (`linnet.jax.model.row_arrays`, or rows of them stacked, and any other
    per-position arrays beside them) laid out for context parallel over `mesh`: the
    positions (the last axis) reordered so that each device's contiguous share is its two
    chunks (`linnet.packing.context_order`), and `index`, each position's place in the
    row, which the ring's masks read. As they are without a "context" axis."""
    size = context_size(mesh)
    if size == 1:
        return arrays
    tokens = np.asarray(arrays["tokens"])
    order = context_order(tokens.shape[-1], size)
    out = {name: np.asarray(x)[..., order] if name != "lora_key" else x for name, x in arrays.items()}
    out["index"] = np.broadcast_to(order.astype(np.int32), tokens.shape).copy()
    return out


def part(x, mesh, path: str | None = None, head_dim: int = 1):
    """A NamedSharding for `x` (an array, or anything with its shape) over `mesh` (see the
    module docstring). On a one-axis mesh, or without the parameter's `path`: split along
    its largest axis that the (data) axis divides, whole where none does. On a ("data",
    "model") mesh, the parameter at `path` as `LAYOUT` places it; attention projections
    split over "model" by whole heads of `head_dim`."""
    from jax.sharding import NamedSharding, PartitionSpec

    if "model" not in mesh.axis_names or path is None:
        axis = row_axis(mesh)
        for d in sorted(range(x.ndim), key=lambda d: -x.shape[d]):
            if x.shape[d] % mesh.shape[axis] == 0:
                return NamedSharding(mesh, PartitionSpec(*[axis if i == d else None for i in range(x.ndim)]))
        return NamedSharding(mesh, PartitionSpec())
    layer, kind = path.rsplit(".", 2)[-2:]
    if layer.endswith("norm"):
        return NamedSharding(mesh, PartitionSpec())
    if layer not in LAYOUT or kind not in DIMENSIONS:
        return part(x, mesh)
    spec = []
    for size, d in zip(x.shape, DIMENSIONS[kind]):
        axis = None if d is None else LAYOUT[layer][d]
        unit = head_dim if axis == "model" and layer in HEADS else 1
        spec.append(axis if axis is not None and size % (mesh.shape[axis] * unit) == 0 else None)
    return NamedSharding(mesh, PartitionSpec(*spec))


def place(params: dict, mesh, head_dim: int) -> dict:
    """Each parameter (path -> array) put where `part` says."""
    import jax

    return {k: jax.device_put(v, part(v, mesh, k, head_dim)) for k, v in params.items()}


def place_like(tree, params: dict, mesh, head_dim: int):
    """Every array of `tree` (an optimizer's state) placed as the parameter its path names
    (a momentum as its weight), the rest (a step count) as `part` places an unnamed array:
    placed as the compiled step returns them, so the second step does not compile again."""
    import jax

    def put(keys, x):
        names = [k.key for k in keys if isinstance(k, jax.tree_util.DictKey) and k.key in params]
        return jax.device_put(x, part(x, mesh, names[-1] if names else None, head_dim)) \
            if isinstance(x, jax.Array) else x

    return jax.tree_util.tree_map_with_path(put, tree)

