"""A small mixture of experts trained with LoRA: against the dense model with the same
active parameters, and against transformers + PEFT on the same mixture of experts.

    python bench/moe.py                  # bench/moe.md, ~6 min on 2 CPU cores
    python bench/moe.py --quick --out -  # a smoke run: a minute, prints only

Models (random weights, float32, written with transformers' save_pretrained): a Qwen3-MoE
of 4 layers, hidden 256, vocabulary 8,192, 8 experts of width 352 a block, 2 a token; and
the dense Qwen3 whose MLP (width 704) makes the same active parameters a token. Work: LoRA
rank 16 on every projection (attention, and both stacked expert tensors of each block, as
PEFT's target_parameters names them; the dense model's gate/up/down), one row of 1,024
positions a step (one document, so attention costs the same everywhere), AdamW, --steps
steps after 2 unmeasured. Cases, each in a fresh process (its peak memory its own),
alternating, --repeats rounds:

  linnet, MoE          nest.load + add_lora("all-linear") + loss_packed
  linnet, MoE, QLoRA   the same over an NF4 base (quantize="nf4": attention and every
                       expert in 4 bits, dequantized in each product by bitsandbytes)
  linnet, dense        the same on the dense model
  transformers + PEFT  AutoModelForCausalLM + get_peft_model(target_modules=attention,
                       target_parameters=the experts' gate_up_proj and down_proj), loss on
                       the same row (labels), its backward
  TRL + PEFT           that PEFT model in TRL's SFTTrainer (its defaults, no packing: the
                       row is one document), the step times from its callbacks

Tokens/s is the row's positions over the median step; peak is the process's resident set
above what it held before the model loaded.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _common import KEEP, GiB, alternate, command, machine, peak_rss, reset_peak, rss, send_result, table, write_report

HERE = Path(__file__).resolve().parent
ROW = 1024


def build(root: Path, quick: bool) -> None:
    import torch
    import transformers

    common = dict(vocab_size=8192, hidden_size=128 if quick else 256, num_hidden_layers=2 if quick else 4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32 if quick else 64,
                  max_position_embeddings=2048, tie_word_embeddings=False)
    width = 176 if quick else 352
    configs = {"moe": transformers.Qwen3MoeConfig(**common, num_experts=8, num_experts_per_tok=2,
                                                  moe_intermediate_size=width, intermediate_size=2 * width,
                                                  norm_topk_prob=True),
               "dense": transformers.Qwen3Config(**common, intermediate_size=2 * width)}
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(8192)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", eos_token="t1")
    for name, config in configs.items():
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)  # TRL's trainer wants one


def child(spec: dict) -> None:
    """One case in this process: train --steps steps, send the step times and peak memory."""
    import torch

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    tokens = torch.randint(3, 8192, (ROW,), generator=torch.Generator().manual_seed(1))
    baseline = rss()
    reset_peak()
    if spec["case"].startswith("linnet"):
        from linnet import nest
        from linnet.packing import Example, pack

        model = nest.load(spec["model"], weights=spec["model"], dtype="float32",
                          quantize="nf4" if spec["case"].endswith("QLoRA") else None)
        model.add_lora("all-linear", rank=16, alpha=32)
        (row,) = pack([Example(tokens.tolist())], tokens=ROW)

        def loss():
            total, count = model.loss_packed(row)
            return total / count
    else:
        import peft
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
        model = peft.get_peft_model(hf, peft.LoraConfig(
            r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
        if spec["case"].startswith("TRL"):
            return send_result(dict(seconds=_trl(model, spec, tokens.tolist()), peak_bytes=peak_rss() - baseline))
        model.train()
        ids = tokens[None]

        def loss():
            return model(input_ids=ids, labels=ids).loss
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    seconds = []
    for _ in range(spec["steps"] + 2):
        start = time.perf_counter()
        loss().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - start)
    send_result(dict(seconds=seconds, peak_bytes=peak_rss() - baseline))


def _trl(model, spec: dict, ids: list[int]) -> list[float]:
    """TRL's SFTTrainer on the PEFT model, one row a step (no packing: the row is one
    document); each step's seconds, from its callbacks."""
    import tempfile

    import transformers
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    seconds: list[float] = []

    class Timer(transformers.TrainerCallback):
        def on_step_begin(self, *args, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, *args, **kwargs):
            seconds.append(time.perf_counter() - self.started)

    steps = spec["steps"] + 2
    with tempfile.TemporaryDirectory() as scratch:
        args = SFTConfig(output_dir=scratch, max_steps=steps, learning_rate=1e-4, per_device_train_batch_size=1,
                         max_length=ROW, packing=False, report_to="none", save_strategy="no", disable_tqdm=True,
                         logging_steps=steps, use_cpu=True, dataloader_num_workers=0, lr_scheduler_type="constant",
                         warmup_steps=0)
        tokenizer = transformers.AutoTokenizer.from_pretrained(spec["model"])
        SFTTrainer(model=model, args=args, processing_class=tokenizer, callbacks=[Timer()],
                   train_dataset=Dataset.from_dict({"input_ids": [ids] * steps})).train()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a 2-layer model, 4 steps, one round")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(HERE / "moe.md"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(json.loads(args.child))
    steps, repeats = (4, 1) if args.quick else (args.steps, args.repeats)
    with tempfile.TemporaryDirectory(prefix="linnet-moe-") as tmp:
        root = Path(tmp)
        build(root, args.quick)
        specs = {"linnet, MoE": "moe", "linnet, MoE, QLoRA": "moe", "linnet, dense": "dense", "transformers + PEFT, MoE": "moe",
                 "TRL SFTTrainer + PEFT, MoE": "moe"}
        got = alternate(__file__, {case: dict(case=case, model=str(root / model), steps=steps, threads=args.threads)
                                   for case, model in specs.items()}, repeats)
    step = {case: statistics.median(s for r in runs for s in r["seconds"][2:]) for case, runs in got.items()}
    rows = [[case, f"{step[case]:.3f} s", f"{ROW / step[case]:,.0f}", f"{step['linnet, MoE'] / step[case]:.2f}x",
             f"{max(r['peak_bytes'] for r in runs) / GiB:.2f} GiB"] for case, runs in got.items()]
    lines = [
        "# A small mixture of experts, LoRA",
        "",
        f"`{command(__file__)}` on {machine()}, {time.strftime('%Y-%m-%d')}, {args.threads} threads; "
        f"{'a 2-layer' if args.quick else 'a 4-layer'} Qwen3-MoE (8 experts, 2 a token) and the dense Qwen3 of the "
        f"same active parameters, float32, LoRA rank 16 on every projection, one {ROW}-position row a step, "
        f"medians of {steps} steps x {repeats} round(s), alternating.",
        "",
        *table(["case", "step", "tokens/s", "tokens/s against linnet, MoE", "peak above start"], rows, "lrrrr"),
    ]
    write_report("\n".join(lines) + "\n", args.out, keep=KEEP)


if __name__ == "__main__":
    sys.exit(main())
