"""Profile one linnet training step of a bench/compare.py workload (torch.profiler).

    python bench/_compare_profile.py --method sft-lora --size 7m --dtype f32
    python bench/_compare_profile.py --method sft-lora --library trl      # TRL's step, for contrast
    python bench/_compare_profile.py --method sft-lora --variant NEW      # with a candidate change

Builds the workload like bench/compare.py (same model, adapters, rows), runs two warm-up
steps, then profiles one step and prints the top operators by self CPU time.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import compare


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", default="sft-lora", choices=compare.METHODS)
    ap.add_argument("--size", default="7m", choices=list(compare.SIZES))
    ap.add_argument("--dtype", default="f32", choices=list(compare.DTYPES))
    ap.add_argument("--library", default="linnet", choices=["linnet", "trl"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=30)
    ap.add_argument("--sort", default="self_cpu_time_total")
    ap.add_argument("--variant", default="base", help="a candidate of bench/_compare_candidates.py to apply")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        work = compare.build_workload(Path(tmp), [args.size], [args.method], 4, 0)[args.size]
        spec = dict(method=args.method, size=args.size, dtype=compare.DTYPES[args.dtype], steps=4,
                    lr=compare.LR[args.method], seed=0, threads=args.threads, tokens=compare.TOKENS,
                    model_dir=work["model_dir"], adapter_dir=work["adapter_dir"],
                    data=work["data"][args.method.split("-")[0]], vocab=compare.SIZES[args.size]["vocab"],
                    eos=compare.EOS, pairs_per_step=compare.PAIRS_PER_STEP, group=compare.GROUP,
                    prompts_per_step=compare.PROMPTS_PER_STEP, max_new_tokens=compare.MAX_NEW,
                    scratch=str(Path(tmp) / "trainer"), library=args.library)
        data = json.loads(Path(spec["data"]).read_text())
        import _compare_run as runner

        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
        state = {"n": 0}

        class Clock(runner.Clock):
            def tick(self):
                super().tick()
                state["n"] += 1
                if state["n"] == 2:
                    prof.start()
                    state["t"] = time.perf_counter()
                elif state["n"] == 3:
                    prof.stop()
                    state["t"] = time.perf_counter() - state["t"]

        run = runner.run_linnet if args.library == "linnet" else runner.run_trl
        import _compare_candidates as candidates

        with candidates.patched(candidates.variant_changes(args.variant)):
            run(spec, data, Clock())
        print(f"profiled step: {state['t']:.2f} s (with profiler overhead)")
        print(prof.key_averages().table(sort_by=args.sort, row_limit=args.rows, max_name_column_width=60))
        print(prof.key_averages(group_by_input_shape=True).table(sort_by=args.sort, row_limit=15,
                                                                 max_name_column_width=50, max_shapes_column_width=70))


if __name__ == "__main__":
    main()
