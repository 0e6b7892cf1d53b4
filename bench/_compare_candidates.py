"""Candidate changes to linnet, measured on bench/compare.py's workload before they are made.

    python bench/_compare_candidates.py --method sft-lora --dtype bf16 --variants base NEW
    python bench/_compare_candidates.py --method grpo --variants NEW --rounds 1   # one variant: prints its peak RSS

Each variant swaps functions of linnet for bench-local versions for the length of its runs,
then restores them: nothing in src/ is edited. The variants run interleaved in one process
(A B C A B C ...), each a fresh model and optimizer over the same rows, and report the median
process CPU time of steps 2..n (one thread: CPU time is the wall time less the time other
jobs held the core) and the losses, which must equal the baseline's (to rounding) for a
change that is meant to be exact. bench/compare.py --linnet-variant takes the same names.

The candidates measured here and since landed in src/ (padding skipped, frozen-head
log-probabilities, CPU-sized loss blocks, split attention, LoRA as one addmm, inverse-CDF
sampling, decode attention as matmuls, shared prompts, bf16 attention in f32) are listed with
their effects in bench/RESULTS.md.
Add a new candidate as a function below and a row in `variant_changes`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import compare

# -- the candidates ----------------------------------------------------------------------
# None open: every measured candidate has landed (bench/RESULTS.md). A new one is a function
# here and a row in `variant_changes`, e.g. (module, "name", replacement).


@contextlib.contextmanager
def patched(changes):
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in changes]
    try:
        for obj, name, value in changes:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)


def variant_changes(name):
    table = {
        "base": [],
    }
    if name not in table:
        raise SystemExit(f"unknown variant {name!r}; choose from {', '.join(table)}")
    return table[name]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", default="sft-lora", choices=compare.METHODS)
    ap.add_argument("--size", default="7m", choices=list(compare.SIZES))
    ap.add_argument("--dtype", default="bf16", choices=list(compare.DTYPES))
    ap.add_argument("--variants", nargs="+", default=["base"])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    import _compare_run as runner

    with tempfile.TemporaryDirectory() as tmp:
        work = compare.build_workload(Path(tmp), [args.size], [args.method], args.steps, 0)[args.size]
        spec = dict(method=args.method, size=args.size, dtype=compare.DTYPES[args.dtype], steps=args.steps,
                    lr=compare.LR[args.method], seed=0, threads=1, tokens=compare.TOKENS,
                    model_dir=work["model_dir"], adapter_dir=work["adapter_dir"],
                    data=work["data"][args.method.split("-")[0]], vocab=compare.SIZES[args.size]["vocab"],
                    eos=compare.EOS, pairs_per_step=compare.PAIRS_PER_STEP, group=compare.GROUP,
                    prompts_per_step=compare.PROMPTS_PER_STEP, max_new_tokens=compare.MAX_NEW, library="linnet")
        data = json.loads(Path(spec["data"]).read_text())
        baseline = runner.vm_rss()
        cpu = {v: [] for v in args.variants}
        loss = {}
        for _ in range(args.rounds):
            for v in args.variants:
                torch.manual_seed(0)
                clock = runner.Clock()
                with patched(variant_changes(v)):
                    runner.run_linnet(spec, data, clock)
                cpu[v] += clock.cpu_seconds()[1:]
                loss[v] = clock.losses
                sampling = [m["sample_seconds"] for m in clock.metrics if "sample_seconds" in m]
                print(f"  {v:10} cpu {[round(x, 2) for x in clock.cpu_seconds()]}"
                      + (f"  sampling wall {[round(x, 2) for x in sampling]}" if sampling else ""), flush=True)
        if len(args.variants) == 1:  # a fresh process a variant (see --memory): its peak is this variant's
            print(f"peak above baseline: {(runner.peak_rss() - baseline) / 2**30:.3f} GiB")
        base = statistics.median(cpu[args.variants[0]])
        print(f"\n{args.method} {args.size} {args.dtype}: median CPU s of steps 2..{args.steps}, {args.rounds} rounds")
        for v in args.variants:
            m = statistics.median(cpu[v])
            diff = max(abs(a - b) / max(abs(b), 1e-9) for a, b in zip(loss[v], loss[args.variants[0]]))
            print(f"| {v} | {m:.3f} s | {base / m:.2f}x | max loss diff vs base {diff:.1e} |")


if __name__ == "__main__":
    main()
