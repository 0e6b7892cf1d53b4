"""Several adapters trained in one run (`linnet adapters`) against the same adapters trained
by separate runs (`linnet sft` each), one after another.

    python bench/adapters.py                  # bench/adapters.md, ~10 min on 2 CPU cores
    python bench/adapters.py --quick --out -  # a smoke run: a minute, prints only

A random ~7M-parameter Llama (4 layers, hidden 256, vocabulary 8,192, float32; --quick: 2
layers, hidden 128) and, for each adapter k, 256 records of its own task (a prompt of 16
random words, the completion the same words shifted by k) are written to a temporary
directory. Each adapter trains LoRA rank 8 on every linear layer for --steps steps of one
row of 256 positions, on the same threads. For N = 1, 4 and 16 adapters, the two ways are
timed as whole processes (wall time, and the largest resident set of any one process),
alternating, --repeats rounds; the table gives medians. Positions trained are N x steps x
256; "steps' own time" sums each run's step times from its metrics.jsonl (the part the two
ways share), the rest is start-up: Python and torch imports, reading the data, loading the
base.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml
from _common import KEEP, command, machine, random_llama, table, write_report

CONTEXT = 256


def build(root: Path, adapters: int, steps: int, threads: int, quick: bool) -> list[Path]:
    """The base, each adapter's records and its sft config; the configs' paths."""
    if not (root / "base").exists():
        random_llama(root / "base", quick, eos=(1,))  # "t1" ends a completion
    rng = np.random.default_rng(0)
    configs = []
    for k in range(adapters):
        lines = []
        for _ in range(256):
            words = rng.integers(2, 8000, 16)
            lines.append(json.dumps({"prompt": " ".join(f"t{w}" for w in words),
                                     "completion": " ".join(f"t{w + k + 1}" for w in words)}))
        (root / f"data{k}.jsonl").write_text("\n".join(lines) + "\n")
        config = {"model": {"card": str(root / "base")},
                  "data": {"path": str(root / f"data{k}.jsonl"), "chat": False, "eval_share": 0.0},
                  "training": {"context_length": CONTEXT, "steps": steps, "checkpoint_every": steps},
                  "lora": {"enabled": True, "rank": 8, "targets": "all-linear"},
                  "optimizer": {"lr": 1e-3}, "lr_schedule": {"warmup_steps": 1},
                  "runtime": {"output_dir": str(root / "runs" / f"a{k}"), "seed": k, "threads": threads,
                              "progress": False}}
        configs.append(root / f"a{k}.yaml")
        configs[-1].write_text(yaml.safe_dump(config))
    return configs


def timed(argv: list[str]) -> tuple[float, int]:
    """(wall seconds, peak resident bytes) of one process, as /usr/bin/time -v reports them."""
    out = subprocess.run(["/usr/bin/time", "-v", *argv], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(argv)}: exit {out.returncode}\n{out.stderr[-3000:]}")
    fields = dict(line.strip().rsplit(": ", 1) for line in out.stderr.splitlines() if ": " in line)
    wall = fields["Elapsed (wall clock) time (h:mm:ss or m:ss)"].split(":")
    seconds = sum(float(x) * 60 ** i for i, x in enumerate(reversed(wall)))
    return seconds, int(fields["Maximum resident set size (kbytes)"]) * 1024


def steps_time(root: Path, adapters: int) -> float:
    return sum(json.loads(line)["seconds"] for k in range(adapters)
               for line in (root / "runs" / f"a{k}" / "metrics.jsonl").read_text().splitlines())


def one_round(root: Path, configs: list[Path], way: str) -> dict:
    """Train every adapter of `configs` one `way`: "one run" or "separate runs"."""
    if way == "one run":
        listing = root / "list.yaml"
        listing.write_text(yaml.safe_dump({"adapters": [str(c) for c in configs]}))
        wall, peak = timed(["linnet", "--quiet", "adapters", "--config", str(listing), "--overwrite"])
    else:
        wall, peak = 0.0, 0
        for c in configs:
            w, p = timed(["linnet", "--quiet", "sft", "--config", str(c), "--overwrite"])
            wall, peak = wall + w, max(peak, p)
    return {"wall": wall, "peak": peak, "steps": steps_time(root, len(configs))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="N = 1 and 4, 5 steps, one round")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="bench/adapters.md")
    args = parser.parse_args()
    counts, steps, repeats = ((1, 4), 5, 1) if args.quick else ((1, 4, 16), args.steps, args.repeats)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for n in counts:
            configs = build(root, n, steps, args.threads, args.quick)
            got = {"one run": [], "separate runs": []}
            order = list(got)
            for _ in range(repeats):
                for way in order:
                    got[way].append(one_round(root, configs, way))
                    print(f"  N={n:2} {way:13} {got[way][-1]['wall']:6.1f} s", flush=True)
                order.reverse()
            positions = n * steps * CONTEXT
            med = {way: {k: statistics.median(r[k] for r in results) for k in ("wall", "peak", "steps")}
                   for way, results in got.items()}
            for way in got:
                m = med[way]
                rows.append([n, way, f"{m['wall']:.1f} s", f"{positions / m['wall']:,.0f}", f"{m['steps']:.1f} s",
                             f"{m['wall'] - m['steps']:.1f} s", f"{m['peak'] / 2**20:,.0f} MiB",
                             f"{med['separate runs']['wall'] / m['wall']:.2f}x"])
    lines = [
        "# Several adapters in one run against separate runs",
        "",
        f"`{command(__file__)}` on {machine()}, {time.strftime('%Y-%m-%d')}, {args.threads} threads; "
        f"{'a 2-layer' if args.quick else 'a 4-layer ~7M-parameter'} Llama, float32, LoRA rank 8 on every linear "
        f"layer, {steps} steps of one {CONTEXT}-position row per adapter; whole-process figures, medians of "
        f"{repeats} alternating rounds.",
        "",
        *table(["N", "way", "wall", "positions/s", "steps' own time", "start-up and the rest", "peak RSS",
                "speed-up vs separate"], rows, "rlrrrrrr"),
    ]
    write_report("\n".join(lines) + "\n", args.out, keep=KEEP)


if __name__ == "__main__":
    main()
