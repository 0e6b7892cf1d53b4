"""A linnet model inside TRL's SFTTrainer, through CausalLM (full or LoRA).

    python examples/11_trl_sft.py                          # tiny random model, CPU, offline
    python examples/11_trl_sft.py --lora --steps 100       # adapters only; saves a PEFT adapter

SFTTrainer's default loss computes the cross-entropy itself, a block of tokens at a time:
it reads the hidden states from `CausalLM.base_model` (the model's `hidden_packed` entry,
padding removed) and the head from `get_output_embeddings()`. With `packing=True` TRL
sends padding-free rows whose position_ids restart at 0 for each example; CausalLM keeps
the examples apart. TRL's default gradient_checkpointing=True would only warn here, so
it is switched off.
"""

import argparse

import numpy as np
import torch
import trl
from datasets import Dataset

from linnet import nest
from linnet.commands import quickstart
from linnet.torch import CausalLM

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--lora", action="store_true", help="train rank-16 adapters instead of every weight")
parser.add_argument("--out", default="runs/example-trl-sft")
args = parser.parse_args()
torch.manual_seed(0)

tokenizer = quickstart.transformers_tokenizer()  # the quickstart's characters, as TRL expects

# A stand-in for a pretrained model: the quickstart's architecture, random weights.
decoder = nest.load(quickstart.CARD, weights="random", trainable=not args.lora)
if args.lora:
    decoder.add_lora(["model.layers.*.self_attn.*_proj", "model.layers.*.mlp.*_proj"], rank=16, alpha=32)
model = CausalLM(decoder)

# Prompt-completion records: TRL learns the completion (and the EOS it appends) only.
problems = quickstart.problems(np.random.default_rng(0), 2000, digits=2)
data = Dataset.from_list([{"prompt": p, "completion": a} for p, a in problems])

config = trl.SFTConfig(
    output_dir=args.out,
    max_steps=args.steps,
    per_device_train_batch_size=1,
    packing=True,  # best-fit rows of up to max_length real tokens, no padding
    max_length=512,
    learning_rate=2e-3 if args.lora else 3e-3,
    lr_scheduler_type="cosine",
    warmup_steps=min(5, args.steps),
    logging_steps=max(1, args.steps // 8),
    activation_checkpointing=False,  # CausalLM does not checkpoint activations
    bf16=False,  # TRL turns it on by default; on a GPU leave it on
    save_strategy="no",
    report_to=[],
    dataloader_num_workers=0,
)
trainer = trl.SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer)
trainer.train()

losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
model.save_pretrained(args.out)  # the whole model, or adapter_config.json + adapter_model.safetensors
kind = "PEFT adapter" if args.lora else "model"
print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {args.steps} steps; {kind} in {args.out}")
