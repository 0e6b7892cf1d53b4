"""Where a checkpoint's tensors are: its safetensors files, and the file and key of each
tensor a model has a place for, every name and shape checked from the files' headers
before any tensor is read. Both backends read weights through here
(`linnet.torch.weights.read_weights`, `linnet.jax.model.load_model`), so a bad checkpoint
gets the same message from either. No torch, no JAX."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path

from linnet.files.atomic import safetensors_file


def weight_files(source: str | os.PathLike) -> list[Path]:
    """The safetensors files of a checkpoint: a file, or a directory holding
    model.safetensors or a sharded model.safetensors.index.json."""
    path = Path(source)
    if path.is_file():
        return [path]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise FileNotFoundError(f"{index}: lists shard {missing[0]}, which is not in {path}")
        return [path / s for s in shards]
    for name in ("model.safetensors", "adapter_model.safetensors"):
        if (path / name).is_file():
            return [path / name]
    raise FileNotFoundError(
        f"{path}: no weights found; expected a .safetensors file, or a directory with "
        "model.safetensors, model.safetensors.index.json or adapter_model.safetensors"
    )


def ignorable(name: str, tied_embeddings: bool) -> bool:
    """Checkpoint tensors that carry nothing a model needs: RoPE's cached frequencies, and
    the head of a tied model (transformers may save it beside the embedding)."""
    return name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and tied_embeddings)


def locate_weights(source: str | os.PathLike, shapes: Mapping[str, tuple[int, ...]], card_name: str, *,
                   strict: bool = True, rename: Callable[[str], str] | None = None,
                   skip: Callable[[str], bool] = lambda name: False) -> dict[str, tuple[Path, str]]:
    """name -> (file, key) for each tensor of `source` that has a place in `shapes` (the
    model's parameter names and shapes), read from the headers alone. `rename` maps a
    stored key to its parameter name; a tensor without a place is an error unless `skip`
    says it carries nothing; so is a shape that differs, and with `strict` a parameter the
    checkpoint lacks."""
    found: dict[str, tuple[Path, str]] = {}
    unexpected: list[str] = []
    for file in weight_files(source):
        with safetensors_file(file, "numpy") as f:
            for key in f.keys():
                name = rename(key) if rename else key
                if name not in shapes:
                    if not skip(name):
                        unexpected.append(name)
                    continue
                shape, needed = tuple(f.get_slice(key).get_shape()), tuple(shapes[name])
                if shape != needed:
                    raise ValueError(f"{file}: {name} has shape {shape} but card {card_name!r} needs "
                                     f"{needed}; are these weights for this card?")
                found[name] = (file, key)
    if unexpected:
        raise ValueError(f"{source}: {len(unexpected)} tensors have no place in card {card_name!r} "
                         f"(e.g. {unexpected[0]}); check the card's family and flags, or the adapters' patterns")
    missing = [n for n in shapes if n not in found]
    if strict and missing:
        raise ValueError(f"{source}: {len(missing)} parameters of card {card_name!r} are missing "
                         f"(e.g. {missing[0]}); is the checkpoint complete?")
    return found
