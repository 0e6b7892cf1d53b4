"""How close is `linnet plan`'s memory per process to what split (tensor-parallel) and pipelined
linnet training steps hold on CPU, process by process?

    python bench/plan_parallel.py                 # bench/plan_parallel.md (~3 CPU-min)
    python bench/plan_parallel.py --out -         # print only

Each row runs in fresh processes (two, or four for split stages and for two copies of sharded
stages; forked, one thread each, one gloo group), built as
`linnet sft` builds them (`linnet.commands.runs.load_model`): a ("copies", "stages", "split")
mesh, `nest.load(..., tensor_parallel=mesh["split"])` or `pipeline(model, mesh["stages"],
schedule=1f1b when the step has as many micro-batches as stages, else gpipe; or interleaved)`, then LoRA
(rank 16 on every projection) or every weight trained (two copies of stages sharded over them:
`nest.load(..., pipeline=mesh["stages"], fully_shard=True, lora=)`), AdamW, and
`linnet.train.train(..., steps=2, accumulate=M)` on packed rows of `seq` random tokens.
Each process measures the most bytes live in PyTorch's CPU allocator at once during step 2
(the profiler's allocation events, from a baseline taken before the model is built:
bench/plan_vs_measured.py's tensor peak), and its own states (the parameters it holds, their
gradients and AdamW's moments, counted from the tensors). The planner is asked for the same
run (`linnet.plan.estimate` with `split`, `pipeline`, `pipeline_schedule`, `accumulation`, and `gpus` and
`shard` for sharded stages) and its per-process
figures (`Plan.processes`) are set beside each process's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from _common import KEEP, command, machine, table, write_report
from plan_vs_measured import CARDS, GB, LORA_PATTERNS, MARK, RANK, card, err, tensor_peaks, warm_up

# (copies, split, stages, micro-batches a step, method, checkpointing, pipeline schedule): two copies
# are two pipelines whose stages are sharded over them (fsdp)
CONFIGS = [(1, 2, 1, 1, m, k, "1f1b") for m in ("full", "lora") for k in ("none", "full")] + \
          [(1, 1, 2, n, m, k, "1f1b") for n in (1, 2, 4) for m in ("full", "lora") for k in ("none", "full")] + \
          [(1, 2, 2, 2, m, k, "1f1b") for m, k in (("full", "none"), ("lora", "full"))] + \
          [(1, 1, 2, n, m, "none", "interleaved") for n in (2, 4) for m in ("full", "lora")] + \
          [(1, 1, 2, 4, "full", "full", "interleaved")] + \
          [(1, 1, 2, n, m, "none", "zero-bubble") for n in (2, 4) for m in ("full", "lora")] + \
          [(2, 1, 2, 2, m, k, "1f1b") for m, k in (("full", "none"), ("full", "full"), ("lora", "none"))]


def settings(copies, split, stages, micro, method, checkpointing, schedule, seq) -> dict:
    """`linnet plan` settings (by their Python names, `plan.plan_inputs`) for the run."""
    return {"method": method, "rank": RANK, "targets": "all-linear", "tokens": seq, "micro_batch_size": 1,
            "activation_checkpointing": checkpointing, "chunked_loss": True, "dtype": "f32", "device": "cpu",
            "grad_dtype": "fp32", "accumulate": micro, "split": split, "pipeline": stages,
            "gpus": copies * split * stages, "shard": "fsdp" if copies > 1 else "none", "pipeline_schedule": schedule}


def run_rank(rank: int, copies: int, split: int, stages: int, micro: int, method: str, checkpointing: str,
             schedule: str, seq: int, card_name: str) -> dict:
    import numpy as np
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.profiler import ProfilerActivity, profile

    from linnet import nest
    from linnet.torch import pipeline
    from linnet.train import Example, pack, train

    torch.manual_seed(0)
    vocab = CARDS[card_name]["vocab"]
    rng = np.random.default_rng(0)
    rows = [next(pack([Example.plain(rng.integers(3, vocab, seq))], tokens=seq)) for _ in range(2 * micro)]
    warm_up(torch, method)
    mesh = init_device_mesh("cpu", (copies, stages, split), mesh_dim_names=("copies", "stages", "split"))
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    prof.start()
    with torch.profiler.record_function(f"{MARK}0:build"):
        pass
    sharded = dict(pipeline=mesh["stages"], fully_shard=True, pipeline_schedule=schedule,
                   lora=None if method == "full" else dict(patterns=LORA_PATTERNS, rank=RANK)) if copies > 1 else {}
    model = nest.load(card(card_name), weights="random", trainable=method == "full", dtype="float32",
                      activation_checkpointing=checkpointing == "full",
                      tensor_parallel=mesh["split"] if split > 1 and stages == 1 else None, **sharded)
    if stages > 1 and copies == 1:
        pipeline(model, mesh["stages"], schedule=schedule if micro >= stages else "gpipe",
                 tensor_parallel=mesh["split"] if split > 1 else None)
    if method != "full" and copies == 1:
        model.add_lora(LORA_PATTERNS, rank=RANK)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0)

    step = [1]

    def mark(phase):  # forward and backward, then the optimizer's step, then the rest (zero_grad, bookkeeping)
        with torch.profiler.record_function(f"{MARK}{step[0]}:{phase}"):
            pass

    def next_step(_):
        step[0] += 1
        mark("passes")

    mark("passes")
    optimizer.register_step_pre_hook(lambda *_: mark("optimizer"))
    optimizer.register_step_post_hook(lambda *_: mark("rest"))
    train(model, rows, optimizer=optimizer, steps=2, accumulate=micro, on_step=next_step)
    prof.stop()
    peaks = tensor_peaks(prof, False, -1)

    def local_bytes(tensors):
        return sum(t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes for t in tensors)

    return {"rank": rank, "params": sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                                        for p in model.parameters()),
            "weights": local_bytes(model.parameters()), "gradients": local_bytes(params),  # f32 as the trained weights; set to None after each step
            "optimizer": local_bytes(t for s in optimizer.state.values() for t in s.values()
                                     if torch.is_tensor(t) and t.dim() > 0),
            "peak": peaks["steps"][1]["peak"] if peaks else None,
            "phases": peaks["steps"][1]["phases"] if peaks else None}


def planned(copies, split, stages, micro, method, checkpointing, schedule, seq, card_name) -> list[dict]:
    from linnet import plan

    p = plan.estimate(card(card_name), **plan.plan_inputs(settings(copies, split, stages, micro, method,
                                                                   checkpointing, schedule, seq)))
    return [{"name": part.name, "total": max(part.phases.values()), "states": part.states.total}
            for part in p.processes]


def main(argv=None) -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from conftest import in_processes

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--card", default="20m", choices=list(CARDS))
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "plan_parallel.md"))
    ap.add_argument("--json", metavar="PATH", help="also write the raw results as JSON")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    rows, raw = [], []
    print(f"{machine()}; one thread a process", flush=True)
    for config in CONFIGS:
        copies, split, stages, micro, method, checkpointing, schedule = config
        t0 = time.perf_counter()
        measured = in_processes(run_rank, *config, args.seq, args.card, processes=copies * split * stages)
        plans = planned(*config, args.seq, args.card)
        raw.append({"config": list(config), "measured": measured, "planned": plans})
        for m in sorted(measured, key=lambda m: m["rank"]):
            p = plans[m["rank"] // split % stages] if stages > 1 else plans[0]
            states = m["weights"] + m["gradients"] + m["optimizer"]
            run = ", ".join(([f"split {split}"] if split > 1 else [])
                            + ([f"{stages} stages{'' if schedule == '1f1b' else ' ' + schedule}, {micro} "
                                 f"micro-batch{'es' * (micro > 1)}"] if stages > 1 else [])
                            + ([f"sharded over {copies} copies"] if copies > 1 else []))
            row = [run,
                   method, checkpointing, str(m["rank"]), p["name"], f"{p['states'] / GB:.4f}",
                   f"{states / GB:.4f}", err(p["states"], states), f"{p['total'] / GB:.3f}",
                   "—" if m["peak"] is None else f"{m['peak'] / GB:.3f}", err(p["total"], m["peak"])]
            rows.append(row)
            print("  ".join(row), f"({time.perf_counter() - t0:.0f} s)", flush=True)
    header = ["run", "method", "checkpointing", "process", "planned as", "states planned GB", "states held GB",
              "error", "peak planned GB", "peak measured GB", "error"]
    report = "\n".join([
        "# The planner's memory per process against split and pipelined linnet steps (CPU)", "",
        "Produced by `bench/plan_parallel.py`; numbers are measured, not edited. GB = 10^9 bytes.", "",
        f"- Command: `{command(__file__, argv)}`",
        f"- Machine: {machine()}; one thread a process. Run time: {time.perf_counter() - start:.0f} s.",
        f"- Model: llama-{args.card} ({', '.join(f'{k}={v}' for k, v in CARDS[args.card].items())}), float32, rows "
        f"of {args.seq} tokens, AdamW; LoRA rank {RANK} on every projection.",
        "- **sharded over 2 copies**: two pipelines (four processes), each stage's blocks sharded over its two "
        "copies (`training.shard: fsdp`); planned with `gpus=4, shard='fsdp'`.",
        "- **states held** = the process's parameters, gradients and AdamW moments, counted from its tensors after "
        "step 2 (a gradient as large as its f32 weight: linnet frees them after each step). **peak measured** = the most bytes live in PyTorch's CPU allocator during step 2 (profiler "
        "allocation events, from before the model was built). **planned** = `linnet.plan.estimate(..., split=, "
        "pipeline=, accumulation=)`, the process's own figures (`Plan.processes`).", "",
        *table(header, rows, "     rrrrrr"), ""])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=1)
    write_report(report, args.out, keep=KEEP)


if __name__ == "__main__":
    main()
