"""Full fine-tuning sharded across processes (FSDP): each process holds its part of
every weight, gradient and optimizer state, and trains on its own rows. With --qlora, LoRA
over a 4-bit NF4 base, the base's codes split across the processes (FSDP + QLoRA).

    torchrun --nproc-per-node 2 examples/06_fully_shard.py          # CPU (gloo), tiny model
    torchrun --nproc-per-node 4 examples/06_fully_shard.py --card path/to/hf-model --dtype bfloat16
    torchrun --nproc-per-node 2 examples/06_fully_shard.py --qlora  # needs bitsandbytes

Every process gets a different share of the rows; `train` sums the learned-position
counts across processes, so the step is the mean over every process's tokens, as one
process over all the rows would take it. The first process writes the gathered weights.
"""

import argparse
import itertools
import os

import torch

from linnet import nest
from linnet.commands import quickstart
from linnet.torch.distributed import join, leave, world
from linnet.train import cosine_schedule, pack, train

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--card", help="registered card or HF model directory (default: a tiny random model)")
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--dtype", default=None, help="compute dtype (default: the card's on GPU, float32 on CPU)")
parser.add_argument("--qlora", action="store_true", help="LoRA over a 4-bit NF4 base (pip install 'linnet[qlora]')")
parser.add_argument("--out", default="runs/example-sharded")
args = parser.parse_args()
joined = join()  # the process group torchrun describes (gloo on CPU, NCCL on GPUs)
rank, processes = world()
device = f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if torch.cuda.is_available() else "cpu"

card = args.card or quickstart.CARD
# sharded while on meta, then filled: each process reads every weight but keeps only its part
# (parts in float32, NF4 codes as bytes), gathered in the compute dtype block by block. The same
# model as a whole load, model.add_lora(...), then fully_shard(model); the adapters stay whole.
model = nest.load(card, weights=None if args.card else "random", trainable=not args.qlora, dtype=args.dtype,
                  device=device, quantize="nf4" if args.qlora else None, fully_shard=True,
                  lora=dict(patterns="*_proj", rank=16) if args.qlora else None)
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3, weight_decay=0.0)
examples = itertools.islice(quickstart.training_examples(seed=0, digits=2, held_out=set()), 20000)
rows = itertools.islice(pack(examples, tokens=512), rank, None, processes)  # this process's share
history = train(
    model, rows, optimizer=optimizer, steps=args.steps, schedule=cosine_schedule(optimizer, min(5, args.steps), args.steps),
    on_step=lambda s: print(f"step {s.step}: loss {s.loss:.3f}, {s.tokens_per_second:.0f} tokens/s "
                            f"over {processes} processes") if rank == 0 and s.step % 10 == 0 else None,
    save_to=args.out,  # every process gathers; the first writes safetensors + config.json (PEFT's files with --qlora)
)
if rank == 0:
    print(f"loss {history.losses[0]:.3f} -> {history.losses[-1]:.3f}; weights in {args.out}")
if joined:
    leave()  # together: the first process may still be writing
