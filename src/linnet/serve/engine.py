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

Compiled passes (`Engine(model, compile=True)`, or a model loaded with `compile=`): the
decode step and the prefill are each one `torch.compile`d function (on CUDA the decode
step is captured as a CUDA graph, mode "reduce-overhead"). A pass size compiles the first
time a call needs it (later sizes of a changing dimension compile once more, as dynamic
shapes); `warmup(prompt_lengths)` compiles them before the first real call. The compiled
prefill attends through one block-diagonal mask (one kernel, no per-prompt Python loop).
If compiling fails (no C++ compiler, an unsupported op) the engine warns once and runs
eagerly from then on. Stop tokens are checked on the host every `stop_every` steps (1 on
CPU, 8 on CUDA: no host sync per token there); rows that stopped in between run on,
and their extra tokens are dropped.

Log-probabilities: each sampled token's log-probability under the model's unmodified
distribution (softmax of the logits at temperature 1, before top-k/top-p), in float32:
what `Decoder.log_probs_packed` gives for the same sequence. With temperature 1 and no
top-k/top-p that is the distribution actually sampled from; with other settings it is
still the model's (which GRPO's importance correction needs), not the sampling one.

Shapes: B rows (completions) in the batch, P positions of the packed prefill row,
H query heads, K kv heads, d head dim, D hidden, V vocabulary, S cache slots, L layers.
"""

from __future__ import annotations

import functools
import math
import warnings
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
    compile: compile the decode and prefill passes (see the module docstring); None
        follows the model (`nest.load(..., compile=...)`, with its backend).
    """

    def __init__(self, model: Decoder, *, max_batch: int | None = None, max_seq: int | None = None,
                 compile: bool | None = None):
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
        # per layer: keys and values [B, K, S, d] in the model's dtype (one tensor a layer and
        # kind: a compiled pass writing into views of one big tensor copies all of it)
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []
        self.compiled = bool(model.compiled if compile is None else compile)
        if self.compiled and model.quantized:
            raise ValueError("Engine: an NF4 (quantize='nf4') model samples eagerly; pass compile=False")
        self._decode_pass, self._prefill_pass = _decode_pass, _prefill_pass
        if self.compiled:  # with the model's backend (inductor unless it names another)
            backend = model.compiled if isinstance(model.compiled, str) and compile is None else "inductor"
            graphs = {"mode": "reduce-overhead"} if backend == "inductor" and model.device.type == "cuda" else {}
            self._decode_pass = torch.compile(_decode_pass, backend=backend, **graphs)
            self._prefill_pass = torch.compile(_prefill_pass, backend=backend)
        self.stop_every = 8 if model.device.type == "cuda" else 1
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
        run = self._generate([prompt], 1, **_defaults(options), stop_every=1)
        for tokens in run:
            yield int(tokens[0])

    def warmup(self, prompt_lengths: Sequence[int], *, n: int = 1, max_new_tokens: int = 2) -> None:
        """Allocate the cache for prompts of these lengths (n completions each) and, in a
        compiled engine, compile the passes they need: one dummy prefill and
        `max_new_tokens - 1` decode steps. Stats are left unchanged."""
        saved = Stats(**vars(self.stats))
        prompts = [[0] * int(t) for t in prompt_lengths]
        self.sample(prompts, n, max_new_tokens=max_new_tokens, temperature=0.0, stop=())
        self.stats = saved

    def reset_stats(self) -> None:
        self.stats = Stats()

    # -- the loop -------------------------------------------------------------------

    @torch.inference_mode()
    def _generate(self, prompts, n, max_new_tokens, temperature, top_k, top_p, stop, seed, generator,
                  stop_every=None):
        """Yields the sampled tokens [rows in the batch] each step; returns the completions."""
        prompts = token_prompts(prompts, self.card.vocab)
        sampling = self._check_sampling(n, max_new_tokens, temperature, top_k, top_p, stop, seed, generator)
        every = stop_every or self.stop_every
        dev = self.model.device
        lengths = [len(p) for p in prompts]
        B, N = len(prompts) * n, max_new_tokens
        S = max(lengths) + N - 1  # the last sampled token is never fed back
        self._ensure_cache(B, S)
        cos, sin = self._rope_table(S)

        out_tok = torch.zeros(B, N, dtype=torch.long, device=dev)
        out_lp = torch.zeros(B, N, dtype=torch.float32, device=dev)
        length = torch.full((B,), N, device=dev)  # tokens a completion keeps (its stop token included)
        stopped = torch.zeros(B, dtype=torch.bool, device=dev)

        logits = self._prefill(prompts, n, cos, sin).repeat_interleave(n, dim=0)
        rows = torch.arange(B, device=dev)  # completion index of each row in the batch
        start = [lengths[r // n] for r in range(B)]  # host: each row's first new slot
        start_B = torch.tensor(start, device=dev)
        finished = torch.zeros(B, dtype=torch.bool, device=dev)  # rows that sampled a stop token
        for step in range(N):
            tok, lp = _pick(logits, sampling, rows, B)
            out_tok[rows, step] = tok
            out_lp[rows, step] = lp
            self.stats.sampled_tokens += len(start)
            yield tok
            if len(sampling.stop):
                hit = torch.isin(tok, sampling.stop) & ~finished
                length[rows] = torch.where(hit, step + 1, length[rows])
                stopped[rows] |= hit
                finished |= hit
            if step == N - 1:
                break
            if len(sampling.stop) and (step + 1) % every == 0:  # the only host sync on stops
                done = finished.tolist()
                if all(done):
                    break
                order = self._compact(done, [s + step for s in start])
                if order is not None:
                    index = torch.tensor(order, device=dev)
                    rows, tok, finished = rows[index], tok[index], finished[index]
                    start = [start[i] for i in order]
                    start_B = torch.tensor(start, device=dev)
            logits = self._decode(tok, start_B + step, max(start) + step, cos, sin)

        out_tok, out_lp, length, stopped = out_tok.cpu(), out_lp.cpu(), length.tolist(), stopped.tolist()
        return [
            Completion(r // n, out_tok[r, : length[r]].tolist(), out_lp[r, : length[r]].clone(), stopped[r])
            for r in range(B)
        ]

    def _compact(self, done: list[bool], pos: list[int]) -> list[int] | None:
        """Drop finished rows from the batch: each finished row among the first rows kept is
        filled by a live row from past them (its cache slots below `pos`, the slot its next
        token goes to, copied), so only rows that move are copied. A compiled engine keeps
        a power of two of rows (finished ones fill up), so few batch sizes compile.
        Returns the old index of each row kept, or None when nothing changes."""
        alive = done.count(False)
        keep = alive if not self.compiled else min(1 << (alive - 1).bit_length(), len(done))
        if keep == len(done):
            return None
        spare = [i for i, d in enumerate(done) if d][: keep - alive]  # finished rows that stay
        kept = sorted(spare + [i for i, d in enumerate(done) if not d])
        kept_set = set(kept)
        holes = [i for i in range(keep) if i not in kept_set]
        movers = [i for i in kept if i >= keep]
        order = list(range(keep))
        if holes:
            used = max(pos[i] for i in movers)
            src = torch.tensor(movers, device=self.model.device)
            dst = torch.tensor(holes, device=self.model.device)
            for t in self._keys + self._values:
                t[dst, :, :used] = t[src, :, :used]
            for h, m in zip(holes, movers):
                order[h] = m
        return order

    def _prefill(self, prompts: list[list[int]], n: int, cos_Sd, sin_Sd) -> torch.Tensor:
        """Run the prompts as one packed row, writing each prompt's keys/values into the
        cache rows of its n completions; the logits [len(prompts), V] (f32) of each prompt's
        last position."""
        m, dev = self.model, self.model.device
        lengths = [len(p) for p in prompts]
        bounds = np.concatenate([[0], np.cumsum(lengths)]).tolist()
        tokens_P = torch.tensor([t for p in prompts for t in p], device=dev)
        positions_P = torch.cat([torch.arange(t, device=dev) for t in lengths])
        prompt_P = torch.repeat_interleave(torch.arange(len(prompts), device=dev), torch.tensor(lengths, device=dev))
        # position p of prompt i goes to slot p of rows i * n + j, j < n
        rows_nP = (prompt_P[None] * n + torch.arange(n, device=dev)[:, None]).flatten()
        last = torch.tensor(bounds[1:], device=dev) - 1
        if self.compiled:  # one mask: no per-prompt loop (and no bounds) in the graph
            attend = attention_paths.block_causal_mask(bounds, dev)
        else:
            attend = functools.partial(attention_paths.choose(m.attention, dev), bounds=bounds)
        logits = self._call("_prefill_pass", m, tokens_P, positions_P, rows_nP, last, self._keys, self._values,
                            cos_Sd, sin_Sd, attend)
        self.stats.prefill_positions += bounds[-1]
        return logits

    def _decode(self, tokens_B: torch.Tensor, pos_B: torch.Tensor, top: int, cos_Sd, sin_Sd) -> torch.Tensor:
        """One position a row: row b's token goes to slot pos_B[b] (`top` is the highest).
        Returns [B, V] f32. Attends over the slots up to `top` rounded up to 64, so that
        few shapes compile (and oneDNN sees few)."""
        S = min(-(-(top + 1) // 64) * 64, self._keys[0].shape[2])
        logits = self._call("_decode_pass", self.model, tokens_B, pos_B, self._keys, self._values, cos_Sd, sin_Sd, S)
        self.stats.decode_positions += len(tokens_B)
        self.stats.decode_steps += 1
        return logits

    def _call(self, name: str, *args) -> torch.Tensor:
        """Run a pass; if compiling it fails, warn once and run eagerly from then on."""
        if not self.compiled:
            return getattr(self, name)(*args)
        try:
            if self.model.device.type == "cuda":
                torch.compiler.cudagraph_mark_step_begin()  # the previous step's outputs are read
            return getattr(self, name)(*args)
        except Exception as error:  # noqa: BLE001 - any compiler failure falls back to the same code, eager
            warnings.warn(f"Engine: compiling its passes failed ({type(error).__name__}: "
                          f"{str(error).splitlines()[0] if str(error) else ''}); sampling eagerly", stacklevel=3)
            self.compiled = False
            self._decode_pass, self._prefill_pass = _decode_pass, _prefill_pass
            return getattr(self, name)(*args)

    def _rope_table(self, S: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [S, d] as `Decoder._trunk` computes them (f32 angles, then the dtype)."""
        m = self.model
        angles = torch.arange(S, device=m.device).float()[:, None] * m.inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(m.dtype), angles.sin().to(m.dtype)

    def _ensure_cache(self, rows: int, slots: int) -> None:
        c = self.card
        if self._keys:
            have_rows, _, have_slots, _ = self._keys[0].shape
            if have_rows >= rows and have_slots >= slots:
                return
            rows, slots = max(rows, have_rows), max(slots, have_slots)
        self._keys, self._values = [], []  # free the old cache before allocating the new
        # zeros, not empty: masked slots are still multiplied by 0 in attention, and
        # uninitialised memory may hold NaNs (0 * NaN = NaN)
        shape = (rows, c.kv_heads, slots, c.head_dim)
        for _ in range(c.layers):
            self._keys.append(torch.zeros(shape, dtype=self.model.dtype, device=self.model.device))
            self._values.append(torch.zeros(shape, dtype=self.model.dtype, device=self.model.device))

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


def _prefill_pass(model, tokens_P, positions_P, rows_nP, last, keys, values, cos_Sd, sin_Sd, attend):
    """The prompts' pass: every layer's keys/values into cache rows `rows_nP` (the n
    completions of each position's prompt, n-major) at their positions; the logits [prompts,
    V] at `last`. attend: the attention function of the model's path (bounds bound), or a
    [P, P] mask for one SDPA call (the compiled pass)."""
    P = len(tokens_P)
    n = len(rows_nP) // P
    cos, sin = cos_Sd[positions_P][:, None], sin_Sd[positions_P][:, None]  # [P, 1, d]
    slots = positions_P.repeat(n)
    x = F.embedding(tokens_P, model.model.embed_tokens.weight).to(model.dtype)
    for i, block in enumerate(model.model.layers):
        q_PHd, k_PKd, v_PKd = _project(block.self_attn, block.input_layernorm(x), cos, sin)
        keys[i][rows_nP, :, slots] = k_PKd.repeat(n, 1, 1)
        values[i][rows_nP, :, slots] = v_PKd.repeat(n, 1, 1)
        q, k, v = q_PHd.transpose(0, 1)[None], k_PKd.transpose(0, 1)[None], v_PKd.transpose(0, 1)[None]
        if isinstance(attend, torch.Tensor):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attend, enable_gqa=q.shape[1] != k.shape[1])
        else:
            out = attend(q, k, v)
        x = _finish(block, x, out[0].transpose(0, 1).reshape(P, -1))
    return _logits(model, x[last])


def _decode_pass(model, tokens_B, pos_B, keys, values, cos_Sd, sin_Sd, S: int):
    """One decode step: row b's token at slot pos_B[b] of cache row b, attending to the
    first S slots (those past its position masked). Returns [B, V] f32.

    The one-query attention is two batched matmuls and a softmax (SDPA's CPU kernel is
    built for long queries: 1.17x a GRPO step)."""
    B = len(tokens_B)
    rows_B = torch.arange(B, device=tokens_B.device)
    cos, sin = cos_Sd[pos_B][:, None], sin_Sd[pos_B][:, None]  # [B, 1, d]
    unseen = (torch.arange(S, device=tokens_B.device)[None] > pos_B[:, None])[:, None, None]  # [B, 1, 1, S]
    x = F.embedding(tokens_B, model.model.embed_tokens.weight).to(model.dtype)
    for i, block in enumerate(model.model.layers):
        attn = block.self_attn
        H, K, d = attn.shape
        q_BHd, k_BKd, v_BKd = _project(attn, block.input_layernorm(x), cos, sin)
        keys[i][rows_B, :, pos_B] = k_BKd
        values[i][rows_B, :, pos_B] = v_BKd
        k_cache, v_cache = keys[i][:B, :, :S], values[i][:B, :, :S]
        scores = (q_BHd.view(B, K, H // K, d) @ k_cache.transpose(-1, -2)).float()  # [B, K, H/K, S]
        scores = scores.mul_(d**-0.5).masked_fill_(unseen, -math.inf)
        out = torch.softmax(scores, dim=-1).to(model.dtype) @ v_cache  # [B, K, H/K, d]
        x = _finish(block, x, out.reshape(B, -1))
    return _logits(model, x)


def _logits(model, h_ND: torch.Tensor) -> torch.Tensor:
    return (model.model.norm(h_ND) @ model.head_weight.to(model.dtype).T).float()


def _project(attn, h_ND, cos_N1d, sin_N1d):
    """q [N, H, d], k and v [N, K, d] of one attention module, q and k rotated."""
    q, k, v = attn.project(h_ND)
    return rotate(q, cos_N1d, sin_N1d), rotate(k, cos_N1d, sin_N1d), v


def _finish(block, x_ND, attended_NE):
    """The rest of `Block.forward` once attention is done: output projection, residual, MLP."""
    x_ND = x_ND + block.self_attn.o_proj(attended_NE)
    return x_ND + block.mlp(block.post_attention_layernorm(x_ND))


def _pick(logits_BV: torch.Tensor, s: _Sampling, rows_B: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled ids [B] and the model's (temperature 1, unfiltered) log-probabilities of them.
    rows_B: each row's completion index among `total`: one uniform is drawn for every
    completion each step, stopped or not, so a completion's draws never depend on when
    the others stop or leave the batch."""
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
        u = torch.rand(total, 1, generator=s.generator, dtype=torch.float64, device=cdf.device)[rows_B]
        tok = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=cdf.shape[1] - 1)[:, 0]
    return tok, logp_BV.gather(-1, tok[:, None])[:, 0]
