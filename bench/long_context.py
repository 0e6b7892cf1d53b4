"""Peak memory and speed of one long row on CPU, with the planner's prediction beside each.

    python bench/long_context.py                        # bench/long_context.md: 4K-16K, whole MLP and tiles
    python bench/long_context.py --seq 4096 8192 --out -  # a quick look: print only

Each configuration is bench/plan_vs_measured.py's child in a fresh process: a small Llama
card (20m: 256 wide, 4 blocks, 32K vocabulary) built with `nest.load(card,
weights="random", trainable=..., activation_checkpointing=...)`, one packed row of `seq`
random tokens (one document: the causal work of the whole row), `linnet.train.train` for
`--steps` AdamW steps; the MLP whole or in tiles (`model.tile_mlp(positions)`,
`training.mlp_tile`). Memory is the resident set's peak above the baseline taken before the
model is built (glibc's mmap threshold at 64 KiB, so RSS follows the live tensors; see
plan_vs_measured.py); tokens/s is the row's length over the last step's seconds. The
planner's peak is `linnet plan` for the same run (`--context-length S --mlp-tile T
--activation-checkpointing full --chunked-loss --device cpu --dtype f32`).

The longest row is also split over `--context` processes (context parallel, torchrun, one
thread each, the last tile setting): the peak is the fullest process's above its own
baseline, beside the planner's with `--context N --gpus N`.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from _common import command, machine, peak_rss, reset_peak, rss, run_child, send_result, table, write_report
from plan_vs_measured import GB, card, malloc_env, plan_settings, warm_up

HERE = os.path.dirname(os.path.abspath(__file__))
KEEP = "<!-- everything below this line is kept when the script rewrites the file -->"


def planned(size: str, method: str, checkpointing: str, seq: int, tile: int | None, context: int = 1):
    from linnet import plan

    settings = plan_settings(method, checkpointing, "f32", seq, mlp_tile=tile)
    if context > 1:
        settings.update(context=context, gpus=context)
    return plan.estimate(card(size), **plan.plan_inputs(settings))


def context_child(spec: dict) -> None:
    """One process of a context group under torchrun: plan_vs_measured's run (the same
    card, row and AdamW steps) with the row's positions split over the group; the first
    process sends every process's RSS peak above its own baseline and the last step's time."""
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from linnet import nest
    from linnet.torch.distributed import join, leave
    from linnet.train import Example, pack, train

    join()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    rows = [next(pack([Example.plain(rng.integers(3, 32000, spec["seq"]))], tokens=spec["seq"]))
            for _ in range(spec["steps"])]
    warm_up(torch, "full")
    base = rss()
    reset_peak()
    model = nest.load(card(spec["card"]), weights="random", trainable=True, dtype="float32",
                      activation_checkpointing=True)
    model.tile_mlp(spec["tile"])
    model.split_context(init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("context",)))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.0)
    steps = []
    train(model, rows, optimizer=optimizer, steps=spec["steps"], on_step=lambda s: steps.append(s.seconds))
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, peak_rss() - base)
    if dist.get_rank() == 0:
        send_result({"peaks": peaks, "seconds": steps})
    leave()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--card", default="20m", choices=["20m", "60m", "150m"])
    ap.add_argument("--method", default="full", choices=["full", "lora"])
    ap.add_argument("--checkpointing", default="full", choices=["none", "full", "selective"])
    ap.add_argument("--seq", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--tiles", nargs="+", default=["none", "2048"], help="MLP tiles: none (whole) or positions")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, nargs="*", default=[2],
                    help="also split the longest row over this many processes (context parallel), one thread each")
    ap.add_argument("--out", default=os.path.join(HERE, "long_context.md"))
    ap.add_argument("--context-child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.context_child:
        return context_child(json.loads(args.context_child))

    start = time.perf_counter()
    rows = []
    for seq in args.seq:
        for tile in [None if t == "none" else int(t) for t in args.tiles]:
            r = run_child([os.path.join(HERE, "plan_vs_measured.py"), "--child", "--card", args.card, "--method",
                           args.method, "--checkpointing", args.checkpointing, "--dtype", "f32", "--seq", seq,
                           "--threads", args.threads, "--steps", args.steps, "--optimizer", "adamw",
                           "--no-profile", *(["--mlp-tile", tile] if tile else [])],
                          env=malloc_env(64 * 1024))
            if "error" in r:
                raise SystemExit(f"seq {seq}, tile {tile}: {r['error']}\n{r['log']}")
            p = planned(args.card, args.method, args.checkpointing, seq, tile)
            last = r["steps"][-1]
            measured = r["measured"]
            rows.append([f"{seq:,}", tile or "whole", f"{last['seconds']:.1f} s", f"{seq / last['seconds']:,.0f}",
                         f"{measured / GB:.3f}", f"{p.total / GB:.3f}", f"{(p.total - measured) / measured * 100:+.0f}%",
                         max(last["phases"], key=last["phases"].get), p.peak_phase])
            print("  " + " | ".join(map(str, rows[-1])), flush=True)
    for context in args.context:
        seq, tile = max(args.seq), None if args.tiles[-1] == "none" else int(args.tiles[-1])
        spec = dict(card=args.card, seq=seq, steps=args.steps, tile=tile)
        r = run_child(["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={context}", __file__,
                       "--context-child", json.dumps(spec)], env={**malloc_env(64 * 1024), "OMP_NUM_THREADS": "1"})
        if "error" in r:
            raise SystemExit(f"seq {seq}, context {context}: {r['error']}\n{r['log']}")
        p = planned(args.card, args.method, args.checkpointing, seq, tile, context)
        measured, last = max(r["peaks"]), r["seconds"][-1]
        rows.append([f"{seq:,} over {context} processes", tile or "whole", f"{last:.1f} s",
                     f"{seq / last:,.0f}", f"{measured / GB:.3f}", f"{p.total / GB:.3f}",
                     f"{(p.total - measured) / measured * 100:+.0f}%", "-", p.peak_phase])
        print("  " + " | ".join(map(str, rows[-1])), flush=True)
    minutes = (time.perf_counter() - start) / 60
    lines = [
        "# One long row on CPU: peak memory and speed, measured and planned",
        "",
        "Produced by `bench/long_context.py`; numbers are measured, not edited.",
        "",
        f"- Command: `{command(__file__)}` ({minutes:.1f} min, {time.strftime('%Y-%m-%d')})",
        f"- Machine: {machine()}; {args.threads} threads.",
        f"- Work: card {args.card} (`bench/plan_vs_measured.py`'s), {args.method} fine-tuning, float32, "
        f"activation checkpointing {args.checkpointing}, one row of one document a step, AdamW, "
        f"{args.steps} steps (the last one timed; the peak over all).",
        "",
        *table(["positions", "MLP", "step", "tokens/s", "peak (GB)", "planned (GB)", "error", "peak phase",
                "planned phase"], rows, "rrrrrrr"),
    ]
    write_report("\n".join(lines), args.out, keep=KEEP)


if __name__ == "__main__":
    main()
