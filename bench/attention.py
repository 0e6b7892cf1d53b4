"""Attention paths over packed rows on CPU: which one should `choose("auto", cpu)` pick?

    OMP_WAIT_POLICY=PASSIVE python bench/attention.py   # bench/attention.md (on a machine others are using)
    python bench/attention.py            # full run; writes bench/attention.md
    python bench/attention.py --quick    # P=2048, fewer cases: about a minute
    python bench/attention.py --out -    # print only, write no markdown
    python bench/attention.py --quick --no-flex --no-e2e --policy-rounds 0 --budget 0.1 --max-reps 3 --out -  # smoke

Run time: the full run took 557 s on the shared 2-core machine with others using 50-70% of
it; about half that when idle.

A packed row of P positions holds several documents end to end; attention stays inside
each document. This times, on 2 threads, every path of `linnet.torch.attention` on rows
built from realistic SFT length mixes, forward alone and forward+backward, f32 and bf16,
then `Decoder.loss_packed` forward+backward of a ~7M-parameter Llama per path.

Besides the shipped paths it times bench-local variants (marked *, not shipped code)
that isolate where time goes:
  documents/slices  the per-document loop as it was before commit ecd295c, over slices
                    q[:, :, s:e]: a slice's backward builds a zero-filled [1, H, P, d]
                    gradient per document and autograd sums them (O(documents x P)
                    memory traffic); the shipped loop runs over `torch.split` views, whose
                    backward is one cat, and takes rows of equal documents in one call.
  dense/row-mask    dense SDPA with an additive float mask built once per row (the model
                    calls attention once per layer and rebuilds the bool mask each time;
                    SDPA then converts bool to float again on each call).
  flex/row-mask     flex with its BlockMask built once per row (`create_block_mask` per
                    call costs ~0.1 s at P=4096).

Timing: each case builds its tensors once, warms every path up once, then runs the paths
interleaved (A B C A B C …) and reports the median; a repeat count adapts to the cost.
Shapes: H query heads, K key/value heads, P positions, d head dim.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from _common import (
    command,
    cpu_now,
    machine,
    others_busy,
    revision,
    run_child,
    send_result,
    table,
    wait_quiet,
    write_report,
)

from linnet import nest
from linnet.packing import Example, pack
from linnet.torch import attention as A

SOURCE = "src/linnet/torch/attention.py"  # the code measured: its commit is in the report

THREADS = 2

# name -> (H, K, d)
HEADS = {
    "small-llama H8/K2/d64": (8, 2, 64),
    "60M-bench H8/K4/d64": (8, 4, 64),  # the "60m" card of bench/plan_vs_measured.py
}

# The ~7M-parameter card for the end-to-end step: the debug card, widened.
E2E_CARD = dict(name="bench-7m", vocab=16384, hidden=256, intermediate=768, layers=4,
                heads=4, kv_heads=2, head_dim=64, max_positions=4096)


# -- rows ---------------------------------------------------------------------------

def _draw(mix: str, rng: np.random.Generator) -> int:
    if mix == "sft":  # typical instruction data: log-normal, median ~250 tokens
        return int(rng.lognormal(math.log(250), 0.7))
    if mix == "long-tail":  # mostly short, one in eight a long document
        if rng.random() < 0.125:
            return int(rng.integers(1024, 2560))
        return int(rng.lognormal(math.log(150), 0.6))
    if mix == "short":  # many short documents: the Python loop's worst case
        return int(rng.lognormal(math.log(40), 0.5))
    raise ValueError(mix)


def document_lengths(mix: str, P: int, seed: int = 0) -> list[int]:
    """Lengths of the documents of one row, packed as `linnet.packing.pack` does (whole
    documents until the next does not fit; the rest is padding, a document of its own)."""
    if mix == "one":
        return [P]
    if mix == "equal":  # pretraining-style rows: equal sequences
        return [256] * (P // 256)
    rng = np.random.default_rng(seed)
    lengths: list[int] = []
    while True:
        n = min(max(_draw(mix, rng), 8), P)
        if sum(lengths) + n > P:
            break
        lengths.append(n)
    if sum(lengths) < P:
        lengths.append(P - sum(lengths))
    return lengths


def bounds_of(lengths: list[int]) -> list[int]:
    return [0, *np.cumsum(lengths).tolist()]


def useful_fraction(lengths: list[int]) -> float:
    """Work inside the documents' causal triangles, as a fraction of the row's full P x P."""
    P = sum(lengths)
    return sum(n * (n + 1) / 2 for n in lengths) / (P * P)


# -- candidates (bench-local) ----------------------------------------------------------

@torch.compiler.disable
def documents_slices(q, k, v, bounds: list[int]):
    """`attention.documents` before commit ecd295c: one SDPA call per slice."""
    gqa = q.shape[1] != k.shape[1]
    outs = [
        F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True, enable_gqa=gqa)
        for s, e in zip(bounds[:-1], bounds[1:])
    ]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def _triangles(bounds: list[int], fill, dtype, device) -> torch.Tensor:
    """[P, P] mask filled block by block: one P x P fill with `fill`, then each document's
    block copied from the top-left corner of one causal triangle (no P x P compares)."""
    P = bounds[-1]
    longest = max(e - s for s, e in zip(bounds[:-1], bounds[1:]))
    if dtype == torch.bool:
        tri = torch.ones(longest, longest, dtype=torch.bool, device=device).tril_()
        mask = torch.zeros(P, P, dtype=torch.bool, device=device)
    else:
        tri = torch.full((longest, longest), fill, dtype=dtype, device=device).triu_(1)
        mask = torch.full((P, P), fill, dtype=dtype, device=device)
    for s, e in zip(bounds[:-1], bounds[1:]):
        mask[s:e, s:e] = tri[: e - s, : e - s]
    return mask


def row_mask(bounds: list[int], dtype, device) -> torch.Tensor:
    """[P, P] additive mask: 0 inside each document's causal triangle, -inf elsewhere."""
    return _triangles(bounds, float("-inf"), dtype, device)


def bool_mask_per_block(bounds: list[int], device) -> torch.Tensor:
    """The shipped `block_causal_mask`, filled block by block."""
    return _triangles(bounds, None, torch.bool, device)


class _RowCache:
    """What a model would build once per row and reuse across its layers."""

    def __init__(self):
        self.key, self.value = None, None

    def get(self, key, build):
        if key != self.key:
            self.key, self.value = key, build()
        return self.value


_dense_cache, _flex_cache = _RowCache(), _RowCache()


def dense_row_mask(q, k, v, bounds: list[int]):
    mask = _dense_cache.get((tuple(bounds), q.dtype), lambda: row_mask(bounds, q.dtype, q.device))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def _flex_block_mask(bounds: list[int], device):
    from torch.nn.attention.flex_attention import create_block_mask

    doc = A.document_ids(bounds, device)

    def same_document_causal(b, h, qi, ki):
        return (doc[qi] == doc[ki]) & (ki <= qi)

    P = bounds[-1]
    return create_block_mask(same_document_causal, None, None, P, P, device=device)


def flex_row_mask(q, k, v, bounds: list[int]):
    mask = _flex_cache.get(tuple(bounds), lambda: _flex_block_mask(bounds, q.device))
    return A._compiled_flex()(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


@dataclass(frozen=True)
class Path:
    name: str
    fn: object
    backward: bool
    candidate: bool = False


PATHS = [
    Path("documents", A.documents, True),
    Path("documents/slices", documents_slices, True, candidate=True),
    Path("dense", A.dense, True),
    # forward only: the mask is built in forward, so its saving is all in the forward table
    Path("dense/row-mask", dense_row_mask, False, candidate=True),
    Path("flex", A.flex, False),
    Path("flex/row-mask", flex_row_mask, False, candidate=True),
]


# -- timing -------------------------------------------------------------------------

def interleaved(fns: dict[str, object], *, budget_s: float, min_reps: int, max_reps: int) -> dict[str, tuple[float, float]]:
    """(median, min) seconds of each callable: one warm-up each, then rounds of all of them."""
    first = {}
    for name, fn in fns.items():
        t0 = time.perf_counter()
        fn()
        first[name] = time.perf_counter() - t0
    round_s = sum(first.values())
    reps = int(min(max_reps, max(min_reps, budget_s // max(round_s, 1e-6))))
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: (statistics.median(ts), min(ts)) for name, ts in times.items()}


@dataclass
class Case:
    P: int
    mix: str
    heads: str
    dtype: torch.dtype
    lengths: list[int]
    fwd: dict[str, float]  # medians
    fwdbwd: dict[str, float]
    fwd_min: dict[str, float]
    fwdbwd_min: dict[str, float]
    mask_s: dict[str, float]
    max_diff: dict[str, float]
    others: float = 0.0  # CPU share other processes used while the case ran


def run_case(P, mix, heads, dtype, paths, args) -> Case:
    H, K, d = HEADS[heads]
    lengths = document_lengths(mix, P)
    bounds = bounds_of(lengths)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, H, P, d, generator=g).to(dtype).requires_grad_()
    k = torch.randn(1, K, P, d, generator=g).to(dtype).requires_grad_()
    v = torch.randn(1, K, P, d, generator=g).to(dtype).requires_grad_()
    grad_out = torch.randn(1, H, P, d, generator=g).to(dtype)

    # flex refuses inputs that require grad on CPU, even under no_grad: forward uses detached ones
    qd, kd, vd = q.detach(), k.detach(), v.detach()

    # correctness first: every path against documents, forward
    with torch.no_grad():
        ref = A.documents(qd, kd, vd, bounds).float()
        max_diff = {p.name: (p.fn(qd, kd, vd, bounds).float() - ref).abs().max().item() for p in paths}

    def forward(fn):
        def run():
            with torch.no_grad():
                fn(qd, kd, vd, bounds)
        return run

    def forward_backward(fn):
        def run():
            q.grad = k.grad = v.grad = None
            fn(q, k, v, bounds).backward(grad_out)
        return run

    # the row-cached candidates built their masks above: the build is not part of the per-layer cost
    fwd = interleaved({p.name: forward(p.fn) for p in paths},
                      budget_s=args.budget, min_reps=args.min_reps, max_reps=args.max_reps)
    fwdbwd = interleaved({p.name: forward_backward(p.fn) for p in paths if p.backward},
                         budget_s=2 * args.budget, min_reps=args.min_reps, max_reps=args.max_reps)
    mask_fns = {
        "bool (shipped)": lambda: A.block_causal_mask(bounds, q.device),
        "bool, per block*": lambda: bool_mask_per_block(bounds, q.device),
        "additive, per block*": lambda: row_mask(bounds, dtype, q.device),
    }
    if any(p.name.startswith("flex") for p in paths):
        mask_fns["flex BlockMask"] = lambda: _flex_block_mask(bounds, q.device)
    mask_s = {k: med for k, (med, _) in interleaved(mask_fns, budget_s=0.5, min_reps=3, max_reps=9).items()}
    assert torch.equal(mask_fns["bool, per block*"](), A.block_causal_mask(bounds, q.device))
    return Case(P, mix, heads, dtype, lengths, {k: m for k, (m, _) in fwd.items()},
                {k: m for k, (m, _) in fwdbwd.items()}, {k: m for k, (_, m) in fwd.items()},
                {k: m for k, (_, m) in fwdbwd.items()}, mask_s, max_diff)


# -- end to end -----------------------------------------------------------------------

@contextlib.contextmanager
def swapped(name: str, fn):
    """Make `choose(name)` return `fn` (choose looks the module's functions up per call)."""
    old = getattr(A, name)
    setattr(A, name, fn)
    try:
        yield
    finally:
        setattr(A, name, old)


E2E_PATHS = {  # label -> (attention path given to nest.load, replacement or None, backward)
    "documents": ("documents", None, True),
    "documents/slices": ("documents", documents_slices, True),
    "dense": ("dense", None, True),
    "flex (fwd only)": ("flex", None, False),
}


def e2e_row(mix: str, P: int, vocab: int):
    rng = np.random.default_rng(1)
    examples = []
    for n in document_lengths(mix, P)[: -1 if mix != "one" else None]:
        tokens = rng.integers(3, vocab, n)
        prompt = n // 3
        examples.append(Example(tokens, [False] * prompt + [True] * (n - prompt)))
    return next(pack(examples, P))


def run_e2e(P, mixes, dtypes, labels, args):
    card = nest.resolve("debug").replace(**E2E_CARD)
    rows = []
    for dtype in dtypes:
        models = {}
        for label in labels:
            path, _, _ = E2E_PATHS[label]
            if path not in models:
                models[path] = nest.load(card, weights="random", attention=path, trainable=True, dtype=dtype)
        for mix in mixes:
            row = e2e_row(mix, P, card.vocab)
            fns = {}
            for label in labels:
                path, replacement, backward = E2E_PATHS[label]
                model = models[path]

                def step(model=model, replacement=replacement, backward=backward, path=path, row=row):
                    model.zero_grad(set_to_none=True)
                    ctx = swapped(path, replacement) if replacement else contextlib.nullcontext()
                    with ctx, torch.set_grad_enabled(backward):
                        loss, count = model.loss_packed(row)
                        if backward:
                            (loss / count).backward()

                fns[label] = step
            if args.wait_quiet:
                wait_quiet(args.wait_quiet)
            before = cpu_now()
            stats = interleaved(fns, budget_s=args.budget * 4, min_reps=args.min_reps, max_reps=args.max_reps)
            med = {k: m for k, (m, _) in stats.items()}
            rows.append((dtype, mix, row, med, {k: m for k, (_, m) in stats.items()}, others_busy(before, cpu_now())))
            print(f"  e2e {_dt(dtype)} {mix:9s} " + "  ".join(f"{k} {1e3 * s:7.1f}" for k, s in med.items()), flush=True)
    return card, rows


# -- reporting ------------------------------------------------------------------------

def _dt(dtype) -> str:
    return {torch.float32: "f32", torch.bfloat16: "bf16"}[dtype]


def _ms(s) -> str:
    return "—" if s is None else f"{1e3 * s:.1f}"



def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def case_tables(cases: list[Case], paths: list[Path]) -> list[str]:
    lines = []
    for kind in ("fwd", "fwdbwd"):
        cols = [p for p in paths if kind == "fwd" or p.backward]
        title = "Forward alone (no grad)" if kind == "fwd" else "Forward + backward"
        lines += [f"### {title}, ms per call (median of repeats)", ""]
        head = ["P", "mix", "docs", "useful", "heads", "dtype", *[p.name + ("*" if p.candidate else "") for p in cols],
                "dense / documents (min-based)", "others' CPU"]
        rows = []
        for c in cases:
            t, tmin = getattr(c, kind), getattr(c, kind + "_min")
            best = min(t[p.name] for p in cols)
            cells = [f"**{_ms(t[p.name])}**" if t[p.name] == best else _ms(t[p.name]) for p in cols]
            rows.append([c.P, c.mix, len(c.lengths), f"{useful_fraction(c.lengths):.3f}", c.heads.split()[1], _dt(c.dtype),
                         *cells, f"{t['dense'] / t['documents']:.2f}x ({tmin['dense'] / tmin['documents']:.2f}x)",
                         f"{100 * c.others:.0f}%"])
        lines += table(head, rows) + [""]
    lines += ["### Mask construction, ms per call (median); the model builds it once per layer", ""]
    first = {(c.P, c.mix, c.dtype): c for c in reversed(cases)}  # the first case of each key
    lines += table(["P", "mix", "docs", "dtype", *cases[0].mask_s],
                   [[c.P, c.mix, len(c.lengths), _dt(c.dtype), *map(_ms, c.mask_s.values())]
                    for c in cases if first[(c.P, c.mix, c.dtype)] is c])
    lines.append("")
    worst = max(((c, name, d) for c in cases for name, d in c.max_diff.items()),
                key=lambda x: x[2] / (1e-4 if x[0].dtype == torch.float32 else 3e-2))
    lines.append(f"Agreement: largest forward |Δ| of any path against `documents`: {worst[2]:.2e} "
                 f"({worst[1]}, {_dt(worst[0].dtype)}, {worst[0].mix}, P={worst[0].P}); bf16 outputs "
                 "differ by their rounding.")
    lines.append("")
    return lines


def e2e_table(card, P, rows) -> list[str]:
    labels = list(rows[0][3])
    lines = [f"### `loss_packed` forward+backward, {card.params() / 1e6:.1f}M-parameter Llama "
             f"(hidden {card.hidden}, {card.layers} layers, H{card.heads}/K{card.kv_heads}/d{card.head_dim}, "
             f"vocab {card.vocab}, trainable, f32 master weights), P={P}, ms per step (median; min in brackets)", ""]
    cells = []
    for dtype, mix, row, med, mins, others in rows:
        best_train = min(v for k, v in med.items() if E2E_PATHS[k][2])
        times = [f"{_ms(v)} ({_ms(mins[k])})" for k, v in med.items()]
        times = [f"**{t}**" if v == best_train else t for t, v in zip(times, med.values())]
        cells.append([_dt(dtype), mix, len(row.bounds) - 1, *times, f"{P / best_train:,.0f}", f"{100 * others:.0f}%"])
    return lines + table(["dtype", "mix", "docs", *labels, "tokens/s (best training path)", "others' CPU"], cells) + [""]


def _gmean(xs) -> float:
    return math.exp(statistics.mean(math.log(x) for x in xs))


def _range(xs) -> str:
    return f"{min(xs):.2f}x to {max(xs):.2f}x (geometric mean {_gmean(xs):.2f}x)"


def conclusion(cases: list[Case], e2e_rows) -> list[str]:
    """Statements computed from the measurements (forward+backward: what training runs).
    Each ratio is given from medians and, in brackets, from the fastest repeat (less
    sensitive to other processes on a shared machine)."""
    lines = ["## Conclusion", "",
             "Computed from the tables above (forward+backward, what training runs); ratios from medians, "
             "in brackets from each path's fastest repeat, which other processes disturb least.", ""]

    def both(f):
        return [f(c.fwdbwd) for c in cases], [f(c.fwdbwd_min) for c in cases]

    r_med, r_min = both(lambda t: t["dense"] / t["documents"])
    lines.append(
        f"- Shipped paths: `dense` takes {_range(r_med)} the time of `documents` [{_range(r_min)}] "
        f"over {len(cases)} cases; `dense` is faster in {sum(r < 1 for r in r_med)} [{sum(r < 1 for r in r_min)}]: "
        + (", ".join(f"{c.mix} ({len(c.lengths)} docs) P={c.P} {_dt(c.dtype)} {c.heads.split()[1]}"
                     for c, r in zip(cases, r_min) if r < 1) or "none")
        + "."
    )
    s_med, s_min = both(lambda t: t["documents/slices"] / t["documents"])
    many = max(cases, key=lambda c: (len(c.lengths), c.P))
    lines.append(
        f"- The loop before ecd295c (`documents/slices`) lost its time in backward: every document's slice "
        f"gets a zero-filled full-row gradient that autograd then sums. The shipped split-based loop is "
        f"{_range(s_med)} faster than it [{_range(s_min)}]; at {len(many.lengths)} documents (P={many.P}, "
        f"{many.mix}, {_dt(many.dtype)}): slices {_ms(many.fwdbwd['documents/slices'])} ms, documents "
        f"{_ms(many.fwdbwd['documents'])} ms, dense {_ms(many.fwdbwd['dense'])} ms."
    )
    equal = [c for c in cases if c.mix == "equal"]
    if equal:
        lines.append(
            "- Rows of equal documents (one batched SDPA call since 8fbb71b): documents/slices takes "
            + ", ".join(f"{c.fwdbwd['documents/slices'] / c.fwdbwd['documents']:.2f}x "
                        f"[{c.fwdbwd_min['documents/slices'] / c.fwdbwd_min['documents']:.2f}x] ({_dt(c.dtype)} "
                        f"{c.heads.split()[1]})" for c in equal)
            + " the time of `documents`."
        )
    wins = [c for c, r in zip(cases, r_min) if r < 1]
    mask_gain = [c.fwd_min["dense"] - c.fwd_min["dense/row-mask"] for c in cases]
    lines.append(
        f"- Building the dense mask once per row (additive, block by block) saves {1e3 * min(mask_gain):.0f} to "
        f"{1e3 * max(mask_gain):.0f} ms per call (forward, min-based) out of the dense call's "
        f"{1e3 * min(c.fwd_min['dense'] for c in cases):.0f} to {1e3 * max(c.fwd_min['dense'] for c in cases):.0f} ms: "
        "too little to change the ranking.")
    one = [c for c in cases if c.mix == "one"]
    if one:
        lines.append(
            "- One document filling the row (`documents` is then a single `is_causal` SDPA call): dense takes "
            + ", ".join(f"{c.fwdbwd['dense'] / c.fwdbwd['documents']:.2f}x [{c.fwdbwd_min['dense'] / c.fwdbwd_min['documents']:.2f}x]"
                        f" (P={c.P} {_dt(c.dtype)} {c.heads.split()[1]})" for c in one)
            + " the time of `documents`."
        )
    if e2e_rows:
        parts = [f"{_dt(dtype)} {mix}: dense {med['dense'] / med['documents']:.2f}x "
                 f"[{mins['dense'] / mins['documents']:.2f}x], documents/slices "
                 f"{med['documents/slices'] / med['documents']:.2f}x [{mins['documents/slices'] / mins['documents']:.2f}x]"
                 for dtype, mix, _, med, mins, _ in e2e_rows]
        lines.append("- End to end, step time relative to `documents`: " + "; ".join(parts) + ".")
    flex = [c.fwd_min["flex/row-mask"] / c.fwd_min["documents"]
            for c in cases if "flex/row-mask" in c.fwd]
    if flex:
        lines.append(
            f"- Forward only: `flex` with its BlockMask built once per row takes {_range(flex)} the time of the "
            "per-document loop (min-based); the shipped `flex` also rebuilds its BlockMask on every call, i.e. "
            "every layer (see the mask table)."
        )
    noisy = [c for c in cases if c.others > 0.25]
    if noisy:
        lines.append(
            f"- {len(noisy)} of {len(cases)} cases ran while other processes kept over 25% of the CPUs busy "
            "(column `others' CPU`). The per-document loop, many small parallel regions, suffers most from that "
            "(OpenMP threads spin-wait at each region's barrier), so medians there overstate its cost; the "
            "min-based ratios are the better estimate of an unshared machine.")
    if not wins:
        rule = ("`choose(\"auto\", cpu)` should stay `documents` for training: in no case measured, whatever "
                "the document count or lengths, one full-row document included, is a dense path faster "
                "than the per-document loop (min-based). No rule by document count is needed.")
    else:
        threshold = min(len(c.lengths) for c in wins)
        clean = all(r < 1 for c, r in zip(cases, r_min) if len(c.lengths) >= threshold)
        rule = ("dense wins only in some rows (see above); "
                + (f"`dense if documents >= {threshold} else documents` agrees with every case measured."
                   if clean else "no document-count threshold separates the cases cleanly, so keep `documents`."))
    lines += ["", "**Rule.** " + rule, ""]
    return lines


PROBE = (4096, "sft", "small-llama H8/K2/d64", torch.float32)


def policy_probe(args) -> None:
    """Child: forward+backward of the three training paths on one case, as JSON."""
    P, mix, heads, dtype = PROBE
    H, K, d = HEADS[heads]
    bounds = bounds_of(document_lengths(mix, P))
    q = torch.randn(1, H, P, d, dtype=dtype, requires_grad=True)
    k = torch.randn(1, K, P, d, dtype=dtype, requires_grad=True)
    v = torch.randn(1, K, P, d, dtype=dtype, requires_grad=True)
    grad_out = torch.randn(1, H, P, d, dtype=dtype)

    def forward_backward(fn):
        def run():
            q.grad = k.grad = v.grad = None
            fn(q, k, v, bounds).backward(grad_out)
        return run

    before = cpu_now()
    stats = interleaved({"documents": forward_backward(A.documents),
                         "documents/slices": forward_backward(documents_slices),
                         "dense": forward_backward(A.dense)}, budget_s=3.0, min_reps=3, max_reps=7)
    send_result({"stats": stats, "others": others_busy(before, cpu_now())})


def wait_policy_section(rounds: int) -> list[str]:
    """The same case under OpenMP's default wait policy and under PASSIVE, alternated in
    fresh processes (the policy is read when the OpenMP runtime starts)."""
    rows = []
    for _ in range(rounds):
        for policy in ("default", "PASSIVE"):
            r = run_child([os.path.abspath(__file__), "--policy-probe"],
                          env={"OMP_WAIT_POLICY": None if policy == "default" else policy})
            if "error" in r:
                rows.append([policy, f"failed: {r['error']}", "", "", ""])
                continue
            cells = [f"{_ms(m)} ({_ms(n)})" for m, n in r["stats"].values()]
            rows.append([policy, *cells, f"{100 * r['others']:.0f}%"])
            print(f"  wait policy {policy:8s} " + "  ".join(cells) + f"  others {100 * r['others']:.0f}%", flush=True)
    P, mix, heads, dtype = PROBE
    return [f"## OpenMP wait policy under contention (P={P}, {mix}, {heads.split()[1]}, {_dt(dtype)}, forward+backward)", "",
            "Fresh processes, alternated; ms median (min). With other processes busy, the default policy makes "
            "OpenMP threads spin at each parallel region's barrier while their partner is descheduled: the "
            "per-document loop (one small region per document and per op) pays that many times a call, one "
            "large dense call pays it once.", "",
            *table(["OMP_WAIT_POLICY", "documents", "documents/slices*", "dense", "others' CPU"], rows), ""]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a ~1 minute run: P=2048, fewer cases")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "attention.md"),
                    help="markdown report path, '-' for none")
    ap.add_argument("--no-flex", action="store_true", help="skip flex (each shape compiles, ~10 s)")
    ap.add_argument("--no-e2e", action="store_true", help="skip the end-to-end loss_packed step")
    ap.add_argument("--budget", type=float, default=1.0, help="seconds of timed repeats per case (forward)")
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="S",
                    help="before each case wait up to S seconds for other processes to go idle")
    ap.add_argument("--min-reps", type=int, default=3)
    ap.add_argument("--max-reps", type=int, default=9)
    ap.add_argument("--policy-rounds", type=int, default=1,
                    help="rounds of the OpenMP wait-policy comparison (0 to skip)")
    ap.add_argument("--policy-probe", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.policy_probe:
        torch.set_num_threads(THREADS)
        return policy_probe(args)

    torch.set_num_threads(THREADS)
    # Every (P, heads, dtype) and each mask_mod's code object is a compile of its own; past
    # dynamo's default limit of 8 flex silently falls back to eager (~45x slower).
    torch._dynamo.config.recompile_limit = 64
    start = time.perf_counter()
    info, load_start = machine(), load()
    print(f"{info}; {torch.get_num_threads()} threads; load {load_start}")
    print(f'choose("auto", cpu) -> {A.choose("auto", torch.device("cpu")).__name__}')

    dtypes = [torch.float32, torch.bfloat16]
    if args.quick:
        plan = [(2048, mix, "small-llama H8/K2/d64") for mix in ("sft", "short", "one")]
        flex_heads, e2e_P, e2e_mixes, e2e_dtypes = {"small-llama H8/K2/d64"}, 2048, ["sft"], [torch.float32]
    else:
        mixes = ("sft", "long-tail", "short", "one")
        plan = [(4096, mix, h) for h in HEADS for mix in mixes]
        plan += [(4096, "equal", "small-llama H8/K2/d64")]
        plan += [(2048, mix, "small-llama H8/K2/d64") for mix in mixes]
        flex_heads, e2e_P, e2e_mixes, e2e_dtypes = {"small-llama H8/K2/d64"}, 4096, ["sft", "one"], dtypes

    cases = []
    for P, mix, heads in plan:
        for dtype in dtypes:
            with_flex = not args.no_flex and heads in flex_heads
            paths = [p for p in PATHS if with_flex or not p.name.startswith("flex")]
            if args.wait_quiet:
                wait_quiet(args.wait_quiet)
            before = cpu_now()
            c = run_case(P, mix, heads, dtype, paths, args)
            c.others = others_busy(before, cpu_now())
            cases.append(c)
            print(f"P={P} {mix:9s} docs={len(c.lengths):3d} {heads:22s} {_dt(dtype):4s} "
                  f"others {100 * c.others:3.0f}% | fwd "
                  + " ".join(f"{k}={_ms(s)}" for k, s in c.fwd.items()) + " | fwd+bwd "
                  + " ".join(f"{k}={_ms(s)}" for k, s in c.fwdbwd.items()), flush=True)

    e2e_rows, card = [], None
    if not args.no_e2e:
        labels = [k for k in E2E_PATHS if not (args.no_flex and k.startswith("flex"))]
        card, e2e_rows = run_e2e(e2e_P, e2e_mixes, e2e_dtypes, labels, args)
    policy_lines = wait_policy_section(args.policy_rounds) if args.policy_rounds else []

    elapsed = time.perf_counter() - start
    # flex cases have extra columns: report them in their own tables
    with_flex = [c for c in cases if "flex" in c.fwd]
    without = [c for c in cases if "flex" not in c.fwd]
    flex_paths = [p for p in PATHS]
    plain_paths = [p for p in PATHS if not p.name.startswith("flex")]

    lines = ["# Attention paths over packed rows on CPU", "",
             "Produced by `bench/attention.py`; numbers are measured, not edited.", "",
             f"- Command: `{command(__file__, argv, env=('OMP_WAIT_POLICY',))}`" + (" (quick)" if args.quick else ""),
             f"- Machine: {info}; {torch.get_num_threads()} threads (`torch.set_num_threads({THREADS})`); "
             f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset: default)')}",
             f"- Load average at start / end: {load_start} / {load()} (the machine is shared; "
             "paths are interleaved within each case so drift hits them alike)",
             f"- Code: linnet at {revision(SOURCE)}",
             f"- Run time: {elapsed:.0f} s",
             f"- `choose(\"auto\", cpu)` currently returns `{A.choose('auto', torch.device('cpu')).__name__}`", "",
             "Mixes (documents packed whole until the next does not fit; the rest is a padding document): "
             "`sft` log-normal median 250 (σ 0.7); `long-tail` log-normal median 150 (σ 0.6) with one in eight "
             "drawn from 1024-2559; `short` log-normal median 40 (σ 0.5); `one` a single document of P tokens. "
             "`equal` 16 documents of 256 (pretraining-style rows). `useful` = the documents' causal work as a fraction of P². Columns marked * are bench-local "
             "candidates (see the script's docstring), not shipped code. Bold: fastest in the row. "
             "`flex` compiles and has no backward on CPU.", ""]
    if with_flex:
        lines += ["## Kernels, with flex", ""] + case_tables(with_flex, flex_paths)
    if without:
        lines += ["## Kernels, other head configs", ""] + case_tables(without, plain_paths)
    if e2e_rows:
        lines += ["## End to end", ""] + e2e_table(card, e2e_P, e2e_rows)
        lines += ["`documents/slices` swaps the pre-ecd295c loop into `linnet.torch.attention` "
                  "for the timed call; `flex` is a no-grad forward.", ""]
    lines += policy_lines
    lines += conclusion(cases, e2e_rows)
    write_report("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
