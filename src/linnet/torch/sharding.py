"""fully_shard: split a decoder's parameters, gradients and optimizer state across the
processes (FSDP), with PyTorch's FSDP2 doing the gathering and reducing.

    parallel.join()                    # under torchrun
    model = nest.load(card, device=..., trainable=True)
    fully_shard(model)                 # parts in f32, gathered in the model's dtype
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    train(model, pack(examples_of_this_process, tokens=4096), optimizer=optimizer, steps=1000)

Each block is one FSDP unit, gathered just before it runs and dropped after (and gathered
again in backward); the embedding, final norm and head form the root unit, gathered for
the packed entries (registered as FSDP forward methods, since trainers call those rather
than `forward`). Gradients are reduced into the parts in float32 and *summed*, not
averaged: every process already divides its loss by the step's global count of learned
positions, so the sum is the mean over every token.

LoRA adapters stay whole on every process (FSDP ignores them); `reduce_gradients` sums
their gradients as it does without sharding, and the frozen weights they adapt are split
in their own dtype, with no float32 copy. An NF4 base (QLoRA, quantize="nf4") is split as
its packed 4-bit codes, gathered as bytes and dequantized by each layer as it runs; the
small quantization state (one absmax per 64 weights) stays whole on every process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from linnet.files.adapters import ADAPTER_SUFFIXES
from linnet.torch.quantize import move_states

# The methods trainers call in place of forward: each gathers the root unit's parameters.
ENTRIES = ("loss_packed", "log_probs_packed", "hidden_packed")


def fully_shard(model, *, mesh=None, reshard_after_forward: bool = True, entries: tuple[str, ...] = ENTRIES):
    """Shard `model` (a linnet Decoder, adapters added first) over `mesh` (default: every
    process of the group). Call after add_lora and before building the optimizer;
    returns the model, changed in place. `entries`: the methods that gather the root unit
    (embedding, final norm, head) as `forward` would (a pipeline stage's `stage_pass`)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, register_fsdp_forward_method
    from torch.distributed.fsdp import fully_shard as fsdp

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("fully_shard needs a process group: run under torchrun and call "
                           "linnet.torch.distributed.join() (or torch.distributed.init_process_group) first")
    if isinstance(model, FSDPModule):
        raise ValueError("fully_shard: this model is sharded already")
    adapters = {p for name, p in model.named_parameters() if name.endswith(ADAPTER_SUFFIXES)}
    experts = {p for p in model.parameters()  # split by expert_parallel already: each process keeps its own
               if isinstance(p, DTensor) and "expert" in (p.device_mesh.mesh_dim_names or ())}
    options = dict(mesh=mesh, ignored_params=(adapters | experts) or None,
                   mp_policy=MixedPrecisionPolicy(param_dtype=model.dtype, reduce_dtype=torch.float32))
    for block in model.model.layers:
        fsdp(block, reshard_after_forward=reshard_after_forward, **options)
    fsdp(model, **options)
    for name in entries:
        register_fsdp_forward_method(model, name)
    # FSDP moved its parts and the buffers to the mesh's device (a model loaded on the CPU to
    # its GPU); the adapters it ignores and an NF4 weight's quantization state go along
    for p in adapters:
        p.data = p.data.to(model.device)
    for layer in model.modules():
        if getattr(layer, "quant_state", None) is not None:
            move_states(layer, model.device)
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum
    return model


def copies_mesh(split):
    """The mesh of the processes holding this process's part of a split model in the other
    copies: the "copies" dimension of the mesh `split` (mesh["split"]) was taken from, as
    FSDP wants the two from one mesh; with a "context" dimension of more than one process,
    the two flattened into one ("copies_context"), so that the reduce-scatter of each part's
    gradient sums the context group's positions too."""
    root = split._get_root_mesh()
    names = root.mesh_dim_names or ()
    if "copies" not in names:
        raise ValueError("fully_shard with tensor_parallel: take the split's mesh from one mesh with a 'copies' "
                         "dimension, e.g. init_device_mesh(..., mesh_dim_names=('copies', 'split'))['split']")
    if "context" in names and root["context"].size() > 1:
        return root["copies", "context"]._flatten("copies_context")
    return root["copies"]


def is_sharded(model: torch.nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in model.parameters())


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a possibly sharded (DTensor) one; every process must call
    this together for a sharded tensor."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def local(t: torch.Tensor) -> torch.Tensor:
    """This process's part of a sharded tensor, or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    """F.dropout(x, p) in training, also for a split model's DTensor input: there the mask
    is drawn at the whole tensor's shape and each process keeps its part. The processes of a
    split share their RNG state and run the same rows, so they draw the same mask: equal
    where x is replicated, one whole mask where x is split (on a CPU, the very mask F.dropout
    draws in one process). DTensor's own random ops coordinate processes only on CUDA."""
    if not isinstance(x, DTensor):
        return F.dropout(x, p)
    keep = torch.empty(x.shape, dtype=x.dtype, device=x.device).bernoulli_(1 - p).div_(1 - p)
    for axis, placement in enumerate(x.placements):
        if placement.is_shard():
            keep = keep.chunk(x.device_mesh.size(axis), dim=placement.dim)[x.device_mesh.get_local_rank(axis)]
    return DTensor.from_local(x.to_local() * keep, x.device_mesh, x.placements, run_check=False)


def tensor_parallel(model, mesh, *, sequence: bool = False):
    """Split every block's projections across the processes of `mesh` (a one-dimension
    DeviceMesh, e.g. mesh["split"] of a ("copies", "split") mesh): q, k, v, gate and up by
    output rows, o and down by input columns (PyTorch's ColwiseParallel / RowwiseParallel),
    so each process holds 1/size of every block's weights and computes its share of the
    heads and of the MLP. A head tied to the embedding is untied first: it starts as a copy
    of the embedding and trains apart from it (the model's card becomes untied, so saved
    weights load back as such). The head, its vocabulary divisible, is split by vocabulary
    rows, its losses combining each row's maximum, sum and target logit across the
    processes (linnet.torch.losses.split_cross_entropy), never the logits. The embedding
    and norms stay whole. The processes of a split take the same batches; `model.copies`
    is then the group of processes holding the same part in other copies, across which
    `train` sums gradients and counts.

    sequence=True (sequence parallel): between the split projections each process holds
    its share of the row's positions, whole, and runs the blocks' norms on those; the
    positions are gathered before q, k, v and the MLP, and the output projections'
    partial sums are summed and scattered at once (all-gather and reduce-scatter in place
    of one all-reduce), so the norms' and the residual stream's activations are split too.
    A row's length must then divide by the split's size."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    size = mesh.size()
    c = model.card
    for name, count in (("heads", c.heads), ("kv_heads", c.kv_heads), ("intermediate", c.intermediate)):
        if count % size:
            raise ValueError(f"tensor_parallel: card {c.name!r} has {name}={count}, which {size} processes "
                             "cannot split evenly")
    if model.lora or is_sharded(model):
        raise ValueError("tensor_parallel: load the model whole and unadapted; adapters on a split model are "
                         "not supported yet")
    plan = {f"self_attn.{n}_proj": ColwiseParallel() for n in ("q", "k", "v")}
    plan.update({"self_attn.o_proj": RowwiseParallel(), "mlp.gate_proj": ColwiseParallel(),
                 "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()})
    if sequence:  # Attention.forward's other five arguments are not tensors to place
        gather = {"self_attn": (Shard(0), None, None, None, None, None), "mlp": (Shard(0),)}
        plan.update({name: PrepareModuleInput(input_layouts=ins, desired_input_layouts=(Replicate(), *ins[1:]),
                                              use_local_output=True) for name, ins in gather.items()})
        plan.update({n: SequenceParallel(sequence_dim=0, use_local_output=True)
                     for n in ("input_layernorm", "post_attention_layernorm")})
        plan.update({n: RowwiseParallel(output_layouts=Shard(0)) for n in ("self_attn.o_proj", "mlp.down_proj")})
    for block in model.model.layers:
        parallelize_module(block, mesh, plan)
        heads, kv_heads, d = block.self_attn.shape
        block.self_attn.shape = (heads // size, kv_heads // size, d)  # this process's heads
    if c.tied_embeddings:
        model.untie_head()
    if c.vocab % size == 0 and hasattr(model, "lm_head"):  # by vocabulary rows (losses: split_*); a stage may hold none
        from torch.distributed.tensor import Shard, distribute_tensor

        weight = model.lm_head.weight
        model.lm_head.weight = torch.nn.Parameter(distribute_tensor(weight.detach(), mesh, [Shard(0)]),
                                                  requires_grad=weight.requires_grad)
    model.copies = copies_group(mesh)
    model.split = mesh
    model.sequence = mesh if sequence else None
    return model


def scatter_positions(x: torch.Tensor, mesh) -> torch.Tensor:
    """This process's equal share of x's positions (its first dimension), whole on every
    process of a sequence-parallel split; the shares' gradients are gathered in backward."""
    from torch.distributed.tensor import Replicate, Shard

    if x.shape[0] % mesh.size():
        raise ValueError(f"sequence parallel: {x.shape[0]} positions do not split into {mesh.size()} equal shares; "
                         f"pack rows whose positions (each context-parallel process's share of them) are a "
                         f"multiple of {mesh.size()} (training.context_length)")
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(0)]).to_local()


def gather_positions(x: torch.Tensor, mesh) -> torch.Tensor:
    """Every process's share of the positions, joined: `scatter_positions` undone. Each
    process's gradient for the whole must already be the whole's (the split head sums its
    parts' in `split_input`): backward keeps this process's share of it."""
    from torch.distributed.tensor import Replicate, Shard

    return DTensor.from_local(x, mesh, [Shard(0)], run_check=False).redistribute(mesh, [Replicate()]).to_local()


class _SplitSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, parts_use_it: bool):
        ctx.group, ctx.parts_use_it = group, parts_use_it
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        if ctx.parts_use_it:
            grad = grad.clone()
            dist.all_reduce(grad, group=ctx.group)
        return grad, None, None


class _SplitInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def split_sum(x: torch.Tensor, group, *, parts_use_it: bool = False) -> torch.Tensor:
    """x summed over the processes of a split, each holding a part of the sum (over its rows
    of the vocabulary, say). In backward, when every process computes the same loss from the
    sum, each part's gradient is the sum's as it is; when each process goes on to use the
    sum in its own part of the computation (parts_use_it: a log-softmax's normaliser over
    its rows), the processes' gradients for it are summed."""
    return _SplitSum.apply(x, group, parts_use_it)


def split_input(x: torch.Tensor, group) -> torch.Tensor:
    """x, whole on every process of a split, as the input of its split parts (a head split
    by vocabulary): each part's gradient for x is summed over the split in backward."""
    return _SplitInput.apply(x, group)


def copies_group(*meshes):
    """The process group of the ranks at this rank's place in every copy: the same local
    rank in each of `meshes` (a split's, a pipeline's stages, or both); this rank alone
    when there is one copy."""
    place = tuple(m.get_local_rank() for m in meshes)
    places: list = [None] * dist.get_world_size()
    dist.all_gather_object(places, place)
    groups = {p: dist.new_group([r for r, q in enumerate(places) if q == p])  # every rank makes every group
              for p in sorted(set(places))}
    return groups[place]


def split_mesh(model):
    """The mesh over which tensor_parallel split `model`'s blocks, None when it is not
    split (parts sharded by fully_shard are not a split: each copy takes its own rows)."""
    return getattr(model, "split", None)


def copy_first(model, compute):
    """compute() on the first process of `model`'s copy alone (the first of a split, of a
    pipeline's first stage, of a context group), its value on every process of the copy, which must all train
    on the same rows: what one samples, say, when engines on several devices need not draw
    alike. compute() itself for a model neither split nor pipelined."""
    if getattr(model, "copies", None) is None:
        return compute()
    split = split_mesh(model)
    pipe = getattr(model, "pipe", None)
    context = getattr(model, "context", None)  # the processes that split each row's positions
    first = (split is None or split.get_local_rank() == 0) and (pipe is None or pipe.first) and (
        context is None or dist.get_rank(context) == 0)
    box = [compute() if first else None]
    if split is not None:  # across each stage's split: the first stage's value, None on the others
        dist.broadcast_object_list(box, group=split.get_group(), group_src=0)
    if context is not None:
        dist.broadcast_object_list(box, group=context, group_src=0)
    if pipe is not None:  # along each pipeline from its first stage
        dist.broadcast_object_list(box, group=pipe.group, group_src=0)
    return box[0]
