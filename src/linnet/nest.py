"""The front door: resolve a card and build its model for a backend.

    from linnet import nest
    card = nest.resolve("qwen2.5-0.5b-instruct")   # a registered name or a local HF directory
    model = nest.load(card, backend="torch", dtype=torch.bfloat16, trainable=True)
    model = nest.load(card, backend="jax")          # linnet.jax.JaxModel

Cards themselves are plain data in `linnet.cards` (re-exported here); `load` sits above the
backends and imports the one it is asked for.
"""

from __future__ import annotations

import os
from typing import Any

from linnet.cards import (
    FAMILIES,
    REGISTRY,
    Card,
    Location,
    RopeScaling,
    card_from_config,
    card_from_directory,
    local_directory,
    resolve,
    weights_directory,
)

__all__ = ["FAMILIES", "REGISTRY", "Card", "Location", "RopeScaling", "card_from_config", "card_from_directory",
           "load", "local_directory", "resolve", "weights_directory"]

NUMERICS = (None, "exact", "fast")  # see load(numerics=)


def load(
    card: str | os.PathLike | Card,
    backend: str = "torch",
    *,
    device: Any = None,
    dtype: Any = None,
    trainable: bool | str | list[str] = False,
    compile: bool | str = False,
    weights: str | os.PathLike | None = None,
    seed: int = 0,
    attention: str = "auto",
    tensor_parallel: Any = None,
    sequence_parallel: bool = False,
    pipeline: Any = None,
    pipeline_schedule: str = "1f1b",
    fully_shard: bool = False,
    expert_parallel: Any = None,
    activation_checkpointing: bool | str = False,
    activation_memory_budget: float | None = None,
    quantize: str | None = None,
    numerics: str | None = None,
    lora: dict | None = None,
    mesh: Any = None,
    **seed_spelling: Any,
):
    """Build the card's decoder for `backend`. `card`: a Card, a registered name, a local
    Hugging Face model directory, or a finished linnet run (its directory or its final/): the
    base it was trained from with its adapters folded into the weights as they are read
    (`linnet.cards.trained_card`).

    weights: a directory or .safetensors file; None takes the card's own (its local
    directory, else the hub cache); "random" initialises from `seed`.
    dtype: the compute dtype (default: the card's on CUDA, float32 on CPU); "auto" takes
    bfloat16 where the device computes it natively (CUDA with bf16, a CPU with amx_bf16 or
    avx512_bf16; linnet.hardware), else float32. Trainable parameters are kept in float32
    and cast on use; frozen ones are stored in `dtype`.
    trainable: True, False, or glob patterns over parameter paths.
    compile: True or "inductor" (one mode here) compiles each block with torch.compile's
    inductor backend; another string names another torch.compile backend. The seed's
    whole-model True has no counterpart: attention over a row's documents runs eagerly,
    so one graph for the whole model would break at every block anyway.
    tensor_parallel: a one-dimension DeviceMesh (mesh["split"]) whose processes split every
    block's weights (linnet.torch.sharding.tensor_parallel); each process reads or draws
    every weight whole and keeps its slice, never holding the whole model.
    sequence_parallel=True (with tensor_parallel): the blocks' norms and the residual
    stream split by positions between the split's processes too (tensor_parallel(sequence=)).
    pipeline: a one-dimension DeviceMesh (mesh["stages"]): build only this process's stage
    of it, never allocating the other stages' weights (linnet.torch.pipeline,
    `pipeline_schedule` "1f1b", "gpipe" or "interleaved": two chunks of blocks a process);
    with tensor_parallel too, the stage is split.
    fully_shard=True: shard the model over every process (linnet.torch.fully_shard) before
    its weights are read or drawn, each process keeping only its part (an NF4 base's codes
    too); for full fine-tuning (trainable=True) or adapters (lora=). With pipeline, each
    stage is sharded over its copies (the processes holding the same stage in the other
    pipelines); with tensor_parallel, each process's part of the split is sharded over the
    "copies" dimension of the mesh tensor_parallel was taken from (FSDP x TP), once read.
    expert_parallel: a DeviceMesh whose last dimension is named "expert" (a first, its
    copies): a mixture of experts' experts split over it (linnet.torch.moe.expert_parallel)
    before the weights are read, each process keeping only its experts; with fully_shard,
    the dense parts are then read whole and sharded over every process.
    lora: adapters to add, as add_lora's arguments in a dict (`patterns` and any of rank,
    alpha, dropout, rslora, dora), e.g. dict(patterns="*_proj.weight", rank=16): the same
    model as model.add_lora(...) after loading, drawn from the same global RNG. With
    fully_shard they are placed before the split, as fully_shard asks, so no process ever
    holds the whole base (without lora=, a LoRA run would load whole, add_lora, then shard).
    activation_checkpointing: True (or "full") keeps each block's input alone in training
    and computes the block again in backward; "selective" also keeps attention's outputs
    (`Decoder.checkpoint_activations`). activation_memory_budget (with compile="inductor"):
    the share of a compiled block's activations the compiler may keep, recomputing the
    rest (torch._functorch.config.activation_memory_budget, process-wide).
    quantize="nf4": QLoRA's frozen base, every block's linear weight in 4-bit NormalFloat
    with double quantization (bitsandbytes; the `qlora` extra), computed in `dtype`; train
    adapters over it with add_lora (linnet.torch.quantize).
    numerics: how freely an accelerator may round matmuls, a process-wide setting made when
    the model lands on one. "fast": float32 matmuls in TF32 and bf16/fp16 matmuls summing
    their partial products in their own dtype (torch on CUDA; JAX's default matmul
    precision on GPUs and TPUs): quicker, and the weights stay f32 either way. "exact":
    full float32 matmuls and f32 sums, for runs compared to the last digits. A CPU
    computes one way, so neither changes anything there; None leaves the settings alone.
    backend="jax" (or the seed's "jax_source") gives a linnet.jax.JaxModel (needs the
    `jax` extra); it takes weights, dtype, seed, numerics and mesh: a jax.sharding.Mesh
    (one axis, or ("data", "model")) over which each parameter is placed in its parts as
    the JAX trainers split it, each device reading its own slice of each tensor
    (linnet.jax.sharding).
    """
    card = resolve(card)
    if backend not in ("torch", "jax", "jax_source"):
        raise ValueError(f"unknown backend {backend!r}; use 'torch' or 'jax'")
    if numerics not in NUMERICS:
        raise ValueError(f"numerics={numerics!r}: use 'fast' (TF32 and reduced-precision sums on accelerators), "
                         "'exact' (full float32 matmuls) or None (leave the process's settings alone)")
    if "cast_dtype" in seed_spelling:
        seed_spelling.pop("cast_dtype")  # trainable weights are always f32, cast on use
    entry = seed_spelling.pop("entry", None)  # every model has every packed entry
    if entry not in (None, "loss_packed", "log_probs_packed", "hidden_packed"):
        raise ValueError(f"entry={entry!r}: the models have loss_packed, log_probs_packed and hidden_packed")
    generics = seed_spelling.pop("generics", None) or {}
    if dtype is None and "T" in generics:
        dtype = generics["T"]
    if seed_spelling:
        raise TypeError(f"load() got unexpected arguments: {', '.join(seed_spelling)}")
    if card.adapters and (backend != "torch" or (isinstance(weights, str) and weights == "random")):
        raise ValueError(f"{card.source}: a trained run's model is its base with its adapters folded in as the "
                         "weights are read: " + ("that is the PyTorch backend's for now; export the run "
                                                 "(`linnet export --merge`) and load that directory"
                                                 if backend != "torch" else "weights='random' would leave them out"))
    if card.experts is not None and backend != "torch":
        raise ValueError(f"card {card.name!r}: a mixture-of-experts model ({card.family}) is the PyTorch backend's "
                         "for now; load it with backend='torch'")
    if backend == "torch" and mesh is not None:
        raise ValueError("mesh= places a JAX model (backend='jax'); the PyTorch backend splits a model with "
                         "tensor_parallel=, pipeline= or fully_shard=True")
    if backend != "torch":
        unused = [name for name, value, default in (("device", device, None), ("trainable", trainable, False),
                                                   ("compile", compile, False), ("attention", attention, "auto"),
                                                   ("tensor_parallel", tensor_parallel, None),
                                                   ("sequence_parallel", sequence_parallel, False),
                                                   ("pipeline", pipeline, None), ("fully_shard", fully_shard, False),
                                                   ("expert_parallel", expert_parallel, None),
                                                   ("activation_checkpointing", activation_checkpointing, False),
                                                   ("activation_memory_budget", activation_memory_budget, None),
                                                   ("quantize", quantize, None), ("lora", lora, None))
                  if value != default]
        if unused:
            raise ValueError(f"backend={backend!r} does not take {', '.join(unused)}: JAX places arrays itself, "
                             "compiles every step, picks what trains in linnet.jax.train.train(trainable=) and recomputes "
                             "layers with train(remat=True)")
        try:
            from linnet.jax import load_model
        except ModuleNotFoundError as e:
            if e.name not in ("jax", "jaxlib", "optax"):
                raise
            raise ModuleNotFoundError(f"backend={backend!r} needs {e.name}: pip install 'linnet[jax]'") from e
        return load_model(card, weights=weights, dtype=dtype, seed=seed, numerics=numerics, mesh=mesh)
    from linnet.torch.loading import build

    return build(
        card,
        device=device,
        dtype=dtype,
        trainable=trainable,
        compile=compile,
        weights=weights,
        seed=seed,
        attention=attention,
        tensor_parallel=tensor_parallel,
        sequence_parallel=sequence_parallel,
        pipeline=pipeline,
        pipeline_schedule=pipeline_schedule,
        fully_shard=fully_shard,
        expert_parallel=expert_parallel,
        activation_checkpointing=activation_checkpointing,
        activation_memory_budget=activation_memory_budget,
        quantize=quantize,
        numerics=numerics,
        lora=lora,
    )
