"""The Llama-family decoder in PyTorch, driven by a card.

Architecture (every family): token embedding; `layers` pre-norm blocks of grouped-query
attention with rotary positions (RoPE, optional Llama 3 frequency scaling) and a SwiGLU
MLP; RMSNorm; an output head, optionally tied to the embedding. The card's flags add
q/k/v (and o) biases (Qwen2), per-head q/k RMSNorm before RoPE (Qwen3), MLP biases.

Parameter paths equal the Hugging Face checkpoint names (model.layers.3.self_attn.q_proj
.weight, …), so checkpoints load by name and LoRA targets read like PEFT's.

Numerics: trainable parameters are kept in float32 (master weights) and cast to the
compute dtype where they are used; frozen ones are stored in the compute dtype. Norms,
RoPE tables and losses run in float32.

Shapes: P positions of a packed row, D hidden, H query heads, K kv heads, d head dim,
F intermediate, V vocabulary.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

from linnet import cards
from linnet.cards import Card
from linnet.paths import select
from linnet.torch import attention as attention_paths
from linnet.torch.context import context_row, gather_row, sum_gradients_over, sum_over
from linnet.torch.distributed import reduced_by_shards, sharded_over
from linnet.torch.losses import linear_cross_entropy, linear_token_log_probs, split_cross_entropy, split_token_log_probs
from linnet.torch.moe import MoE
from linnet.torch.quantize import dense, is_quantized, linear_4bit, move_states, quant_states
from linnet.torch.sharding import copies_group, dropout, full, gather_positions, scatter_positions


class Linear(nn.Linear):
    """y = x @ W.T (+ b), the weight cast to the input's dtype; with a low-rank adapter
    (linnet.torch.lora) y += (dropout(x) @ A.T) @ B.T * scale; with DoRA's magnitude m and
    r = m / ||W + scale * B @ A||_row, y = r * (x @ W.T + (x @ A.T) @ B.T * scale) + b, the
    norm held constant in backward as the DoRA paper suggests; with adapter dropout in
    training, as PEFT computes it, y = x @ W.T + (r - 1) * (z @ W.T) + r * (z @ A.T) @ B.T
    * scale + b for z = dropout(x). An nn.Linear, so PyTorch's tensor-parallel styles split it."""

    def __init__(self, d_in: int, d_out: int, bias: bool):
        nn.Module.__init__(self)  # nn.Linear's own init would allocate and initialise the weight
        self.in_features, self.out_features = d_in, d_out
        self.weight = nn.Parameter(torch.empty(d_out, d_in))
        self.bias = nn.Parameter(torch.empty(d_out)) if bias else None
        self.lora_a: nn.Parameter | None = None
        self.lora_b: nn.Parameter | None = None
        self.lora_magnitude: nn.Parameter | None = None
        self.lora_scale = 0.0
        self.lora_dropout = 0.0
        self.quant_state = None  # set when the weight holds NF4 codes (linnet.torch.quantize)

    def forward(self, x):
        if self.lora_magnitude is not None:
            return self._dora(x)
        if self.lora_a is None:
            return self._base(x, None if self.bias is None else self.bias.to(x.dtype))
        z = dropout(x, self.lora_dropout) if self.lora_dropout and self.training else x
        za = F.linear(z, self.lora_a.to(x.dtype))
        # scale and sum folded into one addmm (no [P, out] multiply and add: 1.10x on SFT-LoRA),
        # in place on the base output, which no backward reads: no copy of it into a new tensor
        # (a [P, out] tensor less at the peak). On a 2-D output itself, not a view of it: an
        # in-place op on a view makes backward clone and copy back the whole [P, out] gradient
        x2 = x.reshape(-1, x.shape[-1])
        y = self._base(x2, None if self.bias is None else self.bias.to(x.dtype))
        y.addmm_(za.reshape(-1, za.shape[-1]), self.lora_b.to(x.dtype).T, alpha=self.lora_scale)
        return y.view(*x.shape[:-1], y.shape[-1])

    def _apply(self, fn, recurse=True):
        """model.to(device) moves an NF4 weight's quantization state with its codes."""
        super()._apply(fn, recurse)
        if self.quant_state is not None:
            move_states(self, self.weight.device)
        return self

    def _base(self, x, bias=None):
        """x @ W.T (+ b) with the frozen or trained weight (an NF4 one through bitsandbytes)."""
        if self.quant_state is not None:
            y = linear_4bit(x, self.weight, self.quant_state)
            return y if bias is None else y + bias
        return F.linear(x, self.weight.to(x.dtype), bias)

    def _dora(self, x):
        with torch.no_grad():
            norm = torch.linalg.vector_norm(self.adapted_weight(), dim=1)
        scale = (self.lora_magnitude / norm).to(x.dtype)
        dropped = bool(self.lora_dropout) and self.training
        z = dropout(x, self.lora_dropout) if dropped else x
        low_rank = F.linear(F.linear(z, self.lora_a.to(x.dtype)), self.lora_b.to(x.dtype)) * self.lora_scale
        if dropped:  # PEFT's form: the base output of x as it is, DoRA's rescaling on the dropped input
            y = self._base(x) + (scale - 1) * self._base(z) + scale * low_rank
        else:
            y = (self._base(x) + low_rank) * scale
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def adapted_weight(self, whole=lambda t: t) -> torch.Tensor:
        """W + scale * B @ A in float32 (`whole` gathers sharded tensors; an NF4 W is
        dequantized first)."""
        delta = whole(self.lora_b).float() @ whole(self.lora_a).float()
        return self.dense_weight(whole).float() + delta * self.lora_scale

    def dense_weight(self, whole=lambda t: t) -> torch.Tensor:
        """The base weight as an ordinary tensor: NF4 codes gathered whole, then dequantized."""
        return dense(whole(self.weight), self.quant_state)

    def merged_weight(self, whole=lambda t: t) -> torch.Tensor:
        """The plain weight this adapted layer computes with, in float32."""
        w = self.adapted_weight(whole)
        if self.lora_magnitude is None:
            return w
        return w * (whole(self.lora_magnitude).float() / torch.linalg.vector_norm(w, dim=1))[:, None]



class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.to(x.dtype) * x32.to(x.dtype)


def rope_frequencies(card: Card) -> torch.Tensor:
    """[d/2] float32 inverse frequencies, the card's scaling applied (linnet.cards)."""
    return cards.rope_frequencies(card, torch)


def rope_tables(positions_P: torch.Tensor, inv_freq: torch.Tensor, card: Card, dtype) -> tuple:
    """cos, sin [P, d] for integer positions: float32 angles, YaRN's factor applied, then
    the compute dtype (as transformers computes them)."""
    angles = positions_P[:, None].float() * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    scale = cards.rope_cos_sin_scale(card)
    return (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)


def rotate(x, cos, sin):
    """RoPE in the half-split layout (first half of each head pairs with the second)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, card: Card):
        super().__init__()
        c = card
        self.q_proj = Linear(c.hidden, c.heads * c.head_dim, c.qkv_bias)
        self.k_proj = Linear(c.hidden, c.kv_heads * c.head_dim, c.qkv_bias)
        self.v_proj = Linear(c.hidden, c.kv_heads * c.head_dim, c.qkv_bias)
        self.o_proj = Linear(c.heads * c.head_dim, c.hidden, c.o_bias)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.norm_eps)
        self.qk_norm = c.qk_norm
        self.shape = (c.heads, c.kv_heads, c.head_dim)

    def project(self, x_ND):
        """q [N, H, d], k and v [N, K, d], q and k normed where the card says (Qwen3) and
        not yet rotated: the caller rotates them in the layout its attention wants."""
        H, K, d = self.shape
        N = x_ND.shape[0]
        q = self.q_proj(x_ND).view(N, H, d)
        k = self.k_proj(x_ND).view(N, K, d)
        v = self.v_proj(x_ND).view(N, K, d)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def forward(self, x_PD, cos_Pd, sin_Pd, bounds: list[int], attend, keep=None):
        P = x_PD.shape[0]
        q, k, v = self.project(x_PD)
        q_1HPd = rotate(q.transpose(0, 1), cos_Pd, sin_Pd)[None]
        k_1KPd = rotate(k.transpose(0, 1), cos_Pd, sin_Pd)[None]
        out = attend(q_1HPd, k_1KPd, v.transpose(0, 1)[None], bounds)[0].transpose(0, 1).reshape(P, -1)
        return self.o_proj(out if keep is None else out[keep])


class MLP(nn.Module):
    def __init__(self, card: Card):
        super().__init__()
        self.gate_proj = Linear(card.hidden, card.intermediate, card.mlp_bias)
        self.up_proj = Linear(card.hidden, card.intermediate, card.mlp_bias)
        self.down_proj = Linear(card.intermediate, card.hidden, card.mlp_bias)
        self.tile: int | None = None  # positions computed at a time (Decoder.tile_mlp)

    def forward(self, x):
        return in_tiles(self._whole, x, self.tile)

    def _whole(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def in_tiles(run, x: torch.Tensor, tile: int | None) -> torch.Tensor:
    """run(x), `tile` rows of x at a time (None: at once): in training each tile's
    activations are freed and made again in backward, so one tile's are live at once."""
    if tile is None or x.shape[0] <= tile:
        return run(x)
    if torch.is_grad_enabled():
        return torch.cat([checkpoint(run, part, use_reentrant=False) for part in x.split(tile)])
    return torch.cat([run(part) for part in x.split(tile)])


class Block(nn.Module):
    def __init__(self, card: Card):
        super().__init__()
        self.input_layernorm = RMSNorm(card.hidden, card.norm_eps)
        self.self_attn = Attention(card)
        self.post_attention_layernorm = RMSNorm(card.hidden, card.norm_eps)
        e = card.experts
        self.mlp = MLP(card) if e is None else MoE(card, MLP(card.replace(intermediate=e.shared)) if e.shared else None)
        self.tile: int | None = None  # sequence parallel's MLP tiles of this process's positions (gathered in the MLP)

    def forward(self, x_PD, cos_Pd, sin_Pd, bounds: list[int], attend, keep=None):
        """keep: the positions whose outputs are wanted (the last block's); every position
        still gives its keys and values, the rest of the block runs on `keep` alone."""
        out = self.self_attn(self.input_layernorm(x_PD), cos_Pd, sin_Pd, bounds, attend, keep)
        x_PD = (x_PD if keep is None else x_PD[keep]) + out
        return x_PD + in_tiles(self.mlp, self.post_attention_layernorm(x_PD), self.tile)


class Body(nn.Module):
    def __init__(self, card: Card):
        super().__init__()
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = nn.Parameter(torch.empty(card.vocab, card.hidden))
        self.layers = nn.ModuleList(Block(card) for _ in range(card.layers))
        self.norm = RMSNorm(card.hidden, card.norm_eps)


class _Layout(NamedTuple):
    """Where a packed row's documents start and end, which see a shared prompt, and (with
    context parallel) the attention function over this process's positions."""

    bounds: list[int]
    prefix: list[int] | None
    attend: Any = None


class Decoder(nn.Module):
    """A decoder with the packed entries every trainer calls.

    A batch is a `linnet.packing.Packed` row (numpy or torch fields): see `hidden_packed`,
    `loss_packed`, `log_probs_packed`. `forward(tokens)` gives logits for plain [B, T]
    token batches (each row one document).
    """

    def __init__(self, card: Card, dtype: torch.dtype = torch.float32, attention: str = "auto"):
        super().__init__()
        self.card = card
        self.dtype = dtype
        self.attention = attention
        self.lora: dict | None = None  # the add_lora settings, while adapters are in place
        self.copies = None  # with tensor_parallel or pipeline: the group of the same part in other copies
        self.pipe = None  # with pipeline: this process's stage (linnet.torch.stages.Pipe)
        self.compiled: bool | str = False  # the blocks' torch.compile backend; they want one row length: keep the padding
        self.checkpointing: str | None = None  # "full", "selective" or "offload": see `checkpoint_activations`
        self.context = None  # with split_context: the process group each row's positions are split over
        self.split = None  # with tensor_parallel: the mesh of the processes splitting every block
        self.sequence = None  # with tensor_parallel(sequence=True): the split's mesh, sharing each row's positions
        self.model = Body(card)
        if not card.tied_embeddings:
            self.lm_head = Linear(card.hidden, card.vocab, bias=False)
        self.register_buffer("inv_freq", rope_frequencies(card), persistent=False)

    @property
    def device(self) -> torch.device:
        return self.inv_freq.device  # every pipeline stage holds it, whatever else it drops

    @property
    def quantized(self) -> str | None:
        """'nf4' when the blocks' linear weights are stored quantized (QLoRA), else None."""
        return "nf4" if any(is_quantized(m) for m in self.model.layers.modules()) else None

    @property
    def shares_prompts(self) -> bool:
        """Whether this model's attention path takes rows whose completions share their
        prompt (`Packed.prefix`; linnet.packing.pack_prompted)."""
        return self.context is not None or (self.sequence is None
                                            and attention_paths.shares_prompts(self.attention, self.device))

    @property
    def head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.card.tied_embeddings else self.lm_head.weight

    # -- the trunk ------------------------------------------------------------------

    def _trunk(self, tokens_P, positions_P, bounds: list[int], prefix: list[int] | None = None, attend=None,
               keep=None):
        """Final-normed hidden states [P, D] of one packed row (`prefix`: shared prompts),
        or [len(keep), D] at the positions `keep` only: the last block's output projection,
        MLP and norm then run on those alone (a reward model reads one position a
        sequence; DPO and GRPO rows skip their prompts)."""
        if self.pipe is not None:
            raise RuntimeError("this model is cut into pipeline stages: it trains through linnet.train's functions "
                               "(train, dpo, kto, reward, distill, grpo), whose steps and held-out passes run the "
                               "stages, and evaluates through loss_packed under torch.no_grad(); for other entries "
                               "load the saved weights whole (save_weights gathers the stages)")
        x = F.embedding(tokens_P, self.model.embed_tokens.weight).to(self.dtype)
        return self.model.norm(self._blocks(x, positions_P, bounds, prefix, attend, keep=keep))

    def _blocks(self, x_PD, positions_P, bounds: list[int], prefix: list[int] | None = None, attend=None, keep=None,
                blocks=None):
        """The blocks this model holds (a pipeline stage's alone), or `blocks` of them (one
        chunk of an interleaved stage), over hidden states [P, D]; `keep` as in `_trunk`,
        taken at the last of them; `attend` the context-parallel ring's (`_fields`)."""
        if attend is None:
            attend = attention_paths.choose(self.attention, self.device)
        if prefix is not None:
            attend = functools.partial(attend, prefix=prefix)
        cos, sin = rope_tables(positions_P, self.inv_freq, self.card, self.dtype)
        recompute = self.checkpointing is not None and torch.is_grad_enabled()
        blocks = self.model.layers if blocks is None else blocks
        last = len(blocks) - 1
        x = x_PD if self.sequence is None else scatter_positions(x_PD, self.sequence)
        whole = self.compiled or self.sequence is not None  # every position through the last block
        for i, block in enumerate(blocks):
            # compiled blocks want one row length: they run whole, the positions taken after
            subset = keep if i == last and not whole else None
            if recompute:  # keep the block's input (offload: in host memory), compute the rest again in backward
                run, kept = (block, x) if self.checkpointing != "offload" else (_from_host(block, x.device), _to_host(x))
                x = checkpoint(run, kept, cos, sin, bounds, attend, subset, use_reentrant=False,
                               context_fn=_KEEP[self.checkpointing])
            else:
                x = block(x, cos, sin, bounds, attend, subset)
        if self.sequence is not None:
            x = gather_positions(x, self.sequence)
        if keep is not None and whole:
            x = x[keep]
        return x

    def _fields(self, batch):
        dev = self.device

        def tensor(x):
            x = torch.from_numpy(x) if isinstance(x, np.ndarray) else x
            return x.to(dev, non_blocking=True)

        bounds = batch.bounds.tolist() if hasattr(batch.bounds, "tolist") else list(batch.bounds)
        if not bounds or bounds[0] != 0 or bounds[-1] != len(batch.tokens):
            raise ValueError(f"packed batch: bounds {bounds[:3]}…{bounds[-1:]} must run from 0 to the row "
                             f"length {len(batch.tokens)}; build batches with linnet.packing.pack")
        fields = batch.tokens, batch.positions, batch.targets, batch.weights
        prefix = getattr(batch, "prefix", None)
        prefix = None if prefix is None else [int(i) for i in prefix]
        if self.context is not None:  # this process's share of the whole row, padding included
            mine, attend = context_row(len(batch.tokens), bounds, self.context, dev, prefix)
            tokens, positions, targets, weights = (tensor(np.asarray(x)[mine]) for x in fields)
            return tokens, positions, _Layout(bounds, None, attend), targets, weights
        real = int(getattr(batch, "real", bounds[-1]))
        if self.sequence is not None:  # the positions split into equal shares: whole rows of such a length, or
            real = self._sequence_length(bounds, real)  # their padding cut to the next multiple of the split
        if real < bounds[-1] and real in bounds and not self.compiled:
            # the trailing padding is a document of its own that every layer would compute
            # (a P² causal attention included); eager code needs no fixed row length, and
            # the entries pad their results back (bench/RESULTS.md: DPO steps 2.3x faster)
            bounds = [b for b in bounds if b <= real]
            fields = [x[:real] for x in fields]
            prefix = None if prefix is None else prefix[: len(bounds) - 1]
        tokens, positions, targets, weights = (tensor(x) for x in fields)
        return tokens, positions, _Layout(bounds, prefix), targets, weights

    def _sequence_length(self, bounds: list[int], real: int) -> int:
        """How many positions of a row a sequence-parallel split computes (its real ones,
        padded to a multiple of the split); `bounds` gains that length as a document end."""
        size, length = self.sequence.size(), bounds[-1]
        if length % size:
            raise ValueError(f"sequence parallel: a row of {length} positions does not split into {size} equal "
                             f"shares; pack rows of a multiple of {size} (training.context_length)")
        if real < length and real in bounds:
            real = -(-real // size) * size
            if real not in bounds:
                bounds.insert(next(i for i, b in enumerate(bounds) if b > real), real)
        return real

    def _padded(self, x, batch):
        """x with its first dimension padded with zeros back to the row's length."""
        missing = len(batch.tokens) - x.shape[0]
        return x if missing == 0 else torch.cat([x, x.new_zeros((missing, *x.shape[1:]))])

    # -- entries ------------------------------------------------------------------

    def hidden_packed(self, batch, at=None) -> torch.Tensor:
        """[P, D] final hidden states of a packed row (after the last norm); with `at`
        (positions, e.g. each answer's last token) [len(at), D] at those alone, the last
        block computing only what they need."""
        tokens, positions, layout, _, _ = self._fields(batch)
        if self.context is not None:  # this process's positions, then the whole row's from every process
            h = gather_row(self._trunk(tokens, positions, *layout), len(batch.tokens), self.context)
            return h if at is None else h[torch.as_tensor(at, device=self.device)]
        if at is not None:
            return self._trunk(tokens, positions, *layout, keep=torch.as_tensor(at, device=self.device))
        return self._padded(self._trunk(tokens, positions, *layout), batch)

    def loss_packed(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of weighted token cross-entropies, sum of weights), both float32: the
        caller divides once by the count over everything it accumulates. A pipelined
        model's (linnet.torch.pipeline) goes through its stages, without gradients."""
        if self.pipe is not None:
            return self.pipe.loss(batch)
        tokens, positions, layout, targets, weights = self._fields(batch)
        keep = self._learned(batch, len(tokens))
        total, count = self._head_loss(self._trunk(tokens, positions, *layout, keep=keep), targets, weights, keep)
        if self.context is not None:  # the row's sums, on every process of its context group
            return sum_over(total, self.context), sum_over(count, self.context)
        return total, count

    def _head_loss(self, h, targets, weights, keep) -> tuple[torch.Tensor, torch.Tensor]:
        """`loss_packed`'s result from the final hidden states (at `keep` when given)."""
        if keep is not None:  # a zero weight adds nothing to the loss or the gradients
            targets, weights = targets[keep], weights[keep]
        split = self.split_head()
        if split is not None:
            return split_cross_entropy(h, *split[:1], targets, weights, **split[1]), weights.float().sum()
        loss = linear_cross_entropy(h, self.head_weight, targets, weights)
        return loss, weights.float().sum()

    def log_probs_packed(self, batch) -> torch.Tensor:
        """[P] float32 log-probability of each position's target where its weight is not 0;
        elsewhere (prompts, the last token of each document, padding) 0 or meaningless."""
        tokens, positions, layout, targets, _ = self._fields(batch)
        keep = self._learned(batch, len(tokens))
        logp = self.head_log_probs(self._trunk(tokens, positions, *layout, keep=keep), targets, keep, batch)
        if self.context is None:
            return logp
        return gather_row(logp[:len(tokens)], len(batch.tokens), self.context)  # its own positions, unpadded

    def head_log_probs(self, h, targets, keep, batch) -> torch.Tensor:
        """`log_probs_packed` from the final (normed) hidden states `h` of the `keep`
        positions (all where None): what a pipeline's last stage computes from the hidden
        states it receives."""
        n = len(targets)
        if keep is not None:
            targets = targets[keep]
        split = self.split_head()
        if split is not None:
            logp = split_token_log_probs(h, *split[:1], targets, **split[1])
        else:
            logp = linear_token_log_probs(h, self.head_weight, targets)
        if keep is not None:
            logp = logp.new_zeros(n).index_put((keep,), logp)
        return self._padded(logp, batch)

    def _learned(self, batch, n: int) -> torch.Tensor | None:
        """The positions among the first n whose weight is not 0, where they are under 90%
        of them (a prompted row: DPO, GRPO, SFT on completions); else None. The head and
        the last block's MLP run on these alone: at small sizes the head is a third or
        more of a position's FLOPs."""
        weights = batch.weights
        if self.context is not None:  # the row's positions are split: the head runs on this process's
            return None
        if isinstance(weights, torch.Tensor):
            if weights.device.type != "cpu":
                return None  # reading it would wait for the device
            weights = weights.numpy()
        keep = np.flatnonzero(np.asarray(weights[:n]) != 0)
        if len(keep) >= 0.9 * n:
            return None
        return torch.from_numpy(keep).to(self.device, non_blocking=True)

    def split_head(self):
        """(this process's rows of the head, {offset, group}) when tensor_parallel split the
        head by vocabulary; None for a whole head (FSDP's parts are not a vocabulary split:
        its processes hold other rows of the batch, as do a sharded pipeline stage's copies)."""
        w = self.head_weight
        if not isinstance(w, DTensor) or self.copies is None or sharded_over(w, self.copies):
            return None
        local = w.to_local()
        return local, {"offset": w.device_mesh.get_local_rank() * local.shape[0], "group": w.device_mesh.get_group()}

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, V] (float32) of plain token batches, each row one document."""
        tokens = torch.as_tensor(tokens, device=self.device)
        squeeze = tokens.ndim == 1
        tokens_BT = tokens[None] if squeeze else tokens
        B, T = tokens_BT.shape
        positions = torch.arange(T, device=self.device).repeat(B)
        h = self._trunk(tokens_BT.reshape(-1), positions, [i * T for i in range(B + 1)])
        logits = (h @ full(self.head_weight).to(self.dtype).T).float().view(B, T, -1)
        return logits[0] if squeeze else logits

    def checkpoint_activations(self, mode: bool | str = True) -> None:
        """Activation checkpointing, a block at a time: in training forward each block keeps
        only its input, and backward computes the block again. True or "full" recomputes
        everything; "selective" keeps the attention's outputs (quadratic in a document's
        length to recompute, one [P, D] tensor to store) and recomputes the rest; "offload"
        recomputes everything and keeps the blocks' inputs in host memory, copied back for
        each block's backward (on an accelerator; on a CPU it is "full"); False stores every
        activation. Gradients are the same either way; peak memory falls roughly to one
        block's activations plus the blocks' inputs (offloaded: one of them)."""
        if mode not in (True, False, "full", "selective", "offload"):
            raise ValueError(f"activation_checkpointing={mode!r}: use True (or 'full'), 'selective', 'offload', False")
        self.checkpointing = None if mode is False else "full" if mode is True else mode

    def split_context(self, mesh) -> None:
        """Context parallel over `mesh`'s processes (a 1-D DeviceMesh, or the "context"
        dimension of one whose other dimension is the copies): they take the same rows,
        each holds 2 of a row's 2·|mesh| chunks of positions, and attention passes keys and
        values round them as a ring (linnet.torch.context). The entries still give whole
        rows' results on every process (loss and count summed, log-probabilities and
        hidden states gathered), and each trained parameter's gradient is summed over the
        mesh as backward makes it: add adapters and choose what trains first. `copies`
        becomes the processes at this place (stage, split part, context) in every copy. FSDP
        sums the gradients of parts it shards over processes that include the group (every
        one, a split's copies and context: copies_mesh, a stage's); the others sum here."""
        if self.compiled:
            raise ValueError("split_context: the model is compiled; context parallel runs on eager models")
        split = self.split
        if any(isinstance(p, DTensor) and p.device_mesh != split and not reduced_by_shards(p, mesh.get_group())
               for p in self.parameters()):
            raise ValueError("split_context: the model is sharded over processes that leave out some of the context "
                             "group; shard it over every process, or a split's over its copies_mesh")
        self.context = mesh.get_group()
        self.copies = copies_group(*(m for m in (getattr(self.pipe, "mesh", None), split) if m is not None), mesh)
        sum_gradients_over(self, self.context)

    def tile_mlp(self, positions: int | None) -> None:
        """Compute each block's MLP `positions` rows at a time (None: the whole row at once).
        A long row's MLP activations ([P, intermediate], three of them) are its largest;
        tiled, only one tile's live at once, and in training each tile is computed again
        in backward (about a third more MLP work). The same function, rounded alike up to
        the order of the weight gradients' sums. Under sequence parallel each process takes
        `positions / split` of its own positions a tile, which the MLP gathers from the
        split's processes and scatters back, so a tile is `positions` rows there too."""
        if positions is not None and not (isinstance(positions, int) and positions >= 1):
            raise ValueError(f"tile_mlp: positions={positions!r}; use a positive number of positions or None")
        if positions is not None and self.card.experts is not None:
            raise ValueError(f"tile_mlp: positions={positions} (the config's training.mlp_tile) on a mixture-of-experts "
                             "model, whose MLPs are its experts, each on its own rows: drop training.mlp_tile")
        if self.sequence is not None:  # each process's share of a tile's positions; the MLP gathers them
            size = self.sequence.size()
            if positions is not None and positions % size:
                raise ValueError(f"tile_mlp: positions={positions} with sequence parallel over {size} processes: "
                                 f"each takes an equal share of a tile; use a multiple of {size}")
            for block in self.model.layers:
                block.tile = None if positions is None else positions // size
            return
        for module in self.modules():
            if isinstance(module, MLP):
                module.tile = positions

    # -- parameters ------------------------------------------------------------------

    def untie_head(self) -> None:
        """Give a tied model its own output head, a copy of the embedding that trains apart
        from it from now on (tensor_parallel does, as the specification says); the card
        says untied, so saved weights load back as such."""
        if not self.card.tied_embeddings:
            return
        embedding = self.model.embed_tokens.weight
        with torch.device("meta"):
            self.lm_head = Linear(self.card.hidden, self.card.vocab, bias=False)
        self.lm_head.weight = nn.Parameter(embedding.detach().clone(), requires_grad=embedding.requires_grad)
        self.card = self.card.replace(tied_embeddings=False)

    def set_trainable(self, spec: bool | str | Sequence[str]) -> list[str]:
        """Choose the trainable parameters: True, False, or glob patterns over paths.
        Trainable ones become float32 master weights; frozen ones are stored in the
        compute dtype. Returns the trainable paths. Call before building the optimizer."""
        names = [n for n, _ in self.named_parameters()]
        chosen = select(names, spec, what="trainable")
        quantized = quant_states(self)
        for name, p in self.named_parameters():
            train = name in chosen
            if name in quantized or not p.dtype.is_floating_point:  # NF4 codes (on meta: no state yet)
                if train:
                    raise ValueError(f"trainable: {name} is stored in NF4 and cannot train; QLoRA trains "
                                     "adapters (add_lora), or load without quantize to train it")
                continue
            want = torch.float32 if train else self.dtype
            if p.dtype != want:
                p.data = p.data.to(want)
            p.requires_grad_(train)
        return [n for n in names if n in chosen]

    def add_lora(self, patterns: str | Sequence[str], rank: int = 16, alpha: float = 32,
                 dropout: float = 0.0, *, rslora: bool = False, dora: bool = False) -> list[str]:
        """Give each linear weight whose path matches an adapter (DoRA's with dora=True; a
        mixture of experts' stacked tensors too); only adapters train. See
        linnet.torch.lora.add_lora."""
        from linnet.torch.lora import add_lora

        return add_lora(self, patterns, rank=rank, alpha=alpha, dropout=dropout, rslora=rslora, dora=dora)

    def merge_lora(self) -> None:
        """Fold every adapter into its weight and remove it (plain weights again)."""
        from linnet.torch.lora import merge_lora

        merge_lora(self)

    def save_weights(self, path, *, dtype=None, names: str = "hf", include: Sequence[str] | None = None,
                     exclude: Sequence[str] | None = None, merged: bool = False) -> None:
        """Write safetensors (all or the `include`/`exclude` globs' pick) under the names
        transformers and PEFT read, or names="linnet" under the model's own paths; a
        directory also gets the config.json (and tokenizer files) transformers needs to
        load it back; merged=True writes the adapters folded in, the model unchanged. See
        linnet.torch.weights.save_weights."""
        from linnet.torch.weights import save_weights

        save_weights(self, path, dtype=dtype, names=names, include=include, exclude=exclude, merged=merged)


def _keep_attention(ctx, op, *args, **kwargs):
    """The selective checkpointing policy: store what attention returns, recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op in _ATTENTION_OPS else CheckpointPolicy.PREFER_RECOMPUTE


_ATTENTION_OPS = {getattr(torch.ops.aten, name).default for name in (
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_attention_math") if hasattr(torch.ops.aten, name)}

# checkpoint's context_fn for each mode (None: the default, recompute everything)
_KEEP = {"full": noop_context_fn, "offload": noop_context_fn,
         "selective": functools.partial(create_selective_checkpoint_contexts, _keep_attention)}


def _to_host(x: torch.Tensor) -> torch.Tensor:
    """x in host memory (from an accelerator): what an offloaded block keeps of its input;
    differentiable, its gradient returning to x's device."""
    return x if x.device.type == "cpu" else x.to("cpu", non_blocking=False)


def _from_host(block, device):
    """block, run on its input brought back to `device` (the checkpoint keeps the host copy;
    backward's recomputation copies it in again)."""
    def run(x, *args):
        return block(x.to(device, non_blocking=True), *args)

    return run
