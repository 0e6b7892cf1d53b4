"""How close is `linnet plan`'s memory estimate to the measured peak of real linnet training steps on CPU?

    python bench/plan_vs_measured.py --json run.json   # bench/plan_vs_measured.md: 2 cards x 4 methods x 3 modes (~18 CPU-min)
    python bench/plan_vs_measured.py --quick           # the 20m card only
    python bench/plan_vs_measured.py --cards 20m --seq 256 --out -   # a smoke run: print only, write no markdown
    python bench/plan_vs_measured.py --dtypes f32 bf16 # also bf16 compute (native on AVX-512 BF16 / AMX CPUs only)
    python bench/plan_vs_measured.py --render run.json # rewrite the report from a --json run (plans recomputed)

The rows run one after another, each in its own process (each measures only its own
memory), on `--threads` threads; run nothing else heavy beside it.

What runs. For each configuration a fresh subprocess (`--child`) builds a small Llama card
with `nest.load(card, weights="random", dtype=..., activation_checkpointing=...)` and trains
it the way linnet trains: full (`trainable=True`), LoRA (`trainable=False`, then
`model.add_lora(["*_proj"], rank=16)`: every q/k/v/o/gate/up/down projection of every
block), DoRA (the same with `dora=True`) or QLoRA (`quantize="nf4"`, then LoRA). It packs
one example of `seq` random tokens into one row with `linnet.train.pack` (micro-batch 1)
and runs `linnet.train.train(model, rows, optimizer=AdamW, steps=2)`: the model's
`loss_packed` entry (the chunked `linear_cross_entropy`), backward, gradient clipping, the
AdamW step. Checkpointing: none, full (each block keeps its input) or selective (also the
attention's outputs).

Why two steps. AdamW allocates its two moments inside the first `optimizer.step()`, so
step 2 is the steady state the planner describes (moments live during forward and
backward). The measured peak is the highest over both steps.

How memory is measured, two ways, in the same run:
  RSS peak      the resident set size at its highest (Linux VmHWM, what `ru_maxrss`
                reports) minus VmRSS just before the model is built: after `import torch`
                and linnet, the packed rows, the thread setting and a tiny model-independent
                warm-up (matmul, SDPA and an AdamW step, in f32 and bf16: the kernel code and
                per-thread buffers every run pays whatever the model). The high-water mark is
                reset (`/proc/self/clear_refs` 5) at that baseline and at every phase
                boundary, so each phase's peak is read on its own. Every child runs with
                `MALLOC_MMAP_THRESHOLD_=65536` (`--mmap-threshold`): glibc then gives every
                block of 64 KiB or more its own mapping and returns it on free, so RSS
                follows the live tensors instead of keeping freed ones in its heap (the
                allocator check below measures what glibc's defaults add).
  tensor peak   the most bytes live in PyTorch's CPU allocator at once, from the profiler's
                allocation events (`torch.profiler.profile(profile_memory=True)`, every
                allocation and free, kernel scratch included), from the same baseline.
                The profiler records allocations only (no `record_shapes`, which inflated RSS).
  allocator check  one configuration (`--allocator-check`, default 20m LoRA) once more with
                glibc's default malloc settings.
The tensor peak of each phase (forward = `loss_packed`; backward = backward and clipping;
optimizer = AdamW's step) is set beside the planner's peak of the same phase, and the
tensors live at the step-2 peak are split by where they were allocated.

How the planner is asked: `linnet.plan.estimate` with the flags that describe this run
(`plan_settings`; the report lists them): `--method M --rank 16 --targets all-linear
--context-length S --micro-batch-size 1 --activation-checkpointing MODE --chunked-loss --dtype f32
--device cpu --grad-dtype fp32`. The error is reported against the RSS peak, and against the tensor peak beside it.
"""

from __future__ import annotations

import argparse
import bisect
import inspect
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
METHODS = ("full", "lora", "dora", "qlora")
CHECKPOINTING = {"none": False, "full": True, "selective": "selective"}
RANK = 16
LORA_PATTERNS = ["*_proj"]  # every q/k/v/o/gate/up/down projection of every block
STEPS = 2
MMAP_THRESHOLD = 64 * 1024
PHASES = ("forward", "backward", "optimizer")


def card(name: str):
    from linnet import nest

    return nest.resolve("debug").replace(
        name=f"llama-{name}", tied_embeddings=False, max_positions=8192, source="bench/plan_vs_measured.py",
        **CARDS[name],
    )


def quantize_supported() -> bool:
    """Whether this checkout's `nest.load` takes quantize= (QLoRA)."""
    from linnet import nest

    return "quantize" in inspect.signature(nest.load).parameters


# -- the planner's side ------------------------------------------------------------------

def plan_settings(method: str, checkpointing: str, dtype: str, seq: int, optimizer: str = "adamw",
                  mlp_tile: int | None = None) -> dict:
    """`linnet plan` settings (by their Python names, `plan.plan_inputs`) that describe linnet's CPU run."""
    return {
        "method": method, "rank": RANK, "targets": "all-linear", "tokens": seq, "micro_batch_size": 1,
        "activation_checkpointing": checkpointing, "chunked_loss": True, "dtype": dtype, "device": "cpu", "grad_dtype": "fp32",
        **({"optimizer_bytes": 2} if optimizer == "adamw8bit" else {}), **({"mlp_tile": mlp_tile} if mlp_tile else {}),
    }


def flags(settings: dict) -> str:
    """The settings as `linnet plan` flags."""
    from linnet.commands.plan import flag

    out = []
    for key, value in settings.items():
        name = flag(key)
        if isinstance(value, bool):
            out.append(name if value else "--no-" + name[2:])
        else:
            out.append(f"{name} {value}")
    return " ".join(out)


def planned(r: dict) -> dict:
    """The planner's estimate for a result row's configuration (recomputed on --render)."""
    from linnet import plan

    try:
        p = plan.estimate(card(r["card"]), **plan.plan_inputs(
            plan_settings(r["method"], r["checkpointing"], r["dtype"], r["seq"], r.get("optimizer", "adamw"))))
    except ValueError as e:
        return {"error": str(e)}
    return {"params": p.params, "trainable": p.trainable, "total": p.total, "phase": p.peak_phase,
            "phases": dict(p.phases), "states": p.states.total}


# -- child: one configuration, one measurement ---------------------------------------------

def warm_up(torch, method: str) -> None:
    """Model-independent: load the matmul, SDPA and optimizer code paths once (and, for
    QLoRA, bitsandbytes and its 4-bit matmul: library code, not the model's memory)."""
    import torch.nn.functional as F

    if method == "qlora":
        from linnet.torch import quantize

        w = quantize.nf4(torch.randn(128, 64), torch.float32)
        quantize.linear_4bit(torch.randn(8, 64, requires_grad=True), w).sum().backward()
        del w

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


def build(args):
    """The model and its AdamW, as linnet builds them for the configuration."""
    import torch

    from linnet import nest

    options = dict(weights="random", trainable=args.method == "full", dtype=DTYPES[args.dtype],
                   activation_checkpointing=CHECKPOINTING[args.checkpointing])
    if args.method == "qlora":
        options["quantize"] = "nf4"
    model = nest.load(card(args.card), **options)
    model.tile_mlp(getattr(args, "mlp_tile", None))
    if args.method != "full":
        model.add_lora(LORA_PATTERNS, rank=RANK, dora=args.method == "dora")
    params = [p for p in model.parameters() if p.requires_grad]
    if args.optimizer == "adamw8bit":
        from linnet.train.optimizer import adamw

        return model, params, adamw(model, lr=1e-4, kind="adamw8bit")
    return model, params, torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0)


def child(args) -> None:
    import numpy as np
    import torch

    from linnet.train import Example, pack, train

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    after_import = rss()
    vocab = CARDS[args.card]["vocab"]
    rng = np.random.default_rng(0)
    rows = [next(pack([Example.plain(rng.integers(3, vocab, args.seq))], tokens=args.seq))
            for _ in range(args.steps)]
    warm_up(torch, args.method)

    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    if args.profile:
        prof.start()
    base_rss = rss()
    phases = Phases(base_rss, torch)
    phases.enter("build")
    t0 = time.perf_counter()
    model, params, optimizer = build(args)
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
        "params": sum(p.numel() for p in model.parameters()), "trainable": sum(p.numel() for p in params),
        "after_import_rss": after_import, "base_rss": base_rss, "built": built_rss - base_rss,
        "build_peak": phases.peaks[0]["build"], "steps": steps, "weight_bytes": weight_bytes,
        "grad_bytes": grad_bytes, "moment_bytes": moment_bytes, "measured": max(s["peak"] for s in steps),
        "tensor_peak": None if tensors is None else max(s["peak"] for s in tensors["steps"]),
        "alloc_events": None if tensors is None else tensors["events"], "seconds": t1 - t0,
    }
    send_result(out)


# -- parent: run the configurations, tabulate ---------------------------------------------

def measure(config: tuple, args, env: dict) -> dict:
    """One configuration in a fresh process."""
    card_name, method, checkpointing, dtype, seq = config
    r = run_child([os.path.abspath(__file__), "--child", "--card", card_name, "--method", method,
                   "--checkpointing", checkpointing, "--dtype", dtype, "--seq", seq, "--threads", args.threads,
                   "--steps", args.steps, "--optimizer", args.optimizer]
                  + ([] if args.profile else ["--no-profile"]), env=env)
    return {"card": card_name, "method": method, "checkpointing": checkpointing, "dtype": dtype, "seq": seq,
            "optimizer": args.optimizer,
            "env": {k: v for k, v in env.items() if v is not None}, **r}


def gb(n: float | None) -> str:
    return "—" if n is None else f"{n / GB:.3f}"


def err(estimate: float | None, measured: float | None) -> str:
    return "—" if not measured or estimate is None else f"{(estimate - measured) / measured * 100:+.0f}%"


def count(n: float) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


def configurations(args) -> list[tuple]:
    return [(c, m, k, d, s) for c in args.cards for s in args.seq for m in args.methods
            for k in args.checkpointing for d in args.dtypes]


def malloc_env(threshold: int | None) -> dict:
    """The environment every child runs with: glibc's mmap threshold fixed, or its defaults."""
    return {"MALLOC_MMAP_THRESHOLD_": None if threshold is None else str(threshold)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cards", nargs="+", default=["20m", "60m"], choices=list(CARDS))
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS,
                    help="qlora needs nest.load(..., quantize='nf4') (bitsandbytes); left out with a note if absent")
    ap.add_argument("--checkpointing", nargs="+", default=list(CHECKPOINTING), choices=list(CHECKPOINTING))
    ap.add_argument("--dtypes", nargs="+", default=["f32"], choices=list(DTYPES),
                    help="compute dtypes; bf16 is native only on CPUs with AVX-512 BF16 or AMX (about 20x slower "
                         "elsewhere)")
    ap.add_argument("--seq", type=int, nargs="+", default=[4096], help="sequence lengths (micro-batch 1)")
    ap.add_argument("--quick", action="store_true", help="the 20m card only")
    ap.add_argument("--mmap-threshold", type=int, default=MMAP_THRESHOLD, metavar="BYTES",
                    help="MALLOC_MMAP_THRESHOLD_ for every child, so freed tensors leave RSS; 0: glibc's defaults")
    ap.add_argument("--allocator-check", default="20m:lora:none:f32", metavar="CARD:METHOD:CHECKPOINTING:DTYPE",
                    help="rerun this configuration with glibc's default malloc settings; 'none' skips it")
    ap.add_argument("--optimizer", default="adamw", choices=["adamw", "adamw8bit"],
                    help="AdamW with f32 moments (torch), or 8-bit moments (linnet's adamw(kind='adamw8bit'), "
                         "bitsandbytes; planned with --optimizer-bytes 2)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=STEPS, help="training steps per configuration (peak over all)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "plan_vs_measured.md"),
                    help="markdown report path, '-' for none; text after the analysis marker of an existing "
                    "report is kept")
    ap.add_argument("--no-profile", dest="profile", action="store_false",
                    help="RSS only: no profiler, so no tensor peak")
    ap.add_argument("--json", metavar="PATH", help="also write the raw results as JSON")
    ap.add_argument("--render", metavar="JSON", help="rewrite the report from a --json file, running nothing "
                    "(the planner's side is recomputed with this checkout's planner)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--card", help=argparse.SUPPRESS)
    ap.add_argument("--method", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", help=argparse.SUPPRESS)
    ap.add_argument("--mlp-tile", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        args.seq, args.checkpointing = args.seq[0], args.checkpointing[0]
        return child(args)
    if args.quick:
        args.cards = ["20m"]
    if args.render:
        with open(args.render) as f:
            run = json.load(f)
        run["rendered"] = True
        return write_report(report(run), args.out, keep=ANALYSIS_MARKER)

    skipped = []
    if "qlora" in args.methods and not quantize_supported():
        args.methods = [m for m in args.methods if m != "qlora"]
        skipped.append("qlora: this checkout's nest.load takes no quantize= yet")
    start, load_start = time.perf_counter(), os.getloadavg()[0]
    env = malloc_env(args.mmap_threshold or None)
    print(f"{machine()}; {args.threads} threads; load average {load_start:.1f}; {env}")
    print(f"{'card':10s} {'method':6s} {'ckpt':9s} {'dtype':5s} {'seq':>5s} {'estimate GB':>11s} "
          f"{'measured GB':>11s} {'error':>6s} {'tensors GB':>10s} {'error':>6s} {'time s':>6s}", flush=True)
    results = []
    for config in configurations(args):
        r = measure(config, args, env)
        results.append(r)
        p = planned(r)
        head = f"{'llama-' + r['card']:10s} {r['method']:6s} {r['checkpointing']:9s} {r['dtype']:5s} {r['seq']:5d}"
        if "error" in r:
            print(f"{head}  FAILED {r['error']}", flush=True)
            continue
        est = p.get("total")
        print(f"{head} {gb(est):>11s} {gb(r['measured']):>11s} {err(est, r['measured']):>6s} "
              f"{gb(r['tensor_peak']):>10s} {err(est, r['tensor_peak']):>6s} {r['seconds']:6.1f}", flush=True)
    check = None
    if args.allocator_check != "none":
        card_name, method, checkpointing, dtype = args.allocator_check.split(":")
        check = measure((card_name, method, checkpointing, dtype, args.seq[0]), args, malloc_env(None))
        if "error" not in check:
            print(f"allocator check, llama-{card_name} {method} {checkpointing} {dtype} with glibc's defaults: "
                  f"measured {gb(check['measured'])} GB, tensors {gb(check['tensor_peak'])} GB", flush=True)
    elapsed = time.perf_counter() - start
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    run = {"results": results, "check": check, "elapsed": elapsed, "argv": sys.argv[1:] if argv is None else argv,
           "load": [load_start, os.getloadavg()[0]], "cpu_s": children.ru_utime + children.ru_stime,
           "threads": args.threads, "steps": args.steps, "cards": args.cards, "machine": machine(),
           "cpu_flags": cpu_flags(), "skipped": skipped, "mmap_threshold": args.mmap_threshold}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(run, f, indent=1)
    write_report(report(run), args.out, keep=ANALYSIS_MARKER)


def cpu_flags() -> str:
    """The CPU's bf16-related flags (bf16 compute is native only with one of them)."""
    with open("/proc/cpuinfo") as f:
        words = set(f.read().split())
    return ", ".join(sorted(words & {"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})) or "none of avx512f/bf16/amx"


ANALYSIS_MARKER = "<!-- analysis: written by hand for the run above; the script keeps what follows -->"


# -- the report --------------------------------------------------------------------------

KINDS = ["weights", "optimizer", "weight casts", "head grad", "activations", "loss", "backward", "other"]


def label(r: dict) -> list:
    return [f"llama-{r['card']}", r["method"], r["checkpointing"], r["dtype"]]


def report(run: dict) -> str:
    results, check = run["results"], run.get("check")
    for r in results:
        r["plan"] = planned(r)
    ok = [r for r in results if "error" not in r and "error" not in r["plan"]]
    threshold = run.get("mmap_threshold")
    lines = [
        "# The planner's memory estimate against measured linnet training steps (CPU)", "",
        ("Produced by `bench/plan_vs_measured.py`; the numbers are measured, not edited. "
         "GB = 10^9 bytes, as the planner prints them. The script's docstring has the method in full."), "",
        f"- Command: `{command(__file__, run['argv'])}`"
        + (" (this text was later re-rendered from that run's raw results with `--render`; the measured "
           "numbers are that run's, the estimates this checkout's planner's)" if run.get("rendered") else ""),
        f"- Machine: {run['machine']}; CPU flags: {run.get('cpu_flags', '?')}; {run['threads']} threads. The run "
        f"took {run['elapsed']:.0f} s ({run['cpu_s'] / 60:.1f} CPU-minutes; load average {run['load'][0]:.1f} at "
        f"the start, {run['load'][1]:.1f} at the end).",
        (f"- Run: each row is a fresh subprocess running `linnet.train.train(..., steps={run['steps']})` on "
         "packed rows of `seq` random tokens (micro-batch 1): "
         + ("AdamW with 8-bit moments (bitsandbytes' AdamW8bit through `linnet.train.optimizer.adamw`)"
            if any(r.get("optimizer") == "adamw8bit" for r in run["results"]) else "AdamW with f32 moments")
         + ", linnet's chunked "
         "`linear_cross_entropy`, gradient clipping. Adapters: rank 16 on every q/k/v/o/gate/up/down "
         "projection (`add_lora([\"*_proj\"])`, DoRA with `dora=True`, QLoRA over `quantize=\"nf4\"`). "
         "Trainable parameters are f32 (linnet's master weights); frozen ones are stored in the compute dtype."),
        (f"- **measured** = peak RSS (VmHWM) over the steps minus VmRSS just before the model is built, every "
         f"child run with `MALLOC_MMAP_THRESHOLD_={threshold}` so that freed tensors leave RSS"
         if threshold else "- **measured** = peak RSS (VmHWM) over the steps minus VmRSS just before the model "
         "is built, with glibc's default malloc settings")
        + ". **tensors** = the most bytes live in PyTorch's CPU allocator at once (profiler allocation events) "
        "over the same span. **estimate** = `linnet.plan.estimate` for the same run (the flags are listed below "
        "the tables); error = (estimate − measured) / measured.",
    ]
    lines += [f"- Left out: {s}." for s in run.get("skipped", [])] + [""]
    rows = []
    for r in results:
        p = r["plan"]
        if "error" in r or "error" in p:
            rows.append(label(r) + [r["seq"], "—", f"FAILED: {r.get('error') or p['error']}"] + [""] * 4)
            continue
        assert r["trainable"] == p["trainable"], (label(r), r["trainable"], p["trainable"])
        rows.append(label(r) + [r["seq"], f"{count(p['params'])} / {count(r['trainable'])}", gb(p["total"]),
                                gb(r["measured"]), err(p["total"], r["measured"]), gb(r["tensor_peak"]),
                                err(p["total"], r["tensor_peak"])])
    lines += table(["card", "method", "checkpointing", "dtype", "seq", "params / trained", "estimate GB",
                    "measured GB (RSS)", "error", "tensors GB", "error vs tensors"], rows, align="lllllrrrrrr")

    lines += [
        "",
        "## Each phase: the planner's peak against the measured tensor peak",
        "",
        ("Step 2, where AdamW's moments exist throughout. forward = `loss_packed` (the chunked loss included); "
         "backward = backward and gradient clipping; optimizer = AdamW's step. The planner's phase with the "
         "largest estimate is its total. All GB, planner / measured."),
        "",
    ]
    rows = []
    for r in ok:
        p, s = r["plan"], r["steps"][-1]
        t = s.get("tensors") or {"phases": {}, "phase": "—"}
        rows.append(label(r) + [f"{gb(p['phases'].get(k))} / {gb(t['phases'].get(k))}" for k in PHASES]
                    + [p["phase"], t["phase"], " / ".join(gb(s["phases"].get(k)) for k in PHASES)])
    lines += table(["card", "method", "checkpointing", "dtype", "forward", "backward", "optimizer", "planner's peak",
                    "measured peak", "RSS forward / backward / optimizer"], rows, align="llllrrrlll")

    with_t = [r for r in ok if r["steps"][-1].get("tensors")]
    kinds = [k for k in KINDS if any(r["steps"][-1]["tensors"]["live"].get(k) for r in with_t)]
    lines += [
        "",
        "## What was live at the measured peak",
        "",
        ("The tensors live at step 2's tensor peak by where they were allocated: *weights* while building the "
         "model (adapters included); *optimizer* in AdamW (its moments); *weight casts* the bf16 copies of f32 "
         "trainable weights that `Linear.forward` makes; *head grad* the head's f32 gradient, which "
         "`linear_cross_entropy` computes in its forward; *loss* the rest of that forward (a logits block, "
         "grad_h); *activations* what the rest of the forward allocated and still holds; *backward* what backward "
         "allocated (gradients, recomputed blocks, temporaries). Persistent states at the end: summed tensor "
         "sizes. All GB."),
        "",
    ]
    rows = [label(r) + [gb(r["steps"][-1]["tensors"]["live"].get(k, 0)) for k in kinds]
            + [gb(r["steps"][-1]["tensors"]["peak"]), gb(r["weight_bytes"]), gb(r["grad_bytes"]),
               gb(r["moment_bytes"]), f"{sum(s['seconds'] for s in r['steps']) / len(r['steps']):.1f}"]
            for r in with_t]
    lines += table(["card", "method", "checkpointing", "dtype", *kinds, "tensor peak", "states: weights", "f32 grads",
                    "moments", "s/step"], rows, align="llll" + "r" * (len(kinds) + 5))

    if check and "error" not in check:
        same = next((r for r in ok if label(r) == label(check)), None)
        lines += [
            "",
            f"Allocator check: llama-{check['card']} {check['method']} ({check['checkpointing']} checkpointing, "
            f"{check['dtype']}) again with glibc's default malloc settings (its mmap threshold starts at 128 KiB "
            "and rises, up to 32 MiB, each time a mapped block is freed, after which freed blocks stay in its "
            f"heap): measured **{gb(check['measured'])} GB**"
            + (f" against {gb(same['measured'])} GB with the threshold fixed" if same else "")
            + f", tensor peak {gb(check['tensor_peak'])} GB.",
        ]
    elif check:
        lines += ["", f"Allocator check FAILED: {check['error']}"]

    lines += ["", "Planner inputs and cards:", ""]
    seen = set()
    for r in results:
        key = (r["method"], r["checkpointing"], r["dtype"], r["seq"], r.get("optimizer", "adamw"))
        if key not in seen:
            seen.add(key)
            lines.append(f"- `linnet plan CARD {flags(plan_settings(*key))}`")
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

    def spread(xs):
        return f"{min(xs):+.1%} to {max(xs):+.1%} (mean {sum(xs) / len(xs):+.1%}, largest |error| {max(map(abs, xs)):.1%})"

    errors = [(r["plan"]["total"] - r["measured"]) / r["measured"] for r in ok]
    worst = max(ok, key=lambda r: abs(r["plan"]["total"] - r["measured"]) / r["measured"])
    out = [f"- Against the RSS peak the planner is off by {spread(errors)}; "
           f"{sum(abs(e) <= 0.15 for e in errors)} of {len(errors)} rows within 15% (the largest: "
           f"{' '.join(map(str, label(worst)))})."]
    with_t = [r for r in ok if r.get("tensor_peak")]
    if with_t:
        te = [(r["plan"]["total"] - r["tensor_peak"]) / r["tensor_peak"] for r in with_t]
        gap = [(r["measured"] - r["tensor_peak"]) / r["tensor_peak"] for r in with_t]
        out.append(f"- Against the tensor peak it is off by {spread(te)}; {sum(abs(e) <= 0.15 for e in te)} of "
                   f"{len(te)} within 15%. The RSS peak is {min(gap):+.1%} to {max(gap):+.1%} off the tensor peak.")
        same = sum(r["plan"]["phase"] == r["steps"][-1]["tensors"]["phase"] for r in with_t)
        out.append(f"- The planner names the phase of the measured tensor peak in {same} of {len(with_t)} rows.")
        over = [r["measured"] - r["tensor_peak"] for r in with_t]
        out.append(f"- RSS above the tensor peak: {min(over) / 1e6:.0f} to {max(over) / 1e6:.0f} MB.")
    return out


if __name__ == "__main__":
    main()
