"""Low-rank adapters (LoRA, Hu et al. 2021, arXiv:2106.09685): adding, merging and saving
them. The layer that computes with them is `linnet.torch.model.Linear`.

A matching linear layer computes x @ W.T + (x @ A.T) @ B.T * alpha / rank with A [r, in]
and B [out, r] stored beside W as `<layer>.lora_a` and `<layer>.lora_b`. B starts at
zero, so a fresh adapter leaves the model unchanged. rsLoRA (Kalajdzievski 2023,
arXiv:2312.03732) scales by alpha / sqrt(rank) instead, which keeps the update's size
steady as the rank grows; DoRA (Liu et al. 2024, arXiv:2402.09353) adds a trained
magnitude per output row.

The adapters save in PEFT's format (`linnet.files.adapters`): an adapter directory written
here loads with `peft.PeftModel.from_pretrained`, and one written by PEFT loads with
`bind_weights`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from linnet.files.adapters import ADAPTER_SUFFIXES, ADAPTERS, MAGNITUDES, check_adapter_options, write_peft
from linnet.paths import CRITIC, adapted_layers
from linnet.torch.distributed import merged_at_first, world
from linnet.torch.quantize import is_quantized
from linnet.torch.sharding import full, is_sharded


def _linears(model) -> dict[str, nn.Linear]:
    """The decoder's linear layers (linnet.torch.model.Linear, an nn.Linear with adapter slots)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def add_lora(model, patterns: str | Sequence[str], *, rank: int = 16, alpha: float = 32,
             dropout: float = 0.0, rslora: bool = False, dora: bool = False) -> list[str]:
    """Add adapters to the linear layers whose weight path (or layer path) matches one
    of `patterns` (globs, PEFT's target_modules names such as "q_proj", or "all-linear":
    linnet.paths.target_matches); freeze everything else. A rank larger than an adapted
    layer's smaller side is refused. dora=True adds DoRA's trainable magnitude per
    output row (Liu et al. 2024, arXiv:2402.09353), starting at each row's norm. In a
    mixture of experts the patterns also pick the experts' stacked tensors
    (`model.layers.*.mlp.experts.gate_up_proj`, `down_proj`, as PEFT's target_parameters
    name them; all-linear takes them too): one low-rank pair an expert
    (linnet.torch.moe.ExpertWeights). Returns the adapted linear layers' paths."""
    check_adapter_options(rank=rank, dropout=dropout)
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        raise ValueError("add_lora: this model is sharded (fully_shard), which wants its adapters first; add them "
                         "before sharding, or load with nest.load(..., lora=dict(patterns=...), fully_shard=True)")
    linears = {n: m for n, m in _linears(model).items() if n != "lm_head"}
    stacks = _expert_stacks(model)
    picked = adapted_layers(list(linears) + list(stacks), patterns)
    chosen = [n for n in picked if n in linears]
    stacked = [n for n in picked if n in stacks]
    if stacked:
        _add_expert_adapters(stacks, stacked, rank, alpha / math.sqrt(rank) if rslora else alpha / rank, dropout, dora)
    check_adapter_options(rank=rank, shapes={n: (linears[n].out_features, linears[n].in_features) for n in chosen})
    scale = alpha / math.sqrt(rank) if rslora else alpha / rank
    shapes = model.card.linear_shapes()
    every = [n for n in adapted_layers([f"model.layers.{i}.{suffix}" for i in range(model.card.layers)
                                        for suffix in shapes] + list(stacks), patterns) if n not in stacks]
    cut = any(name not in linears for name in every)  # a pipeline stage's blocks alone
    device = next(iter(linears.values())).weight.device
    for name in every if cut else chosen:
        layer = linears.get(name)
        if layer is None:  # another pipeline stage's: drawn and dropped, so each stage holds what one process would
            _draw(shapes[name.split(".", 3)[3]], rank, device)
            continue
        if layer.lora_a is not None:
            raise ValueError(f"add_lora: {name} already has an adapter; merge_lora() first")
        a, b = _draw((layer.out_features, layer.in_features), rank, layer.weight.device)
        # split by tensor_parallel (a pipeline's stages also have copies, but whole weights; sharded ones refused above)
        split = getattr(model, "copies", None) is not None and isinstance(layer.weight, DTensor)
        if split:
            a, b = _split_like(layer.weight, a, b)
        layer.lora_a, layer.lora_b = torch.nn.Parameter(a), torch.nn.Parameter(b)
        layer.lora_scale, layer.lora_dropout = scale, dropout
        if dora:
            if layer.weight.is_meta:  # a model built on meta: the magnitudes come with its weights (draw_adapters)
                norms = torch.empty(layer.out_features, device="meta")
            else:
                norms = _row_norms(layer)
                if split:  # one per output row, placed as B's rows are (a column-split weight's sums joined)
                    norms = norms.redistribute(placements=layer.lora_b.placements)
            layer.lora_magnitude = torch.nn.Parameter(norms)
    model.lora = dict(rank=rank, alpha=alpha, dropout=dropout, rslora=rslora, layers=chosen, dora=dora,
                      **({"experts": stacked} if stacked else {}))
    model.set_trainable(ADAPTERS + ([MAGNITUDES] if dora else []))
    return chosen


def _expert_stacks(model) -> dict[str, tuple[nn.Module, str]]:
    """A mixture of experts' stacked tensors by path -> (their module, the tensor's name)."""
    from linnet.torch.moe import STACKED, ExpertWeights

    return {f"{prefix}.{name}": (m, name) for prefix, m in model.named_modules() if isinstance(m, ExpertWeights)
            for name in STACKED}


def _add_expert_adapters(stacks: dict, paths: list[str], rank: int, scale: float, dropout: float,
                         dora: bool) -> None:
    """Adapters on the stacked experts' tensors at `paths` (of `_expert_stacks`)."""
    if dropout or dora:
        raise ValueError("add_lora: the experts' adapters take no dropout and no DoRA (as PEFT's adapters of stacked "
                         "parameters); set lora.dropout=0 and lora.dora=false, or adapt the attention alone "
                         "(lora.targets: [model.layers.*.self_attn.*_proj])")
    check_adapter_options(rank=rank, shapes={p: stacks[p][0].shapes[stacks[p][1]][1:] for p in paths})
    for module in {id(m): m for m, _ in stacks.values()}.values():
        targets = [name for m, name in (stacks[p] for p in paths) if m is module]
        if targets:
            module.adapt(targets, rank, scale)


def _draw(shape: tuple[int, int], rank: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A fresh adapter's A (PEFT's default init, from the global RNG; nothing drawn on meta)
    and B (zeros), whole, for a layer of `shape` (out, in) features (an NF4 weight's own
    shape is its packed bytes')."""
    a = torch.empty(rank, shape[1], device=device)
    torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5))
    return a, torch.zeros(shape[0], rank, device=device)


def _row_norms(layer: nn.Linear, whole=lambda t: t) -> torch.Tensor:
    """DoRA's starting magnitudes: the norm of each output row of the base weight."""
    with torch.no_grad():
        return torch.linalg.vector_norm(layer.dense_weight(whole).float(), dim=1)


def draw_adapters(model, device) -> None:
    """Give the adapters add_lora placed on a whole model still on meta (before fully_shard
    split it or a pipeline cut it) their values once its weights are filled: the draws
    add_lora makes on the whole filled model, in its order (a mixture of experts' stacked
    tensors first; another stage's layers drawn and dropped, so every stage holds what one
    process would), and DoRA's magnitudes from the filled weights (a split one gathered a
    layer at a time; every process calls this together)."""
    for experts in _adapted_experts(model).values():  # drawn first, as add_lora draws them
        if experts.targets:
            experts.redraw(device)
    linears, shapes = _linears(model), model.card.linear_shapes()
    for name in model.lora["layers"]:
        layer = linears.get(name)
        if layer is None:  # another stage's
            _draw(shapes[name.split(".", 3)[3]], model.lora["rank"], device)
            continue
        layer.lora_a.data, layer.lora_b.data = _draw((layer.out_features, layer.in_features), model.lora["rank"],
                                                     device)
        if layer.lora_magnitude is not None:
            layer.lora_magnitude.data = _row_norms(layer, _whole)


def _split_like(weight, a, b):
    """A and B placed to match a split weight: beside one split by output rows
    (ColwiseParallel) B is split the same way and A whole; beside one split by input
    columns (RowwiseParallel) A is split by its columns and B whole, so x @ A.T is a partial
    sum that joins the layer's own before the one all-reduce. A is drawn whole and sent
    from the first process of the split, so every process holds the same draw."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    by_rows = weight.placements[0] == Shard(0)
    return (distribute_tensor(a, weight.device_mesh, [Replicate() if by_rows else Shard(1)]),
            distribute_tensor(b, weight.device_mesh, [Shard(0) if by_rows else Replicate()]))


def merge_lora(model) -> None:
    """Fold every adapter into its weight (W + scale * B @ A in float32, DoRA's rows
    rescaled to their magnitudes), then drop the adapters. An NF4 base (QLoRA) is
    dequantized first, every layer of it: the adapters were trained against the
    dequantized weights, not the original ones, and the merged model is a plain one."""
    if is_sharded(model):
        raise ValueError("merge_lora: this model is sharded (fully_shard); save the adapters (save_to=) and "
                         "merge them on one process, into a model loaded whole")
    for experts in _adapted_experts(model).values():
        with torch.no_grad():
            plain = {name: experts.merged(name) for name in experts.altered()}
            for name, weight in plain.items():
                if name in (experts.quant_state or {}):
                    setattr(experts, name, nn.Parameter(weight.to(model.dtype), requires_grad=False))
                else:
                    getattr(experts, name).copy_(weight)
        experts.drop_adapters()
        experts.quant_state = None
    for layer in _linears(model).values():
        with torch.no_grad():
            merged = layer.dense_weight() if layer.lora_a is None else layer.merged_weight()
            if is_quantized(layer):
                layer.weight = nn.Parameter(merged.to(model.dtype), requires_grad=False)
                layer.quant_state = None
            elif layer.lora_a is not None:
                layer.weight.copy_(merged.to(layer.weight.dtype))
        if layer.lora_a is None:
            continue
        del layer.lora_a, layer.lora_b, layer.lora_magnitude
        layer.lora_a = layer.lora_b = layer.lora_magnitude = None
    model.lora = None


def save_peft(model, directory: str | os.PathLike, *, base_model: str | None = None) -> None:
    """Write a PEFT adapter directory: adapter_config.json + adapter_model.safetensors.
    A split or pipelined model's adapters are gathered first: every process calls this,
    the first writes. Its base (base_model_name_or_path) is the card's weights, or, for a
    model loaded from a finished run, that run: these adapters go over its adapters."""
    if not getattr(model, "lora", None):
        raise ValueError("save_peft: the model has no adapters; call add_lora first")
    adapters = {n: full(p).detach().to("cpu", torch.float32).numpy() for n, p in model.named_parameters()
                if n.endswith(ADAPTER_SUFFIXES) and not n.startswith(CRITIC)}
    if getattr(model, "pipe", None) is not None:  # each stage holds its own blocks' adapters
        adapters = merged_at_first(adapters)
    if world()[0] == 0:
        card = model.card  # a run's model (its adapters folded into the base) is the base of these adapters
        write_peft(directory, adapters, model.lora,
                   base_model or (card.source if card.adapters else card.weights.repo or card.weights.path))


def _adapted_experts(model) -> dict[str, nn.Module]:
    """The mixture-of-experts blocks' stacked tensors that carry adapters or NF4 codes, by
    module path."""
    from linnet.torch.moe import ExpertWeights

    return {name: m for name, m in model.named_modules() if isinstance(m, ExpertWeights) and m.altered()}


def policy_weights(policy: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter, nn.Module | None]]:
    """(name, parameter, its layer if adapted or NF4 (or its experts, adapted or NF4), else None)
    for each of a policy's weights, by Hugging Face name, the adapters' own tensors and a
    PPO critic left out: what an engine copies in and an export writes."""
    adapted = {f"{name}.weight": m for name, m in policy.named_modules()
               if isinstance(m, nn.Linear) and (m.lora_a is not None or is_quantized(m))}
    adapted.update({f"{name}.{t}": m for name, m in _adapted_experts(policy).items() for t in m.altered()})
    for name, p in policy.named_parameters():
        if not name.endswith(ADAPTER_SUFFIXES) and not name.startswith(CRITIC):
            yield name, p, adapted.get(name)


def merged(weight: torch.nn.Parameter, layer: nn.Linear | None) -> torch.Tensor:
    """The plain weight the policy computes with: an adapted layer's merged in float32
    (`Linear.merged_weight`), an NF4 one dequantized, a sharded one gathered (every
    process must call this together)."""
    if layer is None:
        return _whole(weight)
    if not isinstance(layer, nn.Linear):  # adapted experts: the stacked tensor this weight is
        return layer.merged(next(t for t in layer.altered() if getattr(layer, t) is weight))
    return layer.dense_weight(_whole) if layer.lora_a is None else layer.merged_weight(_whole)


def _whole(t: torch.Tensor) -> torch.Tensor:
    return full(t.detach())


def merged_weights(model) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, plain weight) of every weight `model` computes with, the model unchanged: each
    adapted layer's W + scale * B @ A (DoRA's rows rescaled) in float32, NF4 dequantized,
    sharded or split tensors gathered (every process iterates together)."""
    for name, p, layer in policy_weights(model):
        yield name, merged(p, layer)


def take_adapters(model) -> dict:
    """Take `model`'s adapters off (each adapted layer's A, B, DoRA magnitude, scale and
    dropout, and `model.lora`), leaving the frozen base; `put_adapters` puts them back.
    Several adapters' runs share one base this way (linnet.commands.adapters): the same
    Parameter objects go back, so each run's optimizer keeps training its own."""
    layers = {}
    for name, layer in _linears(model).items():
        if layer.lora_a is not None:
            layers[name] = (layer.lora_a, layer.lora_b, layer.lora_magnitude, layer.lora_scale, layer.lora_dropout)
            layer.lora_a = layer.lora_b = layer.lora_magnitude = None
    taken = {"lora": model.lora, "layers": layers}
    model.lora = None
    return taken


def put_adapters(model, taken: dict) -> None:
    """Put back adapters `take_adapters` took off a model that holds none now."""
    if getattr(model, "lora", None):
        raise ValueError("put_adapters: the model holds adapters already; take them off first")
    linears = _linears(model)
    for name, (a, b, magnitude, scale, dropout) in taken["layers"].items():
        layer = linears[name]
        layer.lora_a, layer.lora_b, layer.lora_magnitude = a, b, magnitude
        layer.lora_scale, layer.lora_dropout = scale, dropout
    model.lora = taken["lora"]
