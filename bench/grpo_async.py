"""How much faster is a GRPO step when sampling runs ahead of training (grpo.max_staleness),
and how do both compare with TRL's GRPOTrainer on the same work?

bench/compare.py's GRPO work (its model and LoRA adapter, the reward: the share of
completion tokens in the lower half of the vocabulary), 4 prompts x 8 completions x 64 new
tokens a step, float32, AdamW at 1e-3, every case given the same two threads, at two prompt
lengths: short (a median of 10 tokens) and compare.py's (a median of 60):

  sync      linnet, max_staleness 0: each step samples, then trains, every op on 2 threads
  sync1     the same on 1 thread: what each side costs alone on one core. Half their sum is the
            fastest step any overlap of the two could reach (both cores busy all the time), so
            the report states the bound: sync's step over that
  ahead     linnet, max_staleness 1: a sampler thread samples step t+1 while step t trains, 1 thread a side
  trl       TRL's GRPOTrainer (plain `generate`, compare.py's settings), its micro-batch the fastest
            of --trl-micro, searched first with one run each at each prompt length

Each case runs in a fresh process, the cases' order reversed each round. Reported: the
median step after the first two, the step-rate ratios, each side's busy share (ahead), and
each step's mean reward, so the reward curves can be compared. TRL's asynchronous trainer
(trl.experimental.async_grpo) samples through a vLLM server, which has no CPU build here,
so it is not among the cases.

    python bench/grpo_async.py                       # 7m, both prompt lengths, 10 steps, 2 rounds; writes bench/grpo_async.md
    python bench/grpo_async.py --size 7m 60m --cases sync ahead   # linnet's two alone
    python bench/grpo_async.py --prompts short --steps 4 --repeats 1 --trl-micro 8 --out -   # a quick look
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _common import KEEP, alternate, command, machine, send_result, table, write_report

HERE = Path(__file__).resolve().parent
CASES = {"sync": 0, "sync1": 0, "ahead": 1, "trl": None}
PROMPTS = {"short": 10, "long": 60}  # median prompt tokens


def child(spec: dict) -> None:
    """One case in this process: train, then send each step's seconds and metrics."""
    import torch

    if spec["case"] == "trl":
        return trl_child(spec)

    from linnet import nest
    from linnet.serve import Engine
    from linnet.torch.weights import bind_weights
    from linnet.train.grpo import Prompt, grpo

    torch.set_num_threads(1 if spec["case"] == "sync1" else 2)
    torch.manual_seed(0)
    data = json.loads(Path(spec["data"]).read_text())
    model = nest.load(spec["model_dir"], dtype="float32", trainable=False)
    model.add_lora([f"model.layers.*.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                          "up_proj", "down_proj")], rank=16, alpha=32)
    bind_weights(model, spec["adapter_dir"], strict=False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.0)
    engine = Engine(nest.load(spec["model_dir"], dtype="float32"))
    target = spec["vocab"] // 2

    def lower_half(prompt, completion):
        return sum(1 for t in completion if 3 <= t < target) / max(len(completion), 1)

    steps, per_step = spec["steps"], 4
    prompts = [Prompt(p) for p in data["prompt"][:steps * per_step]]
    records = []
    grpo(model, engine, prompts, lower_half, optimizer=optimizer, steps=steps, prompts_per_step=per_step, group=8,
         max_new_tokens=64, temperature=1.0, stop=(2,), tokens=4096, seed=0, verbose=False,
         max_staleness=CASES[spec["case"]], correction_cap=2.0,
         on_step=lambda r: records.append((r.seconds, dict(r.metrics))))
    send_result(dict(case=spec["case"], seconds=[s for s, _ in records], metrics=[m for _, m in records]))


def trl_child(spec: dict) -> None:
    """TRL's GRPOTrainer on the case's work, through bench/compare.py's runner (its settings)."""
    import torch

    sys.path.insert(0, str(HERE))
    import datasets
    import transformers
    from _compare_run import Clock, run_trl

    torch.set_num_threads(2)
    torch.manual_seed(0)
    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    clock = Clock()
    with tempfile.TemporaryDirectory() as scratch:
        run_trl(dict(method="grpo", dtype="float32", model_dir=spec["model_dir"], adapter_dir=spec["adapter_dir"],
                     scratch=scratch, steps=spec["steps"], lr=1e-3, seed=0, prompts_per_step=4, group=8,
                     max_new_tokens=64, vocab=spec["vocab"], trl_micro=spec["trl_micro"]),
                json.loads(Path(spec["data"]).read_text()), clock)
    send_result(dict(case="trl", seconds=clock.seconds(), metrics=clock.metrics))


def median_step(runs: list) -> float:
    return statistics.median(s for r in runs for s in r["seconds"][2:])


def measure(size: str, prompts: str, args, root: Path) -> list:
    """The cases at one size and prompt length, alternating (TRL's micro-batch searched
    first); a table row a case."""
    from compare import SIZES, build_model, grpo_data

    info = build_model(size, root / size)
    data = root / f"{size}-{prompts}.json"
    data.write_text(json.dumps(grpo_data(SIZES[size]["vocab"], args.steps, 0, median=PROMPTS[prompts])))
    label = f"{size} {prompts} "
    base = dict(steps=args.steps, data=str(data), vocab=SIZES[size]["vocab"], model_dir=info["model_dir"],
                adapter_dir=info["adapter_dir"])
    micro = args.trl_micro[0]
    if "trl" in args.cases and len(args.trl_micro) > 1:
        search = alternate(__file__, {f"trl-{m}": dict(base, case="trl", trl_micro=m) for m in args.trl_micro}, 1,
                           label=f"{label}search ")
        micro = min(args.trl_micro, key=lambda m: median_step(search[f"trl-{m}"]))
    got = alternate(__file__, {case: dict(base, case=case, trl_micro=micro) for case in args.cases}, args.repeats,
                    label=label)
    step = {case: median_step(runs) for case, runs in got.items()}
    parts = {case: [statistics.median(m[k] for r in runs for m in r["metrics"][2:])
                    for k in ("sample_seconds", "train_seconds")] for case, runs in got.items() if case != "trl"}
    bound = f"{step['sync'] / (sum(parts['sync1']) / 2):.2f}x" if {"sync", "sync1"} <= set(step) else "-"
    rows = []
    for case, runs in got.items():
        timed = [m for r in runs for m in r["metrics"][2:]]
        busy = (f"{statistics.median(m['sampler_busy'] for m in timed):.2f} / "
                f"{statistics.median(m['trainer_busy'] for m in timed):.2f}" if case == "ahead" else "-")
        curve = " ".join(f"{statistics.mean(r['metrics'][i]['reward'] for r in runs):.3f}"
                         for i in range(args.steps))
        rows.append([size, f"{prompts} ({PROMPTS[prompts]})", case + (f" (micro {micro})" if case == "trl" else ""),
                     f"{step[case]:.2f} s", *(f"{step[ref] / step[case]:.2f}x" if ref in step else "-"
                                              for ref in ("sync", "trl")),
                     *([f"{t:.2f} s" for t in parts[case]] if case in parts else ["-", "-"]),
                     busy, bound if case == "ahead" else "-", curve])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", nargs="+", default=["7m"])
    ap.add_argument("--prompts", nargs="+", default=list(PROMPTS), choices=list(PROMPTS))
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--trl-micro", type=int, nargs="+", default=[8, 16, 32],
                    help="TRL's completions a forward to search (one run each), the fastest kept")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=str(HERE / "grpo_async.md"), help="the report ('-': print only)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(json.loads(args.child))
    sys.path.insert(0, str(HERE))
    started = time.perf_counter()
    print(f"machine: {machine()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="linnet-grpo-async-") as tmp:
        rows = [row for size in args.size for prompts in args.prompts
                for row in measure(size, prompts, args, Path(tmp))]
    text = "\n".join([
        "# GRPO sampling ahead of training on CPU, and against TRL", "",
        "Produced by `bench/grpo_async.py`; numbers are measured, not edited.", "",
        f"- Command: `{command(__file__)}` ({(time.perf_counter() - started) / 60:.1f} min, "
        f"{time.strftime('%Y-%m-%d')})",
        f"- Machine: {machine()}; 2 threads a process (ahead: 1 a side; sync1: 1).",
        "- Work: bench/compare.py's GRPO models with their LoRA adapters, float32, 4 prompts x 8 completions x 64 "
        f"new tokens a step, correction_cap 2 (linnet), {args.steps} steps a run, {args.repeats} round(s) a case; "
        f"TRL's micro-batch searched over {args.trl_micro} completions a forward.", "",
        *table(["size", "prompts (median tokens)", "case", "step (median)", "step rate / sync",
                "step rate / TRL", "sampling", "training", "busy: sampler / trainer",
                "best overlap / sync", "reward, step by step"], rows),
        ""])
    write_report(text, args.out, keep=KEEP)  # the notes below the marker stay


if __name__ == "__main__":
    main()
