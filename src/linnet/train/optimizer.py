"""The one AdamW every PyTorch command builds: float32 states, or bitsandbytes' 8-bit ones."""

from __future__ import annotations

import torch

from linnet.torch.distributed import world

KINDS = ("adamw", "adamw8bit", "paged_adamw8bit")


def adamw(model: torch.nn.Module, *, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
          shard: str = "none", kind: str = "adamw") -> torch.optim.Optimizer:
    """AdamW over the trained parameters, with decoupled weight decay on matrices (the
    embedding, a tied head and adapters included) and none on vectors (norms, biases,
    DoRA's magnitudes); its state split across the processes with shard="zero"
    (ZeroRedundancyOptimizer).

    kind="adamw8bit" keeps both moments in 8 bits, blockwise quantized (bitsandbytes'
    AdamW8bit, Dettmers et al. 2022): 2 bytes a parameter instead of 8 (tensors under 4096
    values keep float32 moments); shard="zero" splits those too, each parameter's states
    whole on one process, so the blocks quantize as in one process; under fully_shard the
    adapters (whole on every process, FSDP ignoring them) keep whole 8-bit states on every
    process, as without sharding; a pipeline's stages each their own. "paged_adamw8bit"
    also lets CUDA page them out to CPU memory under pressure (PagedAdamW8bit; CUDA only)."""
    if kind not in KINDS:
        raise ValueError(f"adamw: kind={kind!r}; use one of {', '.join(KINDS)}")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for _, p in named if p.ndim >= 2], "weight_decay": weight_decay},
              {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    options = dict(lr=lr, betas=tuple(betas), eps=eps)
    cls = torch.optim.AdamW
    if kind != "adamw":
        cls = _eight_bit(paged=kind == "paged_adamw8bit", params=[p for _, p in named])
    if shard == "zero" and world()[1] > 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=cls,
                                            weight_decay=groups[0]["weight_decay"], **options)
        for extra in groups[1:]:
            optimizer.add_param_group(extra)
        return optimizer
    return cls(groups, **options)


def _eight_bit(*, paged: bool, params: list[torch.Tensor]) -> type[torch.optim.Optimizer]:
    """bitsandbytes' 8-bit AdamW class for these options, or a clear refusal."""
    from torch.distributed.tensor import DTensor

    from linnet.torch.quantize import bitsandbytes

    if any(isinstance(p, DTensor) for p in params):
        raise ValueError("adamw: 8-bit states for trained weights split across processes (a full fine-tune under "
                         "fully_shard, or tensor_parallel) are not supported yet; use shard='zero' to split the "
                         "states instead, train adapters over a sharded base (their 8-bit states stay whole), or "
                         "use float32 states")
    device = params[0].device if params else torch.device("cpu")
    if paged and device.type != "cuda":
        raise ValueError(f"adamw: paged 8-bit states page CUDA memory out to the host; the model is on {device.type}: "
                         "use the 8-bit states unpaged")
    optim = bitsandbytes().optim
    return _plain_states(optim.PagedAdamW8bit if paged else optim.AdamW8bit)


def _plain_states(cls: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """bitsandbytes' optimizer whose state_dict keeps its quantization tensors beside the
    other states, as torch's optimizers do: bitsandbytes nests them in a dict (for FSDP1's
    gathering, which linnet does not use) that torch.distributed.checkpoint's flattening
    loses; a pipeline's stages need that flattening (each holds other parameter groups).
    load_state_dict reads either form."""
    return type(cls.__name__, (cls,), {"state_dict": torch.optim.Optimizer.state_dict,
                                       "__doc__": _plain_states.__doc__, "__module__": __name__})
