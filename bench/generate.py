"""How many tokens/s does `linnet.serve.Engine` generate against transformers' `generate`, same weights and batch?

    python bench/generate.py                  # bench/generate.md: ~34M-parameter Llama, f32 and bf16; ~5 min
    python bench/generate.py --quick          # smaller model, fewer tokens: ~30 s
    python bench/generate.py --quick --dtypes float32 --repeats 1 --new 4 --out -   # smoke: seconds
    python bench/generate.py --out -          # print only, write no markdown
    python bench/generate.py --device cuda    # on a GPU (both sides on it)

A random Llama (LlamaConfig, no eos so both sides run the full length) is saved to a
temporary directory; transformers loads it with `from_pretrained`, linnet with
`nest.load`. Cases:

  greedy        B prompts of equal length, greedy, `max_new_tokens` each. Both sides
                must produce the same tokens in f32 (checked, reported).
  greedy/mixed  B prompts of different lengths (transformers left-pads them; linnet packs
                them in prefill and masks per row in decode).
  group         G prompts x n completions, temperature 1, no top-k/top-p:
                `engine.sample(prompts, n)` (one prefill per prompt) against
                `generate(do_sample=True, num_return_sequences=n)`.

tokens/s counts generated tokens (prompt tokens excluded) over the whole call, prefill
included. Each case runs once to warm up, then the two libraries alternate (A B A B …)
`--repeats` times and the median is reported: the machines are shared and drift ±25%,
so read the ratio rather than the absolute numbers.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import tempfile
import time

import torch
from _common import KEEP, command, machine, table, write_report


def build(directory: str, quick: bool) -> dict:
    import transformers

    size = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=8192) if quick else \
        dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=6, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=16384)
    config = transformers.LlamaConfig(**size, max_position_embeddings=2048, bos_token_id=None,
                                      eos_token_id=None, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.generation_config.eos_token_id = None
    model.save_pretrained(directory)
    return size


def prompts_of(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def left_padded(prompts, device):
    T = max(map(len, prompts))
    ids = torch.zeros(len(prompts), T, dtype=torch.long)
    mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, T - len(p):] = torch.tensor(p)
        mask[i, T - len(p):] = 1
    return ids.to(device), mask.to(device)


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def run_case(name, engines, hf, prompts, n, new, sample, device, repeats, exact=True):
    """engines: side name -> Engine (linnet's eager engine, and its compiled one with --compile).
    exact: float32, where the compiled engine must choose the eager one's greedy tokens (in
    bfloat16 its fused kernels round otherwise, and a near-tie can part)."""
    ids, mask = left_padded(prompts, device)
    T = ids.shape[1]

    def ours(engine):
        done = engine.sample(prompts, n, max_new_tokens=new, temperature=1.0 if sample else 0.0, stop=(),
                             seed=0)
        sync(device)
        return [c.tokens for c in done]

    def theirs():
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                              do_sample=sample, num_return_sequences=n, top_k=0 if sample else None,
                              top_p=1.0, temperature=1.0, pad_token_id=0)
        sync(device)
        return out[:, T:].tolist()

    sides = {side: functools.partial(ours, engine) for side, engine in engines.items()}
    sides["transformers"] = theirs
    got = {side: fn() for side, fn in sides.items()}  # warm up (compiles), and check agreement
    b = got["transformers"]
    tokens = sum(map(len, b))
    assert all(sum(map(len, a)) == tokens == len(prompts) * n * new for a in got.values()), name
    a = got["linnet"]
    same = "yes" if a == b else f"{sum(x == y for x, y in zip(a, b))}/{len(a)} rows"
    if "compiled" in got and not sample and exact:
        assert got["compiled"] == a, f"{name}: the compiled engine chose other greedy tokens than the eager one"
    times = {side: [] for side in sides}
    for _ in range(repeats):
        for side, fn in sides.items():
            start = time.perf_counter()
            fn()
            times[side].append(time.perf_counter() - start)
    rate = {side: tokens / statistics.median(v) for side, v in times.items()}
    return dict(case=name, rows=len(prompts) * n, prompt=f"{min(map(len, prompts))}-{max(map(len, prompts))}",
                new=new, tokens=tokens, **rate, same=same if not sample else "n/a (sampled)")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smaller model and fewer tokens")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, default=8, help="prompts in the greedy cases")
    ap.add_argument("--new", type=int, default=None, help="max_new_tokens (default 64; --quick 32)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: on a shared 2-core machine a second thread spin-waits)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--compile", action="store_true",
                    help="also time the compiled engine (Engine(compile=True); its compile time is in the warm-up)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "generate.md"),
                    help="markdown file to write ('-': print only)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    import transformers

    from linnet import nest
    from linnet.serve import Engine

    new = args.new or (32 if args.quick else 64)
    rows = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as directory:
        size = build(directory, args.quick)
        vocab = size["vocab_size"]
        params = None
        for dtype in args.dtypes:
            td = getattr(torch, dtype)
            engines = {"linnet": Engine(nest.load(directory, device=args.device, dtype=dtype))}
            if args.compile:
                engines["compiled"] = Engine(nest.load(directory, device=args.device, dtype=dtype), compile=True)
            params = sum(p.numel() for p in engines["linnet"].model.parameters())
            hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=td).to(args.device).eval()
            cases = [
                ("greedy", prompts_of([32] * args.batch, vocab), 1, False),
                ("greedy/mixed", prompts_of([8 + 56 * i // max(args.batch - 1, 1) for i in range(args.batch)], vocab, 1),
                 1, False),
                ("group", prompts_of([48, 20], vocab, 2), max(args.batch // 2, 1), True),
            ]
            for name, prompts, n, sample in cases:
                r = run_case(name, engines, hf, prompts, n, new, sample, args.device, args.repeats, dtype == "float32")
                r["dtype"] = dtype
                rows.append(r)
                compiled = f"  compiled {r['compiled']:8.1f} tok/s" if args.compile else ""
                print(f"{dtype:9} {name:13} rows {r['rows']:3} prompt {r['prompt']:>6} new {new}: "
                      f"linnet {r['linnet']:8.1f} tok/s{compiled}  transformers {r['transformers']:8.1f} tok/s  "
                      f"ratio {r['linnet'] / r['transformers']:.2f}x  same tokens: {r['same']}", flush=True)
            del engines, hf
    seconds = time.perf_counter() - start

    lines = [
        "# Generation: linnet Engine against transformers `generate`",
        "",
        "Produced by `bench/generate.py`; numbers are measured, not edited.",
        "",
        f"- Command: `{command(__file__, argv)}`",
        f"- Machine: {machine()}; transformers {transformers.__version__}; "
        f"{args.threads} threads; device {args.device}. **Shared machine**: other jobs ran at the same "
        "time, so absolute numbers drift (±25%); the ratio of interleaved runs is the result.",
        f"- Model: random Llama, {params / 1e6:.1f}M parameters ({', '.join(f'{k}={v}' for k, v in size.items())}), "
        "no eos (every row runs the full length).",
        f"- Method: tokens/s = generated tokens / wall time of one call (prefill included), median of "
        f"{args.repeats} interleaved runs after one warm-up. Greedy rows check that both produce the same tokens.",
        f"- Run time: {seconds:.0f} s",
        "",
        *table(["dtype", "case", "rows", "prompt tokens", "new tokens", "linnet tok/s", "transformers tok/s",
                "linnet / transformers", "same tokens"]
               + (["compiled tok/s", "compiled / transformers"] if args.compile else []),
               [[r["dtype"], r["case"], r["rows"], r["prompt"], r["new"], f"{r['linnet']:.1f}", f"{r['transformers']:.1f}",
                 f"{r['linnet'] / r['transformers']:.2f}x", r["same"]]
                + ([f"{r['compiled']:.1f}", f"{r['compiled'] / r['transformers']:.2f}x"] if args.compile else [])
                for r in rows]),
        "",
        "Cases: `greedy` B equal-length prompts; `greedy/mixed` B prompts of different lengths (transformers "
        "left-pads); `group` prompts x n completions sampled at temperature 1 (linnet passes each prompt once; "
        "transformers' `num_return_sequences` expands the batch before prefill).",
        "",
        "`same tokens`: in float32 both sides must pick the same greedy tokens. In bfloat16 they round "
        "differently (packed prompts and per-row masks here, left padding there; other kernel shapes), so a "
        "greedy path can part at a near-tie and the rest of that row differs.",
        "",
    ]
    write_report("\n".join(lines), args.out, keep=KEEP)


if __name__ == "__main__":
    main()
