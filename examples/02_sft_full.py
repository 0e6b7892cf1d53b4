"""Full fine-tuning: every weight trains, as float32 master weights; compute may be bf16.

    python examples/02_sft_full.py                            # tiny random model, CPU, float32
    python examples/02_sft_full.py --dtype bfloat16 --accumulate 4

Gradient accumulation divides every micro-batch's summed loss by the learned-token count
of the whole step, so `--accumulate 4` over uneven rows is the same update as one row
holding all their tokens. The result is a model directory transformers can load.
"""

import argparse
import itertools

import torch

from linnet import nest
from linnet.commands import quickstart
from linnet.train import pack, train, wsd_schedule

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--accumulate", type=int, default=1, help="packed rows per optimizer step")
parser.add_argument("--dtype", default="float32", help="compute dtype: float32 or bfloat16")
parser.add_argument("--out", default="runs/example-full")
args = parser.parse_args()
torch.manual_seed(0)

model = nest.load(quickstart.CARD, weights="random", trainable=True, dtype=args.dtype)
examples = quickstart.training_examples(seed=0, digits=2, held_out=set())  # an endless stream
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3, weight_decay=0.0)
history = train(
    model,
    pack(itertools.islice(examples, 20000), tokens=512),
    optimizer=optimizer,
    steps=args.steps,
    accumulate=args.accumulate,
    clip=1.0,
    schedule=wsd_schedule(optimizer, min(5, args.steps // 2), args.steps, decay=0.3),  # warmup, hold, decay
    on_step=lambda s: print(f"step {s.step}: loss {s.loss:.3f} (grad norm {s.grad_norm:.2f}, lr {s.lr:.2e})")
    if s.step % 10 == 0 else None,
    save_to=args.out,  # safetensors + config.json
)
print(f"loss {history.losses[0]:.3f} -> {history.losses[-1]:.3f}; weights in {args.out}")
