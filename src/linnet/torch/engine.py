"""Sampling with a preallocated KV cache: generation and GRPO rollouts.

    engine = Engine(nest.load(card, dtype="bfloat16"))     # the engine owns this model
    done = engine.sample([ids_a, ids_b], n=8, max_new_tokens=256, temperature=1.0, seed=0)
    done[0].tokens, done[0].logprobs, done[0].stopped        # completion 0 of prompt 0
    engine.load_weights(policy)                              # policy's weights in, adapters merged

One `sample` call:

1. Prefill: the distinct prompts go through the model once, packed end to end in one row
   (positions restart at 0 for each; attention never crosses prompts, through the model's
   own attention path, as in training). Each layer's keys and values go to the prompt
   cache, one row a prompt: a group of n completions shares one prefill and one copy.
2. Decode: one position per active row and step, all rows at the same step. A row writes
   its new key/value at slot `step` of its own row in the generated tokens' cache and
   attends to its prompt's slots and its own generated ones, in one softmax. The prompt
   part runs a prompt at a time with all its completions as queries, so a group's prompt
   keys and values are read once a step, not once a completion (cascade attention).
3. Stop: a row that samples a stop token (kept as its last token) or reaches
   `max_new_tokens` stops growing. Finished rows are dropped from the batch and the
   caches are compacted (a prompt leaves with its last completion), so later steps cost
   only what is still running; the loop ends when no row is left.

The passes themselves are in `linnet.torch.passes`.

Compiled passes (`Engine(model, compile=True)`, or a model loaded with `compile=`): the
decode step and the prefill are each one `torch.compile`d function (on CUDA the decode
step is captured as a CUDA graph, mode "reduce-overhead"), with dynamic sizes. A pass
compiles the first time a call needs it, and again for the sizes a compiler keeps apart
(one prompt, one row, one row a prompt); `warmup(prompt_lengths)` compiles all of them
before the first real call. The compiled prefill attends through one block-diagonal mask
(one kernel, no per-prompt Python loop). If compiling fails (no C++ compiler, an
unsupported op) the engine warns once and runs eagerly from then on. Stop tokens are
checked on the host every `stop_every` steps (1 on CPU, 8 on CUDA: no host sync per token
there); rows that stopped in between run on, and their extra tokens are dropped.

Log-probabilities: each sampled token's log-probability under the model's unmodified
distribution (softmax of the logits at temperature 1, before top-k/top-p), in float32:
what `Decoder.log_probs_packed` gives for the same sequence; with other settings than
temperature 1 and no top-k/top-p it is still the model's (which GRPO's importance
correction needs), not the distribution sampled from.

Shapes: B rows (completions) in the batch, V vocabulary.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.fx.experimental._config as fx_config
import torch.nn.functional as F

from linnet import hardware
from linnet.files.adapters import ADAPTER_SUFFIXES
from linnet.rl.rollouts import Completion
from linnet.torch import attention as attention_paths
from linnet.torch.lora import merged, policy_weights
from linnet.torch.losses import token_log_probs
from linnet.torch.model import Decoder, Linear, rope_tables
from linnet.torch.passes import Batch, decode_pass, prefill_pass, reorder_weights
from linnet.torch.quantize import is_quantized, quant_states
from linnet.torch.sharding import is_sharded


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
    max_batch, tokens: allocate the caches up front (both or neither) for this many
        prompts and completions, each up to this many tokens; without them they are
        allocated at the first call's size. A cache grows (reallocates) only when a call
        needs more rows or slots than it has.
    compile: compile the decode and prefill passes (module docstring) with the backend the
        model names (`nest.load(..., compile="eager")`), else inductor; None: as the model.
    """

    def __init__(self, model: Decoder, *, max_batch: int | None = None, tokens: int | None = None,
                 compile: bool | None = None):
        if not isinstance(model, Decoder):
            raise TypeError(
                f"Engine: expected a linnet Decoder (nest.load(card)), got {type(model).__name__}"
            )
        if (max_batch is None) != (tokens is None):
            raise ValueError("Engine: give both max_batch and tokens to preallocate the cache, or neither")
        if model.lora and not model.quantized:
            model.merge_lora()  # an NF4 base keeps its adapters beside it (see load_weights)
        model.eval()
        model.requires_grad_(False)
        cpu32 = model.device.type == "cpu" and model.dtype == torch.float32
        reordered_layers = cpu32 and hardware.cpu_reorders_projections()
        if cpu32 and not reordered_layers:
            _store_transposed(model)
        self.model = model
        self.card = model.card
        self.stats = Stats()
        # per layer, in the model's dtype (one tensor a layer and kind: a compiled pass writing
        # into views of one big tensor copies all of it): the prompts' keys and values
        # [prompts, K, S, d], each prompt once however many completions it has, and the
        # generated tokens' [B, K, N, d]
        self._prompt_keys: list[torch.Tensor] = []
        self._prompt_values: list[torch.Tensor] = []
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []
        self.compiled = bool(model.compiled if compile is None else compile)
        if self.compiled and model.quantized:
            raise ValueError("Engine: an NF4 (quantize='nf4') model samples eagerly; pass compile=False")
        self._decode_pass, self._prefill_pass = decode_pass, prefill_pass
        if self.compiled:  # with the model's backend (inductor unless it names another)
            backend = model.compiled if isinstance(model.compiled, str) else "inductor"
            graphs = {"mode": "reduce-overhead"} if backend == "inductor" and model.device.type == "cuda" else {}
            # dynamic sizes from the start: a batch shrinks as rows stop and prompts differ in
            # length, so static graphs would recompile for each new size (see `warmup`)
            self._decode_pass = torch.compile(decode_pass, backend=backend, dynamic=True, **graphs)
            self._prefill_pass = torch.compile(prefill_pass, backend=backend, dynamic=True)
        self.stop_every = 8 if model.device.type == "cuda" else 1
        self._reordered = None if self.compiled else reorder_weights(model, reordered_layers)
        if max_batch is not None:
            self._ensure_cache(max_batch, tokens, max_batch, tokens)

    # -- weights --------------------------------------------------------------------

    @torch.no_grad()
    def load_weights(self, policy: torch.nn.Module) -> None:
        """Copy a policy's weights into the engine's (by parameter name, in place: no
        tensor is reallocated). LoRA adapters are merged on the way (W + scale * B @ A,
        in float32); the policy itself is not changed. A policy sharded by fully_shard is
        gathered one tensor at a time; a pipelined one's stages each copy their weights in
        and pass them to the others, so every stage's engine holds the whole model (every
        process must call this together).

        An engine loaded with quantize="nf4" samples from the policy's own NF4 base,
        shared rather than copied, with copies of its adapters beside it (unmerged: an NF4
        weight cannot take them), so it computes what the QLoRA policy computes."""
        pipe = getattr(policy, "pipe", None)
        if self.model.quantized and (is_sharded(policy) or pipe is not None):
            how = "cut into pipeline stages" if pipe is not None else "split by fully_shard"
            raise ValueError(f"Engine.load_weights: the policy is {how}, so an NF4 engine cannot share its base; load "
                             "the engine without quantize= (it takes the gathered, dequantized and merged weights)")
        if self.card.tied_embeddings and not getattr(policy, "card", self.card).tied_embeddings:
            self.model.untie_head()  # a split policy's head trains apart from its embedding (tensor_parallel)
            self.card = self.model.card
        own = {n: p for n, p in self.model.named_parameters() if not n.endswith(ADAPTER_SUFFIXES)}
        quantized = quant_states(self.model)
        seen = set()
        for name, p, layer in policy_weights(policy):
            if name not in own:
                raise ValueError(
                    f"Engine.load_weights: the policy has {name!r}, which the engine's model "
                    "lacks; load the engine from the same card as the policy"
                )
            seen.add(name)
            if name in quantized:
                self._share_quantized(name, layer)
                continue
            src = merged(p, layer)
            dst = own[name]
            if src.shape != dst.shape:
                raise ValueError(f"Engine.load_weights: {name} is {tuple(src.shape)} in the policy but "
                                 f"{tuple(dst.shape)} in the engine; load the engine from the same card")
            dst.copy_(src)
        if pipe is not None:
            seen = self._pass_stages(pipe, seen)
        if self._reordered is not None:
            self._reordered = reorder_weights(self.model, self._reordered.layers is not None)
        missing = sorted(set(own) - seen)
        if missing:
            raise ValueError(f"Engine.load_weights: the policy has no {missing[0]!r} (and {len(missing) - 1} "
                             "more); load the engine from the same card as the policy")

    def _pass_stages(self, pipe, mine: set[str]) -> set[str]:
        """Each stage of a pipelined policy has copied its own weights in: pass them to the
        other stages' engines, a tensor at a time in place. Returns every stage's names."""
        import torch.distributed as dist

        names: list = [None] * pipe.stages
        dist.all_gather_object(names, sorted(mine), group=pipe.group)
        own = dict(self.model.named_parameters())
        for stage, held in enumerate(names):
            for name in held:
                buffer = own[name].data.contiguous()  # the parameter itself unless laid out transposed
                dist.broadcast(buffer, group=pipe.group, group_src=stage)
                if buffer.data_ptr() != own[name].data_ptr():
                    own[name].data.copy_(buffer)
        return {name for held in names for name in held}

    def _share_quantized(self, name: str, source: Linear | None) -> None:
        """Point the engine's NF4 layer at the policy's NF4 codes and copy its adapters."""
        if source is None or not is_quantized(source):
            raise ValueError(f"Engine.load_weights: the engine's {name} is NF4 but the policy's is not; load the "
                             "engine as the policy was loaded (quantize= the same)")
        if not isinstance(source, Linear):  # NF4 experts: the policy's own module, its adapters in place
            block, _, held = name.rpartition(".")[0].rpartition(".")
            setattr(self.model.get_submodule(block), held, source)
            return
        layer = self.model.get_submodule(name.removesuffix(".weight"))
        layer.weight, layer.quant_state = source.weight, source.quant_state
        for part in ("lora_a", "lora_b", "lora_magnitude"):
            value = getattr(source, part)
            mine = getattr(layer, part)
            if value is None:
                setattr(layer, part, None)
            elif mine is not None and mine.shape == value.shape:
                mine.copy_(value)
            else:
                setattr(layer, part, torch.nn.Parameter(value.detach().clone(), requires_grad=False))
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
        turns=None,
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

        turns: a linnet.rl.conversations.Conversations: a stop token ends a model turn, and the
            completion only when its environment is done (max_new_tokens bounds it all)

        Returns len(prompts) * n completions, prompt-major: completion j of prompt i is
        at i * n + j.
        """
        run = self._generate(prompts, n, max_new_tokens, temperature, top_k, top_p, stop, seed, generator,
                             turns=turns)
        while True:
            try:
                next(run)
            except StopIteration as end:
                return end.value

    def stream(self, prompt: Sequence[int], **options) -> Iterator[int]:
        """Yield one prompt's completion a token at a time, as it is sampled (the
        options of `sample`, n=1). A stop token is yielded too, as the last."""
        for step in self.steps([prompt], **options):
            yield step[0]

    def steps(self, prompts: Sequence[Sequence[int]], **options) -> Iterator[dict[int, int]]:
        """Sample one completion of each prompt in one batch, yielding each step's tokens
        as {prompt index: token} for the rows still running (a server streams them to
        their requests); the options of `sample`."""
        allowed = dict(max_new_tokens=256, temperature=1.0, top_k=None, top_p=None, stop=None, seed=None, generator=None)
        if set(options) - set(allowed):
            raise TypeError(f"Engine.steps: unexpected options {', '.join(sorted(set(options) - set(allowed)))}")
        for rows, tokens in self._generate(prompts, 1, **{**allowed, **options}, stop_every=1):
            yield dict(zip(rows.tolist(), tokens.tolist()))

    def warmup(self, prompt_lengths: Sequence[int], *, n: int = 1, max_new_tokens: int = 2) -> None:
        """Allocate the cache for prompts of these lengths (n completions each) and, in a
        compiled engine, compile every pass size sampling uses: a dummy call at these
        sizes, then the prefill of one prompt and the decode steps of the batches that
        remain as completions stop (`_warm_shapes`). The passes compile with dynamic
        sizes, so later calls of other lengths and batch sizes compile nothing more (on
        CUDA each new size still captures its own graph). Stats are left unchanged."""
        saved = Stats(**vars(self.stats))
        prompts = [[0] * int(t) for t in prompt_lengths]
        self.sample(prompts, n, max_new_tokens=max_new_tokens, temperature=0.0, stop=())
        if self.compiled:
            self._warm_shapes(max(map(len, prompts)))
        self.stats = saved

    @torch.inference_mode()
    def _warm_shapes(self, length: int) -> None:
        """Run the passes whose sizes a compiler keeps apart (a size of 1): a prefill of one
        and of two prompts, and a decode step of one row, of one prompt's rows, of one row
        a prompt and of several rows a prompt (a row's prompt index each: `Batch`), the
        ways the rows can stand once some completions have stopped."""
        dev = self.model.device
        layouts = ([0], [0, 0], [0, 1], [0, 0, 1, 1])  # one row; one prompt's; one row a prompt; the rest
        Sp = self._round(length)
        self._ensure_cache(2, Sp, max(map(len, layouts)), 1)
        cos, sin = self._rope_table(length + 1)
        for prompts in (1, 2):
            self._prefill([[0] * length] * prompts, cos, sin)
        for group in layouts:
            tokens = torch.zeros(len(group), dtype=torch.long, device=dev)
            self._decode(tokens, Batch(group, [length] * (max(group) + 1), Sp, dev, grid=True), 0, cos, sin)

    def reset_stats(self) -> None:
        self.stats = Stats()

    # -- the loop -------------------------------------------------------------------

    @torch.inference_mode()
    def _generate(self, prompts, n, max_new_tokens, temperature, top_k, top_p, stop, seed, generator,
                  stop_every=None, turns=None):
        """Yields (each row's completion index, its sampled token) each step; returns the
        completions."""
        prompts = token_prompts(prompts, self.card.vocab)
        sampling = self._check_sampling(n, max_new_tokens, temperature, top_k, top_p, stop, seed, generator)
        every = stop_every or self.stop_every
        dev = self.model.device
        lengths = [len(p) for p in prompts]
        B, N = len(prompts) * n, max_new_tokens
        Sp = self._round(max(lengths))
        self._ensure_cache(len(prompts), Sp, B, max(N - 1, 1))  # the last sampled token is never fed back
        cos, sin = self._rope_table(max(lengths) + N - 1)

        out_tok = torch.zeros(B, N, dtype=torch.long, device=dev)
        out_lp = torch.zeros(B, N, dtype=torch.float32, device=dev)
        length = torch.full((B,), N, device=dev)  # tokens a completion keeps (its stop token included)
        stopped = torch.zeros(B, dtype=torch.bool, device=dev)

        logits = self._prefill(prompts, cos, sin).repeat_interleave(n, dim=0)
        rows = torch.arange(B, device=dev)  # completion index of each row in the batch
        group = [r // n for r in range(B)]  # host: each row's prompt-cache row
        batch = Batch(group, lengths, Sp, dev, grid=self.compiled)
        finished = torch.zeros(B, dtype=torch.bool, device=dev)  # rows that sampled a stop token
        for step in range(N):
            tok, lp = _pick(logits, sampling, rows, B)
            if turns is not None:  # inserted tokens take the place of sampled ones
                tok, lp, forced = _insert(turns, rows, tok, lp)
            out_tok[rows, step] = tok
            out_lp[rows, step] = lp
            self.stats.sampled_tokens += len(group)
            yield rows, tok
            if len(sampling.stop):
                hit = torch.isin(tok, sampling.stop) & ~finished
                if turns is not None:  # a turn ended: its conversation goes on while its environment answers
                    hit = torch.tensor([h and not f and not turns.ended(r, out_tok[r, : step + 1].tolist(), N - step - 1)
                                        for r, h, f in zip(rows.tolist(), hit.tolist(), forced)], device=dev)
                length[rows] = torch.where(hit, step + 1, length[rows])
                stopped[rows] |= hit
                finished |= hit
            if step == N - 1:
                break
            if len(sampling.stop) and (step + 1) % every == 0:  # the only host sync on stops
                done = finished.tolist()
                if all(done):
                    break
                order = self._compact(self._keys + self._values, done, step)
                if order is not None:
                    index = torch.tensor(order, device=dev)
                    rows, tok, finished = rows[index], tok[index], finished[index]
                    group = [group[i] for i in order]
                    kept = set(group)
                    moved = self._compact(self._prompt_keys + self._prompt_values,
                                          [g not in kept for g in range(batch.groups)], Sp)
                    if moved is not None:
                        new = {old: i for i, old in enumerate(moved)}
                        group = [new[g] for g in group]
                        lengths = [lengths[old] for old in moved]
                    batch = Batch(group, lengths, Sp, dev, grid=self.compiled)
            logits = self._decode(tok, batch, step, cos, sin)

        out_tok, out_lp, length, stopped = out_tok.cpu(), out_lp.cpu(), length.tolist(), stopped.tolist()
        return [
            Completion(r // n, out_tok[r, : length[r]].tolist(), out_lp[r, : length[r]].clone(), stopped[r],
                       **({} if turns is None else dict(learned=turns.learned(r, length[r]),
                                                        turn_rewards=turns.rewards[r])))
            for r in range(B)
        ]

    def _compact(self, cache: list[torch.Tensor], done: list[bool], used: int) -> list[int] | None:
        """Drop finished rows from a cache (the generated tokens' rows, or the prompts'):
        each finished row among the first rows kept is filled by a live row from past them
        (its first `used` slots copied), so only rows that move are copied. A compiled
        engine keeps a power of two of rows (finished ones fill up), so few sizes compile.
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
        if holes and used:
            src = torch.tensor(movers, device=self.model.device)
            dst = torch.tensor(holes, device=self.model.device)
            for t in cache:
                t[dst, :, :used] = t[src, :, :used]
        for h, m in zip(holes, movers):
            order[h] = m
        return order

    def _prefill(self, prompts: list[list[int]], cos_Sd, sin_Sd, first_row: int = 0) -> torch.Tensor:
        """Run the prompts as one packed row, writing prompt i's keys/values into row first_row + i
        of the prompt cache; the logits [len(prompts), V] (f32) of each prompt's last position."""
        m, dev = self.model, self.model.device
        lengths = [len(p) for p in prompts]
        bounds = np.concatenate([[0], np.cumsum(lengths)]).tolist()
        tokens_P = torch.tensor([t for p in prompts for t in p], device=dev)
        positions_P = torch.cat([torch.arange(t, device=dev) for t in lengths])
        prompt_P = torch.repeat_interleave(torch.arange(first_row, first_row + len(prompts), device=dev),
                                           torch.tensor(lengths, device=dev))
        last = torch.tensor(bounds[1:], device=dev) - 1
        if self.compiled:  # one mask: no per-prompt loop (and no bounds) in the graph
            attend = attention_paths.block_causal_mask(bounds, dev)
        else:
            attend = functools.partial(attention_paths.choose(m.attention, dev), bounds=bounds)
        logits = self._call("_prefill_pass", m, tokens_P, positions_P, prompt_P, last, self._prompt_keys,
                            self._prompt_values, cos_Sd, sin_Sd, attend, self._reordered)
        self.stats.prefill_positions += bounds[-1]
        return logits

    def _decode(self, tokens_B: torch.Tensor, batch: Batch, step: int, cos_Sd, sin_Sd) -> torch.Tensor:
        """One position a row: each row's token goes to slot `step` of its row in the
        generated tokens' cache. Returns [B, V] f32. Attends over the generated slots up to
        `step` rounded up (`_round`), so that few shapes compile (and oneDNN sees few)."""
        new = min(self._round(step + 1), self._keys[0].shape[2])
        step_1 = torch.full((1,), step, device=tokens_B.device)
        logits = self._call("_decode_pass", self.model, tokens_B, step_1, batch.prompt_len, batch.grid, batch.place,
                            batch.unseen, self._keys, self._values, self._prompt_keys, self._prompt_values,
                            cos_Sd, sin_Sd, batch.groups, batch.n, new, self._reordered, batch.first)
        self.stats.decode_positions += len(tokens_B)
        self.stats.decode_steps += 1
        return logits

    def _round(self, slots: int) -> int:
        """Slots attended, rounded up: to 64 in a compiled engine (few shapes compile), to 8 eagerly."""
        unit = 64 if self.compiled else 8
        return -(-slots // unit) * unit

    def _call(self, name: str, *args) -> torch.Tensor:
        """Run a pass; if compiling it fails, warn once and run eagerly from then on."""
        if not self.compiled:
            return getattr(self, name)(*args)
        try:
            if self.model.device.type == "cuda":
                torch.compiler.cudagraph_mark_step_begin()  # the previous step's outputs are read
            # sizes that happen to be equal (a batch filling the cache) are not assumed equal
            # later: no graph is kept for such a coincidence
            with fx_config.patch(use_duck_shape=False):
                return getattr(self, name)(*args)
        except Exception as error:  # noqa: BLE001 - any compiler failure falls back to the same code, eager
            warnings.warn(f"Engine: compiling its passes failed ({type(error).__name__}: "
                          f"{str(error).splitlines()[0] if str(error) else ''}); sampling eagerly", stacklevel=3)
            self.compiled = False
            self._decode_pass, self._prefill_pass = decode_pass, prefill_pass
            return getattr(self, name)(*args)

    def _rope_table(self, S: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [S, d] as `Decoder._trunk` computes them (f32 angles, then the dtype)."""
        m = self.model
        return rope_tables(torch.arange(S, device=m.device), m.inv_freq, m.card, m.dtype)

    def _ensure_cache(self, groups: int, prompt_slots: int, rows: int, new_slots: int) -> None:
        """Room for `groups` prompts of `prompt_slots` tokens and `rows` completions of
        `new_slots` fed-back tokens; a cache grows (is reallocated) only when too small."""
        self._prompt_keys, self._prompt_values = self._room(self._prompt_keys, self._prompt_values, groups,
                                                            prompt_slots)
        self._keys, self._values = self._room(self._keys, self._values, rows, new_slots)

    def _room(self, keys: list[torch.Tensor], values: list[torch.Tensor], rows: int, slots: int):
        c = self.card
        if keys:
            have_rows, _, have_slots, _ = keys[0].shape
            if have_rows >= rows and have_slots >= slots:
                return keys, values
            rows, slots = max(rows, have_rows), max(slots, have_slots)
            keys.clear()  # free the old cache before allocating the new
            values.clear()
        # zeros, not empty: masked slots are still multiplied by 0 in attention, and
        # uninitialised memory may hold NaNs (0 * NaN = NaN)
        shape = (rows, c.kv_heads, slots, c.head_dim)

        def layers():
            return [torch.zeros(shape, dtype=self.model.dtype, device=self.model.device) for _ in range(c.layers)]

        return layers(), layers()

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



def _insert(turns, rows_B: torch.Tensor, tok_B: torch.Tensor, lp_B: torch.Tensor):
    """(tokens, logprobs, inserted flags [B] on the host): the rows whose conversation has
    tokens queued take the next one, with log-probability 0."""
    queued = turns.next_tokens(rows_B.tolist())
    if not any(forced := [t is not None for t in queued]):
        return tok_B, lp_B, forced
    mask = torch.tensor(forced, device=tok_B.device)
    ids = torch.tensor([t or 0 for t in queued], device=tok_B.device)
    return torch.where(mask, ids, tok_B), lp_B.masked_fill(mask, 0.0), forced


def _pick(logits_BV: torch.Tensor, s: _Sampling, rows_B: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled ids [B] and the model's (temperature 1, unfiltered) log-probabilities of them.
    rows_B: each row's completion index among `total`: one uniform is drawn for every
    completion each step, stopped or not, so a completion's draws never depend on when
    the others stop or leave the batch."""
    if s.temperature == 0:
        # the first of tied maxima, as argmax; its log-probability is -log sum exp(logits - max)
        # (one pass fewer than argmax and log_softmax: docs/engine.md, "Sampling")
        top_B1, tok_B1 = logits_BV.max(-1, keepdim=True)
        return tok_B1[:, 0], -(logits_BV - top_B1).exp_().sum(-1).log()
    # one uniform a row, where multinomial draws one for every vocabulary entry (1.08x a GRPO step)
    u_B1 = torch.rand(total, 1, generator=s.generator, dtype=torch.float64, device=logits_BV.device)[rows_B]
    if s.temperature == 1 and not s.top_k and s.top_p >= 1.0:
        # the model's own distribution: one pass of exp serves the draw (which needs no
        # normalising) and the log-probability (logit - max - log of the mass), where
        # log_softmax and then its exp took two
        top_B1 = logits_BV.amax(-1, keepdim=True)
        tok, mass_B1 = _inverse_cdf(torch.exp(logits_BV - top_B1), u_B1)
        return tok, logits_BV.gather(-1, tok[:, None])[:, 0] - (top_B1 + mass_B1.log().float())[:, 0]
    z = logits_BV if s.temperature == 1 else logits_BV / s.temperature
    if s.top_k:
        kth = torch.topk(z, s.top_k, dim=-1).values[:, -1:]
        z = z.masked_fill(z < kth, -math.inf)
    if s.top_p < 1.0:
        sorted_z, order = torch.sort(z, dim=-1, descending=True)
        probs = torch.softmax(sorted_z, dim=-1)
        before = probs.cumsum(-1) - probs  # mass of the more likely tokens
        sorted_z = sorted_z.masked_fill(before >= s.top_p, -math.inf)  # the first always stays
        z = torch.full_like(z, -math.inf).scatter(-1, order, sorted_z)
    tok, _ = _inverse_cdf(torch.softmax(z, dim=-1), u_B1)
    return tok, token_log_probs(logits_BV, tok)


def _inverse_cdf(probs_BV: torch.Tensor, u_B1: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """The token where each row's cumulative probability first passes u * total, and the
    total [B, 1] (float64; the probabilities need not be normalised), in two
    levels: the sums of blocks of `block` tokens choose a block, then that block's own
    cumulative sum the token in it (no float64 copy of the whole [B, V]: 1.04x sampling
    at 7M). The sums run in float64, so that no small probability is lost next to a large
    total; "right" and the last-nonzero clamp never land on a token of probability 0."""
    B, V = probs_BV.shape
    if V % block:
        probs_BV = F.pad(probs_BV, (0, block - V % block))
    blocks_BNk = probs_BV.view(B, -1, block)
    ends_BN = blocks_BNk.sum(-1).double().cumsum_(-1)  # the mass up to each block's end
    target_B1 = u_B1 * ends_BN[:, -1:]
    j_B1 = torch.searchsorted(ends_BN, target_B1, right=True).clamp_(max=ends_BN.shape[1] - 1)
    before_B1 = F.pad(ends_BN, (1, 0)).gather(-1, j_B1)  # the mass before block j
    inside_Bk = blocks_BNk.gather(1, j_B1[:, :, None].expand(B, 1, block))[:, 0].double()
    k_B1 = torch.searchsorted(inside_Bk.cumsum(-1), target_B1 - before_B1, right=True)
    last_B1 = torch.where(inside_Bk > 0, torch.arange(block, device=u_B1.device), -1).amax(-1, keepdim=True)
    return (j_B1 * block + torch.minimum(k_B1, last_B1))[:, 0], ends_BN[:, -1:]


def _store_transposed(model: Decoder) -> None:
    """Lay each dense projection's weight in the layers out transposed in memory, still
    [out, in] to every reader: `x @ W.T` then multiplies by a contiguous [in, out] matrix,
    8% faster sampling at 7M on an AVX2 CPU in float32 (32 rows a step), with the same
    numbers. Not where the projections are reordered for oneDNN instead
    (`hardware.cpu_reorders_projections`), nor the head, which oneDNN reorders from its plain
    layout; not in bfloat16, where this layout ran 6x slower on a CPU without avx512_bf16."""
    for layer in model.model.layers.modules():
        w = layer.weight if isinstance(layer, Linear) else None
        if w is not None and type(w.data) is torch.Tensor and not is_quantized(layer):
            w.data = w.data.t().contiguous().t()
