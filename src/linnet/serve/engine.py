"""Sampling with a preallocated KV cache: generation and GRPO rollouts.

    engine = Engine(nest.load(card, dtype="bfloat16"))     # the engine owns this model
    done = engine.sample([ids_a, ids_b], n=8, max_new_tokens=256, temperature=1.0, seed=0)
    done[0].tokens, done[0].logprobs, done[0].stopped        # completion 0 of prompt 0
    engine.load_weights(policy)                              # policy's weights in, adapters merged

One `sample` call:

1. Prefill: the distinct prompts go through the model once, packed end to end in one row
   (positions restart at 0 for each; attention never crosses prompts, through the model's
   own attention path, as in training). Each layer's keys and values are written straight
   into the cache rows of every completion of that prompt: a group of n completions
   shares one prefill.
2. Decode: one position per active row and step. A row's cache slots are its positions
   (prompts are right-aligned at slot 0), so the row writes its new key/value at slot
   `prompt length + step` and attends to the slots up to it; slots past it (the other
   rows' longer prompts) are masked.
3. Stop: a row that samples a stop token (kept as its last token) or reaches
   `max_new_tokens` stops growing. Finished rows are dropped from the batch and the
   cache is compacted, so later steps cost only what is still running; the loop ends
   when no row is left.

The layers are the model's own modules (norms, projections, q/k norms, `rotate`, MLP):
only the attention around the cache is written here, so the engine's numbers are the
model's.

Log-probabilities: each sampled token's log-probability under the model's unmodified
distribution (softmax of the logits at temperature 1, before top-k/top-p), in float32:
what `Decoder.log_probs_packed` gives for the same sequence. With temperature 1 and no
top-k/top-p that is the distribution actually sampled from; with other settings it is
still the model's (which GRPO's importance correction needs), not the sampling one.

Shapes: B rows (completions) in the batch, P positions of the packed prefill row,
H query heads, K kv heads, d head dim, D hidden, V vocabulary, S cache slots, L layers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from linnet.adapter_files import ADAPTER_SUFFIXES
from linnet.rollouts import Completion
from linnet.torch import attention as attention_paths
from linnet.torch.model import Decoder, Linear, rotate
from linnet.torch.quantize import dense, is_quantized
from linnet.torch.sharding import full


@dataclass
class Stats:
    """Work done since the engine was built (or `reset_stats`): positions through the
    model in prefill (one per prompt token; a group's prompt counts once), positions in
    decode (one per active row and step), decode steps, and sampled tokens."""

    prefill_positions: int = 0
    decode_positions: int = 0
    decode_steps: int = 0
    sampled_tokens: int = 0


@dataclass
class _Sampling:
    temperature: float
    top_k: int
    top_p: float
    generator: torch.Generator | None
    stop: torch.Tensor  # [n_stop] ids (may be empty)


class Engine:
    """Generation with a KV cache over a Decoder it owns.

    model: a `linnet.torch.model.Decoder` (from `nest.load`), usually frozen and in the
        compute dtype you want to sample in (bf16 on GPU). The engine takes it over: sets
        it to eval, turns its gradients off and merges any adapters into its weights.
        Don't pass the policy you train: load a second copy and `load_weights(policy)`.
    max_batch, max_seq: allocate the cache for this many rows and slots up front (both
        or neither); without them it is allocated at the first call's size. It grows
        (reallocates) only when a call needs more rows or slots than it has.
    """

    def __init__(self, model: Decoder, *, max_batch: int | None = None, max_seq: int | None = None):
        if not isinstance(model, Decoder):
            raise TypeError(
                f"Engine: expected a linnet Decoder (nest.load(card)), got {type(model).__name__}"
            )
        if (max_batch is None) != (max_seq is None):
            raise ValueError("Engine: give both max_batch and max_seq to preallocate the cache, or neither")
        if model.lora and not model.quantized:
            model.merge_lora()  # an NF4 base keeps its adapters beside it (see load_weights)
        model.eval()
        model.requires_grad_(False)
        self.model = model
        self.card = model.card
        self.stats = Stats()
        self._cache: torch.Tensor | None = None  # [L, 2, B, K, S, d] in the model's dtype
        if max_batch is not None:
            self._ensure_cache(max_batch, max_seq)

    # -- weights --------------------------------------------------------------------

    @torch.no_grad()
    def load_weights(self, policy: torch.nn.Module) -> None:
        """Copy a policy's weights into the engine's (by parameter name, in place: no
        tensor is reallocated). LoRA adapters are merged on the way (W + scale * B @ A,
        in float32); the policy itself is not changed. A policy sharded by fully_shard is
        gathered one tensor at a time (every process must call this together).

        An engine loaded with quantize="nf4" samples from the policy's own NF4 base,
        shared rather than copied, with copies of its adapters beside it (unmerged: an NF4
        weight cannot take them), so it computes what the QLoRA policy computes."""
        own = {n: p for n, p in self.model.named_parameters() if not n.endswith(ADAPTER_SUFFIXES)}
        seen = set()
        for name, p, layer in policy_weights(policy):
            if name not in own:
                raise ValueError(
                    f"Engine.load_weights: the policy has {name!r}, which the engine's model "
                    "lacks; load the engine from the same card as the policy"
                )
            seen.add(name)
            if is_quantized(own[name]):
                self._share_quantized(name, p, layer)
                continue
            src = merged(p, layer)
            dst = own[name]
            if src.shape != dst.shape:
                raise ValueError(
                    f"Engine.load_weights: {name} is {tuple(src.shape)} in the policy but "
                    f"{tuple(dst.shape)} in the engine; load the engine from the same card"
                )
            dst.copy_(src)
        missing = sorted(set(own) - seen)
        if missing:
            raise ValueError(
                f"Engine.load_weights: the policy has no {missing[0]!r} (and {len(missing) - 1} "
                "more); load the engine from the same card as the policy"
            )

    def _share_quantized(self, name: str, weight: torch.nn.Parameter, source: Linear | None) -> None:
        """Point the engine's NF4 layer at the policy's NF4 weight and copy its adapters."""
        if not is_quantized(weight):
            raise ValueError(f"Engine.load_weights: the engine's {name} is NF4 but the policy's is not; load the "
                             "engine as the policy was loaded (quantize= the same)")
        layer = self.model.get_submodule(name.removesuffix(".weight"))
        layer.weight = weight
        for part in ("lora_a", "lora_b", "lora_magnitude"):
            value = None if source is None else getattr(source, part)
            mine = getattr(layer, part)
            if value is None:
                setattr(layer, part, None)
            elif mine is not None and mine.shape == value.shape:
                mine.copy_(value)
            else:
                setattr(layer, part, torch.nn.Parameter(value.detach().clone(), requires_grad=False))
        if source is not None:
            layer.lora_scale = source.lora_scale

    # -- sampling -------------------------------------------------------------------

    def sample(
        self,
        prompts: Sequence[Sequence[int]],
        n: int = 1,
        *,
        max_new_tokens: int = 256,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        stop: Iterable[int] | None = None,
        seed: int | None = None,
        generator: torch.Generator | None = None,
    ) -> list[Completion]:
        """Sample n completions of each prompt.

        prompts: token id sequences (lists, numpy arrays or 1-D tensors), not empty.
        n: completions per prompt; each prompt passes through the model once and its
            cache rows are copied to its n completions.
        temperature: 0 is greedy (argmax); otherwise logits are divided by it.
        top_k: keep the k most likely tokens (None or 0: all). top_p: keep the smallest
            set whose probability reaches p (None or 1: all). Applied after temperature.
        stop: ids that end a completion (kept as its last token); None takes the card's
            eos_token_ids, () never stops early.
        seed / generator: the random stream for sampling (the global one when neither).

        Returns len(prompts) * n completions, prompt-major: completion j of prompt i is
        at i * n + j.
        """
        run = self._generate(prompts, n, max_new_tokens, temperature, top_k, top_p, stop, seed, generator)
        while True:
            try:
                next(run)
            except StopIteration as end:
                return end.value

    def stream(self, prompt: Sequence[int], **options) -> Iterator[int]:
        """Yield one prompt's completion a token at a time, as it is sampled (the
        options of `sample`, n=1). A stop token is yielded too, as the last."""
        run = self._generate([prompt], 1, **_defaults(options))
        for _, tokens in run:
            yield int(tokens[0])

    def warmup(self, prompt_lengths: Sequence[int], *, n: int = 1, max_new_tokens: int = 2) -> None:
        """Run one dummy prefill and `max_new_tokens - 1` decode steps with prompts of
        these lengths, and allocate the cache for them. On CPU this only preallocates; it
        exists for compiled or CUDA-graph paths, which build a pass size the first time
        they see it (none is built here yet). Stats are left unchanged."""
        saved = Stats(**vars(self.stats))
        prompts = [[0] * int(t) for t in prompt_lengths]
        self.sample(prompts, n, max_new_tokens=max_new_tokens, temperature=0.0, stop=())
        self.stats = saved

    def reset_stats(self) -> None:
        self.stats = Stats()

    # -- the loop -------------------------------------------------------------------

    @torch.inference_mode()
    def _generate(self, prompts, n, max_new_tokens, temperature, top_k, top_p, stop, seed, generator):
        """Yields (original row indices (host tuple), sampled tokens [A]) each step;
        returns the completions."""
        prompts = token_prompts(prompts, self.card.vocab)
        sampling = self._check_sampling(n, max_new_tokens, temperature, top_k, top_p, stop, seed, generator)
        dev = self.model.device
        lengths = [len(p) for p in prompts]
        B, N = len(prompts) * n, max_new_tokens
        S = max(lengths) + N - 1  # the last sampled token is never fed back
        cache = self._ensure_cache(B, S)
        cos, sin = self._rope_table(S)

        out_tok = torch.zeros(B, N, dtype=torch.long, device=dev)
        out_lp = torch.zeros(B, N, dtype=torch.float32, device=dev)
        length = [N] * B
        stopped = [False] * B

        logits = self._prefill(prompts, n, cache, cos, sin).repeat_interleave(n, dim=0)
        rows = list(range(B))  # original index of each compact row
        pos = [lengths[r // n] for r in rows]  # slot of each row's next token
        for step in range(N):
            tok, lp = _pick(logits, sampling)
            rows_dev = torch.tensor(rows, device=dev)
            out_tok[rows_dev, step] = tok
            out_lp[rows_dev, step] = lp
            self.stats.sampled_tokens += len(rows)
            yield tuple(rows), tok
            hit = torch.isin(tok, sampling.stop).tolist() if len(sampling.stop) else [False] * len(rows)
            for r, h in zip(rows, hit):
                if h:
                    length[r], stopped[r] = step + 1, True
            alive = len(rows) - sum(hit)
            if step == N - 1 or alive == 0:
                break
            if alive < len(rows):
                tok = self._compact(cache, hit, tok, rows, pos)
            logits = self._decode(tok, pos, cache, cos, sin)
            pos = [p + 1 for p in pos]

        out_tok, out_lp = out_tok.cpu(), out_lp.cpu()
        return [
            Completion(r // n, out_tok[r, : length[r]].tolist(), out_lp[r, : length[r]].clone(), stopped[r])
            for r in range(B)
        ]

    @staticmethod
    def _compact(cache, hit: list[bool], tok, rows: list[int], pos: list[int]):
        """Drop finished rows: each finished row among the first `alive` is filled by a
        live row from past them (its cache slots copied), so only rows that move are
        copied and the batch stays rows 0..alive-1. Updates rows and pos in place;
        returns the live rows' tokens."""
        alive = len(rows) - sum(hit)
        holes = [i for i in range(alive) if hit[i]]
        movers = [i for i in range(alive, len(rows)) if not hit[i]]
        assert len(holes) == len(movers)
        if holes:
            used = max(pos[i] for i in movers)  # slots filled so far in the moving rows
            src = torch.tensor(movers, device=tok.device)
            dst = torch.tensor(holes, device=tok.device)
            cache[:, :, dst, :, :used] = cache[:, :, src, :, :used]
            tok[dst] = tok[src]
            for h, m in zip(holes, movers):
                rows[h], pos[h] = rows[m], pos[m]
        del rows[alive:], pos[alive:]
        return tok[:alive]

    def _prefill(self, prompts: list[list[int]], n: int, cache, cos_Sd, sin_Sd) -> torch.Tensor:
        """Run the prompts as one packed row; write each prompt's keys/values into the
        cache rows of its n completions; return the logits [len(prompts), V] (f32) of
        each prompt's last position."""
        m, dev = self.model, self.model.device
        lengths = [len(p) for p in prompts]
        bounds = np.concatenate([[0], np.cumsum(lengths)]).tolist()
        P = bounds[-1]
        tokens_P = torch.tensor([t for p in prompts for t in p], device=dev)
        positions_P = torch.cat([torch.arange(t, device=dev) for t in lengths])
        prompt_P = torch.repeat_interleave(torch.arange(len(prompts), device=dev), torch.tensor(lengths, device=dev))
        # position p of prompt i goes to slot p of rows i * n + j, j < n
        rows_nP = prompt_P[None] * n + torch.arange(n, device=dev)[:, None]
        cos, sin = cos_Sd[positions_P][:, None], sin_Sd[positions_P][:, None]  # [P, 1, d]
        attend = attention_paths.choose(m.attention, dev)

        x = F.embedding(tokens_P, m.model.embed_tokens.weight).to(m.dtype)
        for i, block in enumerate(m.model.layers):
            attn = block.self_attn
            q_PHd, k_PKd, v_PKd = _project(attn, block.input_layernorm(x), cos, sin)
            for rows_P in rows_nP:  # the prompt's keys/values go to each of its n rows
                cache[i, 0][rows_P, :, positions_P] = k_PKd
                cache[i, 1][rows_P, :, positions_P] = v_PKd
            out = attend(q_PHd.transpose(0, 1)[None], k_PKd.transpose(0, 1)[None], v_PKd.transpose(0, 1)[None], bounds)
            x = _finish(block, x, out[0].transpose(0, 1).reshape(P, -1))
        self.stats.prefill_positions += P
        last = torch.tensor(bounds[1:], device=dev) - 1
        return self._logits(x[last])

    def _decode(self, tokens_B: torch.Tensor, pos: list[int], cache, cos_Sd, sin_Sd) -> torch.Tensor:
        """One position per row: row b's token sits at slot pos[b]. Returns [B, V] f32.

        The one-query attention is two batched matmuls and a softmax (SDPA's CPU kernel is
        built for long queries: 1.17x a GRPO step), over a slot count rounded up to 64 so
        that oneDNN sees few shapes; the slots past each row's position are masked."""
        m, dev = self.model, self.model.device
        B = len(pos)
        S = min(-(-(max(pos) + 1) // 64) * 64, cache.shape[4])
        pos_B = torch.tensor(pos, device=dev)
        rows_B = torch.arange(B, device=dev)
        cos, sin = cos_Sd[pos_B][:, None], sin_Sd[pos_B][:, None]  # [B, 1, d]
        unseen = (torch.arange(S, device=dev)[None] > pos_B[:, None])[:, None, None]  # [B, 1, 1, S]
        x = F.embedding(tokens_B, m.model.embed_tokens.weight).to(m.dtype)
        for i, block in enumerate(m.model.layers):
            attn = block.self_attn
            H, K, d = attn.shape
            q_BHd, k_BKd, v_BKd = _project(attn, block.input_layernorm(x), cos, sin)
            k_cache, v_cache = cache[i, 0, :B, :, :S], cache[i, 1, :B, :, :S]  # views: writes land in the cache
            k_cache[rows_B, :, pos_B] = k_BKd
            v_cache[rows_B, :, pos_B] = v_BKd
            scores = (q_BHd.view(B, K, H // K, d) @ k_cache.transpose(-1, -2)).float()  # [B, K, H/K, S]
            scores = scores.mul_(d**-0.5).masked_fill_(unseen, -math.inf)
            out = torch.softmax(scores, dim=-1).to(m.dtype) @ v_cache  # [B, K, H/K, d]
            x = _finish(block, x, out.reshape(B, -1))
        self.stats.decode_positions += B
        self.stats.decode_steps += 1
        return self._logits(x)

    def _logits(self, h_ND: torch.Tensor) -> torch.Tensor:
        m = self.model
        return (m.model.norm(h_ND) @ m.head_weight.to(m.dtype).T).float()

    def _rope_table(self, S: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [S, d] as `Decoder._trunk` computes them (f32 angles, then the dtype)."""
        m = self.model
        angles = torch.arange(S, device=m.device).float()[:, None] * m.inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(m.dtype), angles.sin().to(m.dtype)

    def _ensure_cache(self, rows: int, slots: int) -> torch.Tensor:
        c = self.card
        have = self._cache
        if have is not None and have.shape[2] >= rows and have.shape[4] >= slots:
            return have
        if have is not None:
            rows, slots = max(rows, have.shape[2]), max(slots, have.shape[4])
        self._cache = None  # free the old one before allocating the new
        # zeros, not empty: masked slots are still multiplied by 0 in attention, and
        # uninitialised memory may hold NaNs (0 * NaN = NaN)
        self._cache = torch.zeros(
            c.layers, 2, rows, c.kv_heads, slots, c.head_dim, dtype=self.model.dtype, device=self.model.device
        )
        return self._cache

    # -- input checks ---------------------------------------------------------------

    def _check_sampling(self, n, max_new_tokens, temperature, top_k, top_p, stop, seed, generator) -> _Sampling:
        top_k, top_p = sampling_options(n, max_new_tokens, temperature, top_k, top_p, self.card.vocab)
        if seed is not None and generator is not None:
            raise ValueError("Engine.sample: give seed or generator, not both")
        dev = self.model.device
        if seed is not None:
            generator = torch.Generator(dev).manual_seed(int(seed))
        stop = self.card.eos_token_ids if stop is None else tuple(int(t) for t in stop)
        return _Sampling(float(temperature), top_k, top_p, generator, torch.tensor(stop, dtype=torch.long, device=dev))


def _defaults(options: dict) -> dict:
    """`sample`'s keyword options, defaults filled in, for `_generate`."""
    allowed = dict(max_new_tokens=256, temperature=1.0, top_k=None, top_p=None, stop=None, seed=None, generator=None)
    unknown = set(options) - set(allowed)
    if unknown:
        raise TypeError(f"Engine.stream: unexpected options {', '.join(sorted(unknown))}")
    return {**allowed, **options}


def token_prompts(prompts, vocab: int, who: str = "Engine.sample") -> list[list[int]]:
    """The prompts as lists of ints, each checked: a sequence, not empty, ids in the vocabulary."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence | np.ndarray | torch.Tensor):
        raise TypeError(f"{who}: prompts must be a list of token id sequences, got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError(f"{who}: no prompts given")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, (int, np.integer)) or (isinstance(p, (torch.Tensor, np.ndarray)) and p.ndim != 1):
            raise TypeError(
                f"{who}: prompt {i} is not a 1-D sequence of token ids; pass a list "
                "of prompts (wrap a single prompt in a list)"
            )
        ids = [int(t) for t in (p.tolist() if isinstance(p, (torch.Tensor, np.ndarray)) else p)]
        if not ids:
            raise ValueError(
                f"{who}: prompt {i} is empty; every prompt needs at least one token "
                "(start it with the tokenizer's bos_id if it has nothing else)"
            )
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(
                f"{who}: prompt {i} has token id {bad[0]}, outside the vocabulary "
                f"[0, {vocab}); tokenize with this model's tokenizer"
            )
        out.append(ids)
    return out


def sampling_options(n, max_new_tokens, temperature, top_k, top_p, vocab: int,
                     who: str = "Engine.sample") -> tuple[int, float]:
    """Check `sample`'s options; returns top_k (0: all, at most the vocabulary) and top_p (1: all)."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"{who}: n={n!r}; give at least 1 completion per prompt")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"{who}: max_new_tokens={max_new_tokens!r}; it must be at least 1")
    if not (temperature >= 0 and math.isfinite(temperature)):
        raise ValueError(f"{who}: temperature={temperature!r}; use 0 (greedy) or a positive number")
    top_k = top_k or 0
    if not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"{who}: top_k={top_k!r}; use a positive int, or None for all tokens")
    top_p = 1.0 if top_p is None else float(top_p)
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"{who}: top_p={top_p!r}; it must be in (0, 1], or None for all tokens")
    return min(top_k, vocab), top_p


def policy_weights(policy: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter, Linear | None]]:
    """(name, parameter, its adapted layer or None) for each of a policy's weights, by
    Hugging Face name, the adapters' own tensors left out: what an engine copies in."""
    adapted = {f"{name}.weight": m for name, m in policy.named_modules()
               if isinstance(m, Linear) and m.lora_a is not None}
    for name, p in policy.named_parameters():
        if not name.endswith(ADAPTER_SUFFIXES):
            yield name, p, adapted.get(name)


def merged(weight: torch.nn.Parameter, layer: Linear | None) -> torch.Tensor:
    """The plain weight the policy computes with: an adapted layer's merged in float32
    (`Linear.merged_weight`), an NF4 one dequantized, a sharded one gathered (every
    process must call this together)."""
    return full(dense(weight).detach()) if layer is None else layer.merged_weight(lambda t: full(t.detach()))


def _project(attn, h_ND, cos_N1d, sin_N1d):
    """q [N, H, d], k and v [N, K, d] of one attention module, q and k rotated."""
    q, k, v = attn.project(h_ND)
    return rotate(q, cos_N1d, sin_N1d), rotate(k, cos_N1d, sin_N1d), v


def _finish(block, x_ND, attended_NE):
    """The rest of `Block.forward` once attention is done: output projection, residual, MLP."""
    x_ND = x_ND + block.self_attn.o_proj(attended_NE)
    return x_ND + block.mlp(block.post_attention_layernorm(x_ND))


def _pick(logits_BV: torch.Tensor, s: _Sampling) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled ids [B] and the model's (temperature 1, unfiltered) log-probabilities of them."""
    logp_BV = torch.log_softmax(logits_BV, dim=-1)
    if s.temperature == 0:
        tok = logits_BV.argmax(-1)
    else:
        z = logits_BV / s.temperature
        if s.top_k:
            kth = torch.topk(z, s.top_k, dim=-1).values[:, -1:]
            z = z.masked_fill(z < kth, -math.inf)
        if s.top_p < 1.0:
            sorted_z, order = torch.sort(z, dim=-1, descending=True)
            probs = torch.softmax(sorted_z, dim=-1)
            before = probs.cumsum(-1) - probs  # mass of the more likely tokens
            sorted_z = sorted_z.masked_fill(before >= s.top_p, -math.inf)  # the first always stays
            z = torch.full_like(z, -math.inf).scatter(-1, order, sorted_z)
        # inverse CDF: one uniform a row, where multinomial draws one for every vocabulary
        # entry (1.08x a GRPO step); "right" never lands on a token of probability 0
        cdf = torch.softmax(z, dim=-1, dtype=torch.float64).cumsum_(-1)
        u = torch.rand(len(cdf), 1, generator=s.generator, dtype=torch.float64, device=cdf.device)
        tok = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=cdf.shape[1] - 1)[:, 0]
    return tok, logp_BV.gather(-1, tok[:, None])[:, 0]
