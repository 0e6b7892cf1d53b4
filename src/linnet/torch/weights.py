"""Safetensors in and out under the Hugging Face checkpoint names."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from linnet.experts import checkpoint_name, expert_checkpoint_names
from linnet.files.adapters import ADAPTER_SUFFIXES, PEFT_PREFIX, from_peft_name, to_peft_name
from linnet.files.atomic import atomic_path, safetensors_file, write_text
from linnet.files.weights import ignorable, locate_weights
from linnet.paths import CRITIC, select
from linnet.torch.distributed import merged_at_first, world
from linnet.torch.quantize import dense, quant_states
from linnet.torch.sharding import full

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja")


_DTYPES = {
    "float32": torch.float32, "f32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "f16": torch.float16, "fp16": torch.float16,
}


def as_dtype(dtype: Any) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use float32, bfloat16 or float16") from None


def bind_weights(model: torch.nn.Module, source: str | os.PathLike, *, strict: bool = False) -> list[str]:
    """Copy tensors from safetensors into the parameters of the same path (cast to each
    parameter's dtype). strict=True requires every parameter; a tensor the model has no
    place for, or of another shape, is always an error, found before anything is copied.
    PEFT adapter names are read as linnet's (call add_lora with the same patterns and rank
    first). Returns the paths loaded."""
    params = dict(model.named_parameters())
    loaded: list[str] = []
    with torch.no_grad():
        for name, tensor in read_weights(model, source, strict=strict):
            params[name].copy_(tensor)
            loaded.append(name)
    return loaded


def read_weights(model: torch.nn.Module, source: str | os.PathLike, *,
                 strict: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(parameter path, tensor) for each tensor of `source` the model has a place for, read
    one at a time in the model's parameter order (so a loader can fill, and quantize, one
    block before the next is read). Every name and shape is checked, as bind_weights
    describes, before the first tensor is read. The model's parameters may be on meta."""
    params = dict(model.named_parameters())
    quantized = quant_states(model)
    # an NF4 weight is checked against its layer's dense shape, then refused by name
    shapes = {name: _dense_shape(model, name, quantized[name]) if name in quantized else tuple(p.shape)
              for name, p in params.items()}
    experts = expert_tensors(model)  # stacked experts: one checkpoint tensor an expert and part
    for name, parts in experts.items():
        stacked = shapes.pop(name)
        shapes.update(dict.fromkeys((n for each in parts for n in each),
                                    (stacked[1] // len(parts[0]), *stacked[2:])))
    family = model.card.family
    found = locate_weights(source, shapes, model.card.name, strict=strict,
                           rename=lambda key: from_peft_name(key) if key.startswith(PEFT_PREFIX)
                           else checkpoint_name(key, family, back=True),
                           skip=lambda name: ignorable(name, model.card.tied_embeddings)
                           or (name == "score.weight" and not hasattr(model, "score")))  # a reward model's head
    nf4 = {n: name for name in quantized for n in [name, *(k for each in experts.get(name, []) for k in each)]}
    stored = [name for name in found if name in nf4]
    if stored:
        raise ValueError(f"{found[stored[0]][0]}: {nf4[stored[0]]} is stored in NF4 in this model; base weights are "
                         "read before quantizing: nest.load(card, weights=..., quantize='nf4')")
    folds = adapter_folds(model.card.adapters, shapes)  # the earlier runs' adapters, when the card is a run
    with ExitStack() as files:
        opened = {}

        def read(name: str) -> torch.Tensor:
            file, key = found[name]
            if file not in opened:
                opened[file] = files.enter_context(safetensors_file(file, "pt", device="cpu"))
            return opened[file].get_tensor(key)

        for name in params:
            if name in experts:
                if all(n in found for each in experts[name] for n in each):
                    yield name, torch.stack([torch.cat([read(n) for n in each]) for each in experts[name]])
            elif name in found:
                tensor = read(name)
                yield name, fold(tensor, folds[name]) if name in folds else tensor


def expert_tensors(model) -> dict[str, list[list[str]]]:
    """Each stacked experts tensor's path -> each expert's checkpoint names (linnet.experts)."""
    card = model.card
    if card.experts is None:
        return {}
    return {name: stored for name, _ in model.named_parameters()
            if (stored := expert_checkpoint_names(name, card.family, card.experts.count))}


def adapter_folds(adapters: Sequence[str], shapes: dict[str, tuple[int, ...]]) -> dict[str, list[tuple]]:
    """Weight path -> [(A, B, scale, DoRA magnitude or None), ...] of PEFT adapter
    directories applied in order (a run's adapters over its base, the next run's over
    those), each checked against the weight's shape before any weight is read."""
    folds: dict[str, list[tuple]] = {}
    for directory in adapters:
        config = Path(directory) / "adapter_config.json"
        if config.is_file() and json.loads(config.read_text()).get("target_parameters"):
            raise ValueError(f"{directory}: adapters on a mixture of experts' stacked tensors are not folded in as the "
                             "weights are read yet; merge the run (linnet export RUN --merge --out DIR) and load DIR")
        scale, file = _adapter_scale(Path(directory))
        with safetensors_file(file, "pt", device="cpu") as f:
            tensors = {from_peft_name(key): f.get_tensor(key).float() for key in f.keys()}
        for layer in sorted({n.rsplit(".", 1)[0] for n in tensors}):
            a, b = tensors.get(f"{layer}.lora_a"), tensors.get(f"{layer}.lora_b")
            weight = f"{layer}.weight"
            if a is None or b is None or shapes.get(weight) != (b.shape[0], a.shape[1]):
                raise ValueError(f"{directory}: its adapter of {layer} does not fit the base model's {weight} "
                                 f"{shapes.get(weight)}; is this adapter over this base?")
            folds.setdefault(weight, []).append((a, b, scale, tensors.get(f"{layer}.lora_magnitude")))
    return folds


def _adapter_scale(directory: Path) -> tuple[float, Path]:
    """(scale, tensor file) of a PEFT adapter directory, or of a checkpoint of a run of
    adapters (checkpoints/step-…: its trained.safetensors, the settings in the run's
    config.json)."""
    if (directory / "adapter_config.json").is_file():
        info = json.loads((directory / "adapter_config.json").read_text())
        rank, alpha, rslora, file = info["r"], info["lora_alpha"], info.get("use_rslora"), "adapter_model.safetensors"
    else:
        lora = json.loads((directory.parent.parent / "config.json").read_text())["lora"]
        rank, alpha, rslora, file = lora["rank"], lora["alpha"], lora.get("rslora"), "trained.safetensors"
    return (alpha / rank ** 0.5 if rslora else alpha / rank), directory / file


def fold(weight: torch.Tensor, adapters: list[tuple]) -> torch.Tensor:
    """`weight` with each adapter merged in, in float32: W + scale * B @ A, DoRA's rows
    rescaled to its magnitude (as `Linear.merged_weight`); back in the weight's dtype."""
    w = weight.float()
    for a, b, scale, magnitude in adapters:
        w = w + scale * (b @ a)
        if magnitude is not None:
            w = w * (magnitude / torch.linalg.vector_norm(w, dim=1))[:, None]
    return w.to(weight.dtype)


def _dense_shape(model, name: str, state) -> tuple[int, ...]:
    """The shape an NF4 weight had (stacked experts': one state an expert)."""
    if isinstance(state, list):
        return len(state), *state[0].shape
    layer = model.get_submodule(name.rsplit(".", 1)[0])
    return layer.out_features, layer.in_features


def save_weights(model, path: str | os.PathLike, *, dtype=None, names: str = "hf",
                 include: Sequence[str] | None = None, exclude: Sequence[str] | None = None,
                 merged: bool = False) -> None:
    """Write the parameters as safetensors in `dtype` (default: the model's compute
    dtype). include / exclude: glob patterns over the model's paths picking what to write
    (default everything but a PPO critic, which is no part of the decoder), e.g. include=["*.lora_a", "*.lora_b"] for the adapters alone.
    names: "hf" writes each tensor under the name transformers and PEFT read (the
    checkpoint names; adapters as PEFT's `base_model.model.<layer>.lora_A.weight`), "linnet"
    under the model's own paths (`<layer>.lora_a`); bind_weights reads either. A path
    ending in .safetensors is one file; otherwise a directory gets model.safetensors and,
    for a whole model, the config.json and tokenizer files transformers needs to load it.
    merged=True writes the plain model the adapters make (each W + scale * B @ A, NF4
    dequantized; linnet.torch.lora.merged_weights) without changing `model`, sharded or not.
    Under torchrun every process calls it (a sharded model's parts are gathered) and the
    first writes."""
    if names not in ("hf", "linnet"):
        raise ValueError(f"save_weights: names={names!r}; use 'hf' (transformers' and PEFT's names) or 'linnet' "
                         "(the model's parameter paths)")
    dtype = model.dtype if dtype is None else as_dtype(dtype)
    paths = [n for n, _ in model.named_parameters() if include is not None or not n.startswith(CRITIC)]
    chosen = select(paths, True if include is None else include, what="include")
    chosen -= select(paths, exclude, what="exclude")
    def stored(name: str) -> str:
        if names != "hf":
            return name
        return to_peft_name(name) if name.endswith(ADAPTER_SUFFIXES) else checkpoint_name(name, model.card.family)

    if merged:
        from linnet.torch.lora import merged_weights

        plain = merged_weights(model)
    else:
        states = quant_states(model)
        plain = ((n, dense(full(p.detach()), states.get(n))) for n, p in model.named_parameters())
    experts = expert_tensors(model) if names == "hf" else {}
    tensors = {}
    for n, t in plain:
        if n in chosen:  # stacked experts as one tensor an expert, as checkpoints hold them
            t = t.to("cpu", dtype)
            tensors.update({k: part.contiguous() for e, each in enumerate(experts[n])
                            for k, part in zip(each, t[e].chunk(len(each)))} if n in experts
                           else {stored(n): t.contiguous()})
    if getattr(model, "pipe", None) is not None:  # each stage holds its own blocks
        tensors = merged_at_first(tensors)
    if world()[0] != 0:
        return
    path = Path(path)
    target = path if path.suffix == ".safetensors" else path / "model.safetensors"
    with atomic_path(target) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    if target is path or include is not None or exclude is not None:
        return
    config = model.card.hf_config()
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    write_text(path / "config.json", json.dumps(config, indent=2) + "\n")
    if model.card.tokenizer.path is not None:
        source = Path(model.card.tokenizer.path)
        for name in TOKENIZER_FILES:
            src = source / name
            if src.is_file() and src.resolve() != (path / name).resolve():
                with atomic_path(path / name) as tmp:
                    shutil.copyfile(src, tmp)
        if (source / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
            write_text(path / "tokenizer_config.json", json.dumps(special_tokens(model.card, source), indent=2) + "\n")
        if model.card.chat_template:  # the one it trained with (a run's data.chat_template), over the folder's
            write_text(path / "chat_template.jinja", model.card.chat_template)


def special_tokens(card, source: Path) -> dict:
    """A tokenizer_config.json for a bare tokenizer.json: the card's BOS, EOS and padding
    tokens by name, so transformers (and lm-evaluation-harness through it) know where a
    sequence starts and stops."""
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(source / "tokenizer.json"))
    named = {"bos_token": card.bos_token_id, "eos_token": (card.eos_token_ids or (None,))[0],
             "pad_token": card.pad_token_id}
    out = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": card.max_positions}
    out.update({key: raw.id_to_token(i) for key, i in named.items() if i is not None and raw.id_to_token(i)})
    return out


def attach_adapter(model, directory: str | os.PathLike) -> None:
    """Add the adapters a PEFT directory describes and load their weights."""
    info = json.loads((Path(directory) / "adapter_config.json").read_text())
    targets = [f"{t}.weight" if not t.endswith(".weight") else t for t in info["target_modules"] or []]
    model.add_lora(targets + list(info.get("target_parameters") or []),  # a mixture of experts' stacked tensors
                   rank=info["r"], alpha=info["lora_alpha"], rslora=info.get("use_rslora", False),
                   dora=info.get("use_dora", False))
    bind_weights(model, directory)
