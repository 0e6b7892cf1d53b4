"""Context extension: a model trained on 64-position documents, its RoPE base raised, then
trained briefly on 1,024-position documents; held-out loss on long documents falls, and the
saved model gives transformers' logits with the new RoPE settings.

    python examples/14_context_extension.py                     # about 15 s on a laptop CPU
    python examples/14_context_extension.py --rope-base 500000 --long-steps 80
    python examples/14_context_extension.py --yarn 16           # YaRN scaling instead of a new base

The documents are runs of the quickstart's addition problems ("07+35=042..."), so most of
a document is predictable from the few positions before it; what fails past the trained
length is RoPE: positions further apart than any seen in training rotate queries against
keys by angles the model never met. The same change in a run config is `model.rope_base`
(or `model.rope_scaling`) with `model.max_positions` (docs/long_context.md).
"""

import argparse
import dataclasses

import numpy as np
import torch

from linnet import nest
from linnet.cards import with_rope
from linnet.commands import quickstart
from linnet.packing import Example, pack
from linnet.train import train

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--short-steps", type=int, default=300, help="steps on 64-position documents")
parser.add_argument("--long-steps", type=int, default=40, help="steps on 1,024-position documents")
parser.add_argument("--rope-base", type=float, default=160000.0, help="the new RoPE base (the card's: 10000)")
parser.add_argument("--yarn", type=float, default=None, metavar="FACTOR", help="YaRN scaling instead of --rope-base")
parser.add_argument("--out", default="runs/example-context-extension")
args = parser.parse_args()
torch.manual_seed(0)
SHORT, LONG = 64, 1024


def document(rng: np.random.Generator, length: int) -> Example:
    """Addition problems back to back, cut to `length` positions, every token learned."""
    tokens = [quickstart.BOS]
    while len(tokens) < length - 1:
        prompt, answer = quickstart.problems(rng, 1, 2)[0]
        tokens += quickstart.encode(prompt + answer)
    return Example.plain(tokens[: length - 1] + [quickstart.EOS])


def documents(seed: int, length: int, count: int):
    rng = np.random.default_rng(seed)
    return (document(rng, length) for _ in range(count))


def held_out(model, length: int) -> float:
    """Mean loss a token over 8 unseen documents of `length` positions."""
    total = count = 0.0
    with torch.no_grad():
        for row in pack(documents(99, length, 8), tokens=length):
            loss, n = model.loss_packed(row)
            total, count = total + float(loss), count + float(n)
    return total / count


def fit(model, length: int, steps: int, lr: float, seed: int) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    train(model, pack(documents(seed, length, 10**6), tokens=max(length, 256)), optimizer=optimizer, steps=steps,
          clip=1.0)


card = dataclasses.replace(quickstart.CARD, layers=2)  # pretrained context: 64 positions
model = nest.load(card, weights="random", trainable=True)
fit(model, SHORT, args.short_steps, 3e-3, seed=0)
print(f"trained on {SHORT}-position documents: held-out loss {held_out(model, SHORT):.3f} on {SHORT}, "
      f"{held_out(model, LONG):.3f} on {LONG} positions")
model.save_weights(f"{args.out}/short")

# the card with its RoPE changed: a larger base (every wavelength longer), or YaRN's stretch of the long ones
if args.yarn:
    longer = with_rope(card, scaling={"kind": "yarn", "factor": args.yarn})
else:
    longer = with_rope(card, base=args.rope_base, max_positions=LONG)
model = nest.load(longer, weights=f"{args.out}/short", trainable=True)
before = held_out(model, LONG)
fit(model, LONG, args.long_steps, 1e-3, seed=1)
after = held_out(model, LONG)
print(f"RoPE base {longer.rope_base:g}" + (f", {longer.rope_scaling.kind} x{longer.rope_scaling.factor:g}"
                                          if longer.rope_scaling else "")
      + f": held-out loss on {LONG} positions {before:.3f} -> {after:.3f} after {args.long_steps} steps "
      f"({held_out(model, SHORT):.3f} on {SHORT})")
model.save_weights(f"{args.out}/long")

# transformers reads the saved RoPE settings and gives the same logits
from transformers import AutoModelForCausalLM  # noqa: E402

theirs = AutoModelForCausalLM.from_pretrained(f"{args.out}/long", dtype=torch.float32).eval()
tokens = torch.tensor(document(np.random.default_rng(7), LONG).tokens)[None]
with torch.no_grad():
    gap = (theirs(tokens).logits - model(tokens)).abs().max().item()
print(f"transformers' logits at {LONG} positions, max difference {gap:.1e}")
if gap > 1e-4:
    raise SystemExit("the saved model's logits differ from transformers'")
