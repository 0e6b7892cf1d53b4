"""The model passes of the sampling engine (`linnet.torch.engine`), around its KV cache.

Two caches a layer: the prompts' keys and values [prompts, K, S, d], each prompt once
however many completions it has, and the generated tokens' [B, K, N, d]. The layers are
the model's own modules (norms, projections, q/k norms, `rotate`, MLP): only the attention
around the cache is written here, so the engine's numbers are the model's.

Shapes: B rows (completions) in the batch, G prompts, n rows a prompt at most, P positions
of the packed prefill row, H query heads, K kv heads, r = H/K, d head dim, D hidden,
V vocabulary, S prompt slots, L layers.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from linnet.torch.losses import onednn_linear, onednn_reorder
from linnet.torch.model import rotate


class Batch:
    """Which prompt each row of the batch attends to, as the decode pass reads it. The
    prompt cache is read one prompt at a time with all its rows as queries (a group's
    prompt keys are read once, not once a completion): `grid` [groups, n] lists each
    prompt's rows (padded with a repeat), `place` [B] each row's cell in it; both None
    when the rows are the grid in order (no row has stopped yet), unless `grid` (a compiled
    engine: one graph whether or not rows have stopped)."""

    groups: int
    n: int
    grid: torch.Tensor | None
    place: torch.Tensor | None
    prompt_len: torch.Tensor  # [B]
    unseen: torch.Tensor  # [B, 1, 1, S]: prompt slots past the row's prompt
    first: torch.Tensor | None  # [B]: the generated slot each row's completion began at (None: 0 for every row)

    def __init__(self, group: list[int], lengths: list[int], slots: int, device, *, grid: bool = False,
                 first: list[int] | None = None):
        members: list[list[int]] = [[] for _ in lengths]
        for row, g in enumerate(group):
            members[g].append(row)
        self.groups, self.n = len(lengths), max(map(len, members))
        self.grid = self.place = None
        if grid or any(len(m) != self.n for m in members) or group != sorted(group):
            self.grid = torch.tensor([m + [m[0] if m else 0] * (self.n - len(m)) for m in members], device=device)
            place = [0] * len(group)
            for g, m in enumerate(members):
                for j, row in enumerate(m):
                    place[row] = g * self.n + j
            self.place = torch.tensor(place, device=device)
        self.prompt_len = torch.tensor([lengths[g] for g in group], device=device)
        self.unseen = (torch.arange(slots, device=device)[None] >= self.prompt_len[:, None])[:, None, None]
        self.first = None if first is None else torch.tensor(first, device=device)


class Reordered(NamedTuple):
    """The engine's weights again, in oneDNN's blocked layout (`reorder_weights`): per layer
    (weight, bias) pairs for q, k and v as one product, o, gate and up as one product, and
    down (or None: the layers' own modules); the head's weight (None where reordering it
    does not pay)."""

    layers: list[tuple[tuple, tuple, tuple, tuple]] | None
    head: torch.Tensor | None

    def layer(self, i: int):
        return None if self.layers is None else self.layers[i]


def reorder_weights(model, layers: bool) -> Reordered | None:
    """A float32 model's head (and with `layers`, its projections, q/k/v and gate/up each
    fused into one product) reordered for oneDNN on the CPU, else None (another dtype or
    device, NF4 weights, a torch without oneDNN). A decode step's products have few rows
    (32 typically), where oneDNN runs a reordered weight faster than the plain product. The
    reordered copies cost the weights' memory again and must be redone whenever the weights
    change."""
    if (model.device.type != "cpu" or model.dtype != torch.float32 or model.quantized
            or not torch.backends.mkldnn.is_available()):
        return None

    def reorder(*linears):
        weight = torch.cat([layer.weight.detach() for layer in linears]).contiguous()
        bias = None if linears[0].bias is None else torch.cat([layer.bias.detach() for layer in linears])
        return torch.ops.mkldnn._reorder_linear_weight(weight, 32), bias  # 32: rows a decode step, typically

    blocks = [(reorder(b.self_attn.q_proj, b.self_attn.k_proj, b.self_attn.v_proj), reorder(b.self_attn.o_proj),
               reorder(b.mlp.gate_proj, b.mlp.up_proj), reorder(b.mlp.down_proj)) for b in model.model.layers] \
        if layers and model.card.experts is None else None  # experts run through their own module
    return Reordered(blocks, onednn_reorder(model.head_weight, 32))


def prefill_pass(model, tokens_P, positions_P, prompt_P, last, keys, values, cos_Sd, sin_Sd, attend, reordered=None):
    """The prompts' pass: every layer's keys/values into prompt-cache row `prompt_P` at
    their positions; the logits [prompts, V] at `last`. attend: the attention function of
    the model's path (bounds bound), or a [P, P] mask for one SDPA call (the compiled pass).
    reordered: the weights reordered for oneDNN (`reorder_weights`), or None for the model's own."""
    P = len(tokens_P)
    cos, sin = cos_Sd[positions_P][:, None], sin_Sd[positions_P][:, None]  # [P, 1, d]
    x = F.embedding(tokens_P, model.model.embed_tokens.weight).to(model.dtype)
    for i, block in enumerate(model.model.layers):
        mine = None if reordered is None else reordered.layer(i)
        q_PHd, k_PKd, v_PKd = _project(block.self_attn, block.input_layernorm(x), cos, sin, mine)
        keys[i][prompt_P, :, positions_P] = k_PKd
        values[i][prompt_P, :, positions_P] = v_PKd
        q, k, v = q_PHd.transpose(0, 1)[None], k_PKd.transpose(0, 1)[None], v_PKd.transpose(0, 1)[None]
        if isinstance(attend, torch.Tensor):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attend, enable_gqa=q.shape[1] != k.shape[1])
        else:
            out = attend(q, k, v)
        x = _finish(block, x, out[0].transpose(0, 1).reshape(P, -1), mine)
    return _logits(model, x[last], reordered)


def decode_pass(model, tokens_B, step_1, prompt_len_B, grid_Gn, place_B, unseen_B11S, keys, values,
                 prompt_keys, prompt_values, cos_Sd, sin_Sd, G: int, n: int, new: int, reordered=None, first_B=None):
    """One decode step: row b's token at slot `step_1` of its row in the generated tokens'
    cache, attending to its prompt (the prompt cache, a group's rows together) and to its
    first `new` generated slots (those past `step_1` masked). Returns [B, V] f32; `reordered`
    as in `prefill_pass`. `first_B`: the slot each row's completion began at, for rows that
    joined a running batch (linnet.torch.continuous): its earlier slots are masked and its
    positions count from there; None: every row began at slot 0.

    The one-query attention is batched matmuls and one softmax over the prompt's slots and
    the generated ones together (SDPA's CPU kernel is built for long queries)."""
    B = len(tokens_B)
    pos_B = prompt_len_B + step_1 if first_B is None else prompt_len_B + step_1 - first_B
    cos, sin = cos_Sd[pos_B][:, None], sin_Sd[pos_B][:, None]  # [B, 1, d]
    slot = torch.arange(new, device=tokens_B.device)
    later = (slot > step_1).expand(B, 1, 1, new)
    if first_B is not None:
        later = later | (slot < first_B[:, None])[:, None, None]
    unseen = torch.cat([unseen_B11S, later], dim=-1)  # [B, 1, 1, S + new]
    S = unseen_B11S.shape[-1]
    x = F.embedding(tokens_B, model.model.embed_tokens.weight).to(model.dtype)
    for i, block in enumerate(model.model.layers):
        attn = block.self_attn
        H, K, d = attn.shape
        r = H // K
        mine = None if reordered is None else reordered.layer(i)
        q_BHd, k_BKd, v_BKd = _project(attn, block.input_layernorm(x), cos, sin, mine)
        keys[i][:B].index_copy_(2, step_1, k_BKd[:, :, None])
        values[i][:B].index_copy_(2, step_1, v_BKd[:, :, None])
        q = q_BHd.view(B, K, r, d)
        by_prompt = _to_grid(q, grid_Gn, G, n)  # [G, K, n r, d]
        old = _from_grid(by_prompt @ prompt_keys[i][:G, :, :S].transpose(-1, -2), place_B, G, n)  # [B, K, r, S]
        scores = torch.cat([old, q @ keys[i][:B, :, :new].transpose(-1, -2)], dim=-1).float()
        scores = scores.mul_(d**-0.5).masked_fill_(unseen, -math.inf)
        probs = torch.softmax(scores, dim=-1).to(model.dtype)  # [B, K, r, S + new]
        out = _from_grid(_to_grid(probs[..., :S], grid_Gn, G, n) @ prompt_values[i][:G, :, :S], place_B, G, n)
        out = out + probs[..., S:] @ values[i][:B, :, :new]  # [B, K, r, d]
        x = _finish(block, x, out.reshape(B, -1), mine)
    return _logits(model, x, reordered)


def _to_grid(t_BKrX: torch.Tensor, grid_Gn, G: int, n: int) -> torch.Tensor:
    """[B, K, r, X] per row -> [G, K, n r, X]: each prompt's rows side by side."""
    if grid_Gn is not None:
        t_BKrX = t_BKrX[grid_Gn.flatten()]
    _, K, r, X = t_BKrX.shape
    return t_BKrX.reshape(G, n, K, r, X).transpose(1, 2).reshape(G, K, n * r, X)


def _from_grid(t_GKnX: torch.Tensor, place_B, G: int, n: int) -> torch.Tensor:
    """The inverse of `_to_grid`: [G, K, n r, X] -> [B, K, r, X]."""
    _, K, nr, X = t_GKnX.shape
    t = t_GKnX.view(G, K, n, nr // n, X).transpose(1, 2).reshape(G * n, K, nr // n, X)
    return t if place_B is None else t[place_B]


def _logits(model, h_ND: torch.Tensor, reordered: Reordered | None = None) -> torch.Tensor:
    """The f32 logits; the head's product through oneDNN where `reordered` has it (the
    step's largest: about 1.5x the plain product at V = 8192, AVX2 EPYC)."""
    h_ND = model.model.norm(h_ND)
    if reordered is not None and reordered.head is not None:
        return onednn_linear(h_ND, reordered.head)
    return (h_ND @ model.head_weight.to(model.dtype).T).float()


def _project(attn, h_ND, cos_N1d, sin_N1d, reordered=None):
    """q [N, H, d], k and v [N, K, d] of one attention module, q and k rotated; through
    the layer's reordered weights (`Reordered.layers`) when given."""
    if reordered is None:
        q, k, v = attn.project(h_ND)
    else:
        H, K, d = attn.shape
        N = h_ND.shape[0]
        q, k, v = onednn_linear(h_ND, *reordered[0]).split([H * d, K * d, K * d], dim=-1)
        q, k, v = (_adapted(layer, h_ND, t) for layer, t in ((attn.q_proj, q), (attn.k_proj, k), (attn.v_proj, v)))
        q, k, v = q.view(N, H, d), k.view(N, K, d), v.view(N, K, d)
        if attn.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
    return rotate(q, cos_N1d, sin_N1d), rotate(k, cos_N1d, sin_N1d), v


def _finish(block, x_ND, attended_NE, reordered=None):
    """The rest of `Block.forward` once attention is done: output projection, residual, MLP."""
    if reordered is None:
        x_ND = x_ND + block.self_attn.o_proj(attended_NE)
        return x_ND + block.mlp(block.post_attention_layernorm(x_ND))
    x_ND = x_ND + _adapted(block.self_attn.o_proj, attended_NE, onednn_linear(attended_NE, *reordered[1]))
    h_ND = block.post_attention_layernorm(x_ND)
    gate, up = onednn_linear(h_ND, *reordered[2]).chunk(2, dim=-1)
    mid = F.silu(_adapted(block.mlp.gate_proj, h_ND, gate)) * _adapted(block.mlp.up_proj, h_ND, up)
    return x_ND + _adapted(block.mlp.down_proj, mid, onednn_linear(mid, *reordered[3]))


def _adapted(layer, x_NI, y_NO):
    """A fused product's share `y` of `layer` with the layer's low-rank additions, where an
    adapter bank gave it some (linnet.torch.adapter_bank: each row's own adapter)."""
    add = getattr(layer, "low_rank", None)
    return y_NO if add is None else add(x_NI, y_NO)
