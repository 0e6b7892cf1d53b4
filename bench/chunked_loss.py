"""How much peak memory and time does the chunked output-head loss take against plain logits, on CPU?

    python bench/chunked_loss.py --block-bytes 256M 1G  # bench/chunked_loss.md: P=4096, D=4096, V=128256; 8-10 min
    python bench/chunked_loss.py --quick                # P=2048, V=32768, blocks 32M/128M: ~1 min
    python bench/chunked_loss.py --out -                # print only, write no markdown
    python bench/chunked_loss.py --P 256 --D 256 --V 4096 --block-bytes 1M 4M --out -  # smoke: seconds

Each variant runs forward+backward once in a fresh subprocess (`--child`), so one
variant's allocations never hide another's. Method: the child allocates its inputs
(hidden states h [P, D] bf16 requiring grad, the head weight W [V, D], targets, weights),
reads its resident set size (VmRSS) and resets the high-water mark there, runs
forward+backward, then reads the peak resident set size (VmHWM). "Peak above inputs" is
the difference: everything forward+backward held at its worst moment, including the
gradients it returns. Large tensors are mmap'd by glibc and unmapped when freed, so RSS
tracks live tensors closely.

Heads:
  trainable  W is an f32 master weight (what `Decoder` keeps for a trainable head), cast
             to bf16 for the products; W's f32 gradient [V, D] is part of any method's peak.
  frozen     W is stored in bf16 and gets no gradient (LoRA, or a frozen head): only the
             logits-related memory remains.

Variants:
  plain      logits = h @ W.T (bf16, [P, V]), then `linnet.torch.losses.cross_entropy`
             (log-softmax in f32).
  chunked    `linnet.torch.losses.linear_cross_entropy` at each `--block-bytes`.
  chunked/candidate*  a bench-local copy of the shipped algorithm (not shipped code) whose
             backward scales W's saved f32 gradient in place rather than allocating a
             second [V, D] f32 copy (the shipped backward keeps the saved one intact, so a
             retained graph can run backward again). An earlier candidate also freed
             each block before the next and scaled grad_h in f32: both have shipped.

Shapes: P positions, D hidden, V vocabulary.
"""

from __future__ import annotations

import argparse
import os
import time

from _common import (
    GiB,
    command,
    cpu_now,
    machine,
    others_busy,
    peak_rss,
    reset_peak,
    revision,
    rss,
    run_child,
    send_result,
    table,
    wait_quiet,
    write_report,
)

SOURCE = "src/linnet/torch/losses.py"  # the code measured: its commit is in the report


def parse_bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def fmt_bytes(n: int) -> str:
    return f"{n / GiB:.0f} GiB" if n >= GiB and n % GiB == 0 else f"{n / (1 << 20):.0f} MiB"


# -- child: one variant, one measurement ------------------------------------------------

def candidate_linear_cross_entropy(h_ND, w_VD, targets_N, weights_N, *, block_bytes):
    """The shipped algorithm (one pass: loss and both gradients block by block), self-
    contained here, differing only where the docstring at the top says."""
    import torch

    class _Candidate(torch.autograd.Function):
        @staticmethod
        def forward(ctx, h_ND, w_VD, targets_N, weights_N, rows, need_h, need_w):
            N, V, D = h_ND.shape[0], w_VD.shape[0], h_ND.shape[1]
            wc_VD = w_VD.to(h_ND.dtype)
            total = torch.zeros((), dtype=torch.float32)
            grad_h = torch.zeros_like(h_ND) if need_h else None
            grad_w = torch.zeros(w_VD.shape, dtype=torch.float32) if need_w else None
            vocab_rows = max(1, (1 << 26) // (4 * D))  # [vocab slice, D] products of ~64 MiB f32
            arange = torch.arange(min(rows, N))
            for s in range(0, N, rows):
                sl = slice(s, min(s + rows, N))
                z = (h_ND[sl] @ wc_VD.T).float()
                t, wt = targets_N[sl].long(), weights_N[sl].float()
                picked = z.gather(-1, t[:, None])[:, 0]
                top = z.amax(dim=-1, keepdim=True)
                sums = z.sub_(top).exp_().sum(dim=-1)
                total += ((top[:, 0] + sums.log() - picked) * wt).sum()
                if need_h or need_w:
                    z.div_(sums[:, None])
                    z[arange[: z.shape[0]], t] -= 1.0
                    g = z.mul_(wt[:, None]).to(h_ND.dtype)
                    del z  # (1) the f32 block goes before the products run
                    if need_h:
                        grad_h[sl] = g @ wc_VD
                    if need_w:
                        for v in range(0, V, vocab_rows):
                            grad_w[v : v + vocab_rows].add_(g[:, v : v + vocab_rows].T @ h_ND[sl])
                    del g  # (1) and the bf16 one before the next block's logits exist
                else:
                    del z
            ctx.save_for_backward(grad_h, grad_w)
            ctx.w_dtype = w_VD.dtype
            return total

        @staticmethod
        def backward(ctx, grad_out):
            grad_h, grad_w = ctx.saved_tensors
            # (3) the scale stays f32 for the bf16 grad_h (bf16(1/count) is off by up to 0.4%)
            gh = None if grad_h is None else (grad_h.float() * grad_out).to(grad_h.dtype)
            # (2) in place: no second [V, D] f32 (this graph then supports one backward only)
            gw = None if grad_w is None else grad_w.mul_(grad_out).to(ctx.w_dtype)
            return gh, gw, None, None, None, None, None

    rows = max(1, block_bytes // (4 * w_VD.shape[0]))
    grad = torch.is_grad_enabled()
    return _Candidate.apply(h_ND, w_VD, targets_N, weights_N, rows,
                            grad and h_ND.requires_grad, grad and w_VD.requires_grad)


def grad_scale_bias(count: int = 3000) -> dict:
    """Relative error of each gradient when the loss is divided by `count` before backward
    (as trainers do: sum / global count), against backward of the sum scaled afterwards."""
    import torch

    from linnet.torch import losses

    g = torch.Generator().manual_seed(0)
    h = torch.randn(count, 64, generator=g).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(512, 64, generator=g) * 0.1).requires_grad_()
    t, wt = torch.randint(0, 512, (count,), generator=g), torch.ones(count)
    out = {}
    for name, fn in (("shipped", losses.linear_cross_entropy), ("candidate", candidate_linear_cross_entropy)):
        grads = []
        for divide in (True, False):
            h.grad = w.grad = None
            loss = fn(h, w, t, wt, block_bytes=4 * 512 * 1000)
            (loss / count if divide else loss).backward()
            grads.append((h.grad.float().clone(), w.grad.clone() / (1 if divide else count)))
        (gh, gw), (gh1, gw1) = grads
        gh1 = gh1 / count
        out[name] = {"h": ((gh * gh1).sum() / (gh1 * gh1).sum()).item() - 1,
                     "w": ((gw * gw1).sum() / (gw1 * gw1).sum()).item() - 1}
    return out


def child(args) -> None:
    import torch

    from linnet.torch import losses

    torch.set_num_threads(args.threads)
    P, D, V = args.P, args.D, args.V
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(P, D, generator=g) * 0.5).to(torch.bfloat16).requires_grad_()
    if args.head == "trainable":
        w = torch.empty(V, D).normal_(0.0, 0.02, generator=g).requires_grad_()
    else:
        w = torch.empty(V, D, dtype=torch.bfloat16).normal_(0.0, 0.02, generator=g)
    targets = torch.randint(0, V, (P,), generator=g)
    weights = (torch.arange(P) % 3 != 0).float()  # a third of positions not learned (prompt-like)
    weights[-64:] = 0.0  # padding

    base_rss = rss()
    reset_peak()
    t0 = time.perf_counter()
    if args.variant == "plain":
        logits = h @ w.to(h.dtype).T
        loss = losses.cross_entropy(logits, targets, weights)
        del logits
    elif args.variant == "chunked":
        loss = losses.linear_cross_entropy(h, w, targets, weights, block_bytes=args.block_bytes)
    elif args.variant == "chunked/candidate":
        loss = candidate_linear_cross_entropy(h, w, targets, weights, block_bytes=args.block_bytes)
    else:
        raise ValueError(args.variant)
    t1 = time.perf_counter()
    (loss / weights.sum()).backward()
    t2 = time.perf_counter()
    peak = peak_rss()
    send_result({
        "variant": args.variant, "head": args.head, "block_bytes": args.block_bytes,
        "P": P, "D": D, "V": V, "threads": args.threads,
        "base_rss": base_rss, "peak": peak, "peak_above_inputs": peak - base_rss, "retained": rss() - base_rss,
        "forward_s": t1 - t0, "backward_s": t2 - t1,
        "loss": loss.item() / weights.sum().item(),
        "grad_h_norm": h.grad.float().norm().item(),
        "grad_w_norm": None if w.grad is None else w.grad.float().norm().item(),
    })


# -- parent: run the variants, tabulate -------------------------------------------------

def measure(variant, head, block_bytes, args) -> dict:
    """One variant in a fresh process, and the share of the CPUs others used meanwhile."""
    if args.wait_quiet:
        wait_quiet(args.wait_quiet)
    before = cpu_now()
    r = run_child([os.path.abspath(__file__), "--child", "--variant", variant, "--head", head, "--P", args.P,
                   "--D", args.D, "--V", args.V, "--block-bytes", block_bytes, "--threads", args.threads])
    return {"variant": variant, "head": head, "block_bytes": block_bytes, **r, "others": others_busy(before, cpu_now())}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="P=2048, V=32768: a small check")
    ap.add_argument("--P", type=int, default=4096, help="positions (rows of the loss)")
    ap.add_argument("--D", type=int, default=4096, help="hidden size")
    ap.add_argument("--V", type=int, default=128256, help="vocabulary (Llama 3: 128256)")
    ap.add_argument("--block-bytes", nargs="+", default=None,
                    help="block sizes of f32 logits to compare (default 256M 1G; --quick: 32M 128M)")
    ap.add_argument("--heads", nargs="+", default=["trainable", "frozen"], choices=["trainable", "frozen"])
    ap.add_argument("--no-candidate", action="store_true", help="skip the bench-local candidate")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="S",
                    help="before each variant wait up to S seconds for other processes to go idle")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "chunked_loss.md"),
                    help="markdown report path, '-' for none")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--head", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        args.block_bytes = parse_bytes(args.block_bytes[0])
        return child(args)
    if args.quick:
        args.P, args.V = 2048, 32768
    if args.block_bytes is None:
        args.block_bytes = ["32M", "128M"] if args.quick else ["256M", "1G"]
    blocks = [parse_bytes(b) for b in args.block_bytes]

    start = time.perf_counter()
    P, D, V = args.P, args.D, args.V
    logits_f32 = P * V * 4
    print(f"{machine()}; P={P} D={D} V={V}; [P,V] f32 logits {logits_f32 / GiB:.2f} GiB")
    plan = []
    for head in args.heads:
        plan.append(("plain", head, blocks[-1]))
        plan += [("chunked", head, b) for b in blocks]
        if not args.no_candidate:
            plan += [("chunked/candidate", head, b) for b in blocks]
    results = []
    for variant, head, b in plan:
        r = measure(variant, head, b, args)
        results.append(r)
        if "error" in r:
            print(f"{variant:18s} {head:9s} {fmt_bytes(b):>8s}  FAILED {r['error']}", flush=True)
        else:
            print(f"{variant:18s} {head:9s} {fmt_bytes(b):>8s}  peak above inputs {r['peak_above_inputs'] / GiB:6.2f} GiB"
                  f"  fwd {r['forward_s']:6.1f} s  bwd {r['backward_s']:5.2f} s  loss {r['loss']:.5f}"
                  f"  others' CPU {100 * r['others']:.0f}%", flush=True)
    elapsed = time.perf_counter() - start

    wgrad = V * D * 4
    lines = ["# Chunked output-head loss: peak memory and time on CPU", "",
             "Produced by `bench/chunked_loss.py`; numbers are measured, not edited.", "",
             f"- Command: `{command(__file__, argv)}`",
             f"- Machine: {machine()}; {args.threads} threads",
             f"- Code: linnet at {revision(SOURCE)}",
             f"- Shapes: P={P}, D={D}, V={V}; h bf16 [P, D] requiring grad; targets random; a third of "
             "the positions and the last 64 weigh 0",
             f"- Run time: {elapsed:.0f} s",
             "- Method: each row is a fresh subprocess; peak above inputs = the RSS high-water mark (VmHWM) after "
             "forward+backward minus VmRSS measured right after allocating the inputs, where the mark is reset "
             "(so it includes "
             "the gradients the call returns). Times are one run each (not repeated); `others' CPU` is "
             "the share of the 2 CPUs other processes used meanwhile (the machine is shared): a run "
             "with a high share is slowed by it, its memory is not. The chunked forward computes both "
             "gradients (its backward only scales them): compare forward + backward.", "",
             "Reference sizes: "
             f"[P, V] f32 logits = **{logits_f32 / GiB:.2f} GiB**; [P, V] bf16 = {P * V * 2 / GiB:.2f} GiB; "
             f"[V, D] f32 (W's gradient for a trainable head, which every method returns) = {wgrad / GiB:.2f} GiB; "
             f"[V, D] bf16 (W cast for the products) = {V * D * 2 / GiB:.2f} GiB. "
             f"`linear_cross_entropy`'s default block is {fmt_bytes(1 << 30)} of f32 logits "
             f"(= {max(1, (1 << 30) // (4 * V))} rows at this V).", ""]
    cells = []
    for r in results:
        if "error" in r:
            cells.append([r["head"], r["variant"], fmt_bytes(r["block_bytes"]), "", f"FAILED: {r['error']}"] + [""] * 7)
            continue
        plain = r["variant"] == "plain"
        rows = "—" if plain else str(min(P, max(1, r["block_bytes"] // (4 * V))))
        peak = r["peak_above_inputs"]
        working = peak - (wgrad if r["head"] == "trainable" else 0)
        name = r["variant"] + ("*" if "candidate" in r["variant"] else "")
        cells.append([r["head"], name, "—" if plain else fmt_bytes(r["block_bytes"]), rows, f"{peak / GiB:.2f} GiB",
                      f"{working / GiB:.2f} GiB", f"{peak / logits_f32:.2f}x", f"{r['forward_s']:.1f}",
                      f"{r['backward_s']:.2f}", f"{100 * r['others']:.0f}%", f"{r['loss']:.5f}", f"{r['grad_h_norm']:.4g}"])
    lines += table(["head", "variant", "block", "rows/block", "peak above inputs", "less W's f32 grad",
                    "vs [P,V] f32 logits", "forward s", "backward s", "others' CPU", "loss", "‖grad h‖"], cells)
    lines.append("")
    lines.append("`less W's f32 grad` subtracts the [V, D] f32 gradient a trainable head must return anyway: "
                 "what remains is the method's working memory. * bench-local candidate (see the script's "
                 "docstring), not shipped code.")
    lines.append("")

    ok = [r for r in results if "error" not in r]
    findings = []
    for r in ok:
        if r["variant"] != "chunked":
            continue
        working = r["peak_above_inputs"] - (wgrad if r["head"] == "trainable" else 0)
        if working > 0.5 * logits_f32:
            cast = " (of which the bf16 cast of W: %.2f GiB)" % (V * D * 2 / GiB) if r["head"] == "trainable" else ""
            findings.append(
                f"- **Not far below the logits**: shipped `linear_cross_entropy`, {r['head']} head, block "
                f"{fmt_bytes(r['block_bytes'])}: working memory {working / GiB:.2f} GiB{cast}, "
                f"{working / logits_f32:.2f}x the [P, V] f32 logits; peak above inputs "
                f"{r['peak_above_inputs'] / GiB:.2f} GiB.")
    plains = {r["head"]: r for r in ok if r["variant"] == "plain"}
    for r in ok:
        if r["variant"] == "plain":
            continue
        p = plains.get(r["head"])
        if p:
            findings.append(
                f"- {r['head']} head, {r['variant']} {fmt_bytes(r['block_bytes'])}: peak "
                f"{r['peak_above_inputs'] / GiB:.2f} GiB vs plain {p['peak_above_inputs'] / GiB:.2f} GiB "
                f"({r['peak_above_inputs'] / p['peak_above_inputs']:.2f}x); time "
                f"{r['forward_s'] + r['backward_s']:.1f} s vs {p['forward_s'] + p['backward_s']:.1f} s; "
                f"loss differs by {abs(r['loss'] - p['loss']):.1e}.")
    def peak(head, variant, block):
        for r in ok:
            if (r["head"], r["variant"], r["block_bytes"]) == (head, variant, block):
                return r["peak_above_inputs"] / GiB
        return None

    why = []
    big, small = max(blocks), min(blocks)
    f_ship, f_cand = peak("frozen", "chunked", big), peak("frozen", "chunked/candidate", big)
    t_ship, t_cand = peak("trainable", "chunked", big), peak("trainable", "chunked/candidate", big)
    if None not in (f_ship, f_cand, t_ship, t_cand):
        why = [
            f"## Where the shipped chunked loss holds memory (losses.py at {revision(SOURCE)})", "",
            "The candidate runs the shipped algorithm and differs only in the numbered points of the script's "
            "docstring, so the differences between their rows measure those points:", "",
            f"1. Backward's `(grad_w * grad_out)` allocates a second [V, D] f32 ({V * D * 4 / GiB:.2f} GiB) while "
            f"the saved one is alive, so backward holds twice W's gradient; that sets the peak when the forward's "
            f"blocks are small. Trainable head, block {fmt_bytes(small)}: "
            f"{peak('trainable', 'chunked', small):.2f} GiB shipped, {peak('trainable', 'chunked/candidate', small):.2f} "
            f"GiB scaling in place; block {fmt_bytes(big)}: {t_ship:.2f} GiB shipped, {t_cand:.2f} GiB (there "
            "the forward's blocks set the peak). Frozen head (no W gradient), block "
            f"{fmt_bytes(big)}: {f_ship:.2f} GiB shipped, {f_cand:.2f} GiB: the same algorithm.",
            f"2. What remains beyond W's f32 gradient: the bf16 cast of the f32 master weight "
            f"({V * D * 2 / GiB:.2f} GiB; the plain variant has it too) and about 1.5 blocks (a block's bf16 "
            "product and its f32 copy coexist: CPU matmuls have no bf16-in/f32-out form).",
            f"3. The 1 GiB block (the default on accelerators) is {(1 << 30) / logits_f32:.0%} of the whole [P, V] "
            f"f32 logits at P={P}. On a CPU the default is 16 MiB of logits but at least 512 rows "
            f"(`losses.rows_per_block`: {max(512, (16 << 20) // (4 * V))} rows at this V, close to the "
            f"{fmt_bytes(small)} row): the frozen-head peak is then {peak('frozen', 'chunked', small):.2f} GiB.", "",
        ]
    bias = grad_scale_bias()
    why += [
        "## Numerics: the incoming gradient's scale", "",
        "Trainers divide the loss sum by a token count before backward. The shipped backward scales the saved "
        "bf16 grad_h in f32 and rounds once: with a count of 3000, grad_h comes out scaled by "
        f"1{bias['shipped']['h']:+.2e} relative to W's gradient (whose scale stays f32: "
        f"{bias['shipped']['w']:+.1e}), the rounding of one bf16 product. (An earlier version rounded the scale "
        "itself to bf16 first: +1.40e-03, a systematic bias on every step with that count.)", "",
    ]
    lines += ["## Findings", ""] + findings + [""] + why
    write_report("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
