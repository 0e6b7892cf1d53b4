"""Pipeline stages: each process holds a chunk of blocks (two, with the interleaved schedule),
and every objective passes its rows along them. SFT teaches the quickstart's task, then GRPO
improves it with adapters, every stage's engine taking the whole policy from the stages.

    torchrun --nproc-per-node 2 examples/08_pipeline.py                         # CPU (gloo), tiny model
    torchrun --nproc-per-node 2 examples/08_pipeline.py --schedule 1f1b --sft-steps 100

The processes of a pipeline take the same rows: a step's `accumulate` packed rows are its
micro-batches, passed along on PyTorch's schedule (interleaved 1F1B here: with 4 blocks over
2 processes, the first holds blocks 0 and 2, the second 1 and 3). The last stage computes the
losses; `train` adds every stage's squared gradient norm for clipping. For GRPO the first
stage samples and scores, and every stage trains on its completions.
"""

import argparse
import os

import numpy as np
import torch
from torch.distributed.device_mesh import init_device_mesh

from linnet import nest
from linnet.commands import quickstart
from linnet.serve import Engine
from linnet.torch.distributed import join, leave, world
from linnet.train import pack, train
from linnet.train.grpo import Prompt, grpo

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--schedule", default="interleaved", choices=["1f1b", "gpipe", "interleaved", "zero-bubble"])
parser.add_argument("--sft-steps", type=int, default=300)
parser.add_argument("--steps", type=int, default=30, help="GRPO steps")
parser.add_argument("--out", default="runs/example-pipeline")
args = parser.parse_args()
joined = join()  # the process group torchrun describes (gloo on CPU, NCCL on GPUs)
rank, processes = world()
device = f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)

# every process one stage, built alone: it never holds the other stages' weights
mesh = init_device_mesh(torch.device(device).type, (processes,), mesh_dim_names=("stages",))
model = nest.load(quickstart.CARD, weights="random", trainable=True, device=device, pipeline=mesh,
                  pipeline_schedule=args.schedule)
optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
examples = quickstart.training_examples(seed=0, digits=2, held_out=set())
history = train(model, pack(examples, tokens=512), optimizer=optimizer, steps=args.sft_steps, accumulate=4,
                on_step=lambda s: print(f"sft step {s.step}: loss {s.loss:.3f}")
                if rank == 0 and s.step % 100 == 0 else None)

# adapters after the cut, each stage on its own blocks; the engine is a whole model on each process
model.set_trainable(False)
model.add_lora(["model.layers.*.self_attn.*_proj", "model.layers.*.mlp.*_proj"], rank=16, alpha=32)
engine = Engine(nest.load(quickstart.CARD, weights="random", device=device))
problems = quickstart.problems(np.random.default_rng(1), 256, digits=2)
prompts = [Prompt([quickstart.BOS] + quickstart.encode(p), quickstart.encode(a) + [quickstart.EOS])
           for p, a in problems]
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
rl = grpo(model, engine, prompts, quickstart.exact_answer, optimizer=optimizer, steps=args.steps, group=8,
          prompts_per_step=8, max_new_tokens=4, tokens=256, save_to=args.out, verbose=rank == 0,
          on_step=lambda s: print(f"grpo step {s.step}: reward {s.metrics['reward']:.3f}")
          if rank == 0 and s.step % 10 == 0 else None)
if rank == 0:
    rewards = [s.metrics["reward"] for s in rl.steps]
    k = max(1, len(rewards) // 3)  # a step's 64 completions are a noisy sample: thirds of the run
    print(f"sft loss {history.losses[0]:.3f} -> {history.losses[-1]:.3f}; grpo reward {np.mean(rewards[:k]):.3f} "
          f"(first {k} steps) -> {np.mean(rewards[-k:]):.3f} (last {k}); adapters in {args.out}")
if joined:
    leave()  # together: the first process may still be writing
