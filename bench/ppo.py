"""What does a PPO step cost beside a GRPO step on the same work?

TRL no longer ships a PPO trainer (1.16 has none, not even under trl.experimental), so PPO is
measured against linnet's own GRPO: bench/compare.py's 7M workload (its model, LoRA adapter,
prompts and reward: the share of completion tokens in the lower half of the vocabulary), 4
prompts x 8 completions x 64 new tokens a step, float32, AdamW at 1e-3, no gradient clip. Cases:

  grpo        group 8, one optimizer step a sampling step, no reference (beta 0)
  ppo         samples 8, one optimizer step a sampling step, kl_coef 0.05 (a frozen reference
              reads every completion), a float32 critic on the policy's hidden states
  ppo-epochs  the same with ppo.iterations 4 (PPO's default: four passes over each step's rollouts)

Each case runs in a fresh process (its peak memory its own), the cases' order reversed each
round. Reported: median step seconds after the first two, the medians of sampling and of
PPO's no-gradient passes (old policy and critic, reference), peak RSS above the process's
RSS after imports, and the reward's first and last steps.

    python bench/ppo.py                       # 7M, 8 steps, 2 rounds; writes bench/ppo.md
    python bench/ppo.py --steps 3 --out -     # a quick look, print only
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _common import KEEP, GiB, alternate, command, machine, peak_rss, reset_peak, rss, send_result, table, write_report

HERE = Path(__file__).resolve().parent
CASES = {"grpo": {}, "ppo": {"iterations": 1}, "ppo-epochs": {"iterations": 4}}


def child(spec: dict) -> None:
    """One case in this process: train, then send the step times, metrics and peak memory."""
    import torch

    from linnet import nest
    from linnet.serve import Engine
    from linnet.torch.weights import bind_weights
    from linnet.train.grpo import Prompt, grpo
    from linnet.train.ppo import ppo, value_head

    torch.set_num_threads(1)
    torch.manual_seed(0)
    data = json.loads(Path(spec["data"]).read_text())
    baseline = rss()
    reset_peak()
    model = nest.load(spec["model_dir"], dtype="float32", trainable=False)
    model.add_lora([f"model.layers.*.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                          "up_proj", "down_proj")], rank=16, alpha=32)
    bind_weights(model, spec["adapter_dir"], strict=False)
    case = spec["case"]
    if case != "grpo":
        value_head(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.0)
    engine = Engine(nest.load(spec["model_dir"], dtype="float32"))
    target = spec["vocab"] // 2

    def lower_half(prompt, completion):
        return sum(1 for t in completion if 3 <= t < target) / max(len(completion), 1)

    steps, per_step = spec["steps"], 4
    prompts = [Prompt(p) for p in data["prompt"][:steps * per_step]]
    seconds, metrics = [], []

    def on_step(step):
        seconds.append(step.seconds)
        metrics.append(dict(step.metrics))

    common = dict(optimizer=optimizer, steps=steps, prompts_per_step=per_step, max_new_tokens=64, temperature=1.0,
                  stop=(2,), tokens=4096, seed=0, on_step=on_step)
    if case == "grpo":
        grpo(model, engine, prompts, lower_half, group=8, verbose=False, **common)
    else:
        reference = nest.load(spec["model_dir"], dtype="float32")
        ppo(model, engine, prompts, lower_half, samples=8, kl_coef=0.05, reference=reference,
            **CASES[case], **common)
    send_result(dict(case=case, seconds=seconds, metrics=metrics, peak_bytes=peak_rss() - baseline))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=str(HERE / "ppo.md"), help="the report ('-': print only)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(json.loads(args.child))
    sys.path.insert(0, str(HERE))
    from compare import SIZES, build_model, grpo_data

    started = time.perf_counter()
    print(f"machine: {machine()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="linnet-ppo-") as tmp:
        root = Path(tmp)
        info = build_model("7m", root)
        data = root / "prompts.json"
        data.write_text(json.dumps(grpo_data(SIZES["7m"]["vocab"], args.steps, 0)))
        got = alternate(__file__, {case: dict(case=case, steps=args.steps, data=str(data), vocab=SIZES["7m"]["vocab"],
                                              model_dir=info["model_dir"], adapter_dir=info["adapter_dir"])
                                   for case in CASES}, args.repeats)
    rows, grpo_step = [], None
    for case, runs in got.items():
        step = statistics.median(s for r in runs for s in r["seconds"][2:])
        timed = [(m, s) for r in runs for m, s in zip(r["metrics"][2:], r["seconds"][2:], strict=True)]
        sample = statistics.median(m["sample_seconds"] for m, _ in timed)
        passes = statistics.median(m.get("rollout_seconds", 0.0) for m, _ in timed)
        grpo_step = grpo_step or step
        rewards = [statistics.mean(r["metrics"][i]["reward"] for r in runs) for i in (0, -1)]
        rows.append([case, f"{step:.2f} s", f"{step / grpo_step:.2f}x", f"{sample:.2f} s", f"{passes:.2f} s",
                     f"{max(r['peak_bytes'] for r in runs) / GiB:.2f} GiB", f"{rewards[0]:.3f} -> {rewards[1]:.3f}"])
    text = "\n".join([
        "# PPO beside GRPO on CPU", "",
        "Produced by `bench/ppo.py`; numbers are measured, not edited.", "",
        f"- Command: `{command(__file__)}` ({(time.perf_counter() - started) / 60:.1f} min, "
        f"{time.strftime('%Y-%m-%d')})",
        f"- Machine: {machine()}; 1 thread a process.",
        "- Work: bench/compare.py's 7M model with its LoRA adapter, float32, 4 prompts x 8 completions x 64 new "
        f"tokens a step, {args.steps} steps a run, {args.repeats} round(s) a case.", "",
        *table(["case", "step (median)", "step / GRPO's", "sampling", "old policy, critic, reference", "peak",
                "reward first -> last"], rows),
        "", KEEP, ""])
    print(text)
    if args.out != "-":
        write_report(text, args.out)


if __name__ == "__main__":
    main()
