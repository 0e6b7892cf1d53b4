"""The one AdamW every PyTorch command builds."""

from __future__ import annotations

import torch

from linnet.torch.distributed import world


def adamw(model: torch.nn.Module, *, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
          shard: str = "none") -> torch.optim.Optimizer:
    """AdamW over the trained parameters, with decoupled weight decay on matrices (the
    embedding, a tied head and adapters included) and none on vectors (norms, biases,
    DoRA's magnitudes); its state split across the processes with shard="zero"
    (ZeroRedundancyOptimizer)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for _, p in named if p.ndim >= 2], "weight_decay": weight_decay},
              {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    options = dict(lr=lr, betas=tuple(betas), eps=eps)
    if shard == "zero" and world()[1] > 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=torch.optim.AdamW,
                                            weight_decay=groups[0]["weight_decay"], **options)
        for extra in groups[1:]:
            optimizer.add_param_group(extra)
        return optimizer
    return torch.optim.AdamW(groups, **options)
