"""DPO with LoRA through the Python API.

    python examples/04_dpo.py                                      # a tiny random model, synthetic pairs, CPU
    python examples/04_dpo.py --card path/to/hf-model --data pairs.jsonl --steps 100

Records hold `prompt`, `chosen` and `rejected` (text, or chat messages rendered with the
model's template). Without --card the script runs anywhere, offline: the quickstart's
architecture with random weights, and pairs whose chosen answer is the right sum and whose
rejected answer is a wrong one.
"""

import argparse

import numpy as np
import torch

from linnet import nest
from linnet.commands import quickstart
from linnet.data import load_tokenizer, pairs_from_records, read_records
from linnet.torch.lora import save_peft
from linnet.train.dpo import Pair, dpo

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--card", help="registered card or HF model directory (default: a tiny random model)")
parser.add_argument("--data", help="JSONL/JSON/Parquet preference records (needs --card)")
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--context-length", type=int, default=1024, help="positions per packed row (training.context_length)")
parser.add_argument("--out", default="runs/example-dpo")
args = parser.parse_args()
torch.manual_seed(0)

if args.card:
    model = nest.load(args.card)  # the card's own weights, frozen
    pairs = pairs_from_records(read_records(args.data), load_tokenizer(nest.resolve(args.card)))
else:
    model = nest.load(quickstart.CARD, weights="random")
    rng = np.random.default_rng(0)
    pairs = []
    for prompt, answer in quickstart.problems(rng, 512, digits=2):
        wrong = f"{(int(answer) + int(rng.integers(1, 99))) % 1000:03d}"
        pairs.append(Pair([quickstart.BOS] + quickstart.encode(prompt), quickstart.encode(answer) + [quickstart.EOS],
                          quickstart.encode(wrong) + [quickstart.EOS]))

# LoRA: the frozen model before training is the reference, so one model is enough.
model.add_lora(["model.layers.*.self_attn.*_proj", "model.layers.*.mlp.*_proj"], rank=16, alpha=32)
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
history = dpo(
    model, pairs, optimizer=optimizer, steps=args.steps, pairs_per_step=16, beta=0.1,
    tokens=args.context_length,  # each row holds whole pairs, each prompt once with both answers attending to it
    on_step=lambda s: print(f"step {s.step}: loss {s.loss:.3f}, accuracy {s.metrics['accuracy']:.2f}, "
                            f"margin {s.metrics['margin']:.3f}") if s.step % 10 == 0 else None,
)
save_peft(model, args.out)
print(f"loss {history.losses[0]:.3f} -> {history.losses[-1]:.3f}; adapters in {args.out}")
