"""Adapters on disk, for both backends: linnet's adapter paths and PEFT's files.

An adapted linear layer `<layer>` keeps its low-rank pair beside its weight as
`<layer>.lora_a` [r, in] and `<layer>.lora_b` [out, r] (and DoRA's `<layer>.lora_magnitude`
[out]). PEFT stores the same tensors as `base_model.model.<layer>.lora_A.weight`,
`lora_B.weight` and `lora_magnitude_vector`: the names translate one to one, so a directory
written here loads with `peft.PeftModel.from_pretrained`, and PEFT's own load back into a
linnet model (`bind_weights`).
"""

from __future__ import annotations

import json
import numbers
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

ADAPTERS = ["*.lora_a", "*.lora_b"]
MAGNITUDES = "*.lora_magnitude"  # DoRA's, beside the adapters
ADAPTER_SUFFIXES = (".lora_a", ".lora_b", ".lora_magnitude")

# (linnet suffix, PEFT suffix) for one adapter's tensors under `base_model.model.`
PEFT_NAMES = ((".lora_a", ".lora_A.weight"), (".lora_b", ".lora_B.weight"), (".lora_magnitude", ".lora_magnitude_vector"))
PEFT_PREFIX = "base_model.model."


def check_adapter_options(*, rank: int | None = None, dropout: float | None = None,
                          shapes: Mapping[str, Sequence[int]] | None = None) -> None:
    """Refuse an adapter rank or dropout neither backend's add_lora can take (None: not
    given), and a rank larger than the smallest side of an adapted layer (`shapes`: each
    adapted layer's (out, in) features): B @ A of rank r on an out x in weight has at most
    min(out, in) independent directions, so the rest of the adapter is parameters that
    add nothing."""
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, numbers.Integral)):
        raise ValueError(f"add_lora: rank={rank!r}; it must be an integer")
    if rank is not None and rank < 1:
        raise ValueError(f"add_lora: rank={rank}; it must be at least 1")
    if dropout is not None and not 0.0 <= dropout < 1.0:
        raise ValueError(f"add_lora: dropout={dropout}; it must be in [0, 1)")
    if rank is not None and shapes:
        layer, (out, inputs) = min(shapes.items(), key=lambda item: min(item[1]))
        if rank > min(out, inputs):
            raise ValueError(f"add_lora: rank={rank} is larger than the adapted layer {layer} ({out} x {inputs}): an "
                             f"adapter's update B @ A has at most {min(out, inputs)} independent directions there, so "
                             f"the largest useful rank is {min(out, inputs)} (a config's lora.rank); lower the rank, "
                             "or adapt only larger layers")


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


def write_peft(directory: str | os.PathLike, adapters: dict[str, np.ndarray], info: dict, base_model) -> None:
    """The PEFT files (adapter_model.safetensors, adapter_config.json) for `adapters`
    (linnet path -> float32 array) and the add_lora settings `info` (rank, alpha, dropout,
    rslora, layers, dora, and the adapted experts' stacked tensors)."""
    from safetensors.numpy import save_file

    from linnet.files.atomic import atomic_path, write_text

    tensors = {to_peft_name(n): np.ascontiguousarray(t) for n, t in adapters.items()}
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
        **({"target_parameters": info["experts"]} if info.get("experts") else {}),  # stacked experts' tensors
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    write_text(directory / "adapter_config.json", json.dumps(config, indent=2) + "\n")
