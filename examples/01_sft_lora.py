"""SFT with LoRA adapters through the Python API.

    python examples/01_sft_lora.py                          # a tiny random model, synthetic task, CPU
    python examples/01_sft_lora.py --card path/to/hf-model --data train.jsonl --steps 200

With a real model directory the records are read with its tokenizer and chat template
(prompt/completion or `messages` records); without one the script makes the quickstart's
addition task so it runs anywhere, offline.
"""

import argparse
import itertools

import torch

from linnet import nest
from linnet.commands import quickstart
from linnet.data import load_examples, load_tokenizer
from linnet.torch.lora import save_peft
from linnet.train import cosine_schedule, pack, train

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--card", help="registered card or HF model directory (default: a tiny random model)")
parser.add_argument("--data", help="JSONL/JSON/Parquet records (needs --card)")
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--context-length", type=int, default=512, help="positions per packed row (training.context_length)")
parser.add_argument("--out", default="runs/example-lora")
args = parser.parse_args()
torch.manual_seed(0)

if args.card:
    model = nest.load(args.card)  # the card's own weights, frozen
    tokenizer = load_tokenizer(nest.resolve(args.card))
    examples = load_examples(args.data, tokenizer, tokens=args.context_length)
else:
    # A stand-in for a pretrained model: the quickstart's architecture, random weights.
    model = nest.load(quickstart.CARD, weights="random")
    examples = list(itertools.islice(quickstart.training_examples(seed=0, digits=2, held_out=set()), 4000))

# Adapters on every attention and MLP projection; everything else is frozen.
layers = model.add_lora(["model.layers.*.self_attn.*_proj", "model.layers.*.mlp.*_proj"], rank=16, alpha=32)
trained = [p for p in model.parameters() if p.requires_grad]
print(f"{len(layers)} adapted layers, {sum(p.numel() for p in trained):,} trainable parameters")

optimizer = torch.optim.AdamW(trained, lr=2e-3)
history = train(
    model,
    pack(examples, tokens=args.context_length),  # whole examples end to end, one shape per row
    optimizer=optimizer,
    steps=args.steps,
    schedule=cosine_schedule(optimizer, min(5, args.steps), args.steps),
    on_step=lambda s: print(f"step {s.step}: loss {s.loss:.3f}, {s.tokens_per_second:.0f} tokens/s")
    if s.step % 10 == 0 else None,
)
save_peft(model, args.out)  # adapter_config.json + adapter_model.safetensors, as PEFT writes them
print(f"loss {history.losses[0]:.3f} -> {history.losses[-1]:.3f}; adapters in {args.out}")
