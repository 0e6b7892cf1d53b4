"""A linnet model inside TRL's DPOTrainer, through CausalLM.

    python examples/12_trl_dpo.py                          # tiny random model, CPU, offline
    python examples/12_trl_dpo.py --steps 100 --precompute

DPOTrainer scores every completion with its fused log-probability head over
`CausalLM.base_model` (padding removed, the model's `hidden_packed` entry) for the policy
and for the reference. The reference is either a frozen CausalLM of the same weights
(default), or, with --precompute, the policy itself before training
(`precompute_ref_log_probs=True`): linnet's LoRA adapters are not PEFT's, so TRL cannot
switch them off to get the reference. linnet's own `linnet.train.dpo` does the same
training on packed rows without padding.
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
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--precompute", action="store_true", help="reference log-probs from the policy, up front")
parser.add_argument("--out", default="runs/example-trl-dpo")
args = parser.parse_args()
torch.manual_seed(0)

tokenizer = quickstart.transformers_tokenizer()  # the quickstart's characters, as TRL expects

# A stand-in for an SFT model: the quickstart's architecture, random weights (seed 0).
policy = CausalLM(nest.load(quickstart.CARD, weights="random", seed=0, trainable=True))
reference = None if args.precompute else CausalLM(nest.load(quickstart.CARD, weights="random", seed=0))

# Preferences: the right sum over a wrong one.
rng = np.random.default_rng(0)
records = []
for prompt, answer in quickstart.problems(rng, 1000, digits=2):
    wrong = (int(answer) + int(rng.integers(1, 50))) % 200
    records.append({"prompt": prompt, "chosen": answer, "rejected": f"{wrong:03d}"})
data = Dataset.from_list(records)

config = trl.DPOConfig(
    output_dir=args.out,
    max_steps=args.steps,
    per_device_train_batch_size=16,
    learning_rate=1e-3,
    beta=0.1,
    logging_steps=max(1, args.steps // 6),
    precompute_ref_log_probs=args.precompute,
    activation_checkpointing=False,  # CausalLM does not checkpoint activations
    bf16=False,
    save_strategy="no",
    report_to=[],
    dataloader_num_workers=0,
)
trainer = trl.DPOTrainer(model=policy, ref_model=reference, args=config, train_dataset=data,
                         processing_class=tokenizer)
trainer.train()

logs = [h for h in trainer.state.log_history if "loss" in h]
policy.save_pretrained(args.out)
print(f"loss {logs[0]['loss']:.3f} -> {logs[-1]['loss']:.3f}, reward accuracy "
      f"{logs[0]['rewards/accuracies']:.2f} -> {logs[-1]['rewards/accuracies']:.2f}; model in {args.out}")
