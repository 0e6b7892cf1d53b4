"""Low-rank adapters (LoRA, Hu et al. 2021, arXiv:2106.09685).

A matching linear layer computes x @ W.T + (x @ A.T) @ B.T * alpha / rank with A [r, in]
and B [out, r] stored beside W as `<layer>.lora_a` and `<layer>.lora_b`. B starts at
zero, so a fresh adapter leaves the model unchanged. rsLoRA (Kalajdzievski 2023,
arXiv:2312.03732) scales by alpha / sqrt(rank) instead, which keeps the update's size
steady as the rank grows.

PEFT stores the same tensors as `base_model.model.<layer>.lora_A.weight` / `lora_B.weight`:
`PEFT_NAMES` translates, so an adapter directory written here loads with
`peft.PeftModel.from_pretrained`, and one written by PEFT loads with `bind_weights`.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from linnet.files import atomic_path, write_text

ADAPTERS = ["*.lora_a", "*.lora_b"]
MAGNITUDES = "*.lora_magnitude"  # DoRA's, beside the adapters
ADAPTER_SUFFIXES = (".lora_a", ".lora_b", ".lora_magnitude")

# (linnet suffix, PEFT suffix) for one adapter's tensors under `base_model.model.`
PEFT_NAMES = ((".lora_a", ".lora_A.weight"), (".lora_b", ".lora_B.weight"), (".lora_magnitude", ".lora_magnitude_vector"))
PEFT_PREFIX = "base_model.model."


def _linears(model) -> dict[str, torch.nn.Module]:
    from linnet.torch.model import Linear

    return {name: m for name, m in model.named_modules() if isinstance(m, Linear)}


def add_lora(model, patterns: str | Sequence[str], *, rank: int = 16, alpha: float = 32,
             dropout: float = 0.0, rslora: bool = False, dora: bool = False) -> list[str]:
    """Add adapters to the linear layers whose weight path (or layer path) matches one
    of `patterns`; freeze everything else. dora=True adds DoRA's trainable magnitude per
    output row (Liu et al. 2024, arXiv:2402.09353), starting at each row's norm. Returns
    the adapted layer paths."""
    if rank < 1:
        raise ValueError(f"add_lora: rank={rank}; it must be at least 1")
    if getattr(model, "copies", None) is not None:
        raise ValueError("add_lora: adapters on a split model (tensor_parallel) are not supported yet")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"add_lora: dropout={dropout}; it must be in [0, 1)")
    if dora and dropout:
        raise ValueError("add_lora: DoRA with adapter dropout is not supported yet; set dropout=0")
    # the output head feeds the blockwise losses directly, never through Linear.forward
    linears = {n: m for n, m in _linears(model).items() if n != "lm_head"}
    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    chosen: list[str] = []
    for pattern in patterns:
        hits = [n for n in linears if fnmatch.fnmatch(f"{n}.weight", pattern) or fnmatch.fnmatch(n, pattern)]
        if not hits:
            head = fnmatch.fnmatch("lm_head.weight", pattern) or fnmatch.fnmatch("lm_head", pattern)
            raise ValueError(
                f"add_lora: pattern {pattern!r} matches no linear weight; paths look like "
                "model.layers.0.self_attn.q_proj.weight" + ("; the output head takes no adapter (train it in "
                                                            "full with trainable='lm_head.weight')" if head else "")
            )
        chosen += [n for n in hits if n not in chosen]
    scale = alpha / math.sqrt(rank) if rslora else alpha / rank
    for name in chosen:
        layer = linears[name]
        if layer.lora_a is not None:
            raise ValueError(f"add_lora: {name} already has an adapter; merge_lora() first")
        d_out, d_in = layer.weight.shape
        a = torch.empty(rank, d_in, device=layer.weight.device)
        torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # PEFT's default for A
        layer.lora_a = torch.nn.Parameter(a)
        layer.lora_b = torch.nn.Parameter(torch.zeros(d_out, rank, device=layer.weight.device))
        layer.lora_scale, layer.lora_dropout = scale, dropout
        if dora:
            with torch.no_grad():
                layer.lora_magnitude = torch.nn.Parameter(torch.linalg.vector_norm(layer.weight.float(), dim=1))
    model.lora = dict(rank=rank, alpha=alpha, dropout=dropout, rslora=rslora, layers=chosen, dora=dora)
    model.set_trainable(ADAPTERS + ([MAGNITUDES] if dora else []))
    return chosen


def merge_lora(model) -> None:
    """Fold every adapter into its weight (W + scale * B @ A in float32, DoRA's rows
    rescaled to their magnitudes), then drop the adapters."""
    from linnet.torch.sharding import is_sharded

    if is_sharded(model):
        raise ValueError("merge_lora: this model is sharded (fully_shard); save the adapters (save_to=) and "
                         "merge them on one process, into a model loaded whole")
    for layer in _linears(model).values():
        if layer.lora_a is None:
            continue
        with torch.no_grad():
            layer.weight.copy_(layer.merged_weight().to(layer.weight.dtype))
        del layer.lora_a, layer.lora_b, layer.lora_magnitude
        layer.lora_a = layer.lora_b = layer.lora_magnitude = None
    model.lora = None


def to_peft_name(name: str) -> str:
    for ours, theirs in PEFT_NAMES:
        if name.endswith(ours):
            return PEFT_PREFIX + name[: -len(ours)] + theirs
    raise ValueError(f"{name} is not an adapter tensor")


def from_peft_name(name: str) -> str:
    """linnet path of a PEFT adapter tensor name (adapter name segments dropped)."""
    body = name.removeprefix(PEFT_PREFIX)
    body = re.sub(r"\.lora_([AB])\.(?:[\w-]+\.)?weight$", lambda m: f".lora_{m.group(1).lower()}", body)
    return re.sub(r"\.lora_magnitude_vector(?:\.[\w-]+)?(?:\.weight)?$", ".lora_magnitude", body)


def save_peft(model, directory: str | os.PathLike, *, base_model: str | None = None) -> None:
    """Write a PEFT adapter directory: adapter_config.json + adapter_model.safetensors."""
    if not getattr(model, "lora", None):
        raise ValueError("save_peft: the model has no adapters; call add_lora first")
    adapters = {n: p.detach().to("cpu", torch.float32) for n, p in model.named_parameters()
                if n.endswith(ADAPTER_SUFFIXES)}
    write_peft(directory, adapters, model.lora, base_model or model.card.weights.repo or model.card.weights.path)


def write_peft(directory: str | os.PathLike, adapters: dict[str, torch.Tensor], info: dict, base_model) -> None:
    """The PEFT files for `adapters` (linnet path -> tensor) and the add_lora settings
    `info` (rank, alpha, dropout, rslora, layers); shared by both backends."""
    tensors = {to_peft_name(n): t.contiguous() for n, t in adapters.items()}
    directory = Path(directory)
    with atomic_path(directory / "adapter_model.safetensors") as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": info["rank"],
        "lora_alpha": info["alpha"],
        "lora_dropout": info["dropout"],
        "use_rslora": info["rslora"],
        "use_dora": info.get("dora", False),
        "target_modules": info["layers"],  # full paths: PEFT matches them by suffix
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    write_text(directory / "adapter_config.json", json.dumps(config, indent=2) + "\n")
