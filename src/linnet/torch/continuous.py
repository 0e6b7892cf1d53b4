"""Continuous batching: requests join a running batch of the sampling engine between two
decode steps, instead of waiting for the whole batch to end (iteration-level scheduling,
Yu et al. 2022, "Orca"; what vLLM and TGI call continuous batching).

    session = Continuous(engine, temperature=0)
    session.add("r1", prompt_ids, max_new_tokens=64)
    while session.active:
        for key, (token, logprob) in session.step().items():   # one token for every request
            ...
        session.add("r2", other_ids, max_new_tokens=32, adapter="tenant-a")  # joins at the next step

A joining request's prompt is prefilled into the next free row of the engine's prompt
cache, and its completion writes its keys and values from the batch's current generated
slot on, its earlier slots masked and its positions counted from there (`first_B` of
`linnet.torch.passes.decode_pass`), so it samples what it would sample alone (greedy: the
same tokens and log-probabilities, tests/test_continuous.py). A request leaves the batch
at its stop token or its max_new_tokens (or when `cancel`led) and its rows are compacted
away, as in `Engine.sample`. With an AdapterEngine each request names its adapter.

The session uses the engine's caches: nothing else may sample with the engine while
requests are active. A request is admitted when the caches hold it (its prompt within the
prompt slots, its completion within the generated slots left once the slots no running
request reads are let go, a row free); otherwise it waits for the batch to drain, when the
caches are sized anew for what waits.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from linnet.torch.engine import Engine, _pick, token_prompts
from linnet.torch.passes import Batch


@dataclass
class _Row:
    key: Hashable
    prompt: list[int]
    max_new_tokens: int
    adapter: int  # its index in the engine's adapter bank; -1: the base
    serial: int  # its draw among the session's uniforms (_pick)
    sampling: object  # the session's settings, or its own (then with its own generator when seeded)
    first: int = 0  # the generated slot its first fed-back token goes to
    made: int = 0  # tokens sampled so far
    cancelled: bool = False


class Continuous:
    """A batch that requests join and leave between decode steps, over `engine` (eager:
    a compiled engine keeps a batch's sizes fixed). The session's sampling settings
    (temperature, top-p, seed, stop ids as `Engine.sample` takes them), which a request
    may replace with its own but the stop ids (`add`); `rows`:
    requests at once; `prompt_slots`, `new_slots`: the least the caches are sized for
    when the session (re)starts, so that later, longer requests can still join."""

    def __init__(self, engine: Engine, *, temperature: float = 0.0, top_p: float | None = None,
                 seed: int | None = None, stop: Sequence[int] | None = None, rows: int = 16,
                 prompt_slots: int = 0, new_slots: int = 0):
        if engine.compiled:
            raise ValueError("Continuous: the engine compiles its passes for fixed batch sizes; build it eagerly "
                             "(compile=False) to let requests join a running batch")
        self.engine, self.rows = engine, rows
        self.sampling = engine._check_sampling(1, 1, temperature, None, top_p, stop, seed, None)
        self.prompt_slots, self.new_slots = prompt_slots, new_slots
        self.running: list[_Row] = []  # in the caches' row order
        self.joining: list[_Row] = []  # admitted, prefilled at the next step
        self.slot = 0  # the generated slot the next decode step writes
        self._logits: torch.Tensor | None = None  # the running rows' next-token logits
        self._serial = 0
        self._capacity = (0, 0)  # (prompt slots, generated slots) of the caches this session sized
        self._rope = None

    @property
    def active(self) -> bool:
        """Whether any request is running or waits to join."""
        return bool(self.running or self.joining)

    def fits(self, prompt: Sequence[int], max_new_tokens: int) -> bool:
        """Whether a request could join now (else it waits for the batch to drain)."""
        if not self.active:
            return True
        prompts, slots = self._capacity
        return (len(self.running) + len(self.joining) < self.rows and len(prompt) <= prompts
                and self.slot - self._unused() + max_new_tokens - 1 <= slots)

    def _unused(self) -> int:
        """Generated slots no running request attends to any longer (before the oldest one's first)."""
        return min((r.first for r in self.running), default=self.slot)

    def add(self, key: Hashable, prompt: Sequence[int], max_new_tokens: int, *, adapter: str | None = None,
            temperature: float | None = None, top_p: float | None = None, seed: int | None = None) -> bool:
        """Admit a request (it joins at the next step); False, admitting nothing, when it does
        not fit now. temperature, top_p, seed: its own sampling settings (None: the
        session's); with a seed of its own it draws from its own generator, one uniform a
        step, and samples exactly what `Engine.sample` samples for it alone."""
        (ids,) = token_prompts([prompt], self.engine.card.vocab, who="Continuous.add")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"Continuous.add: max_new_tokens={max_new_tokens!r}; it must be at least 1")
        sampling = self.sampling
        if (temperature, top_p, seed) != (None, None, None):
            s = self.sampling
            sampling = self.engine._check_sampling(
                1, 1, s.temperature if temperature is None else temperature, None,
                top_p if top_p is not None else s.top_p, s.stop.tolist(), seed, None)
        if not self.fits(ids, max_new_tokens):
            return False
        bank = getattr(self.engine, "bank", None)
        if adapter is not None and bank is None:
            raise ValueError(f"Continuous.add: adapter {adapter!r} for an engine without adapters")
        index = -1 if adapter is None else bank.index(adapter)
        if not self.active:
            self._restart(len(ids), max_new_tokens)
        elif self.slot + max_new_tokens - 1 > self._capacity[1]:
            self._rebase()
        self.joining.append(_Row(key, ids, max_new_tokens, index, self._serial, sampling))
        self._serial += 1
        return True

    def cancel(self, key: Hashable) -> None:
        """Stop a request early (its answer is complete: a stop string): it leaves at the next step."""
        for row in self.running + self.joining:
            if row.key == key:
                row.cancelled = True

    def _restart(self, prompt: int, new: int) -> None:
        """An empty batch: generated slots from 0, the caches sized for at least this request."""
        e = self.engine
        self.prompt_slots, self.new_slots = max(self.prompt_slots, prompt), max(self.new_slots, new)
        prompts = e._round(self.prompt_slots)
        e._ensure_cache(self.rows, prompts, self.rows, max(self.new_slots - 1, 1))
        self._capacity = (prompts, e._keys[0].shape[2])
        self._rope = e._rope_table(prompts + self._capacity[1])
        self.slot, self._serial = 0, 0

    @torch.inference_mode()
    def _rebase(self) -> None:
        """Shift the running rows' generated slots left past those no request reads any longer,
        so a batch that never drains keeps room for requests to join."""
        e, unused, rows = self.engine, self._unused(), len(self.running)
        for t in e._keys + e._values:
            t[:rows, :, :self.slot - unused] = t[:rows, :, unused:self.slot].clone()
        for r in self.running:
            r.first -= unused
        self.slot -= unused

    @torch.inference_mode()
    def step(self) -> dict[Hashable, tuple[int, float]]:
        """One token for every running request and every one that joins now: {key: (token,
        its log-probability)}. A request's last token is among them the step it ends."""
        e = self.engine
        self.joining = [r for r in self.joining if not r.cancelled]  # a running one leaves after this step
        logits = [] if self._logits is None else [self._logits]
        if self.joining:
            if hasattr(e, "bank"):
                e._prompt_ids = [r.adapter for r in self.joining]
            at = len(self.running)  # the joiners' prompt rows follow the running ones'
            logits.append(e._prefill([r.prompt for r in self.joining], *self._rope, first_row=at))
            for r in self.joining:
                r.first = self.slot
            self.running += self.joining
            self.joining = []
        if not self.running:
            return {}
        logits = torch.cat(logits) if len(logits) > 1 else logits[0]
        tokens, logprobs = self._sampled(logits)
        out, done = {}, []
        stops = set(self.sampling.stop.tolist())
        for r, token, logprob in zip(self.running, tokens.tolist(), logprobs.tolist()):
            r.made += 1
            if not r.cancelled:
                out[r.key] = (token, logprob)
            done.append(token in stops or r.made >= r.max_new_tokens or r.cancelled)
        e.stats.sampled_tokens += len(self.running)
        self._decode(tokens, done)
        return out

    def _sampled(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each running row's token and log-probability, the rows grouped by their sampling
        settings: the session's draw from one stream by serial, a request's own seeded
        stream one uniform a step."""
        dev = logits.device
        tokens = torch.empty(len(self.running), dtype=torch.long, device=dev)
        logprobs = torch.empty(len(self.running), dtype=torch.float32, device=dev)
        groups: dict[int, list[int]] = {}
        for i, r in enumerate(self.running):
            groups.setdefault(id(r.sampling), []).append(i)
        for members in groups.values():
            sampling, index = self.running[members[0]].sampling, torch.tensor(members, device=dev)
            if sampling is self.sampling:
                draws = torch.tensor([self.running[i].serial for i in members], device=dev), self._serial
            else:
                draws = torch.arange(len(members), device=dev), len(members)
            tokens[index], logprobs[index] = _pick(logits[index], sampling, *draws)
        return tokens, logprobs

    def _decode(self, tokens: torch.Tensor, done: list[bool]) -> None:
        """The running rows that go on: compacted in the caches, then one decode step."""
        e = self.engine
        if all(done):
            self.running, self._logits = [], None
            return
        if hasattr(e, "bank"):  # each row's adapter, moved with its row by the bank's _compact
            e._row_ids = [r.adapter for r in self.running]
        order = e._compact(e._prompt_keys + e._prompt_values, done, e._prompt_keys[0].shape[2])
        if order is not None:
            moved = e._compact(e._keys + e._values, done, self.slot)
            assert moved == order, "the prompt and generated caches compacted alike"
            self.running = [self.running[i] for i in order]
            tokens = tokens[torch.tensor(order, device=tokens.device)]
        batch = Batch(list(range(len(self.running))), [len(r.prompt) for r in self.running], self._capacity[0],
                      e.model.device, first=[r.first for r in self.running])
        self._logits = e._decode(tokens, batch, self.slot, *self._rope)
        self.slot += 1
