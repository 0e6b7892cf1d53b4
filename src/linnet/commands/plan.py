"""`linnet plan`: memory, FLOPs, GPU-hours and cost of a run, before anyone rents a GPU
(the arithmetic is linnet.plan's; this is its table and its command line).

    linnet plan llama-3.1-8b-instruct --method lora --rank 16 --context-length 4096 \\
        --total-targets 12e6 --mfu 0.35 --gpus 8 --gpu h100 --price 2.5
    linnet plan llama-3.1-70b-instruct --compare          # full vs LoRA vs QLoRA
    linnet plan path/to/hf-model-dir --total-targets chinchilla --json
    linnet plan llama-3.2-1b-instruct --method lora --dtype f32 --device cpu --chunked-loss --grad-dtype fp32
    linnet plan --config run.yaml                         # the run a config describes (any command's)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Sequence
from typing import Any

from linnet import cards, plan
from linnet.commands.spellings import former_flags
from linnet.plan import (
    ACCELERATORS,
    CHECKPOINTING,
    COMPARED,
    DEVICES,
    DTYPES,
    GB,
    GRADIENT_BYTES,
    METHODS,
    NF4_BYTES,
    PRECISIONS,
    SCHEDULES,
    SHARDED_STATES,
    Cluster,
    Method,
    Plan,
    SettingError,
    Workload,
    compare,
    estimate,
    plan_inputs,
    sampling_memory,
)
from linnet.report.tables import count, duration, gb, money, sci


def _gpus(n: int) -> str:
    return f"{n} GPU" if n == 1 else f"{n} GPUs"


def _gpu_count(n: int | None, per_node: int) -> str:
    if n is None:
        return "none: activations overflow one GPU"
    return f"{n} ({math.ceil(n / per_node)} nodes of {per_node})" if n > per_node else str(n)


CHECKPOINTING_LABELS = {"full": "checkpointing", "selective": "selective checkpointing", "none": "no checkpointing",
                        "offload": "checkpointing, inputs in host memory"}


def _rows(plans: Sequence[Plan]) -> list[tuple[str, list[str]]]:
    """(label, one value per plan) for the table."""
    first = plans[0]
    chosen = CHECKPOINTING_LABELS[first.workload.activation_checkpointing]
    memory = {
        "parameters": lambda p: count(p.params),
        **({"active a token": lambda p: count(p.active)} if first.active != first.params else {}),
        "trainable": lambda p: f"{count(p.trainable)} ({p.trainable / p.params:.1%})",
        "weights": lambda p: gb(p.states.weights),
        "gradients": lambda p: gb(p.states.gradients),
        "master weights": lambda p: gb(p.states.master),
        "optimizer state": lambda p: gb(p.states.optimizer),
        "states": lambda p: gb(p.states.total),
        "activations, checkpointing": lambda p: gb(p.activations_checkpointed),
        "activations, no checkpointing": lambda p: gb(p.activations_uncheckpointed),
    }
    if first.workload.activation_checkpointing in ("selective", "offload"):
        memory[f"activations, {chosen}"] = lambda p: gb(p.activations.peak)
    memory.update({f"peak in the {phase}": lambda p, key=key: gb(p.phases[key])
                   for phase, key in (("forward", "forward"), ("backward", "backward"), ("optimizer step", "optimizer"))})
    if len(first.processes) > 1:  # split or pipelined: each stage's own peak, then the fullest's
        memory.update({f"peak, {proc.name}": lambda p, i=i: gb(max(p.processes[i].phases.values()))
                       for i, proc in enumerate(first.processes)})
    memory.update({
        f"total per GPU ({chosen})": lambda p: gb(p.total),
        f"fits {gb(first.cluster.usable_bytes)} usable": lambda p: "yes" if p.fits else "no",
        f"minimum {first.cluster.gpu.name} GPUs (FSDP)": lambda p: _gpu_count(p.min_gpus, p.cluster.gpus_per_node),
    })
    compute = {
        "total targets": lambda c: count(c.total_targets),
        "FLOPs": lambda c: sci(c.flops),
        "GPU-hours": lambda c: f"{c.gpu_hours:,.0f}" if c.gpu_hours >= 100 else f"{c.gpu_hours:.3g}",
        f"wall time on {_gpus(first.cluster.gpus)}": lambda c: duration(c.days),
    }
    if first.cluster.price is not None:
        compute["cost"] = lambda c: money(c.cost)
    rows = [(label, [value(p) for p in plans]) for label, value in memory.items()]
    if first.compute is not None:
        rows += [(label, [value(p.compute) for p in plans]) for label, value in compute.items()]
    return rows


def _assumptions(plans: Sequence[Plan]) -> list[str]:
    """The conventions behind the numbers, filled in with this plan's values."""
    first = plans[0]
    method, workload, cluster = first.method, first.workload, first.cluster
    names = {p.method.name for p in plans}
    adapted = [p.method.name for p in plans if p.method.adapters]
    c = method.compute_bytes
    copy = (f"{method.copy_bytes:g} B {method.dtype} weight" if method.copy_bytes
            else "no separate weight (f32 compute reads the f32 master)")
    lines = [
        "GB = 10^9 bytes (MB = 10^6); memory is per GPU",
        f"each trainable parameter: {copy} + {GRADIENT_BYTES[method.grad_dtype]} B {method.grad_dtype} gradient + "
        f"{method.master_bytes:g} B f32 master + {method.optimizer_bytes:g} B optimizer state = "
        f"{method.bytes_per_trainable:g} B",
    ]
    if adapted:
        lines.append(
            f"{', '.join(adapted)}: base frozen (no gradient, master or optimizer state)"
            + ("" if adapted == ["qlora"] else f" in {method.dtype}, {c} B per parameter")
            + f"; rank {method.rank} adapters on {', '.join(plan.experts.adapted_names(first.experts, method.targets))}"
            " in every block, r·(d_in + d_out) parameters each"
        )
    if "qlora" in names:
        lines.append(
            f"qlora: every block's linear weights in NF4 with double quantization, 4 + 8/64 + 32/(64·256) bits = "
            f"{NF4_BYTES:.3f} B per parameter; embeddings, norms and the head stay in {method.dtype}"
        )
    if "dora" in names:
        lines.append("dora also trains one magnitude per output row of each adapted matrix")
    if workload.num_models > 1:
        lines.append(f"packed: {workload.num_models} models, each whole with its gradients, master weights, AdamW "
                     "moments and its own micro-batch's activations, side by side on each GPU")
    attention = "f32 attention, " if workload.device == "cpu" and c == 2 else ""
    lines += [
        f"activations: what linnet's block saves for backward, from the card's shapes in {method.dtype} "
        f"({attention}s = {workload.tokens}, b = {workload.micro_batch_size}); checkpointing keeps each block's input "
        "and recomputes one block at a time in backward, selective also keeps attention's outputs",
        (f"logits: one block of linnet's chunked loss in f32 = {gb(first.logits)} ("
         + ("16 MiB but at least 512 rows on a CPU" if workload.device == "cpu" else "at most about 1 GiB on a GPU")
         + "), with the hidden states' gradient" if workload.chunked_loss
         else f"logits in f32: s·b·V·4 bytes = {gb(first.logits)} (--chunked-loss: linnet's blockwise loss)"),
        "peak: the largest of the end of the forward ("
        + (f"{workload.accumulate} micro-steps a step: every gradient live from the second on" if workload.accumulate > 1
           else "no gradient yet but the head's, which the chunked loss makes there")
        + "), the backward (gradients growing as activations are freed) and the optimizer step "
        f"({'AdamW tensor by tensor' if workload.device == 'cpu' else 'foreach AdamW: 4 B more per trainable parameter'})",
    ]
    split = [name for name in dataclasses.asdict(first.states) if name in SHARDED_STATES[cluster.shard]]
    per_copy = cluster.split * cluster.pipeline
    if per_copy > 1:
        lines.append(_cut_assumption(cluster))
    else:
        lines.append(
            f"--shard {cluster.shard}: {', '.join(split)} split over {_gpus(cluster.gpus)}; activations on every GPU"
            if split
            else "states not sharded: every GPU holds all of them (--shard zero, zero1, zero2 or fsdp splits them)"
        )
    lines += plan.experts.describe(first) + [
        f"usable memory: {cluster.usable:.0%} of {cluster.gpu.memory_gb:g} GB per {cluster.gpu.name} (CUDA "
        "context, allocator fragmentation, communication buffers); minimum GPUs shards every state (FSDP)"
    ]
    if first.compute is not None:
        lines += [
            "FLOPs = 6·N·D when the base trains, 4·N·D when it is frozen (no weight gradients in backward); "
            "N counts the parameters a token computes with (a mixture of experts' chosen experts alone)",
            f"GPU-hours = FLOPs / ({cluster.peak_flops / 1e12:g} TFLOP/s dense {cluster.precision} × "
            f"{cluster.mfu:.0%} MFU) / 3600; MFU counts model FLOPs, so recomputation lowers MFU",
            f"wall time = GPU-hours / {_gpus(cluster.gpus)}"
            + ("" if cluster.price is None else f"; cost = GPU-hours × ${cluster.price:,.2f}, compute only"),
        ]
    return lines


def _cut_assumption(cluster: Cluster) -> str:
    """How --split and --pipeline divide one copy of the model, as linnet does."""
    per_copy = cluster.split * cluster.pipeline
    parts = [f"{_gpus(per_copy)} hold one copy of the model ({cluster.gpus // per_copy} "
             f"cop{'y' if cluster.gpus == per_copy else 'ies'}); the table's memory is the fullest GPU's"]
    if cluster.split > 1:
        parts.append(f"--split {cluster.split}: each block's q, k, v, gate and up split by output rows, o and down "
                     "by input columns (their adapters alike), and with them its attention heads and MLP "
                     "activations; the head split by vocabulary rows (its loss combines the rows' sums, the "
                     "logits never gathered); the embedding whole on each GPU, the norms and the block inputs "
                     + ("a GPU's share of the positions (--sequence-parallel; each norm's output gathered whole)"
                        if cluster.sequence_parallel else "whole"))
    if cluster.pipeline > 1 and cluster.pipeline_schedule == "zero-bubble":
        parts.append(f"--pipeline {cluster.pipeline} zero-bubble: the interleaved chunks (stage i holding chunks i and "
                     "i + P of 2P); each backward split into the input's gradient and the weights', the weights' of "
                     "stage i waiting i passes; with --accumulation at least the stages stage i keeping a round of "
                     "micro-batches through one chunk and P passes more, the one in hand among them (a pass keeps "
                     "its activations until its weights' half), else every micro-batch's")
    elif cluster.pipeline > 1 and cluster.pipeline_schedule == "interleaved":
        parts.append(f"--pipeline {cluster.pipeline} interleaved: the blocks cut into 2P chunks, stage i holding chunks i "
                     "and i + P, the first the embedding, the last the final norm and the head (a tied head "
                     "untied); with --accumulation at least the stages interleaved 1F1B, stage i keeping its "
                     "warm-up's passes, a round of micro-batches through one chunk and 2 (P - 1 - i) more, and the one "
                     "in hand (a pass through one chunk half a micro-batch's activations), else every micro-batch's; "
                     "each chunk a receive buffer a micro-batch for the activations coming in and one for the "
                     "gradients coming back")
    elif cluster.pipeline > 1:
        parts.append(f"--pipeline {cluster.pipeline}: stage i holds blocks i·L/P to (i+1)·L/P, the first the "
                     "embedding, the last the final norm and the head (a tied head untied); with --accumulation "
                     "at least the stages 1F1B, stage i keeping at most P - i micro-batches' activations, else "
                     "GPipe keeping every one's; each stage a receive buffer a micro-batch for the activations "
                     "coming in and one for the gradients coming back")
    if cluster.shard == "fsdp":
        parts.append(f"--shard fsdp: each stage's blocks (their weights, gradients and optimizer state; adapters "
                     f"whole) split over its {cluster.gpus // per_copy} copies, the embedding, final norm and head "
                     "whole on their stages")
    return "; ".join(parts)


def render(plans: Sequence[Plan]) -> str:
    """A table with one column per plan, and the assumptions under it."""
    first = plans[0]
    cluster = first.cluster
    title = (
        f"{first.model}: context length {first.workload.tokens} × micro-batch size {first.workload.micro_batch_size} "
        + (f"× {first.workload.num_models} packed models " if first.workload.num_models > 1 else "")
        + f"on {cluster.gpus} × {cluster.gpu.name}"
        + (f" (split {cluster.split}, {cluster.pipeline} stages)" if cluster.split * cluster.pipeline > 1 else "")
    )
    rows = _rows(plans)
    label_width = max(len(label) for label, _ in rows)
    widths = [max(len(p.method.name), *(len(values[i]) for _, values in rows)) for i, p in enumerate(plans)]

    def line(label: str, values: Sequence[str]) -> str:
        return f"{label:<{label_width}}" + "".join(f"  {value:>{width}}" for value, width in zip(values, widths))

    lines = [title, "", line("", [p.method.name for p in plans])] + [line(*row) for row in rows]
    lines += ["", "assumptions:"] + [f"  - {assumption}" for assumption in _assumptions(plans)]
    return "\n".join(lines)


def _token_count(text: str) -> float | str:
    """'12e6', '12M', '15T' or 'chinchilla'."""
    if text == "chinchilla":
        return text
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}.get(text[-1:].upper(), 1)
    try:
        return float(text[:-1] if scale != 1 else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a token count; use e.g. 12e6, 12M, 15T or chinchilla") from None


# linnet plan's former flags, refused with the flag that replaced them
FORMER_FLAGS = {"--seq": "--context-length", "--micro-batch": "--micro-batch-size", "--workers": "--num-models",
                "--tokens": "--total-targets", "--checkpointing": "--activation-checkpointing",
                "--no-checkpointing": "--no-activation-checkpointing"}
# the Python name (linnet.plan.plan_inputs') -> this command's flag, where they differ by more
# than dashes; an error from the planner names the flag (SettingError.named)
FLAGS = {"tokens": "--context-length", "accumulate": "--accumulation", "method": "--method",
         "memory_gb": "--gpu-memory", "bf16_tflops": "--gpu-tflops", "fp8_tflops": "--gpu-fp8-tflops"}


# the planner's Python names -> a run config's fields (linnet plan --config)
CONFIG_FIELDS = {"tokens": "training.context_length", "accumulate": "training.accumulation",
                 "micro_batch_size": "training.micro_batch_size", "num_models": "decentralized.num_models",
                 "activation_checkpointing": "training.activation_checkpointing", "shard": "training.shard",
                 "split": "training.split", "pipeline": "training.pipeline",
                 "pipeline_schedule": "training.pipeline_schedule", "rank": "lora.rank", "targets": "lora.targets",
                 "mlp_tile": "training.mlp_tile", "context": "training.context",
                 "sequence_parallel": "training.sequence_parallel", "expert": "training.expert"}


class _Flags(dict):
    def __missing__(self, key: str) -> str:
        return "--" + key.replace("_", "-")


def flag(name: str) -> str:
    """The flag of a planner setting named in Python (`linnet.plan.plan_inputs`): tokens ->
    --context-length, accumulate -> --accumulation, micro_batch_size -> --micro-batch-size."""
    return _Flags(FLAGS)[name]


def parser() -> argparse.ArgumentParser:
    """`linnet plan`'s flags: the YAML's names (--context-length, --accumulation, ...),
    each stored under the planner's Python name (dest)."""
    method, workload, cluster = Method(), Workload(), Cluster()
    parser = argparse.ArgumentParser(
        prog="linnet plan",
        description="Memory per GPU, minimum GPUs, FLOPs, GPU-hours and cost of a training run, "
        "from a model card, before anyone rents a GPU. Unset flags take the defaults shown.",
    )
    parser.add_argument(
        "card", nargs="?",
        help=f"a registered card ({', '.join(sorted(cards.REGISTRY))}) or a Hugging Face model directory",
    )
    parser.add_argument("--config", metavar="YAML",
                        help="plan the run a `linnet sft` / `dpo` / `grpo` config describes (flags override it)")

    what = parser.add_argument_group("what is trained").add_argument
    what("--method", choices=METHODS, help=f"full fine-tuning or an adapter method (default {method.name})")
    what("--rank", type=int, metavar="R", help=f"adapter rank r, lora.rank (default {method.rank})")
    what("--targets", metavar="NAMES",
         help="adapted linear layers: all-linear, or names such as q_proj,v_proj (default all-linear)")
    what("--optimizer-bytes", type=float, metavar="B",
         help="optimizer state bytes per trainable parameter: 8 for AdamW's two f32 moments, 2 for 8-bit "
         f"Adam, 0 for plain SGD (default {method.optimizer_bytes:g})")
    what("--grad-dtype", choices=list(GRADIENT_BYTES),
         help=f"gradient dtype (default {method.grad_dtype}; fp32 when gradients accumulate in f32)")
    what("--master-bytes", type=float, metavar="B",
         help="master weight bytes per trainable parameter: 4 for an f32 copy, 0 for pure bf16 training "
         f"(default {method.master_bytes:g})")
    what("--dtype", choices=list(DTYPES),
         help="compute dtype: activations and frozen weights in it; bf16 casts each trained f32 weight for the "
         f"matmuls, f32 computes with the f32 weights themselves (default {method.dtype}; linnet on a CPU "
         "without bf16 instructions: f32)")

    run = parser.add_argument_group("workload").add_argument
    run("--context-length", dest="tokens", type=int, metavar="N",
        help=f"positions per packed row, training.context_length (default {workload.tokens})")
    run("--micro-batch-size", type=int, metavar="N",
        help=f"rows per GPU per micro-step, training.micro_batch_size (default {workload.micro_batch_size})")
    run("--activation-checkpointing", nargs="?", const="full", choices=CHECKPOINTING, metavar="MODE",
        help="training.activation_checkpointing: full (the flag alone) keeps each block's input and recomputes "
        "the block in backward; selective also keeps attention's outputs; offload keeps the inputs in host "
        "memory; none keeps everything (default full)")
    run("--no-activation-checkpointing", dest="activation_checkpointing", action="store_const", const="none",
        help="the same as --activation-checkpointing none")
    run("--mlp-tile", type=int, metavar="N",
        help="training.mlp_tile: positions each block's MLP computes at a time, computed again in backward "
        "(default: the whole row)")
    run("--accumulation", dest="accumulate", type=int, metavar="N",
        help="micro-steps per optimizer step, training.accumulation; from the second on, the earlier ones' "
        f"gradients are live in the forward (default {workload.accumulate})")
    run("--num-models", type=int, metavar="N",
        help="packed decentralized training (decentralized.num_models): N whole models on each GPU, each with its "
        f"gradients, AdamW moments and micro-batch (default {workload.num_models})")
    run("--chunked-loss", action=argparse.BooleanOptionalAction,
        help="compute the loss a block of rows at a time instead of holding every logit (default off)")

    hardware = parser.add_argument_group("hardware").add_argument
    hardware("--device", choices=DEVICES,
             help=f"where the steps run: gpu, or cpu for linnet's CPU paths (16 MiB loss blocks, bf16 attention "
             f"computed in f32, AdamW tensor by tensor); GPU counts and costs still use --gpu "
             f"(default {workload.device})")
    hardware("--gpu", metavar="NAME",
             help=f"accelerator: {', '.join(ACCELERATORS)}; any other name needs --gpu-memory and "
             f"--gpu-tflops (default {cluster.gpu.name})")
    hardware("--gpu-memory", dest="memory_gb", type=float, metavar="GB",
             help="memory per GPU in GB (10^9 bytes), overriding the table")
    hardware("--gpu-tflops", dest="bf16_tflops", type=float, metavar="TFLOPS",
             help="dense bf16 peak in TFLOP/s, overriding the table")
    hardware("--gpu-fp8-tflops", dest="fp8_tflops", type=float, metavar="TFLOPS",
             help="dense fp8 peak in TFLOP/s, overriding the table")
    hardware("--gpus", type=int, metavar="N",
             help=f"GPUs the run uses: data-parallel copies x split x pipeline (default {cluster.gpus})")
    hardware("--gpus-per-node", type=int, metavar="N", help="GPUs a node's fast links (NVLink) join; groups that "
             f"span more send over the network in --suggest's step estimate (default {cluster.gpus_per_node})")
    hardware("--split", type=int, metavar="N",
             help="GPUs that split every block between them (tensor parallel, linnet's training.split); the head by "
             f"vocabulary rows, the embedding and norms whole (default {cluster.split})")
    hardware("--sequence-parallel", action=argparse.BooleanOptionalAction,
             help="with --split: the blocks' norms share each row's positions among the split's GPUs")
    hardware("--pipeline", type=int, metavar="N",
             help="pipeline stages, each GPU holding consecutive blocks (linnet's training.pipeline); the first the "
             f"embedding, the last the norm and head; --accumulation is the micro-batches (default {cluster.pipeline})")
    hardware("--context", type=int, metavar="N",
             help="GPUs that take the same rows, each computing 1/N of every row's positions (context parallel, "
             f"linnet's training.context; attention as a ring) (default {cluster.context})")
    hardware("--expert", type=int, metavar="N", help="GPUs that split a mixture of experts' experts between them "
             f"(expert parallel, linnet's training.expert; --gpus a multiple) (default {cluster.expert})")
    hardware("--pipeline-schedule", choices=list(SCHEDULES),
             help="with --pipeline: 1f1b, interleaved (two chunks of blocks a stage) or zero-bubble (those chunks, "
                  "each backward split in two), linnet's training.pipeline_schedule "
                  f"(default {cluster.pipeline_schedule})")
    hardware("--shard", choices=list(SHARDED_STATES),
             help=f"which states split over the GPUs: zero the optimizer state alone (ZeroRedundancyOptimizer, linnet's "
                  f"training.shard=zero), ZeRO-1, ZeRO-2 or FSDP (default {cluster.shard})")
    hardware("--usable", type=float, metavar="FRACTION",
             help=f"share of GPU memory a run can fill (default {cluster.usable:g})")

    cost = parser.add_argument_group("compute and cost").add_argument
    cost("--total-targets", type=_token_count, metavar="N",
         help="tokens trained on (prediction targets, training.total_targets): 12e6, 12M, 15T, or chinchilla for "
         "20 per parameter; adds FLOPs, GPU-hours and wall time")
    cost("--mfu", type=float, metavar="FRACTION",
         help=f"model FLOPs utilization, a fraction in (0, 1] (default {cluster.mfu:g})")
    cost("--precision", choices=PRECISIONS,
         help=f"matmul precision whose peak the MFU applies to (default {cluster.precision})")
    cost("--price", type=float, metavar="DOLLARS", help="dollars per GPU-hour; adds a cost row")

    output = parser.add_argument_group("output").add_argument
    output("--compare", action="store_true", help="full, lora and qlora side by side (and --method if another)")
    output("--json", action="store_true", help="print JSON for scripts (bytes in bytes) instead of the table")
    output("--suggest", action="store_true",
           help="every layout of --gpus GPUs linnet runs (copies, zero, fsdp, split, pipeline, context), planned: "
                "those that fit first, the least communication first (linnet.plan.layouts)")
    output("--textbook", action="store_true",
           help="the course module's arithmetic (seed 004's 'Why LoRA fits on one GPU': 16 B a trained parameter, "
                "34·s·b·d activations, 4.127-bit QLoRA) for full, LoRA and QLoRA beside linnet's plan, and why they "
                "differ; with no CARD, the module's Llama 3.1 8B and 70B")
    former_flags(parser, FORMER_FLAGS)
    return parser


def settings_from_config(path: str) -> dict[str, Any]:
    """The card and plan settings of a run config, loaded and checked as the run would
    load it (an unknown field is the same error), describing linnet's step: f32 gradients,
    the compute dtype, activation checkpointing, the optimizer's state bytes, the device,
    linnet's blockwise loss, the packed row as the sequence and the token count when the
    steps are fixed; which states `training.shard` splits. For sft, dpo, grpo and distill
    also how `training.split` and `training.pipeline` divide one copy (one copy's GPUs),
    LoRA, DoRA, QLoRA (model.quantize) or full, rank and adapted layers, and what the run
    holds beside the model (`_beside`); for pretraining, the model it builds, its
    micro-batch, the budget's targets and, packed, its models (N side by side). The
    settings are named as `linnet.plan.plan_inputs` takes them (Python's names)."""
    from linnet.config import PretrainConfig, load_any
    from linnet.plan.experts import config_targets

    config = load_any(path)
    t, model = config.training, config.model
    device = "cpu" if (config.runtime.device or "").startswith("cpu") else "gpu"
    settings: dict[str, Any] = {
        "chunked_loss": True, "tokens": t.context_length, "device": device, "grad_dtype": "fp32",
        "activation_checkpointing": {False: "none", True: "full"}.get(t.activation_checkpointing,
                                                                      t.activation_checkpointing),
        "dtype": _config_dtype(model.dtype, device),
        "optimizer_bytes": 8 if config.optimizer.name == "adamw" else 2,
        "accumulate": t.accumulation if config.command in ("sft", "distill", "pretrain") else 1,
        "mlp_tile": t.mlp_tile,
    }
    if isinstance(config, PretrainConfig):
        from linnet.pretrain.recipe import make_budget, model_card

        card = model_card(config, _pretrain_vocab(config), eos_id=0)
        models = config.decentralized.num_models if config.decentralized is not None else 1
        return {**settings, "card": card, "method": "full", "micro_batch_size": t.micro_batch_size,
                "num_models": models, "total_targets": make_budget(config, card.params()).trained_targets,
                "shard": t.shard}
    split, stages = getattr(t, "split", 1), getattr(t, "pipeline", 1)
    settings.update(card=model.card, micro_batch_size=1, shard=t.shard)  # the planner's none, zero and fsdp are linnet's
    if split * stages > 1:  # one copy, unless --gpus says how many
        settings.update(split=split, pipeline=stages, gpus=split * stages,
                        pipeline_schedule=getattr(t, "pipeline_schedule", "1f1b"),
                        sequence_parallel=getattr(t, "sequence_parallel", False))
    for name in [n for n in ("context", "expert") if getattr(t, n, 1) > 1]:  # one group, unless --gpus says more
        settings.update({name: getattr(t, name), "gpus": getattr(t, name)})
    lora = config.lora
    if lora.enabled:
        if model.quantize and lora.dora:
            raise ValueError(f"{path}: DoRA over an NF4 base (model.quantize with lora.dora) has no plan yet; "
                             "plan it as qlora (lora.dora: false) and add one magnitude per output row")
        settings.update(method="qlora" if model.quantize else "dora" if lora.dora else "lora", rank=lora.rank,
                        targets=config_targets(cards.resolve(model.card), lora.targets))
    else:
        settings["method"] = "full"
    if t.steps:
        settings["total_targets"] = t.steps * (t.accumulation if config.command in ("sft", "distill") else 1) \
            * t.context_length
    beside = _beside(config, device)
    if beside.get("vllm_share"):  # vLLM takes its share of the GPU for its weights and cache: training the rest
        settings["usable"] = round(Cluster().usable - beside["vllm_share"], 6)
    if beside:
        settings["beside"] = beside
    return settings


def _beside(config, device: str) -> dict[str, Any]:
    """What a run holds beside the trained model, from its config: GRPO's or PPO's sampling
    engine (`rows` completions, in `dtype` or the policy's) or vLLM's share of the GPU;
    distillation's frozen teacher (in the student's dtype) and, on-policy, the student's
    sampling engine (a completion a prompt)."""
    if config.command in ("grpo", "ppo"):
        g = getattr(config, config.command)
        if g.engine == "vllm":
            from linnet.serve.vllm import GPU_SHARE

            return {"who": config.command.upper(), "group": g.YAML,
                    "vllm_share": g.vllm_gpu_memory_utilization or GPU_SHARE}
        completions = g.group if config.command == "grpo" else g.samples
        return {"who": config.command.upper(), "rows": g.prompts_per_step * completions,
                "dtype": None if g.engine_dtype is None else _config_dtype(g.engine_dtype, device)}
    if config.command == "distill":
        d = config.distill
        return {"who": "Distillation", "teacher": d.teacher, "dtype": None,
                "rows": d.prompts_per_step if d.mode == "on_policy" else None}
    return {}


def _config_dtype(dtype: str | None, device: str) -> str:
    """The planner's dtype for a config's model.dtype: null takes bf16 on a GPU and f32 on a
    CPU (linnet's default), auto bf16 where the device computes it natively (a CPU's flags
    are read from this machine), float16 counts as bf16 (the same bytes)."""
    if dtype == "float32" or (dtype is None and device == "cpu"):
        return "f32"
    if dtype == "auto" and device == "cpu":
        from linnet import hardware

        return "bf16" if hardware.cpu_prefers_bf16() else "f32"
    return "bf16"


def _pretrain_vocab(config) -> int:
    """The vocabulary a pretraining config's model gets: model.vocab, else its prepared
    cache's, else its tokenizer's (a card's, or a tokenizer.json), else the BPE it would
    train."""
    from pathlib import Path

    from linnet.pretrain.cache import read_manifest

    if config.model.vocab:
        return config.model.vocab
    if Path(config.data.cache, "manifest.json").is_file():
        return read_manifest(config.data.cache)["vocab_size"]
    if config.data.tokenizer is None:
        return config.data.vocab_size
    if config.data.tokenizer in cards.REGISTRY:
        return cards.REGISTRY[config.data.tokenizer].vocab
    path = Path(config.data.tokenizer)
    path = path / "tokenizer.json" if path.is_dir() else path
    if path.is_file():
        import tokenizers

        return tokenizers.Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)
    raise ValueError(f"data.tokenizer={config.data.tokenizer!r}: not a card, a tokenizer.json or a directory holding "
                     "one, and no prepared cache gives the vocabulary; run `linnet prepare` first, or set model.vocab")


def _held_beside(beside: dict[str, Any], card, inputs: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The JSON entries and the lines after the plan for what `_beside` describes: not in
    the plan's totals (vLLM's share is taken out of the usable memory instead)."""
    extras, notes = {}, []
    method, dtype = inputs["method"], beside.get("dtype") or inputs["method"].dtype
    if beside.get("vllm_share"):
        share = beside["vllm_share"]
        extras["sampling"] = {"engine": "vllm", "gpu_memory_share": share,
                              "bytes": share * inputs["cluster"].gpu.memory_gb * GB}
        notes.append(f"{beside['who']}'s vLLM engine takes {share:.0%} of each GPU's memory "
                     f"({gb(extras['sampling']['bytes'])}) for its weights and KV cache, left out of the usable memory "
                     f"above ({beside['group']}.vllm_gpu_memory_utilization).")
    if beside.get("teacher"):
        try:
            teacher = cards.resolve(beside["teacher"])
        except (ValueError, OSError):  # the plan stands without it; the run itself would refuse the name
            extras["teacher"] = {"card": beside["teacher"], "params": None, "bytes": None}
            notes.append(f"{beside['who']} also holds its frozen teacher {beside['teacher']}, not in the totals "
                         "above: no card by that name here (registered or a local directory) to size it.")
        else:
            extras["teacher"] = {"card": teacher.name, "params": teacher.params(),
                                 "bytes": teacher.params() * DTYPES[method.dtype]}
            notes.append(f"{beside['who']} also holds its frozen teacher, not in the totals above: a {method.dtype} "
                         f"copy of {teacher.name} ({count(teacher.params())} parameters, "
                         f"{gb(extras['teacher']['bytes'])}).")
    if beside.get("rows"):
        # a completion and its prompt fit one packed row, so the cache needs at most tokens slots
        cluster = inputs["cluster"]  # a base split by fsdp or cut into stages is not shared (runs.engine_quantize)
        shares = method.name == "qlora" and cluster.shard != "fsdp" and cluster.pipeline == 1
        sampling = extras["sampling"] = sampling_memory(card, beside["rows"], inputs["workload"].tokens, dtype, method,
                                                        shares, cpu=inputs["workload"].device == "cpu")
        weights = "the weights outside the NF4 blocks it shares, with f32 adapters" if shares else "the weights"
        if sampling["reordered_bytes"]:
            weights += f", and {gb(sampling['reordered_bytes'])} of them again reordered for oneDNN"
        notes.append(f"{beside['who']} also holds its sampling engine, not in the totals above: a {dtype} copy of "
                     f"{weights} ({gb(sampling['weights_bytes'])}) and a KV cache of {sampling['rows']} completions "
                     f"x at most {sampling['slots']:,} positions ({gb(sampling['cache_bytes'])}).")
    return extras, notes


def main(argv: list[str] | None = None) -> int:
    """`linnet plan CARD [flags]` or `linnet plan --config RUN.yaml`: print the plan; 2 on bad input."""
    args = vars(parser().parse_args(argv))
    if args.pop("textbook"):
        return _textbook(args)
    card, as_json, side_by_side, suggesting = args.pop("card"), args.pop("json"), args.pop("compare"), args.pop("suggest")
    config = args.pop("config")
    beside: dict[str, Any] = {}
    names = _Flags(FLAGS)  # how an error names a setting: the flag, or the config's field it came from
    try:
        if config is None and card is not None and card.endswith((".yaml", ".yml")):
            raise ValueError(f"{card} is a YAML file, not a card; give a run's config as --config {card}")
        if config is not None:
            settings = settings_from_config(config)
            config_card = settings.pop("card")
            beside = settings.pop("beside", {})
            card = card or config_card
            names.update({k: CONFIG_FIELDS[k] for k in settings if k in CONFIG_FIELDS and args.get(k) is None})
            args = {**settings, **{k: v for k, v in args.items() if v is not None}}
        if card is None:
            raise ValueError("give a CARD, or --config RUN.yaml")
        inputs = plan_inputs(args)
        if suggesting:
            return _suggest(card, inputs, as_json)
        if side_by_side:
            methods = list(dict.fromkeys((*COMPARED, inputs["method"].name)))
            plans = compare(card, **inputs, names=methods)
        else:
            plans = [estimate(card, **inputs)]
        extras, notes = _held_beside(beside, cards.resolve(card), inputs)
    except SettingError as error:
        print(f"linnet plan: error: {error.named(names)}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as error:
        print(f"linnet plan: error: {error}", file=sys.stderr)
        return 2
    if as_json:
        data = [p.to_dict() for p in plans] if side_by_side else plans[0].to_dict()
        if extras:
            data = {"plans": data, **extras} if side_by_side else {**data, **extras}
        print(json.dumps(data, indent=2))
    else:
        print(render(plans))
        for note in notes:
            print(note)
    return 0


def _suggest(card, inputs: dict[str, Any], as_json: bool) -> int:
    """`linnet plan CARD --suggest --gpus N`: the layouts table (or JSON)."""
    from linnet.plan.layouts import render as render_layouts
    from linnet.plan.layouts import suggest

    card = cards.resolve(card)
    layouts = suggest(card, inputs["method"], inputs["workload"], inputs["cluster"])
    if as_json:
        keys = ("settings", "shard", "split", "pipeline", "context", "expert", "peak", "fits", "tokens_per_second")
        print(json.dumps([{k + "_bytes" * (k == "peak"): getattr(x, k) for k in keys} for x in layouts], indent=2))
        return 0
    w, c = inputs["workload"], inputs["cluster"]
    print(render_layouts(layouts, f"{card.name}, {inputs['method'].name}: context length {w.tokens} x micro-batch size "
                                  f"{w.micro_batch_size} on {c.gpus} x {c.gpu.name} "
                                  f"({c.usable_bytes / 1e9:.1f} GB usable each)"))
    return 0


def _textbook(args: dict[str, Any]) -> int:
    """`linnet plan --textbook [CARD]`: the module's table beside linnet's plan."""
    from linnet.plan.textbook import render, textbook

    rank, seq, batch = args.get("rank") or 16, args.get("tokens") or 4096, args.get("micro_batch_size") or 1
    names = [args["card"]] if args.get("card") else ["llama-3.1-8b-instruct", "llama-3.1-70b-instruct"]
    rows, plans = [], []
    try:
        for name in names:
            for row in textbook(name, rank=rank, tokens=seq, micro_batch=batch):
                rows.append(row)
                plans.append(estimate(name, **plan_inputs({"method": row.method, "rank": rank, "tokens": seq,
                                                           "micro_batch_size": batch, "activation_checkpointing": "full"})))
    except (ValueError, OSError) as error:
        print(f"linnet plan: error: {error}", file=sys.stderr)
        return 2
    print(render(rows, plans))
    return 0
