"""Training in PyTorch: packed batches as tensors, and the trainers."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import torch

from linnet import packing
from linnet.packing import Example, Packed
from linnet.run import History, Step
from linnet.schedules import constant_schedule, cosine_schedule, wsd_schedule
from linnet.torch.distributed import clip_gradients, reduce_gradients
from linnet.train.checkpoint import load_checkpoint, save_checkpoint
from linnet.train.loop import train

__all__ = [
    "Example", "History", "Packed", "Step", "clip_gradients", "constant_schedule",
    "cosine_schedule", "load_checkpoint", "pack", "reduce_gradients", "save_checkpoint",
    "train", "wsd_schedule",
]


def pack(examples: Iterable[Example], tokens: int, *, pad_id: int = 0, pin_memory: bool = False) -> Iterator[Packed]:
    """`linnet.packing.pack` with torch tensors (bounds stay on the host). With
    pin_memory, rows are pinned so the copy to a GPU can overlap compute."""
    for row in packing.pack(examples, tokens, pad_id=pad_id):
        fields = {}
        for name in ("tokens", "targets", "weights", "positions"):
            t = torch.from_numpy(getattr(row, name))
            fields[name] = t.pin_memory() if pin_memory else t
        yield dataclasses.replace(row, **fields, bounds=torch.from_numpy(row.bounds))
