"""PackedAdamW: every worker's local AdamW, clipping and mixing, over three arenas.

    model = PackedLlama(card, 4).to(device)       # on its final device first
    optimizer = PackedAdamW(model, config)        # config: a PretrainConfig
    local_mean_losses(model, x, y).sum().backward()
    optimizer.step()                              # clip locally, mix (awc) / update / mix (atc)

The parameters (`model.parameter_storage`) and both moments (`first_moment_storage`,
`second_moment_storage`) are [N, D_padded] arenas with the same offsets, so one update is a
handful of elementwise kernels over all workers and tensors at once. The update is
torch.optim.AdamW's, element for element (decoupled weight decay on matrices only; norms
and the zero padding are never decayed, and padding, whose gradient is zero, stays zero).

A step, for each worker on its own gradient: clip it to `optimizer.grad_clip` (null: only
measure), then by `decentralized.scheme`
- awc (adapt while combining): mix the parameters, then apply the AdamW update;
- atc (adapt then combine): apply the AdamW update (weight decay included), then mix.
The mixing event of update r uses the topology's phase r and gamma from adaptive
consensus (1 without it). Moments never mix. `local_norms` holds the last step's norms.
"""

from __future__ import annotations

import math

import torch

from linnet.pretrain.consensus import AdaptiveConsensus
from linnet.pretrain.decentralized import PackedLlama, mix_columns_

SCHEMES = ("awc", "atc")
BLOCK = 1 << 15  # arena columns an update step works on at once (N x 128 KiB in float32)


class PackedAdamW(torch.optim.Optimizer):
    def __init__(self, model: PackedLlama, config, *, consensus: AdaptiveConsensus | None = None):
        o = config.optimizer
        d = getattr(config, "decentralized", None)
        self.scheme = d.scheme if d is not None else "awc"
        self.topology = d.topology if d is not None else "complete"
        if self.scheme not in SCHEMES:
            raise ValueError(f"decentralized.scheme={self.scheme!r}; use awc or atc")
        self.model, self.clip, self.consensus = model, o.grad_clip, consensus
        self.local_norms: torch.Tensor | None = None
        self.last_gamma = 1.0
        S = model.parameter_storage
        super().__init__([S], dict(lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay))
        decay = torch.zeros(S.shape[1], dtype=torch.bool, device=S.device)
        for slot in model.layout:
            decay[slot.start:slot.start + slot.numel] = len(slot.shape) >= 2
        self.decay_mask = decay  # the matrices: decayed
        self.state[S] = {"step": torch.zeros((), dtype=torch.float32), "exp_avg": torch.zeros_like(S),
                         "exp_avg_sq": torch.zeros_like(S)}

    @property
    def first_moment_storage(self) -> torch.Tensor:
        return self.state[self.model.parameter_storage]["exp_avg"]

    @property
    def second_moment_storage(self) -> torch.Tensor:
        return self.state[self.model.parameter_storage]["exp_avg_sq"]

    @property
    def updates(self) -> int:
        """Updates applied so far: the zero-based index (and topology phase) of the next."""
        return int(self.state[self.model.parameter_storage]["step"])

    def gamma(self) -> float:
        """The next update's mixing strength."""
        if self.consensus is None:
            return 1.0
        return self.consensus.gamma(self.updates, self.param_groups[0]["lr"])

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Mark the gradient buffer stale: the next backward overwrites it (kept allocated)."""
        self.model.zero_grad()

    @torch.no_grad()
    def step(self, closure=None):
        S = self.model.parameter_storage
        g = S.grad
        # tensor by tensor, as clip_gradients sums an ordinary model's: N = 1 clips identically
        squares = [torch.linalg.vector_norm(v.reshape(v.shape[0], -1), dim=1, dtype=torch.float32) ** 2
                   for v in self.model.views(g).values()]
        norms = torch.stack(squares).sum(0).sqrt()
        self.local_norms = norms
        scale = (self.clip / (norms + 1e-6)).clamp(max=1.0)[:, None].to(g.dtype) if self.clip is not None else None
        r, gamma = self.updates, self.gamma()
        self.last_gamma = gamma
        group, state = self.param_groups[0], self.state[S]
        state["step"] += 1
        t = float(state["step"])
        m, v = state["exp_avg"], state["exp_avg_sq"]
        # a block of columns at a time, every operation on it before the next: the arenas
        # are read once from memory instead of once an operation (bench/packed.md: with the
        # gradient buffer, the 4.2M x 4 step went from 0.69x to 0.99x the sequential workers')
        for a in range(0, S.shape[1], BLOCK):
            cols = slice(a, a + BLOCK)
            Sb, gb = S[:, cols], g[:, cols]
            if scale is not None:
                gb.mul_(scale)
            if self.scheme == "awc":
                mix_columns_(Sb, self.topology, r, gamma)
            self._adamw(Sb, gb, m[:, cols], v[:, cols], self.decay_mask[cols], group, t)
            if self.scheme == "atc":
                mix_columns_(Sb, self.topology, r, gamma)

    @staticmethod
    def _adamw(S, g, m, v, decay, group, t: float) -> None:
        """torch.optim.AdamW's update, element for element, on blocks of the arenas."""
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        if wd:
            S.mul_(torch.where(decay, 1 - lr * wd, 1.0))
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        step_size = lr / (1 - beta1 ** t)
        denom = (v.sqrt() / math.sqrt(1 - beta2 ** t)).add_(eps)
        S.addcdiv_(m, denom, value=-step_size)
