"""Two tenants' adapters over one base: trained together in one process (`linnet adapters`),
then served together from one engine, each prompt through its tenant's adapter.

    python examples/15_tenants.py                 # a tiny random base, two synthetic tasks: ~20 s on 2 cores
    python examples/15_tenants.py --steps 3       # a smoke run

Both tenants read the same prompts ("12+34="): tenant "add" answers the sum, tenant "max"
the larger number (which 300 steps teach it; the sum takes longer from a random base). Each
is an ordinary `linnet sft` config with its own data, rank and learning rate; the list file
names both. Each run writes its own directory (metrics, checkpoints, a PEFT adapter in
final/), exactly what `linnet sft --config` would have written for it alone.
"""

import argparse
import json
from pathlib import Path

import numpy as np
import torch
import yaml

from linnet import nest
from linnet.commands import adapters, quickstart
from linnet.config import load_any
from linnet.torch.adapter_bank import AdapterEngine

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--out", default="runs/example-tenants")
args = parser.parse_args()
out = Path(args.out)
out.mkdir(parents=True, exist_ok=True)
torch.manual_seed(0)

# A stand-in for a pretrained base: the quickstart's architecture, random weights, its tokenizer.
base = out / "base"
nest.load(quickstart.CARD, weights="random", seed=0).save_weights(base)
quickstart.save_tokenizer(base / "tokenizer.json")

rng = np.random.default_rng(0)
tasks = {"add": lambda a, b: a + b, "max": max}
listing = []
for k, (name, task) in enumerate(tasks.items()):
    pairs = rng.integers(0, 100, size=(2000, 2))
    (out / f"{name}.jsonl").write_text("".join(
        json.dumps({"prompt": f"{a:02d}+{b:02d}=", "completion": f"{task(a, b):03d}"})
        + "\n" for a, b in pairs))
    config = {"model": {"card": str(base)},
              "data": {"path": str(out / f"{name}.jsonl"), "chat": False, "eval_share": 0.05},
              "training": {"context_length": 128, "steps": args.steps, "checkpoint_every": args.steps},
              "lora": {"enabled": True, "rank": 8 * (k + 1)},
              "optimizer": {"lr": 3e-3 / (k + 1)},
              "lr_schedule": {"warmup_steps": min(5, args.steps - 1)},
              "evaluation": {"every": max(1, args.steps // 3)},
              "runtime": {"output_dir": str(out / name), "seed": k, "progress": False}}
    (out / f"{name}.yaml").write_text(yaml.safe_dump(config))
    listing.append(str(out / f"{name}.yaml"))
(out / "tenants.yaml").write_text(yaml.safe_dump({"adapters": listing}))  # linnet adapters --config reads this

# Train both over one base in one process, a step each in turn (the command line:
# linnet adapters --config runs/example-tenants/tenants.yaml --overwrite).
tenants = adapters.run([(None, load_any(path)) for path in listing], overwrite=True)
for t in tenants:
    if t.error is not None:
        raise SystemExit(f"{t.name}: {t.error}")
    print(f"{t.name}: loss {t.summary['first_loss']:.3f} -> {t.summary['last_loss']:.3f}, "
          f"held-out {t.summary['held_out_loss']:.3f}; adapter in {t.summary['final']}")

# Serve both from one engine: one base, the adapters unmerged, a batch mixing them.
engine = AdapterEngine(nest.load(base, weights=base), {name: out / name for name in tasks})
prompts = ["12+34=", "50+25="] * 2
routes = ["add", "add", "max", "max"]
done = engine.sample([[quickstart.BOS, *quickstart.encode(p)] for p in prompts], adapters=routes,
                     max_new_tokens=4, temperature=0.0)
for prompt, route, completion in zip(prompts, routes, done):
    answer = "".join(quickstart.CHARS[t - 3] for t in completion.tokens if t >= 3)  # ids 3.. are the characters
    print(f"{route}: {prompt}{answer}")
