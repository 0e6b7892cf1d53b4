"""Pipeline stages on this machine: what two stages hold and how fast they step, against one
process and against two whole copies (data parallel), on the same rows.

    python bench/pipeline.py --out bench/pipeline.md        # ~3 min on two cores
    python bench/pipeline.py --steps 2 --out -             # smoke

Every mode trains the same random Llama (full fine-tuning, float32, AdamW) on the same 8
packed rows a step:

  one process        accumulate 8, one thread (and again with two threads)
  two copies         two processes (torchrun), four rows each, gradients summed
  two stages         two processes, each half the blocks (`linnet.torch.pipeline`),
                     the step's 8 rows as micro-batches on GPipe, then on 1F1B, then
                     on interleaved 1F1B and zero bubble (two chunks of blocks a process)

Reported: the median seconds a step after a warm-up step, tokens a second, the bytes of
parameters, gradients and AdamW state each process holds (counted from its tensors: the
largest process's), and each process's peak resident memory over the training steps (the
high-water mark reset after the model is built, since every process builds the whole model
before a pipeline drops the other stage's blocks). One thread a process.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from _common import KEEP, command, machine, peak_rss, reset_peak, run_child, send_result, table, write_report

HERE = os.path.abspath(__file__)
SIZE = dict(hidden=256, intermediate=704, layers=8, heads=4, kv_heads=2, head_dim=64, vocab=8192)
ROWS, TOKENS = 8, 256  # a step: 8 packed rows of 256 positions
MODES = [("one process, 1 thread", 1, "one", 1), ("one process, 2 threads", 1, "one", 2),
         ("two copies (data parallel)", 2, "copies", 1), ("two stages, GPipe", 2, "gpipe", 1),
         ("two stages, 1F1B", 2, "1f1b", 1), ("two stages, interleaved 1F1B", 2, "interleaved", 1),
         ("two stages, zero bubble", 2, "zero-bubble", 1)]


def _rows(steps: int):
    import numpy as np

    from linnet.packing import Example, pack

    g = np.random.default_rng(0)
    docs = [Example.plain(g.integers(3, SIZE["vocab"], int(n)).tolist()) for n in g.integers(32, 250, 40 * steps)]
    rows = list(pack(docs, tokens=TOKENS))
    assert len(rows) >= ROWS * steps, "too few rows"
    return rows[: ROWS * steps]


def child(mode: str, steps: int, threads: int) -> None:
    import torch

    from linnet import nest
    from linnet.torch import pipeline
    from linnet.torch.distributed import join, leave, world
    from linnet.train import train

    torch.set_num_threads(threads)
    join()
    rank, processes = world()
    model = nest.load(nest.resolve("debug").replace(**SIZE, tied_embeddings=False), weights="random", seed=0,
                      trainable=True)
    rows, accumulate = _rows(steps), ROWS
    if mode == "copies":
        rows, accumulate = rows[rank::processes], ROWS // processes
    elif mode != "one":
        pipeline(model, schedule=mode)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    reset_peak()
    history = train(model, rows, optimizer=optimizer, steps=steps, accumulate=accumulate, clip=1.0)
    held = sum(p.numel() * 4 * 4 for p in model.parameters())  # weights, gradients, AdamW's two moments
    result = torch.tensor([held, peak_rss()], dtype=torch.float64)
    if processes > 1:
        torch.distributed.all_reduce(result, op=torch.distributed.ReduceOp.MAX)
    if rank == 0:
        times = [s.seconds for s in history.steps[1:]]
        send_result({"seconds": statistics.median(times), "tokens": ROWS * TOKENS, "held": result[0].item(),
                     "peak": result[1].item(), "loss": history.steps[-1].loss})
    if processes > 1:
        leave()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6, help="steps a mode (the first is a warm-up)")
    p.add_argument("--out", default="bench/pipeline.md", help="the report; - prints only")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args.child, args.steps, args.threads)
    started = time.monotonic()
    results = {}
    for label, processes, mode, threads in MODES:
        launch = ["-m", "torch.distributed.run", f"--nproc-per-node={processes}", "--master-port=29517"] \
            if processes > 1 else []
        r = run_child([*launch, HERE, "--child", mode, "--steps", args.steps, "--threads", threads],
                      env={"OMP_NUM_THREADS": str(threads)})
        if "error" in r:
            sys.exit(f"{label}: {r['error']}\n{r['log']}")
        results[label] = r
        print(f"{label}: {r['seconds']:.2f} s a step", file=sys.stderr)
    base = results[MODES[0][0]]["seconds"]
    rows = [[label, processes, f"{r['seconds']:.2f}", f"{r['tokens'] / r['seconds']:,.0f}",
             f"{base / r['seconds']:.2f}x", f"{r['held'] / 2**20:.0f}", f"{r['peak'] / 2**20:.0f}", f"{r['loss']:.4f}"]
            for (label, processes, _, _), r in zip(MODES, results.values())]
    params = SIZE["vocab"] * SIZE["hidden"] * 2 + SIZE["layers"] * (
        SIZE["hidden"] * SIZE["head_dim"] * (2 * SIZE["heads"] + 2 * SIZE["kv_heads"]) + 3 * SIZE["hidden"] * SIZE["intermediate"])
    text = "\n".join([
        "# Pipeline stages against one process and two copies (CPU)",
        "",
        f"- Command: `{command(__file__, argv)}`",
        f"- Machine: {machine()}",
        f"- Model: random Llama, {params / 1e6:.1f}M parameters ({', '.join(f'{k}={v}' for k, v in SIZE.items())}), "
        f"full fine-tuning in float32, AdamW; a step is {ROWS} packed rows of {TOKENS} positions "
        f"({ROWS * TOKENS:,} positions), the same rows in every mode.",
        f"- Method: median seconds a step over steps 2-{args.steps}; `held` counts the parameters, gradients and "
        "AdamW moments of the largest process (4 bytes each); `peak RSS` is the largest process's resident "
        "high-water mark over the training steps (reset after building the model). One run a mode, in turn. "
        f"Run time: {time.monotonic() - started:.0f} s.",
        "",
        *table(["mode", "processes", "s a step", "positions/s", "speed vs one thread", "held MiB", "peak RSS MiB",
                "last loss"], rows, "lrrrrrrr"),
        "",
        "The last loss is the same in every mode up to rounding: every mode takes the same steps.",
    ])
    write_report(text, args.out, keep=KEEP)


if __name__ == "__main__":
    main()
