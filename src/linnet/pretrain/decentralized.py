"""Packed decentralized training: N independent Llama workers computed together.

    model = PackedLlama(card, 4, seed=0)            # each worker = nest.load(card, weights="random", seed=0)
    losses = local_mean_losses(model, tokens, targets)  # [N]: each worker's mean over its own tokens
    losses.sum().backward()                         # independent gradients, no division by N
    model.mix_("one_peer_ring", step)               # one gossip event (linnet.pretrain.consensus)

Every parameter of every worker lives in one arena, `parameter_storage` [N, D_padded]:
worker i's tensor `name` is row i, columns [start, start + numel) viewed in its shape, each
tensor starting on a 64-element boundary (`layout`). Forward slices those views out of the
arena, so the gradient lands in one [N, D_padded] arena too, and a layer is one batched
matmul over the workers (bmm), not a loop. Attention sees workers x sequences as one batch.
The head alone runs worker by worker, through the chunked cross-entropy every linnet model
uses, so no [tokens, vocab] logits are ever held.

The architecture is the pretraining card's (tied embeddings, RoPE, RMSNorm, SwiGLU, no
biases); the parameter names are the ordinary Decoder's, so `local_state_dict(i)` loads in
`nest.load` and, saved with `to_decoder(...).save_weights`, in transformers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from linnet.cards import Card
from linnet.pretrain.consensus import TOPOLOGIES, mixing_matrix, peer
from linnet.torch.losses import linear_cross_entropy
from linnet.torch.model import rope_frequencies, rope_tables, rotate

ALIGN = 64  # every tensor of the arena starts on a multiple of 64 elements


@dataclass(frozen=True)
class Slot:
    """Where one named tensor of a worker lives in the arena's row."""

    name: str
    shape: tuple[int, ...]
    start: int
    numel: int
    padded_numel: int


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def ordinary(card: Card, seed: int, device="cpu") -> nn.Module:
    """The ordinary float32 Decoder of `card` with the seeded initialisation."""
    from linnet import nest

    return nest.load(card, device=device, dtype="float32", weights="random", seed=seed, trainable=True)


class PackedLlama(nn.Module):
    """`num_models` Llama workers of `card` (or of a pretraining config's `model` group, as
    seed 002 writes `PackedLlama(config.model, 4)`: it needs `model.vocab`), each
    initialised exactly as `nest.load(card, weights="random", seed=seed)`; see the module
    docstring."""

    def __init__(self, card, num_models: int, *, seed: int = 0, dtype: torch.dtype = torch.float32):
        super().__init__()
        if not isinstance(card, Card):
            from linnet.pretrain.recipe import group_card

            card = group_card(card)
        if num_models < 1:
            raise ValueError(f"PackedLlama: num_models={num_models}; it must be at least 1")
        if not card.tied_embeddings or card.qkv_bias or card.o_bias or card.mlp_bias or card.qk_norm:
            raise ValueError(f"PackedLlama: card {card.name!r} is not the pretraining Llama (tied embeddings, no "
                             "biases, no q/k norms); packed training builds that architecture only")
        self.card, self.num_models = card, num_models
        self.compute_dtype = dtype  # master weights stay float32 in the arena
        base = ordinary(card, seed)
        slots, start = [], 0
        for name, p in base.named_parameters():
            slots.append(Slot(name, tuple(p.shape), start, p.numel(), _align(p.numel())))
            start += _align(p.numel())
        self.layout: list[Slot] = slots
        self.slots = {s.name: s for s in slots}
        row = torch.zeros(start)
        for s, p in zip(slots, base.parameters()):
            row[s.start:s.start + s.numel] = p.detach().reshape(-1)
        self.parameter_storage = nn.Parameter(row.repeat(num_models, 1))
        self._gradients: torch.Tensor | None = None
        self._fresh = True  # the next backward overwrites the gradient buffer instead of adding
        self.register_buffer("inv_freq", rope_frequencies(card), persistent=False)

    # -- the arena ---------------------------------------------------------------------

    @property
    def padded_size(self) -> int:
        return self.parameter_storage.shape[1]

    def views(self, arena: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Each named tensor as an [N, *shape] view of `arena` (default: the parameters),
        which aliases it: writing a view writes the arena."""
        if arena is None and torch.is_grad_enabled() and self.parameter_storage.requires_grad:
            return dict(zip(self.slots, _Unpack.apply(self.parameter_storage, self)))
        arena = self.parameter_storage if arena is None else arena
        return dict(zip(self.slots, _unpack(arena, self.layout)))

    def gradient_arena(self) -> torch.Tensor:
        """The [N, D_padded] gradient buffer backward writes into (kept across steps: a
        fresh 68 MB arena a step cost page faults worth 14% of a 4.2M x 4 step)."""
        if self._gradients is None or self._gradients.device != self.parameter_storage.device:
            self._gradients = torch.zeros_like(self.parameter_storage, memory_format=torch.contiguous_format)
        return self._gradients

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The next backward writes the gradients afresh (the buffer stays; see `gradient_arena`)."""
        self._fresh = True

    def real_mask(self) -> torch.Tensor:
        """[D_padded] bool: True where a row holds a parameter, False on padding."""
        mask = torch.zeros(self.padded_size, dtype=torch.bool, device=self.parameter_storage.device)
        for s in self.layout:
            mask[s.start:s.start + s.numel] = True
        return mask

    def local_state_dict(self, i: int) -> dict[str, torch.Tensor]:
        """Worker i's weights under the ordinary Decoder's names: compact float32 CPU
        clones, no padding."""
        row = self.parameter_storage.detach()[i]
        return {s.name: row[s.start:s.start + s.numel].view(s.shape).float().cpu().clone() for s in self.layout}

    def average_state_dict(self) -> dict[str, torch.Tensor]:
        """The global average of the workers' weights (what validation and the root
        epoch exports hold)."""
        row = self.parameter_storage.detach().float().mean(0)
        return {s.name: row[s.start:s.start + s.numel].view(s.shape).cpu().clone() for s in self.layout}

    def load_local_state_dict(self, i: int, weights: dict[str, torch.Tensor]) -> None:
        """Write ordinary weights into worker i's row (names and shapes must match)."""
        with torch.no_grad():
            row = self.parameter_storage[i]
            for s in self.layout:
                row[s.start:s.start + s.numel].copy_(weights[s.name].reshape(-1))

    @torch.no_grad()
    def mix_(self, topology: str, step: int, gamma: float = 1.0) -> None:
        """One mixing event: the workers' parameters become W' @ parameters, with W the
        topology's matrix at `step` and W' = gamma W + (1 - gamma) I. Gradients and
        optimizer moments are left alone."""
        mix_columns_(self.parameter_storage, topology, step, gamma)

    def consensus_distance(self) -> float:
        """sqrt(mean over workers and parameters of (w - mean_w)^2): 0 when the workers agree."""
        S = self.parameter_storage.detach()
        real = int(sum(s.numel for s in self.layout))
        return float(((S - S.mean(0, keepdim=True)).float().pow(2).sum() / (S.shape[0] * real)).sqrt())

    # -- forward -----------------------------------------------------------------------

    def hidden(self, tokens_NBT: torch.Tensor) -> torch.Tensor:
        """[N, B*T, D] final-normed hidden states of every worker's micro-batch."""
        c, dt = self.card, self.compute_dtype
        N, B, T = tokens_NBT.shape
        if N != self.num_models:
            raise ValueError(f"PackedLlama: {N} micro-batches for {self.num_models} workers")
        w = self.views()
        cos, sin = rope_tables(torch.arange(T, device=tokens_NBT.device), self.inv_freq, c, dt)
        table = w["model.embed_tokens.weight"]  # [N, V, D]
        offsets = torch.arange(N, device=tokens_NBT.device)[:, None, None] * c.vocab
        x = F.embedding(tokens_NBT + offsets, table.reshape(N * c.vocab, c.hidden)).to(dt).view(N, B * T, c.hidden)
        H, K, d = c.heads, c.kv_heads, c.head_dim

        def linear(x, name):  # [N, P, in] @ [N, out, in]^T, one batched matmul for all workers
            return torch.bmm(x, w[name].to(dt).transpose(1, 2))

        def heads(x, n):  # [N, B*T, n*d] -> [N*B, n, T, d]
            return x.view(N * B, T, n, d).transpose(1, 2)

        for i in range(c.layers):
            p = f"model.layers.{i}."
            h = _rms_norm(x, w[p + "input_layernorm.weight"], c.norm_eps)
            q = rotate(heads(linear(h, p + "self_attn.q_proj.weight"), H), cos, sin)
            k = rotate(heads(linear(h, p + "self_attn.k_proj.weight"), K), cos, sin)
            v = heads(linear(h, p + "self_attn.v_proj.weight"), K)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=H != K)
            x = x + linear(a.transpose(1, 2).reshape(N, B * T, H * d), p + "self_attn.o_proj.weight")
            h = _rms_norm(x, w[p + "post_attention_layernorm.weight"], c.norm_eps)
            gate, up = linear(h, p + "mlp.gate_proj.weight"), linear(h, p + "mlp.up_proj.weight")
            x = x + linear(F.silu(gate) * up, p + "mlp.down_proj.weight")
        return _rms_norm(x, w["model.norm.weight"], c.norm_eps)


def _unpack(arena: torch.Tensor, layout: list[Slot]) -> list[torch.Tensor]:
    parts = arena.split([s.padded_numel for s in layout], dim=1)
    return [part[:, :s.numel].view(arena.shape[0], *s.shape) for s, part in zip(layout, parts)]


class _Unpack(torch.autograd.Function):
    """The parameter arena as its named [N, *shape] tensors. Backward writes each tensor's
    gradient into the model's persistent gradient buffer (adding when no zero_grad came
    since the last backward) and makes it the arena's .grad."""

    @staticmethod
    def forward(ctx, arena, model):
        ctx.model = model
        return tuple(_unpack(arena.detach(), model.layout))

    @staticmethod
    def backward(ctx, *grads):
        model = ctx.model
        G, fresh = model.gradient_arena(), model._fresh
        for s, g in zip(model.layout, grads):
            into = G[:, s.start:s.start + s.numel]
            if g is None:
                if fresh:
                    into.zero_()
            elif fresh:
                into.copy_(g.reshape(G.shape[0], -1))
            else:
                into.add_(g.reshape(G.shape[0], -1))
        model._fresh = False
        model.parameter_storage.grad = G
        return None, None


def mix_columns_(S: torch.Tensor, topology: str, step: int, gamma: float = 1.0) -> None:
    """Mix the rows of S [N, columns] (the whole arena or a block of its columns) in place:
    complete, toward their mean (exactly the mean at gamma 1: the rows become identical);
    one-peer, S + gamma/2 (S[peer] - S), one pass."""
    n = S.shape[0]
    if topology == "complete":
        average = S.mean(0, keepdim=True).expand_as(S)
        if gamma == 1.0:
            S.copy_(average)
        else:
            S.lerp_(average, gamma)
        return
    if topology not in TOPOLOGIES:
        mixing_matrix(topology, n, step)  # refuses it by name
    S.lerp_(S[[peer(topology, n, step, i) for i in range(n)]], 0.5 * gamma)


def _rms_norm(x, weight_ND, eps: float):
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight_ND[:, None, :].to(x.dtype) * x32.to(x.dtype)


def local_mean_losses(model: PackedLlama, tokens_NBT: torch.Tensor, targets_NBT: torch.Tensor) -> torch.Tensor:
    """[N] float32: each worker's mean next-token cross-entropy over its own targets.
    Their sum is what a packed step differentiates (each worker's gradient is its own)."""
    h = model.hidden(tokens_NBT)
    table = model.views()["model.embed_tokens.weight"]
    targets = targets_NBT.reshape(model.num_models, -1)
    ones = torch.ones(targets.shape[1], device=h.device)
    return torch.stack([linear_cross_entropy(h[i], table[i], targets[i], ones) for i in range(model.num_models)]) \
        / targets.shape[1]


def to_decoder(card: Card, weights: dict[str, torch.Tensor], device="cpu") -> nn.Module:
    """An ordinary float32 Decoder holding `weights` (a local or averaged state dict)."""
    model = ordinary(card, 0, device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights[name])
    return model
