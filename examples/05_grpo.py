"""GRPO with LoRA through the Python API: sample groups with the engine, reward, update.

    python examples/05_grpo.py                                    # the quickstart's task, CPU, offline
    python examples/05_grpo.py --card path/to/hf-model --data gsm8k.jsonl --steps 50

With --card, records hold a `question` and an `answer` whose last number is the final
answer (GSM8K's layout); a completion is rewarded 1 when its last number matches. Without
one, a few SFT steps first teach the quickstart's architecture (random weights) to add two
numbers, then GRPO rewards exactly right answers.
"""

import argparse
import itertools

import numpy as np
import torch

from linnet import nest
from linnet.commands import quickstart
from linnet.data import encode_prompt, load_tokenizer, read_records
from linnet.rl import rewards
from linnet.serve import Engine
from linnet.train import pack, train
from linnet.train.grpo import Prompt, grpo

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--card", help="registered card or HF model directory (default: a tiny random model)")
parser.add_argument("--data", help="JSONL/JSON/Parquet records with question and answer (needs --card)")
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--sft-steps", type=int, default=300, help="without --card: SFT steps before GRPO")
parser.add_argument("--max-new-tokens", type=int, default=256)
parser.add_argument("--out", default="runs/example-grpo")
args = parser.parse_args()
torch.manual_seed(0)

if args.card:
    card = nest.resolve(args.card)
    tokenizer = load_tokenizer(card)
    prompts = [Prompt(encode_prompt(tokenizer, r.data["question"], chat=True), r.data["answer"])
               for r in read_records(args.data)]
    reward, max_new, model = rewards.numeric(tokenizer), args.max_new_tokens, nest.load(card)
else:
    card = quickstart.CARD
    model = nest.load(card, weights="random", trainable=True)
    examples = quickstart.training_examples(seed=0, digits=2, held_out=set())
    sft = torch.optim.AdamW(model.parameters(), lr=2e-3)
    train(model, pack(itertools.islice(examples, 200 * args.sft_steps), tokens=1024), optimizer=sft,
          steps=args.sft_steps)
    model.set_trainable(False)
    problems = quickstart.problems(np.random.default_rng(1), 256, digits=2)
    prompts = [Prompt([quickstart.BOS] + quickstart.encode(p), quickstart.encode(a) + [quickstart.EOS])
               for p, a in problems]
    reward, max_new = quickstart.exact_answer, 4

# The policy trains adapters; the engine samples from its own copy of the model, whose
# weights grpo() copies in from the policy (adapters merged) before every step.
model.add_lora(["model.layers.*.self_attn.*_proj", "model.layers.*.mlp.*_proj"], rank=16, alpha=32)
engine = Engine(nest.load(card, weights="random"))
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
history = grpo(
    model, engine, prompts, reward, optimizer=optimizer, steps=args.steps, group=8, prompts_per_step=8,
    max_new_tokens=max_new, tokens=2048, save_to=args.out,
    on_step=lambda s: print(f"step {s.step}: reward {s.metrics['reward']:.3f}, "
                            f"uniform groups {s.metrics['uniform']:.2f}") if s.step % 5 == 0 else None,
)
first, last = history.steps[0].metrics["reward"], history.steps[-1].metrics["reward"]
print(f"mean reward {first:.3f} -> {last:.3f}; adapters in {args.out}")
