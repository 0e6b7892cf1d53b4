"""Many LoRA adapters over one frozen base, applied unmerged, each row of a batch with its
own (S-LoRA's and Punica's idea): the base's products run once for every row, and each
adapter's low-rank product runs only on the positions routed to it.

    bank = AdapterBank(model, {"tenant-a": "runs/a/final", "tenant-b": "peft_dir"})
    with bank.routed(torch.tensor([0, 0, 1, -1, ...])):   # an adapter a position; -1: the base
        logits = model(...)

Each adapted layer carries every adapter's A [r, in] and B [out, r] and scale; a forward
hook adds, for each adapter present in the routing, x[rows] @ A.T @ B.T * scale to those
rows of the base layer's output (a gather, two small products and a scatter-add an
adapter: the segmented product). The adapters may have different ranks and targets; a
layer an adapter does not adapt is the base for it. A DoRA adapter also rescales its rows'
outputs: y = r * (x @ W.T + x @ A.T @ B.T * scale) + b, with r = m / ||W + scale * B @ A||
per output row, computed once when the adapter is read.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from linnet.torch.engine import Engine
from linnet.torch.model import Linear

GATHERED_ROWS = 64  # up to this many rows (a decode step's) each row's adapter is gathered; past it, one product an adapter


class AdapterBank:
    """Adapters by name (their order is their index in a routing) over `model`, a frozen
    base without adapters of its own; `add` and `remove` change them between passes."""

    def __init__(self, model, adapters: Mapping[str, str | os.PathLike]):
        if getattr(model, "lora", None):
            raise ValueError("AdapterBank: the model has adapters of its own; give it the plain base")
        self.model, self.names = model, []
        self.layers: dict[str, list] = {}  # layer path -> [(A, B, scale, DoRA's r or None) or None an adapter]
        self._stacks: dict[str, tuple] = {}
        self._hooks: dict[str, object] = {}
        self._route: torch.Tensor | None = None
        self._keep: torch.Tensor | None = None
        for name, directory in adapters.items():
            self.add(name, directory)

    def add(self, name: str, directory: str | os.PathLike) -> None:
        """Read one more adapter (a PEFT directory or a LoRA run) into the bank."""
        if name in self.names:
            raise ValueError(f"AdapterBank: {name!r} is loaded already; remove it first")
        found = _read(self.model, name, directory)
        for entries in self.layers.values():
            entries.append(None)
        for path, a, b, scale, rescale in found:
            self.layers.setdefault(path, [None] * (len(self.names) + 1))[-1] = (a, b, scale, rescale)
        self.names.append(name)
        self._restack()

    def remove(self, name: str) -> None:
        """Drop an adapter; the layers no adapter adapts any longer lose their hook."""
        k = self.index(name)
        self.names.pop(k)
        for entries in self.layers.values():
            entries.pop(k)
        self.layers = {path: entries for path, entries in self.layers.items() if any(e is not None for e in entries)}
        self._restack()

    def _restack(self) -> None:
        """Hooks on the adapted layers (where they are called), and each one's `low_rank`
        (where the engine's passes run a fused copy of its weights instead,
        linnet.torch.passes)."""
        modules = dict(self.model.named_modules())
        for path in set(self._hooks) - set(self.layers):
            self._hooks.pop(path).remove()
            del modules[path].low_rank
        for path in set(self.layers) - set(self._hooks):
            self._hooks[path] = modules[path].register_forward_hook(self._hook(path))
            modules[path].low_rank = functools.partial(self.adapted, path)
        self._stacks = {path: _stacked(entries) for path, entries in self.layers.items()}
        self._bias = {path: None if modules[path].bias is None else modules[path].bias.detach() for path in self.layers}

    def index(self, name: str) -> int:
        if name not in self.names:
            raise ValueError(f"AdapterBank: no adapter {name!r}; these are loaded: {', '.join(self.names) or 'none'}")
        return self.names.index(name)

    @contextlib.contextmanager
    def routed(self, route: torch.Tensor):
        """Within the block, position i of what the model computes goes through adapter
        route[i] (-1: none, the base alone)."""
        self._route, self._keep, self._pick = route, None, None
        try:
            yield self
        finally:
            self._route = self._keep = self._pick = None

    def adapted(self, path: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The base layer's output `y` [N, out] of its input `x` [N, in] with each row's
        adapter added (as routed; `y` itself when nothing is routed)."""
        route = self._route
        if route is None:
            return y
        adapters, bias = self.layers[path], self._bias[path]
        if len(x) <= GATHERED_ROWS:  # a decode step: every adapter's A at once, each row keeps its own
            a, b, rescale = self._stacks[path]
            rank = a.shape[0] // (len(adapters) + 1)
            if self._keep is None:  # [rows, adapters + 1, 1], one-hot: alike in every layer of the pass
                self._pick = torch.where(route < 0, len(adapters), route)  # the last slot: zeros, the base alone
                self._keep = (torch.arange(len(adapters) + 1, device=x.device) == self._pick[:, None])[:, :, None]
            low = (x @ a.to(x.dtype).T).view(len(x), -1, rank) * self._keep.to(x.dtype)
            y = y.addmm(low.view(len(x), -1), b.to(x.dtype).T)
            return y if rescale is None else _rescaled(y, rescale.to(x.dtype)[self._pick], bias)
        for k in torch.unique(route).tolist():  # a prefill: each adapter's product on its rows
            if k < 0 or adapters[k] is None:
                continue
            a, b, scale, rescale = adapters[k]
            rows = (route == k).nonzero().squeeze(1)
            low = (x.index_select(0, rows) @ a.to(x.dtype).T) @ b.to(x.dtype).T
            if rescale is None:
                y = y.index_add(0, rows, low, alpha=scale)
            else:
                y = y.index_copy(0, rows, _rescaled(y.index_select(0, rows) + low * scale, rescale.to(x.dtype), bias))
        return y

    def _hook(self, path: str):
        def add(module, inputs, output):
            x = inputs[0].reshape(-1, inputs[0].shape[-1])
            return self.adapted(path, x, output.reshape(-1, output.shape[-1])).view(output.shape)

        return add

    def close(self) -> None:
        """Remove the hooks: the model is the plain base again."""
        modules = dict(self.model.named_modules())
        for path, hook in self._hooks.items():
            hook.remove()
            del modules[path].low_rank
        self._hooks = {}


def _stacked(adapters: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Every adapter's A [r, in] and scale x B [out, r] of one layer, zero-padded to the
    largest rank r, side by side with a zero adapter last (the base's rows, and adapters
    that leave the layer alone): A [(K + 1) r, in] and B [out, (K + 1) r]; and, when a DoRA
    adapter adapts the layer, each adapter's r [K + 1, out] (ones for the others), else None."""
    first = next(x for x in adapters if x is not None)
    rank = max(x[0].shape[0] for x in adapters if x is not None)
    a = first[0].new_zeros(len(adapters) + 1, rank, first[0].shape[1])
    b = first[1].new_zeros(first[1].shape[0], len(adapters) + 1, rank)
    rescale = None
    if any(x is not None and x[3] is not None for x in adapters):
        rescale = first[1].new_ones(len(adapters) + 1, first[1].shape[0])
    for k, x in enumerate(adapters):
        if x is not None:
            a[k, :x[0].shape[0]] = x[0]
            b[:, k, :x[1].shape[1]] = x[1] * x[2]
            if x[3] is not None:
                rescale[k] = x[3]
    return a.flatten(0, 1), b.flatten(1, 2), rescale


def _rescaled(y: torch.Tensor, rescale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """DoRA's output from the adapted product y = x @ W.T + low + b: r * (y - b) + b."""
    return y * rescale if bias is None else (y - bias) * rescale + bias


def _read(model, name: str, directory: str | os.PathLike):
    """(layer path, A, B, scale) of each layer a PEFT adapter (or a LoRA run) adapts, read
    by attaching it to the base for a moment (the base's weights untouched)."""
    from linnet.torch.weights import attach_adapter

    path = Path(directory)
    if not (path / "adapter_config.json").is_file() and (path / "final" / "adapter_config.json").is_file():
        path = path / "final"
    config = path / "adapter_config.json"
    if not config.is_file():
        raise ValueError(f"adapter {name!r}: {directory} holds no adapter_config.json (a PEFT adapter or a LoRA run)")
    attach_adapter(model, path)
    found = []
    try:
        for layer_path, layer in model.named_modules():
            if isinstance(layer, Linear) and layer.lora_a is not None:
                rescale = None
                if layer.lora_magnitude is not None:  # DoRA: r = m / ||W + scale * B @ A|| per output row
                    with torch.no_grad():
                        rescale = layer.lora_magnitude.float() / torch.linalg.vector_norm(layer.adapted_weight(), dim=1)
                found.append((layer_path, layer.lora_a.detach().clone(), layer.lora_b.detach().clone(),
                              float(layer.lora_scale), rescale))
    finally:
        for layer in model.modules():
            if isinstance(layer, Linear):
                layer.lora_a = layer.lora_b = layer.lora_magnitude = None
                layer.lora_scale = 0.0
        model.lora = None
        model.requires_grad_(False)
    return found


class AdapterEngine(Engine):
    """An Engine over a plain base holding many adapters unmerged (an AdapterBank): each
    prompt of a call names its adapter, and one batch mixes them.

        engine = AdapterEngine(nest.load(base), {"a": "runs/a", "b": "runs/b"})
        engine.sample([ids_1, ids_2, ids_3], adapters=["a", "b", None], temperature=0)

    It samples eagerly; where the engine runs fused, reordered copies of the projections
    (oneDNN on a CPU) the passes add each layer's `low_rank` to their outputs."""

    def __init__(self, model, adapters: Mapping[str, str | os.PathLike], **options):
        if options.get("compile") or getattr(model, "compiled", None):
            raise ValueError("AdapterEngine: samples eagerly; load the base without compile=")
        super().__init__(model, **options)
        self.bank = AdapterBank(self.model, adapters)
        self._prompt_ids: list[int] = []
        self._row_ids: list[int] = []

    def sample(self, prompts, n: int = 1, *, adapters=None, **options):
        """`Engine.sample`, prompt i through adapter adapters[i] (None: the base)."""
        self._route(prompts, n, adapters)
        return super().sample(prompts, n, **options)

    def steps(self, prompts, *, adapters=None, **options):
        """`Engine.steps`, prompt i through adapter adapters[i] (None: the base)."""
        self._route(prompts, 1, adapters)
        yield from super().steps(prompts, **options)

    def _route(self, prompts, n: int, adapters) -> None:
        adapters = [None] * len(prompts) if adapters is None else list(adapters)
        if len(adapters) != len(prompts):
            raise ValueError(f"AdapterEngine: {len(adapters)} adapters for {len(prompts)} prompts; name one a prompt")
        self._prompt_ids = [-1 if a is None else self.bank.index(a) for a in adapters]
        self._row_ids = [self._prompt_ids[r // n] for r in range(len(prompts) * n)]

    def _prefill(self, prompts, cos_Sd, sin_Sd, first_row: int = 0):
        lengths = torch.tensor([len(p) for p in prompts])
        route = torch.repeat_interleave(torch.tensor(self._prompt_ids[:len(prompts)]), lengths)
        with self.bank.routed(route.to(self.model.device)):
            return super()._prefill(prompts, cos_Sd, sin_Sd, first_row)

    def _decode(self, tokens_B, batch, step, cos_Sd, sin_Sd):
        route = torch.tensor(self._row_ids[:len(tokens_B)], device=self.model.device)
        with self.bank.routed(route):
            return super()._decode(tokens_B, batch, step, cos_Sd, sin_Sd)

    def _compact(self, cache, done, used):
        order = super()._compact(cache, done, used)
        if order is not None and self._keys and cache[0] is self._keys[0]:  # the rows moved: their adapters too
            self._row_ids = [self._row_ids[i] for i in order]
        return order
