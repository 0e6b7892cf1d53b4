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
from linnet.pretrain.packed import PackedLlama

SCHEMES = ("awc", "atc")


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

    @torch.no_grad()
    def step(self, closure=None):
        S = self.model.parameter_storage
        g = S.grad
        # tensor by tensor, as clip_gradients sums an ordinary model's: N = 1 clips identically
        squares = [torch.linalg.vector_norm(v.reshape(v.shape[0], -1), dim=1, dtype=torch.float32) ** 2
                   for v in self.model.views(g).values()]
        norms = torch.stack(squares).sum(0).sqrt()
        if self.clip is not None:
            g.mul_((self.clip / (norms + 1e-6)).clamp(max=1.0)[:, None].to(g.dtype))
        self.local_norms = norms
        r, gamma = self.updates, self.gamma()
        self.last_gamma = gamma
        if self.scheme == "awc":
            self.model.mix_(self.topology, r, gamma=gamma)
            self._adamw(S, g)
        else:
            self._adamw(S, g)
            self.model.mix_(self.topology, r, gamma=gamma)

    def _adamw(self, S: torch.Tensor, g: torch.Tensor) -> None:
        group, state = self.param_groups[0], self.state[S]
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        state["step"] += 1
        t = float(state["step"])
        m, v = state["exp_avg"], state["exp_avg_sq"]
        if wd:
            S.mul_(torch.where(self.decay_mask, 1 - lr * wd, 1.0))
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        step_size = lr / (1 - beta1 ** t)
        denom = (v.sqrt() / math.sqrt(1 - beta2 ** t)).add_(eps)
        S.addcdiv_(m, denom, value=-step_size)
