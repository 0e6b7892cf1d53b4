"""How close is the planner's memory estimate to the measured peak of real linnet training steps on CPU?

    python bench/plan_vs_measured.py --json run.json  # bench/plan_vs_measured.md: 9 rows + the allocator check, ~5 CPU-minutes
    python bench/plan_vs_measured.py --all            # also the 150m f32 and LoRA rows (12; ~10)
    python bench/plan_vs_measured.py --quick          # the 20m card only (~1)
    python bench/plan_vs_measured.py --cards 20m --seq 4096 --out -   # print only, write no markdown
    python bench/plan_vs_measured.py --render run.json  # rewrite the report from a --json run, running nothing
    python bench/plan_vs_measured.py --cards 20m --methods lora --dtypes f32 --seq 256 --allocator-check none --out -  # smoke

Wall time is about the CPU time on 2 cores shared with one other 2-thread job; the rows
are sequential (one configuration per process, so each measures only its own memory).

What runs. For each configuration a fresh subprocess (`--child`) builds a small Llama card
with `nest.load(card, weights="random", trainable=..., dtype=...)` (LoRA: `trainable=False`,
then `model.add_lora(["*_proj"], rank=16)`: every q/k/v/o/gate/up/down projection of every
block), packs one example of `seq` random tokens into one row with `linnet.train.pack`
(micro-batch 1), and runs `linnet.train.train(model, rows, optimizer=AdamW, steps=2)`: the
model's `loss_packed` entry (chunked `linear_cross_entropy`), backward, gradient clipping,
the AdamW step. No activation checkpointing (linnet has none). The default matrix is every
card x {full, lora} x {f32, bf16} at seq 2048, except that the 150m card runs full bf16
only (its other rows add ~4 CPU-minutes; `--all` runs them), plus the allocator check below.

Why two steps. AdamW allocates its two moments inside the first `optimizer.step()`, after
the first backward has freed the activations; the planner's total (states + activations)
describes the steady state, where the moments already exist while forward and backward
run. Step 2 is that steady state, and also the first step that runs on a heap the previous
step has already shaped. The measured peak is the highest over both steps.

How memory is measured, two ways, in the same run:
  RSS peak      the resident set size at its highest (Linux VmHWM, which is what
                `getrusage(RUSAGE_SELF).ru_maxrss` reports) minus VmRSS just before the
                model is built: after `import torch` and linnet, the packed rows, the thread
                setting, and a tiny model-independent warm-up (a small f32 and bf16 matmul,
                SDPA and AdamW step with backward, which loads the oneDNN/OpenMP code and
                per-thread buffers every run pays whatever the model). The high-water mark is
                reset (`/proc/self/clear_refs` 5) at that baseline and at every phase boundary,
                so each phase's peak is read on its own and nothing earlier can hide one. This
                is what the machine actually had to provide, allocator included.
  tensor peak   the most bytes live in PyTorch's CPU allocator at once, from the profiler's
                allocation events (`torch.profiler.profile(profile_memory=True)`, every
                allocation and free, kernel-internal scratch included), counted from the same
                baseline. The gap to the RSS peak is what glibc's malloc keeps mapped beyond
                live tensors (freed blocks below its mmap threshold stay in the heap), plus
                non-tensor memory (Python objects, the profiler's own records). The profiler
                records allocations only (no `record_shapes`, which did inflate RSS).
  allocator check  one configuration (`--allocator-check`, default 20m LoRA f32) once more
                with `MALLOC_MMAP_THRESHOLD_=131072`: glibc then mmaps every block of 128 KiB
                or more and unmaps it on free, so RSS follows live tensors; the difference
                to the default run is glibc's heap retention.
The live tensors at the tensor peak are split by where they were allocated: while building
the model (weights), inside AdamW (moments), in the forward outside the loss (activations;
the bf16 casts of trainable weights separately), in the forward inside the loss (the
chunked loss computes both gradients in its forward: logits working set plus grad_h and
the head's f32 grad_w), and in backward (gradients and temporaries).

How the planner is asked. `linnet.plan.estimate` with `--method full|lora --rank 16
--targets all-linear --seq S --micro-batch 1 --no-checkpointing --chunked-loss`, and byte
options chosen so each trainable parameter costs what linnet spends on it on CPU:

  bf16 compute   linnet keeps a trainable parameter as an f32 weight (4 B) with an f32
                 gradient (4 B) and AdamW's two f32 moments (8 B), and every `Linear` casts
                 its weight to bf16 on use; autograd keeps that bf16 copy (2 B) for
                 backward. Planner: --grad-dtype fp32 --master-bytes 4 --optimizer-bytes 8
                 = 2 + 4 + 4 + 8 = 18 B (its "bf16 weight" is the cast copy, its "master"
                 the f32 weight). Frozen weights are stored in bf16: the planner's 2 B.
  f32 compute    no cast copies: 4 + 4 + 8 = 16 B. The planner's 2 B "bf16 weight" is fixed,
                 so --grad-dtype fp32 --master-bytes 2 --optimizer-bytes 8 tops it up to
                 16 B. Two things have no option: the frozen base of LoRA is stored in f32
                 (4 B/param; the planner fixes 2 B), and activations are f32 (the planner's
                 34·s·b·d is in bf16 bytes). The column "planner+f32" adds both terms
                 (2 B per frozen parameter, and the block activations doubled) to show how
                 much of the error those missing options explain.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import resource
import sys
import time

from _common import command, machine, peak_rss, reset_peak, rss, run_child, send_result, table, write_report

GB = 1e9  # the planner's unit

# Small Llama-shaped cards (untied head, GQA, SwiGLU, 32K vocabulary), built from the debug card.
CARDS = {
    "20m": {"vocab": 32000, "hidden": 256, "intermediate": 768, "layers": 4,
            "heads": 4, "kv_heads": 2, "head_dim": 64},
    "60m": {"vocab": 32000, "hidden": 512, "intermediate": 1536, "layers": 8,
            "heads": 8, "kv_heads": 4, "head_dim": 64},
    "150m": {"vocab": 32000, "hidden": 768, "intermediate": 2048, "layers": 16,
             "heads": 12, "kv_heads": 4, "head_dim": 64},
}
DTYPES = {"f32": "float32", "bf16": "bfloat16"}
RANK = 16
LORA_PATTERNS = ["*_proj"]  # every q/k/v/o/gate/up/down projection of every block
STEPS = 2
# Left out of the default matrix to keep it near 5 minutes on 2 shared cores; --all runs them.
SLOW = {("150m", "full", "f32"), ("150m", "lora", "f32"), ("150m", "lora", "bf16")}


def card(name: str):
    from linnet import nest

    return nest.resolve("debug").replace(
        name=f"llama-{name}", tied_embeddings=False, max_positions=8192, source="bench/plan_vs_measured.py",
        **CARDS[name],
    )


# -- the planner's side ------------------------------------------------------------------

def plan_settings(method: str, dtype: str, seq: int) -> dict:
    """`linnet plan` flags (by their Python names) that describe linnet's CPU run."""
    return {
        "method": method, "rank": RANK, "targets": "all-linear", "seq": seq, "micro_batch": 1,
        "checkpointing": False, "chunked_loss": True,
        "grad_dtype": "fp32", "optimizer_bytes": 8, "master_bytes": 4 if dtype == "bf16" else 2,
    }


def flags(settings: dict) -> str:
    out = []
    for key, value in settings.items():
        name = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            out.append(name if value else "--no-" + name[2:])
        else:
            out.append(f"{name} {value}")
    return " ".join(out)


def planned(card_name: str, method: str, dtype: str, seq: int) -> dict:
    from linnet import plan

    c = card(card_name)
    p = plan.estimate(c, **plan.plan_inputs(plan_settings(method, dtype, seq)))
    blocks = p.activations_uncheckpointed - p.logits
    f32_terms = 0.0
    if dtype == "f32":
        frozen = p.params if p.method.adapters else 0
        f32_terms = (4 - plan.BF16_BYTES) * frozen + blocks  # f32 base, f32 activations
    return {"params": p.params, "trainable": p.trainable, "total": p.total, "states": p.states.total,
            "weights": p.states.weights, "activations": p.activations, "blocks": blocks, "logits": p.logits,
            "f32_terms": f32_terms}


# -- child: one configuration, one measurement ---------------------------------------------

def warm_up(torch) -> None:
    """Model-independent: load the matmul, SDPA and optimizer code paths once."""
    import torch.nn.functional as F

    for dt in (torch.float32, torch.bfloat16):
        w = torch.randn(64, 64, requires_grad=True)
        x = torch.randn(128, 64).to(dt)
        q = torch.randn(1, 2, 128, 32).to(dt).requires_grad_()
        y = F.linear(x, w.to(dt)).float().sum() + F.scaled_dot_product_attention(q, q, q, is_causal=True).float().sum()
        y.backward()
        opt = torch.optim.AdamW([w], lr=1e-4)
        opt.step()
        del w, x, q, y, opt


MARK = "plan_vs_measured:"
LINEAR_MARK = "plan_vs_measured.Linear"


def mark_linears(model, torch) -> None:
    """Wrap every linnet `Linear` call in a profiler range, so the casts its forward makes
    of its own weights can be told from activations (forward hooks: no effect on autograd)."""
    from linnet.torch.model import Linear

    def enter(module, _inputs):
        module._bench_range = torch.profiler.record_function(LINEAR_MARK)
        module._bench_range.__enter__()

    def leave(module, _inputs, _output):
        module._bench_range.__exit__(None, None, None)
        del module._bench_range

    for m in model.modules():
        if isinstance(m, Linear):
            m.register_forward_pre_hook(enter)
            m.register_forward_hook(leave)


class Phases:
    """Peak RSS above the baseline in each phase of each step, via VmHWM and clear_refs:
    at a phase's end the high-water mark is read, then reset to the current RSS. Each
    boundary also leaves a marker event in the profiler's trace, so allocations can be
    assigned to phases on the profiler's own clock."""

    def __init__(self, base: int, torch):
        self.base = base
        self.torch = torch
        self.current: str | None = None
        self.peaks: list[dict] = [{}]  # [setup, step 1, step 2, ...]: phase -> RSS peak above base

    def enter(self, phase: str | None) -> None:
        """Close the current phase and open `phase` (None: close only); every forward
        (one micro-batch per step here) opens a new step."""
        if self.current is not None:
            self.peaks[-1][self.current] = max(self.peaks[-1].get(self.current, 0), peak_rss() - self.base)
        if phase == "forward":
            self.peaks.append({})
        with self.torch.profiler.record_function(f"{MARK}{len(self.peaks) - 1}:{phase}"):
            pass
        reset_peak()
        self.current = phase


def tensor_peaks(prof, trainable_linears: bool, head_grad_bytes: int) -> dict | None:
    """From the profiler's allocation events: the peak of live bytes per step and phase,
    and what was live at each step's peak, by where it was allocated."""
    try:
        from torch._C._profiler import _EventType

        tree = prof.profiler.kineto_results.experimental_event_tree()
    except (AttributeError, ImportError, RuntimeError):
        return None  # a torch without this (private) API: RSS only
    marks, allocs = [], []

    def walk(nodes, context):
        for n in nodes:
            if n.tag == _EventType.Allocation:
                f = n.extra_fields
                if f.device.type == "cpu":
                    allocs.append((n.start_time_ns, f.alloc_size, f.ptr, context))
                continue
            if n.name.startswith(MARK):
                step, phase = n.name[len(MARK):].split(":")
                marks.append((n.start_time_ns, int(step), phase))
            if context == "loss" or (n.name.startswith("_LinearCrossEntropy") and "Backward" not in n.name):
                inner = "loss"
            elif n.name == LINEAR_MARK:
                inner = "linear"
            elif context == "linear":
                # an op called by Linear.forward itself: `weight.to(x.dtype)` is its only
                # aten::to (inputs arrive already in the compute dtype)
                inner = "cast" if n.name == "aten::to" and trainable_linears else None
            else:
                inner = context
            walk(n.children, inner)

    walk(tree, None)
    marks.sort()
    allocs.sort(key=lambda a: a[0])
    times = [m[0] for m in marks]

    def where(t):
        """(step, phase) of a time: the last mark at or before it."""
        i = bisect.bisect_right(times, t)
        return (marks[i - 1][1], marks[i - 1][2]) if i else (0, "build")

    def kind(phase, context, size):
        if phase == "build":
            return "weights"
        if phase == "optimizer":
            return "optimizer"
        if phase == "forward":
            if context == "loss":
                return "head grad" if size == head_grad_bytes else "loss"
            return "weight casts" if context == "cast" else "activations"
        return "backward" if phase == "backward" else "other"

    live, cur = {}, 0
    steps: dict[int, dict] = {}
    for t, size, ptr, context in allocs:
        cur += size
        step, phase = where(t)
        if size > 0:
            live[ptr] = (size, kind(phase, context, size))
        else:
            live.pop(ptr, None)
        if step == 0:
            continue
        s = steps.setdefault(step, {"peak": 0, "phases": {}})
        s["phases"][phase] = max(s["phases"].get(phase, 0), cur)
        if cur > s["peak"]:
            s["peak"], s["phase"] = cur, phase
            s["_live"] = list(live.values())  # copied only when the peak rises
    for s in steps.values():
        split: dict[str, int] = {}
        for size, k in s.pop("_live"):
            split[k] = split.get(k, 0) + size
        s["live"] = split
    return {"steps": [steps[k] for k in sorted(steps)], "events": len(allocs)}


def child(args) -> None:
    import numpy as np
    import torch

    from linnet import nest
    from linnet.train import Example, pack, train

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    after_import = rss()
    c = card(args.card)
    rng = np.random.default_rng(0)
    rows = [next(pack([Example.plain(rng.integers(3, c.vocab, args.seq))], tokens=args.seq))
            for _ in range(args.steps)]
    warm_up(torch)

    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    if args.profile:
        prof.start()
    base_rss = rss()
    phases = Phases(base_rss, torch)
    phases.enter("build")
    t0 = time.perf_counter()
    model = nest.load(c, weights="random", trainable=args.method == "full", dtype=DTYPES[args.dtype])
    if args.method == "lora":
        model.add_lora(LORA_PATTERNS, rank=RANK)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0)
    built_rss = rss()
    if args.profile:
        mark_linears(model, torch)

    # Phase marks around the loop's own calls (the loop itself is linnet's, unchanged):
    # forward = loss_packed; backward = from there to the optimizer's pre-hook (backward,
    # gradient clipping); optimizer = AdamW's step; rest = zero_grad, bookkeeping.
    loss_packed = model.loss_packed

    def marked_loss_packed(batch):
        phases.enter("forward")
        out = loss_packed(batch)
        phases.enter("backward")
        return out

    model.loss_packed = marked_loss_packed
    optimizer.register_step_pre_hook(lambda *_: phases.enter("optimizer"))
    optimizer.register_step_post_hook(lambda *_: phases.enter("rest"))
    steps = []
    train(model, rows, optimizer=optimizer, steps=args.steps,
          on_step=lambda s: steps.append({"step": s.step, "loss": s.loss, "seconds": s.seconds}))
    phases.enter(None)
    t1 = time.perf_counter()
    if args.profile:
        prof.stop()

    head = model.head_weight
    tensors = None if not args.profile else tensor_peaks(
        prof, model.dtype != torch.float32, head.numel() * 4 if head.requires_grad else -1)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    trainable = sum(p.numel() for p in params)
    grad_bytes = sum(p.numel() * p.element_size() for p in params)  # f32, as backward makes them
    moment_bytes = sum(t.numel() * t.element_size() for s in optimizer.state.values()
                       for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
    for step, peaks in zip(steps, phases.peaks[1:], strict=True):
        step["phases"] = peaks
        step["peak"] = max(peaks.values())
    if tensors is not None:
        for step, t in zip(steps, tensors["steps"], strict=True):
            step["tensors"] = t
    out = {
        "card": args.card, "method": args.method, "dtype": args.dtype, "seq": args.seq,
        "threads": args.threads, "params": sum(p.numel() for p in model.parameters()),
        "trainable": trainable, "after_import_rss": after_import, "base_rss": base_rss,
        "built": built_rss - base_rss, "build_peak": phases.peaks[0]["build"], "steps": steps,
        "weight_bytes": weight_bytes, "grad_bytes": grad_bytes, "moment_bytes": moment_bytes,
        "measured": max(s["peak"] for s in steps),
        "tensor_peak": None if tensors is None else max(s["peak"] for s in tensors["steps"]),
        "alloc_events": None if tensors is None else tensors["events"],
        "seconds": t1 - t0,
    }
    send_result(out)


# -- parent: run the configurations, tabulate ---------------------------------------------

def measure(card_name, method, dtype, seq, args, env=None) -> dict:
    """One configuration in a fresh process."""
    r = run_child([os.path.abspath(__file__), "--child", "--card", card_name, "--method", method, "--dtype", dtype,
                   "--seq", seq, "--threads", args.threads, "--steps", args.steps]
                  + ([] if args.profile else ["--no-profile"]), env=env)
    return {"card": card_name, "method": method, "dtype": dtype, "seq": seq, **r}


def gb(n: float | None) -> str:
    return "—" if n is None else f"{n / GB:.3f}"


def err(estimate: float, measured: float | None) -> str:
    return "—" if not measured else f"{(estimate - measured) / measured * 100:+.0f}%"


def count(n: float) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


def configurations(args) -> list[tuple[str, str, str, int]]:
    return [(c, m, d, s) for c in args.cards for s in args.seq for m in args.methods for d in args.dtypes
            if args.all or (c, m, d) not in SLOW]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cards", nargs="+", default=list(CARDS), choices=list(CARDS))
    ap.add_argument("--methods", nargs="+", default=["full", "lora"], choices=["full", "lora"])
    ap.add_argument("--dtypes", nargs="+", default=["f32", "bf16"], choices=list(DTYPES))
    ap.add_argument("--seq", type=int, nargs="+", default=[2048], help="sequence lengths (micro-batch 1)")
    ap.add_argument("--all", action="store_true", help="also the slow 150m rows (f32, and LoRA)")
    ap.add_argument("--quick", action="store_true", help="the 20m card only")
    ap.add_argument("--allocator-check", default="20m:lora:f32", metavar="CARD:METHOD:DTYPE",
                    help="rerun this configuration with glibc's mmap threshold fixed at 128 KiB "
                    f"(MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}), so freed tensors leave RSS; 'none' skips it")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=STEPS, help="training steps per configuration (peak over all)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "plan_vs_measured.md"),
                    help="markdown report path, '-' for none; text after the analysis marker of an existing "
                    "report is kept")
    ap.add_argument("--no-profile", dest="profile", action="store_false",
                    help="RSS only: no profiler, so no tensor peak")
    ap.add_argument("--json", metavar="PATH", help="also write the raw results as JSON")
    ap.add_argument("--render", metavar="JSON", help="rewrite the report from a --json file, running nothing")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--card", help=argparse.SUPPRESS)
    ap.add_argument("--method", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        args.seq = args.seq[0]
        return child(args)
    if args.quick:
        args.cards = ["20m"]
    if args.render:
        with open(args.render) as f:
            run = json.load(f)
        run["rendered"] = True
        return write_report(report(run), args.out, keep=ANALYSIS_MARKER)

    start, load_start = time.perf_counter(), os.getloadavg()[0]
    print(f"{machine()}; {args.threads} threads; load average {load_start:.1f}")
    print(f"{'card':10s} {'params':>7s} {'method':6s} {'dtype':5s} {'seq':>5s} {'estimate GB':>11s} "
          f"{'measured GB':>11s} {'error':>6s} {'tensors GB':>10s} {'error':>6s} {'planner+f32':>11s} "
          f"{'error':>6s} {'time s':>6s}", flush=True)
    results = []
    for card_name, method, dtype, seq in configurations(args):
        r = measure(card_name, method, dtype, seq, args)
        r["plan"] = p = planned(card_name, method, dtype, seq)
        results.append(r)
        if "error" in r:
            print(f"{'llama-' + card_name:10s} {method:6s} {dtype:5s} {seq:5d}  FAILED {r['error']}", flush=True)
            continue
        m, t = r["measured"], r["tensor_peak"]
        adj = p["total"] + p["f32_terms"] if dtype == "f32" else None
        print(f"{'llama-' + card_name:10s} {count(r['params']):>7s} {method:6s} {dtype:5s} {seq:5d} "
              f"{gb(p['total']):>11s} {gb(m):>11s} {err(p['total'], m):>6s} {gb(t):>10s} {err(p['total'], t):>6s} "
              f"{gb(adj) if adj else '':>11s} {err(adj, m) if adj else '':>6s} {r['seconds']:6.1f}", flush=True)
    check = None
    if args.allocator_check != "none":
        card_name, method, dtype = args.allocator_check.split(":")
        check = measure(card_name, method, dtype, args.seq[0], args, env={"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)})
        if "error" not in check:
            print(f"allocator check, llama-{card_name} {method} {dtype} with MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}: "
                  f"measured {gb(check['measured'])} GB, tensors {gb(check['tensor_peak'])} GB", flush=True)
    elapsed = time.perf_counter() - start
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    run = {"results": results, "check": check, "elapsed": elapsed, "argv": sys.argv[1:] if argv is None else argv,
           "load": [load_start, os.getloadavg()[0]], "cpu_s": children.ru_utime + children.ru_stime,
           "threads": args.threads, "steps": args.steps, "cards": args.cards, "machine": machine()}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(run, f, indent=1)
    write_report(report(run), args.out, keep=ANALYSIS_MARKER)


MMAP_THRESHOLD = 128 * 1024  # glibc's initial value; setting it also stops glibc raising it
ANALYSIS_MARKER = "<!-- analysis: written by hand for the run above; the script keeps what follows -->"


# -- the report --------------------------------------------------------------------------

KINDS = ["weights", "optimizer", "weight casts", "head grad", "activations", "loss", "backward", "other"]


def report(run: dict) -> str:
    results, check = run["results"], run.get("check")
    ok = [r for r in results if "error" not in r]
    where = run["machine"] + (f"; torch {run['torch']}" if "torch" in run else "")  # older runs kept torch apart
    lines = [
        "# The planner's memory estimate against measured linnet training steps (CPU)", "",
        ("Produced by `bench/plan_vs_measured.py`; the numbers are measured, not edited. "
        "GB = 10^9 bytes, as the planner prints them. The script's docstring has the method in full."), "",
        f"- Command: `{command(__file__, run['argv'])}`"
        + (" (this text was later re-rendered from that run's raw results with `--render`; the numbers "
           "are that run's)" if run.get("rendered") else ""),
        f"- Machine: {where}; {run['threads']} threads. The run took "
        f"{run['elapsed']:.0f} s"
        + (f" ({run['cpu_s'] / 60:.1f} CPU-minutes; load average {run['load'][0]:.1f} at the start, "
           f"{run['load'][1]:.1f} at the end)" if "load" in run else "")
        + " on a machine shared with other jobs (that changes times, not memory).",
        (f"- Run: each row is a fresh subprocess running `linnet.train.train(..., steps={run['steps']})` on "
        "packed rows of `seq` random tokens (micro-batch 1): AdamW with f32 moments, linnet's chunked "
        "`linear_cross_entropy`, gradient clipping, no activation checkpointing. LoRA: rank 16 on every "
        "q/k/v/o/gate/up/down projection (`add_lora([\"*_proj\"])`). Trainable parameters are f32 "
        "(linnet's master weights); frozen ones are stored in the compute dtype."),
        ("- **measured** = peak RSS (VmHWM, what `ru_maxrss` reports) over the steps, minus VmRSS just "
        "before the model is built (after `import torch`, linnet, the packed rows and a tiny "
        "model-independent matmul/SDPA/AdamW warm-up). **tensors** = the most bytes live in PyTorch's "
        "CPU allocator at once (profiler allocation events, kernel scratch included) over the same span. "
        "Step 2 is the steady state the planner describes (AdamW's moments exist during forward and "
        "backward); the measured peak is the highest over both steps."),
        ("- **estimate** = `linnet.plan.estimate` with the flags listed below the tables; error = "
        "(estimate − measured) / measured. **planner+f32** adds what the planner has no option for in "
        "f32 compute: the LoRA base stored in f32 (+2 B per frozen parameter) and f32 activations (the "
        "34·s·b·d block term doubled)."),
        "",
    ]
    rows = []
    for r in results:
        p = r["plan"]
        row = [f"llama-{r['card']}", count(p["params"] if "error" in r else r["params"]), r["method"], r["dtype"],
               r["seq"], gb(p["total"])]
        if "error" in r:
            rows.append(row + [f"FAILED: {r['error']}"] + [""] * 5)
            continue
        m, t = r["measured"], r["tensor_peak"]
        adj = p["total"] + p["f32_terms"] if r["dtype"] == "f32" else None
        rows.append(row + [gb(m), err(p["total"], m), gb(t), err(p["total"], t), gb(adj) if adj else "—",
                           f"{err(adj, m)} / {err(adj, t)}" if adj else "—"])
    lines += table(["card", "params", "method", "dtype", "seq", "estimate GB", "measured GB", "error %", "tensors GB",
                    "error vs tensors", "planner+f32 GB", "error vs measured / tensors"], rows, align="lrllrrrrrrrr")

    # What the planner counts, and what was live at the measured peak.
    with_t = [r for r in ok if r["steps"][-1].get("tensors")]
    kinds = [k for k in KINDS if any(r["steps"][-1]["tensors"]["live"].get(k) for r in with_t)]
    lines += [
        "",
        "## Where the memory goes",
        "",
        ("The planner's terms, and the tensors live at step 2's tensor peak by where they were allocated: "
        "*weights* while building the model (LoRA adapters included); *optimizer* in AdamW (its moments); "
        "*weight casts* the bf16 copies of f32 trainable weights that `Linear.forward` makes and autograd "
        "keeps for backward; *head grad* the head's f32 gradient, which `linear_cross_entropy` computes "
        "in its forward; *loss* the rest of that forward (f32 logits block, the temporaries of "
        "`logsumexp` and softmax, grad_h, a bf16 copy of the head); *activations* everything else the "
        "forward allocated and still holds. All GB."),
        "",
    ]
    rows = []
    for r in with_t:
        p = r["plan"]
        t2 = r["steps"][-1]["tensors"]
        states = p["states"] - p["weights"]
        trainable = p["trainable"]
        grads = 4 * trainable  # --grad-dtype fp32
        master = states - grads - 8 * trainable
        rows.append([f"llama-{r['card']}", r["method"], r["dtype"], gb(p["weights"]), gb(grads), gb(master),
                     gb(8 * trainable), gb(p["blocks"]), gb(p["logits"]), *(gb(t2["live"].get(k, 0)) for k in kinds),
                     f"{gb(t2['peak'])} ({t2['phase']})"])
    measured = ["measured: " + kinds[0], *kinds[1:]] if kinds else []
    lines += table(["card", "method", "dtype", "planner: weights", "gradients", "master", "moments", "blocks 34·s·b·d·L",
                    "logits", *measured, "tensor peak (phase)"], rows, align="lll" + "r" * (7 + len(kinds)))

    lines += [
        "",
        "## RSS by step and phase",
        "",
        ("Peak RSS above the baseline in each phase (forward = `loss_packed`; backward = backward and "
        "gradient clipping; optimizer = AdamW's step), the tensor peak of each step, and the exact "
        "persistent states at the end (summed tensor sizes). All GB."),
        "",
    ]
    rows = []
    for r in ok:
        cells = []
        for s in r["steps"][:2]:
            ph = s["phases"]
            cells.append(" / ".join(gb(ph.get(k)) for k in ("forward", "backward", "optimizer")))
            cells.append(gb(s["tensors"]["peak"]) if s.get("tensors") else "—")
        rows.append([f"llama-{r['card']}", r["method"], r["dtype"], *cells, gb(r["weight_bytes"]), gb(r["grad_bytes"]),
                     gb(r["moment_bytes"]), f"{sum(s['seconds'] for s in r['steps']) / len(r['steps']):.1f}"])
    lines += table(["card", "method", "dtype", "step 1: forward / backward / optimizer", "tensors",
                    "step 2: forward / backward / optimizer", "tensors", "weights", "f32 grads", "moments", "s/step"],
                   rows, align="llllrlrrrrr")
    if check and "error" not in check:
        same = next((r for r in ok if (r["card"], r["method"], r["dtype"]) ==
                     (check["card"], check["method"], check["dtype"])), None)
        lines += [
            "",
            f"Allocator check: llama-{check['card']} {check['method']} {check['dtype']} again, with "
            f"`MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}` (glibc then serves every block of 128 KiB or more "
            "with its own mmap and unmaps it on free, instead of raising its threshold, up to 32 MiB, as "
            "large blocks are freed, and keeping freed smaller blocks in its heap): measured "
            f"**{gb(check['measured'])} GB**"
            + (f" against {gb(same['measured'])} GB with glibc's defaults" if same else "")
            + f", tensor peak {gb(check['tensor_peak'])} GB"
            + (f" (RSS step 1 / step 2: {gb(check['steps'][0]['peak'])} / {gb(check['steps'][-1]['peak'])})"
               if len(check["steps"]) > 1 else "")
            + f"; {sum(s['seconds'] for s in check['steps']) / len(check['steps']):.1f} s/step.",
        ]
    elif check:
        lines += ["", f"Allocator check FAILED: {check['error']}"]

    lines += ["", "Planner inputs (every row also `--rank 16 --targets all-linear`) and cards:", ""]
    seen = set()
    for r in results:
        key = (r["method"], r["dtype"], r["seq"])
        if key not in seen:
            seen.add(key)
            lines.append(f"- {r['method']}, {r['dtype']}, seq {r['seq']}: `linnet plan CARD "
                         f"{flags(plan_settings(*key))}`")
    for name in run["cards"]:
        c = card(name)
        lines.append(f"- llama-{name}: vocab {c.vocab}, hidden {c.hidden}, intermediate {c.intermediate}, "
                     f"layers {c.layers}, heads {c.heads} ({c.kv_heads} kv), head_dim {c.head_dim}, untied head: "
                     f"{c.params() / 1e6:.1f}M parameters (`nest.resolve(\"debug\").replace(**CARDS[...])`)")
    lines += ["", "## Findings (computed from this run)", ""] + findings(ok) + [""]
    return "\n".join(lines)


def findings(ok) -> list[str]:
    """Numbers the analysis rests on, computed from this run."""
    if not ok:
        return ["- No configuration ran."]
    out = []

    def spread(xs):
        return f"{min(xs):+.0%} to {max(xs):+.0%} (mean {sum(xs) / len(xs):+.0%})"

    errors = [(r["plan"]["total"] - r["measured"]) / r["measured"] for r in ok]
    out.append(f"- Against the RSS peak the planner is off by {spread(errors)}"
               + ("; it underestimates in every row." if max(errors) < 0 else "."))
    with_t = [r for r in ok if r.get("tensor_peak")]
    if not with_t:
        return out
    te = [(r["plan"]["total"] - r["tensor_peak"]) / r["tensor_peak"] for r in with_t]
    gap = [(r["measured"] - r["tensor_peak"]) / r["tensor_peak"] for r in with_t]
    out.append(f"- Against the tensor peak it is off by {spread(te)}. The RSS peak is {min(gap):.0%} to "
               f"{max(gap):.0%} above the tensor peak.")
    phases = sorted({r["steps"][-1]["tensors"]["phase"] for r in with_t})
    out.append(f"- Step 2's tensor peak falls in: {', '.join(phases)}.")
    frozen = [r["steps"][-1]["tensors"]["live"].get("loss", 0) / r["plan"]["logits"] for r in with_t
              if r["method"] == "lora"]
    if frozen:
        out.append(f"- LoRA (frozen head): the loss holds {min(frozen):.2f}x to {max(frozen):.2f}x the "
                   "planner's logits term at the peak.")
    acts = [(r, r["steps"][-1]["tensors"]["live"].get("activations", 0) / r["plan"]["blocks"]) for r in with_t]
    out.append("- Activations live at the peak over the planner's 34·s·b·d·L (bf16 bytes): "
               + ", ".join(f"llama-{r['card']} {r['method']} {r['dtype']} {x:.2f}x" for r, x in acts) + ".")
    rss = [r["steps"][-1]["peak"] / r["steps"][0]["peak"] for r in ok if len(r["steps"]) > 1]
    if rss:
        out.append(f"- RSS peak of step 2 over step 1: {min(rss):.2f}x to {max(rss):.2f}x.")
    full = [r for r in with_t if r["method"] == "full" and len(r["steps"]) > 1]
    if full:
        out.append("- Tensor peak of step 2 minus step 1, over AdamW's moments (full fine-tuning): "
                   + ", ".join(f"llama-{r['card']} {r['dtype']} "
                               f"{(r['steps'][1]['tensors']['peak'] - r['steps'][0]['tensors']['peak']) / r['moment_bytes']:.2f}x"
                               for r in full) + ".")
    adj = [(r, r["plan"]["total"] + r["plan"]["f32_terms"]) for r in with_t if r["dtype"] == "f32"]
    if adj:
        out.append("- planner+f32 against the tensor peak: "
                   + ", ".join(f"llama-{r['card']} {r['method']} {err(a, r['tensor_peak'])}" for r, a in adj) + ".")
    return out


if __name__ == "__main__":
    main()
