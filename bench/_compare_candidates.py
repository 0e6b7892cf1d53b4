"""Candidate changes to linnet, measured on bench/compare.py's workload before they are made.

    python bench/_compare_candidates.py --method sft-lora --dtype bf16
    python bench/_compare_candidates.py --method grpo --dtype f32 --variants base trim pick all
    python bench/_compare_candidates.py --method grpo --variants all --rounds 1   # one variant: prints its peak RSS

Variants: base, split, attn-f32, lora-addmm, ce-16MiB, trim, pick, frozen-head, decode-bmm (each
below, with the change it stands for); all5 (trim, ce-16MiB, attn-f32, lora-addmm, pick), all (all5
with frozen-head, in 16 MiB blocks), all+decode. bench/compare.py --linnet-variant takes the same names.

Each variant swaps one function of linnet for a bench-local version (below, each with the
change it stands for) for the length of its runs, then restores it: nothing in src/ is
edited. The variants run interleaved in one process (A B C A B C ...), each a fresh model
and optimizer over the same rows, and report the median process CPU time of steps 2..n (one
thread: CPU time is the wall time less the time other jobs held the core) and the losses,
which must equal the baseline's (to rounding) for a change that is meant to be exact.
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
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

import compare

from linnet.serve import engine as engine_module
from linnet.torch import attention, losses
from linnet.torch import model as model_module

# -- the candidates ----------------------------------------------------------------------

def documents_split(q, k, v, bounds):
    """attention.documents over torch.split views: autograd joins the per-document
    gradients with one cat, where slices each build a zero-filled [1, H, P, d] gradient
    that is then summed (O(documents x P) memory traffic in backward)."""
    sizes = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    gqa = q.shape[1] != k.shape[1]
    outs = [F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, enable_gqa=gqa)
            for qi, ki, vi in zip(q.split(sizes, 2), k.split(sizes, 2), v.split(sizes, 2))]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def documents_f32(q, k, v, bounds):
    """documents_split with q, k, v in float32 when they are bf16: torch's CPU flash
    attention backward is several times slower in bf16 than in f32."""
    if q.dtype == torch.float32:
        return documents_split(q, k, v, bounds)
    return documents_split(q.float(), k.float(), v.float(), bounds).to(q.dtype)


def lora_forward(self, x):
    """Linear.forward with the adapter's scale and sum folded into one addmm:
    y + (x A^T) B^T * s without the [P, out] multiply and add (and their backward)."""
    bias = None if self.bias is None else self.bias.to(x.dtype)
    y = F.linear(x, self.weight.to(x.dtype), bias)
    if self.lora_a is None:
        return y
    z = F.dropout(x, self.lora_dropout, self.training) if self.lora_dropout else x
    za = F.linear(z, self.lora_a.to(x.dtype))
    out = torch.addmm(y.reshape(-1, y.shape[-1]), za.reshape(-1, za.shape[-1]), self.lora_b.to(x.dtype).t(),
                      alpha=self.lora_scale)
    return out.view(y.shape)


def trimmed_fields(original):
    """Decoder._fields that drops the row's trailing padding (a document of its own that
    every layer, attention included, would otherwise compute): eager mode needs no fixed
    row length. log_probs_packed pads its output back (see trimmed_log_probs)."""
    def _fields(self, batch):
        tokens, positions, bounds, targets, weights = original(self, batch)
        real = int(batch.real)
        if real < len(tokens):
            bounds = [b for b in bounds if b <= real]
            tokens, positions, targets, weights = tokens[:real], positions[:real], targets[:real], weights[:real]
        return tokens, positions, bounds, targets, weights
    return _fields


def trimmed_log_probs(original):
    def log_probs_packed(self, batch):
        out = original(self, batch)
        P = len(batch.tokens)
        return out if out.shape[0] == P else F.pad(out, (0, P - out.shape[0]))
    return log_probs_packed


def pick_inverse_cdf(logits_BV, s):
    """engine._pick sampling one uniform a row through the cumulative distribution,
    instead of torch.multinomial (which draws an exponential for every vocabulary entry:
    B x V random numbers a step)."""
    import math

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
            before = probs.cumsum(-1) - probs
            sorted_z = sorted_z.masked_fill(before >= s.top_p, -math.inf)
            z = torch.full_like(z, -math.inf).scatter(-1, order, sorted_z)
        cdf = torch.softmax(z, dim=-1, dtype=torch.float64).cumsum_(-1)
        u = torch.rand(cdf.shape[0], 1, generator=s.generator, dtype=torch.float64, device=cdf.device)
        tok = torch.searchsorted(cdf, u * cdf[:, -1:]).clamp_(max=cdf.shape[1] - 1)[:, 0]
    return tok, logp_BV.gather(-1, tok[:, None])[:, 0]


def ce_blocks(rows_bytes):
    original = losses.linear_cross_entropy
    original_lp = losses.linear_token_log_probs

    def ce(h, w, t, wt):
        return original(h, w, t, wt, block_bytes=rows_bytes)

    def lp(h, w, t):
        return original_lp(h, w, t, block_bytes=rows_bytes)
    return ce, lp


def decode_bmm(self, tokens_B, pos, cache, cos_Sd, sin_Sd):
    """Engine._decode with the one-query attention as two batched matmuls and a softmax
    (query heads grouped over their kv head) instead of SDPA, whose CPU flash kernel
    is built for long queries."""
    m, dev = self.model, self.model.device
    B, S = len(pos), max(pos) + 1
    pos_B = torch.tensor(pos, device=dev)
    rows_B = torch.arange(B, device=dev)
    cos, sin = cos_Sd[pos_B][:, None], sin_Sd[pos_B][:, None]
    bias = None
    if min(pos) != max(pos):
        bias = torch.zeros(B, S, device=dev).masked_fill_(
            torch.arange(S, device=dev)[None] > pos_B[:, None], float("-inf")).view(B, 1, 1, S)
    x = F.embedding(tokens_B, m.model.embed_tokens.weight).to(m.dtype)
    for i, block in enumerate(m.model.layers):
        attn = block.self_attn
        H, K, d = attn.shape
        q_BHd, k_BKd, v_BKd = engine_module._project(attn, block.input_layernorm(x), cos, sin)
        k_cache, v_cache = cache[i, 0], cache[i, 1]
        k_cache[rows_B, :, pos_B] = k_BKd
        v_cache[rows_B, :, pos_B] = v_BKd
        q = q_BHd.reshape(B, K, H // K, d)
        scores = (q @ k_cache[:B, :, :S].transpose(-1, -2)).float() * d ** -0.5  # [B, K, G, S]
        if bias is not None:
            scores = scores + bias
        out = torch.softmax(scores, dim=-1).to(q.dtype) @ v_cache[:B, :, :S]  # [B, K, G, d]
        x = engine_module._finish(block, x, out.reshape(B, -1))
    self.stats.decode_positions += B
    self.stats.decode_steps += 1
    return self._logits(x)


class _FrozenHeadTokenLogProbs(torch.autograd.Function):
    """linear_token_log_probs for a frozen head (LoRA): d log p(t_n) / d h_n =
    (onehot(t_n) - softmax(z_n)) @ W does not depend on the incoming gradient, which only
    scales each row; so forward computes it once, block by block, while the logits are in
    hand, and backward is one multiply: two head matmuls a block instead of three (the
    shipped backward recomputes the logits)."""

    @staticmethod
    def forward(ctx, h_ND, w_VD, targets_N, rows):
        wc_VD = w_VD.to(h_ND.dtype)
        out = []
        grad = torch.empty_like(h_ND) if h_ND.requires_grad else None
        for sl in losses._blocks(h_ND.shape[0], rows):
            z = losses._block_logits(h_ND, wc_VD, sl)
            t = targets_N[sl].long()
            picked = z.gather(-1, t[:, None])[:, 0]
            lse, sums = losses._shifted_exp_(z)
            out.append(picked - lse)
            if grad is not None:
                g = z.div_(sums[:, None]).neg_()  # -softmax, in place of the logits
                g.scatter_add_(-1, t[:, None], torch.ones_like(g[:, :1]))
                grad[sl] = g.to(h_ND.dtype) @ wc_VD
        ctx.save_for_backward(grad)
        return torch.cat(out)

    @staticmethod
    def backward(ctx, grad_N):
        (grad,) = ctx.saved_tensors
        return grad * grad_N[:, None].to(grad.dtype), None, None, None


def head_logp(block_bytes):
    original = losses.linear_token_log_probs

    def lp(h, w, t):
        if w.requires_grad or not torch.is_grad_enabled():
            return original(h, w, t, block_bytes=block_bytes)
        rows = losses._rows_per_block(w.shape[0], block_bytes)
        return _FrozenHeadTokenLogProbs.apply(h, w, t, rows)
    return lp


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
    D = model_module.Decoder
    ce, lp = ce_blocks(16 << 20)
    table = {
        "base": [],
        "split": [(attention, "documents", documents_split)],
        "attn-f32": [(attention, "documents", documents_f32)],
        "lora-addmm": [(model_module.Linear, "forward", lora_forward)],
        "ce-16MiB": [(model_module, "linear_cross_entropy", ce), (model_module, "linear_token_log_probs", lp)],
        "trim": [(D, "_fields", trimmed_fields(D._fields)), (D, "log_probs_packed", trimmed_log_probs(D.log_probs_packed))],
        "pick": [(engine_module, "_pick", pick_inverse_cdf)],
        "frozen-head": [(model_module, "linear_token_log_probs", head_logp(losses.BLOCK_BYTES))],
        "decode-bmm": [(engine_module.Engine, "_decode", decode_bmm)],
    }
    if name == "all5":  # the first five together
        return [c for k in ("attn-f32", "lora-addmm", "ce-16MiB", "trim", "pick") for c in table[k]]
    if name == "all":  # all5 with the frozen-head log-probabilities (in 16 MiB blocks)
        changes = [c for k in ("attn-f32", "lora-addmm", "trim", "pick") for c in table[k]]
        return changes + [(model_module, "linear_cross_entropy", ce),
                          (model_module, "linear_token_log_probs", head_logp(16 << 20))]
    if name == "all+decode":
        return variant_changes("all") + table["decode-bmm"]
    return table[name]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", default="sft-lora", choices=compare.METHODS)
    ap.add_argument("--size", default="7m", choices=list(compare.SIZES))
    ap.add_argument("--dtype", default="bf16", choices=list(compare.DTYPES))
    ap.add_argument("--variants", nargs="+", default=["base", "split", "attn-f32", "lora-addmm", "ce-16MiB", "trim",
                                                     "pick", "frozen-head", "all"])
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
