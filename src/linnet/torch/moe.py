"""A mixture-of-experts block's MLP (linnet.experts): a router and `count` expert MLPs held
as stacked tensors, each position through its `per_token` chosen experts, dropless (every
position goes through every expert it chose; no capacity).

For each expert the positions that chose it are gathered, go through its SwiGLU MLP
(x @ gate.T, x @ up.T, silu(gate) * up @ down.T), are weighed by their routing weight and
added back: a loop over the experts that some position chose, each a few dense products on
its own rows (what transformers computes, with the experts' weights side by side).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from linnet.cards import Card


class Router(nn.Module):
    """One logit an expert from the hidden state (`weight` [count, hidden], no bias)."""

    def __init__(self, hidden: int, count: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(count, hidden))


class ExpertWeights(nn.Module):
    """Every expert's SwiGLU weights, stacked: gate_proj and up_proj [count, intermediate,
    hidden], down_proj [count, hidden, intermediate]."""

    def __init__(self, hidden: int, count: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(count, intermediate, hidden))
        self.up_proj = nn.Parameter(torch.empty(count, intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(count, hidden, intermediate))


class MoE(nn.Module):
    """The experts' MLP of one block: [N, hidden] -> [N, hidden]."""

    def __init__(self, card: Card):
        super().__init__()
        e = card.experts
        self.per_token, self.normalize = e.per_token, e.normalize
        self.gate = Router(card.hidden, e.count)
        self.experts = ExpertWeights(card.hidden, e.count, e.intermediate)

    def route(self, x_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(router logits [N, count], each position's chosen experts [N, per_token] and
        their weights [N, per_token] in x's dtype): softmax in float32 over the logits,
        the largest kept, renormalized to sum to 1 where the family says so."""
        logits = F.linear(x_ND, self.gate.weight.to(x_ND.dtype))
        weights, chosen = torch.topk(torch.softmax(logits.float(), dim=-1), self.per_token, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, chosen, weights.to(x_ND.dtype)

    def forward(self, x):
        shape = x.shape
        x_ND = x.reshape(-1, shape[-1])
        _, chosen_NK, weights_NK = self.route(x_ND)
        w = self.experts
        out = torch.zeros_like(x_ND)
        flat = chosen_NK.flatten()
        order = torch.argsort(flat, stable=True)  # (position, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=w.gate_proj.shape[0]).tolist()
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            pairs = order[start:start + n]
            start += n
            rows = pairs // self.per_token
            h = x_ND.index_select(0, rows)
            dtype = h.dtype
            mid = F.silu(F.linear(h, w.gate_proj[expert].to(dtype))) * F.linear(h, w.up_proj[expert].to(dtype))
            y = F.linear(mid, w.down_proj[expert].to(dtype)) * weights_NK.flatten()[pairs, None]
            out = out.index_add(0, rows, y)
        return out.view(shape)
