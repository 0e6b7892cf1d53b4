"""A linnet model inside an existing transformers.Trainer script, through CausalLM.

    python examples/10_transformers_trainer.py                 # tiny random model, CPU, offline
    python examples/10_transformers_trainer.py --steps 200 --out runs/example-hf-trainer

The Trainer, its arguments, data and collator are unchanged from a transformers script;
only the model line differs. CausalLM takes the Trainer's padded batches, removes the
padding and packs the rows into the model's `loss_packed` entry; with the
`num_items_in_batch` the Trainer passes, gradient accumulation takes the mean over every
learned token of the step. The result is a directory transformers loads.
"""

import argparse

import numpy as np
import torch
import transformers
from datasets import Dataset

from linnet import nest
from linnet.commands import quickstart
from linnet.torch import CausalLM

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--out", default="runs/example-hf-trainer")
args = parser.parse_args()
torch.manual_seed(0)

# A stand-in for a pretrained model: the quickstart's architecture, random weights.
# With a real one: nest.load("path/to/hf-model-dir", trainable=True).
model = CausalLM(nest.load(quickstart.CARD, weights="random", trainable=True))

# The quickstart's addition task as a transformers dataset: prompt tokens labelled -100.
rows = []
for prompt, answer in quickstart.problems(np.random.default_rng(0), 2000, digits=2):
    p = [quickstart.BOS] + quickstart.encode(prompt)
    c = quickstart.encode(answer) + [quickstart.EOS]
    rows.append({"input_ids": p + c, "labels": [-100] * len(p) + c})
data = Dataset.from_list(rows)


def collate(features):
    """Right-padded rows; CausalLM drops the padding before the model sees it."""
    T = max(len(f["input_ids"]) for f in features)

    def pad(x, value):
        return x + [value] * (T - len(x))

    return {
        "input_ids": torch.tensor([pad(f["input_ids"], quickstart.PAD) for f in features]),
        "attention_mask": torch.tensor([pad([1] * len(f["input_ids"]), 0) for f in features]),
        "labels": torch.tensor([pad(f["labels"], -100) for f in features]),
    }


training = transformers.TrainingArguments(
    output_dir=args.out,
    max_steps=args.steps,
    per_device_train_batch_size=32,
    gradient_accumulation_steps=2,
    learning_rate=3e-3,
    lr_scheduler_type="cosine",
    warmup_steps=min(5, args.steps),
    logging_steps=max(1, args.steps // 8),
    save_strategy="no",
    report_to=[],
    bf16=False,  # on a GPU: bf16=True, or load the model with dtype="bfloat16"
    dataloader_num_workers=0,
)
trainer = transformers.Trainer(model=model, args=training, train_dataset=data, data_collator=collate)
trainer.train()

losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
model.save_pretrained(args.out)  # model.safetensors + config.json: transformers loads it
print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {args.steps} steps; model in {args.out}")
