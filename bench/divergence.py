"""How fast, and in how much memory, does distillation's blockwise divergence run forward and backward?

    python bench/divergence.py              # bench/divergence.md: 1024 positions, D=256, V=32768, blocks of 512; ~2 min
    python bench/divergence.py --out -      # print only, write no markdown
    python bench/divergence.py --N 256 --D 64 --V 4096 --repeats 1 --out -   # smoke: seconds

`linnet.train.distill.linear_divergence` (the student's and teacher's heads over a block of
positions at a time) against a bench-local copy of what it did before (not shipped code):
each block through autograd under torch's non-reentrant checkpoint, so that backward
recomputes the block and differentiates log_softmax, kl_div and (JSD) the mixture's
logsumexp op by op. linnet now takes each block's gradient in closed form
(`_BlockDivergence`). Time: median of `--repeats` forward+backward calls after a warm-up,
one thread. Peak: the resident set's high-water mark during one call above its size before
it (inputs and the first call's allocations excluded; glibc maps large tensors on their own).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

import torch
from _common import KEEP, command, machine, peak_rss, reset_peak, rss, table, write_report
from torch.utils.checkpoint import checkpoint


def autograd_divergence(h_s, w_s, h_t, w_t, weights, *, divergence, beta, rows):
    """The reference: each block differentiated by autograd, recomputed under checkpoint."""
    from linnet.train.distill import token_divergence

    def block(hs, ws, ht, wt, wb):
        return (token_divergence(hs @ ws.T, ht @ wt.T, divergence=divergence, beta=beta) * wb).sum()

    total = h_s.new_zeros(())
    for start in range(0, h_s.shape[0], rows):
        sl = slice(start, start + rows)
        total = total + checkpoint(block, h_s[sl], w_s, h_t[sl], w_t, weights[sl], use_reentrant=False)
    return total


def closed_form(h_s, w_s, h_t, w_t, weights, *, divergence, beta, rows):
    from linnet.train.distill import linear_divergence

    return linear_divergence(h_s, w_s, h_t, w_t, weights, divergence=divergence, beta=beta, block_rows=rows)


def step(fn, h_s, w_s, *rest, **options) -> None:
    """One forward and backward, the gradients dropped after."""
    fn(h_s, w_s, *rest, **options).backward()
    h_s.grad = w_s.grad = None


def peak_bytes(fn) -> int:
    """The resident set's high-water mark while fn runs, above where it started (glibc maps
    large tensors on their own and unmaps them when freed, so RSS follows live tensors)."""
    before = rss()
    reset_peak()
    fn()
    return peak_rss() - before


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--N", type=int, default=1024, help="positions")
    ap.add_argument("--D", type=int, default=256, help="hidden size")
    ap.add_argument("--V", type=int, default=32768, help="vocabulary")
    ap.add_argument("--rows", type=int, default=512, help="positions a block")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "divergence.md"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    h_s = torch.randn(args.N, args.D, generator=g, requires_grad=True)
    w_s = (torch.randn(args.V, args.D, generator=g) / args.D**0.5).requires_grad_(True)
    h_t, w_t = torch.randn(args.N, args.D, generator=g), torch.randn(args.V, args.D, generator=g) / args.D**0.5
    weights = (torch.rand(args.N, generator=g) > 0.2).float()
    start = time.perf_counter()
    rows = []
    for divergence, beta in (("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.5)):
        got = {}
        for name, fn in (("autograd", autograd_divergence), ("closed form", closed_form)):
            call = functools.partial(step, fn, h_s, w_s, h_t, w_t, weights, divergence=divergence, beta=beta,
                                     rows=args.rows)
            call()
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                call()
                times.append(time.perf_counter() - t0)
            got[name] = (statistics.median(times), peak_bytes(call))
        (ta, pa), (tc, pc) = got["autograd"], got["closed form"]
        rows.append([divergence, f"{ta * 1e3:.0f} ms", f"{tc * 1e3:.0f} ms", f"**{ta / tc:.2f}x**",
                     f"{pa / 2**20:.0f} MiB", f"{pc / 2**20:.0f} MiB", f"**{pc / pa:.2f}x**"])
        print(" ".join(map(str, rows[-1])), flush=True)
    block = args.rows * args.V * 4 / 2**20
    text = "\n".join([
        "# Distillation's blockwise divergence: closed-form gradient against autograd",
        "",
        "Produced by `bench/divergence.py`; numbers are measured, not edited.",
        "",
        f"- Command: `{command(__file__, argv)}` ({time.perf_counter() - start:.0f} s)",
        f"- Machine: {machine()}; 1 thread.",
        f"- Shapes: {args.N} positions, hidden {args.D}, vocabulary {args.V}, blocks of {args.rows} positions "
        f"(one f32 [rows, V] buffer: {block:.0f} MiB); forward + backward of the summed weighted divergence "
        f"(JSD with beta 0.5), median of {args.repeats}.",
        "",
        *table(["divergence", "autograd", "closed form", "speed-up", "autograd peak", "closed-form peak",
                "peak ratio"], rows, "lrrrrrr"),
    ])
    write_report(text, args.out, keep=KEEP)


if __name__ == "__main__":
    main()
