"""Building a Decoder from a card (`linnet.nest.load`): on meta, cut into its pipeline stage,
split across its tensor-parallel processes or sharded (FSDP) there, then filled a weight at a time from
files or a seeded draw (each process allocating only its part), NF4 blocks quantized as
they are filled; the compute dtype and the matmul numerics it runs with."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from linnet import hardware
from linnet.cards import Card
from linnet.files.adapters import check_adapter_options
from linnet.torch import attention as attention_paths
from linnet.torch.model import Decoder, Linear, rope_frequencies
from linnet.torch.moe import STACKED, ExpertWeights
from linnet.torch.quantize import QUANTIZE, quantize_into
from linnet.torch.sharding import copies_mesh
from linnet.torch.sharding import fully_shard as shard
from linnet.torch.sharding import tensor_parallel as split
from linnet.torch.weights import as_dtype


def compute_dtype(dtype, device: torch.device, card: Card) -> torch.dtype:
    """The dtype a model computes in. None: the card's on CUDA, float32 elsewhere. "auto":
    bfloat16 where the device multiplies it natively (CUDA with bf16; a CPU with AMX or
    AVX-512 BF16, read from its flags), else float32. An explicit bfloat16 on a CPU that
    emulates it runs, with a warning: it is about 20x slower there than float32."""
    if dtype == "auto":
        native = torch.cuda.is_bf16_supported() if device.type == "cuda" else (
            device.type == "cpu" and hardware.cpu_prefers_bf16())
        return torch.bfloat16 if native else torch.float32
    dtype = as_dtype(card.dtype if device.type == "cuda" else "float32") if dtype is None else as_dtype(dtype)
    if dtype == torch.bfloat16 and device.type == "cpu" and hardware.cpu_bf16_flag() is None:
        warnings.warn(f"dtype bfloat16 on a CPU without {' or '.join(hardware.BF16_FLAGS)}: bfloat16 is emulated "
                      f"here, about {hardware.EMULATED_BF16_SLOWDOWN}x slower than float32 on an SFT-LoRA step. "
                      "Use dtype 'auto' (float32 here) or float32", stacklevel=4)
    return dtype


def usable_device(name, where: str = "device") -> torch.device:
    """The torch device `name` names (None: CUDA when present, else the CPU), refused in
    one line naming `where` when linnet cannot compute on it here: a name torch does not
    know (tpu), a kind other than cpu and cuda (mps, xla, meta), CUDA where none is
    visible, or a CUDA index past the devices there are (cuda:7 on a one-GPU machine)."""
    if isinstance(name, torch.device):
        device = name
    else:
        try:
            device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
        except (RuntimeError, ValueError, TypeError):
            raise ValueError(f"{where}={name}: not a device name; use cpu, cuda or cuda:N (null: cuda when "
                             "present)") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{where}={name}: linnet computes on cpu or cuda (cuda:N); {device.type} is not supported "
                         "yet")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{where}={name}: no CUDA device is visible here; use cpu, or null (CUDA when present)")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            there = "cuda:0" if count == 1 else f"cuda:0 to cuda:{count - 1}"
            raise ValueError(f"{where}={name}: this machine shows {count} CUDA device{'s' * (count > 1)} ({there}); "
                             "use one of them, or null")
    return device


def set_numerics(numerics: str | None, device: torch.device) -> None:
    """The matmul rounding `nest.load(numerics=)` asks for, as torch's process-wide flags:
    on CUDA "fast" computes float32 matmuls in TF32 and lets bf16/fp16 matmuls sum partial
    products in their own dtype; "exact" keeps both in float32. A CPU has one precision:
    nothing changes there, nor for None."""
    if numerics is None or device.type != "cuda":
        return
    fast = numerics == "fast"
    torch.set_float32_matmul_precision("high" if fast else "highest")
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = fast
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = fast


def _check_quantize(quantize, *, trainable, tensor_parallel, pipeline, compile) -> None:
    if quantize not in QUANTIZE:
        raise ValueError(f"quantize={quantize!r}: the one supported form is 'nf4' (QLoRA's 4-bit NormalFloat)")
    if trainable is not False:
        raise ValueError("quantize='nf4' freezes the base: load with trainable=False and train adapters "
                         "(lora=, or model.add_lora)")
    if tensor_parallel is not None or compile:
        raise ValueError(f"quantize='nf4' with {'tensor_parallel' if tensor_parallel is not None else 'compile'} is "
                         "not supported yet; load the quantized model eager, whole, sharded (fully_shard) or cut "
                         "into pipeline stages")


LORA_OPTIONS = ("patterns", "rank", "alpha", "dropout", "rslora", "dora")  # linnet.torch.lora.add_lora's


def _check_lora(lora, trainable) -> None:
    if not isinstance(lora, dict) or "patterns" not in lora or set(lora) - set(LORA_OPTIONS):
        raise ValueError(f"lora={lora!r}: a dict of add_lora's arguments, 'patterns' and any of "
                         f"{', '.join(LORA_OPTIONS[1:])}, e.g. dict(patterns='*_proj.weight', rank=16)")
    if trainable is not False:
        raise ValueError("lora= trains the adapters alone: leave trainable=False")
    check_adapter_options(rank=lora.get("rank"), dropout=lora.get("dropout"))  # before any weight is read


def nf4_layout(model: Decoder) -> None:
    """Give every block's linear layer (and stacked experts' tensor) of a model on meta the
    place of its NF4 codes (uint8, the packed 4-bit pairs, as linnet.torch.quantize.nf4
    makes them; a row an expert), so a split (FSDP) divides the codes and loading
    quantizes each weight as it arrives."""
    def codes(*shape):
        return nn.Parameter(torch.empty(*shape, dtype=torch.uint8, device="meta"), requires_grad=False)

    for layer in model.model.layers.modules():
        if isinstance(layer, Linear):
            layer.weight = codes((layer.out_features * layer.in_features + 1) // 2, 1)
        elif isinstance(layer, ExpertWeights):
            for name in STACKED:
                count, out, inputs = getattr(layer, name).shape
                setattr(layer, name, codes(count, (out * inputs + 1) // 2))


def _random_values(model: Decoder, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Deterministic init from `seed`, the same on every device: N(0, 0.02) for matrices,
    zeros for biases, ones for norms; drawn on the CPU in parameter order."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            yield name, torch.ones(p.shape)
        elif name.endswith(".bias"):
            yield name, torch.zeros(p.shape)
        else:
            yield name, torch.empty(p.shape).normal_(0.0, 0.02, generator=g)


def _fill(model: Decoder, values: Iterator[tuple[str, torch.Tensor]], device: torch.device,
          also: dict[str, str] | None = None) -> None:
    """Allocate each parameter of a model built on meta on `device` as its value arrives (in
    parameter order) and copy the value in, or a split parameter's (DTensor's) slice of it;
    a value the model holds no place for (another pipeline stage's) is passed over, and
    `also` names a second parameter that takes the same value (a head untied from the
    embedding). A weight whose place holds NF4 codes (`nf4_layout`) is quantized as it
    arrives, whole, before any split: loading holds the codes and one weight in the compute
    dtype, never a block of them."""
    owners = {f"{prefix}.{name}".lstrip("."): (module, name)
              for prefix, module in model.named_modules() for name, _ in module.named_parameters(recurse=False)}
    with torch.no_grad():
        for path, value in values:
            for held in (path, *([also[path]] if also and path in also else [])):
                if held not in owners:
                    continue
                module, name = owners[held]
                if getattr(module, name).is_meta:
                    module.to_empty(device=device, recurse=False)
                param, part = getattr(module, name), value
                if param.dtype == torch.uint8:  # NF4 codes: the layer keeps their state whole
                    part = quantize_into(module, name, value.to(device), model.dtype)
                if isinstance(param, DTensor):  # split: this process's slice of the whole value
                    mesh = param.device_mesh
                    for axis, place in enumerate(param.placements):
                        if place.is_shard():
                            part = part.chunk(mesh.size(axis), place.dim)[mesh.get_local_rank(axis)]
                    param = param.to_local()
                param.copy_(part)


def build(card: Card, *, device, dtype, trainable, compile, weights, seed, attention, tensor_parallel=None,
          sequence_parallel: bool = False, pipeline=None, pipeline_schedule: str = "1f1b", fully_shard: bool = False,
          expert_parallel=None, activation_checkpointing: bool | str = False, activation_memory_budget: float | None = None,
          quantize: str | None = None, numerics: str | None = None, lora: dict | None = None) -> Decoder:
    """Construct, fill and prepare a Decoder (see `linnet.nest.load`)."""
    from linnet.cards import weights_directory
    from linnet.torch import stages
    from linnet.torch.lora import add_lora, draw_adapters
    from linnet.torch.weights import read_weights

    if lora is not None:
        _check_lora(lora, trainable)
    if quantize is not None:
        _check_quantize(quantize, trainable=trainable, tensor_parallel=tensor_parallel, pipeline=pipeline,
                        compile=compile)
    if expert_parallel is not None and card.experts is None:
        raise ValueError(f"nest.load(expert_parallel=...) splits a mixture of experts' experts; {card.name} has none")
    if card.experts is not None and (tensor_parallel is not None or pipeline is not None):
        used = "tensor_parallel" if tensor_parallel is not None else "pipeline"
        raise ValueError(f"nest.load({used}=...): not yet for a mixture-of-experts model ({card.family}); train it "
                         "whole, or sharded with fully_shard=True")
    if sequence_parallel and tensor_parallel is None:
        raise ValueError("nest.load(sequence_parallel=True) splits the positions of a model split by "
                         "tensor_parallel=: pass that too")
    if fully_shard and not (trainable is True or lora):
        raise ValueError("nest.load(fully_shard=True) shards a model that trains (trainable=True, or adapters "
                         "through lora=)")
    device = usable_device(device or "cpu")
    dtype = compute_dtype(dtype, device, card)
    # reject a bad path before any work (flex has no backward on a CPU: refused for a model that trains)
    attention_paths.choose(attention, device, training=bool(trainable) or bool(lora))
    set_numerics(numerics, device)

    def on_meta():
        with torch.device("meta"):
            model = Decoder(card, dtype=dtype, attention=attention)
            model.set_trainable(trainable)  # on meta: each parameter is allocated once, in its dtype
        return model

    model = whole = on_meta()
    also = None
    if pipeline is not None or tensor_parallel is not None or fully_shard or quantize or expert_parallel is not None:
        # cut, split, sharded or quantized on meta: only this process's part of each weight is ever allocated
        whole = on_meta()  # what the weights are read (or drawn) for, every process's, as they are stored
        also = {"model.embed_tokens.weight": "lm_head.weight"} if card.tied_embeddings else None  # untied
    if quantize:
        nf4_layout(model)
    # adapters placed on the whole model before a cut or fully_shard (which wants them first), drawn
    # once the weights are in; a tensor-parallel split adds its own after, split as its weights are
    placed = lora and (fully_shard or pipeline is not None) and tensor_parallel is None and expert_parallel is None
    if placed:
        add_lora(model, **lora)
    copies = None
    if pipeline is not None:
        stages.cut(model, stages.check(model, pipeline, pipeline_schedule, tensor_parallel, fully_shard),
                   pipeline_schedule)
        copies = stages.stage_copies(pipeline, tensor_parallel)
    if tensor_parallel is not None:
        split(model, tensor_parallel, sequence=sequence_parallel)
    # a split model's parts are sharded over their copies once filled and adapted (below)
    if expert_parallel is not None:  # each process allocates its own experts alone (no stages: refused above)
        from linnet.torch.moe import expert_parallel as split_experts

        split_experts(model, expert_parallel)
    elif fully_shard and pipeline is not None and tensor_parallel is None:  # each stage over its copies
        stages.shard_stage(model, copies, device.type)
    elif fully_shard and tensor_parallel is None:  # a tied head is the embedding's own parameter: one part
        also = None
        shard(model)
    if isinstance(weights, str) and weights == "random":
        values = _random_values(whole, seed)
    else:  # every name and shape checked before any memory is taken
        values = read_weights(whole, weights_directory(card) if weights is None else weights, strict=True)
    _fill(model, values, device, also)
    model.inv_freq = rope_frequencies(card).to(device)
    if placed:
        draw_adapters(model, device)
    elif lora:  # whole, or split by tensor_parallel (A drawn whole, then split)
        add_lora(model, **lora)
    if fully_shard and expert_parallel is not None:  # the dense parts, once read and adapted, beside the experts
        shard(model)
    if fully_shard and tensor_parallel is not None and pipeline is not None:  # 3-D: a stage's part over its copies
        stages.shard_stage(model, copies, device.type, tensor_parallel)
    elif fully_shard and tensor_parallel is not None:  # 2-D: each process's part of the split over its copies
        shard(model, mesh=copies_mesh(tensor_parallel))
    if pipeline is not None:
        stages.staged(model, pipeline, pipeline_schedule, copies)
    model.checkpoint_activations(activation_checkpointing)
    if activation_memory_budget is not None:
        if compile not in (True, "inductor"):
            raise ValueError("activation_memory_budget sets how much the inductor compiler keeps: use it with "
                             "compile='inductor'")
        if not 0 <= activation_memory_budget <= 1:
            raise ValueError(f"activation_memory_budget={activation_memory_budget}: a share in [0, 1] of what "
                             "the compiled blocks would keep")
        torch._functorch.config.activation_memory_budget = activation_memory_budget  # process-wide, read at compile
    if compile:
        backend = "inductor" if compile is True else compile
        for block in model.model.layers:
            block.compile(backend=backend)
        model.compiled = backend
    return model
