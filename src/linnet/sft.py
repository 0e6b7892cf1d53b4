"""`linnet sft`: supervised fine-tuning from a YAML config, and `linnet inspect` for its
data. Every step here is a call into the library (nest.load, load_examples, pack,
add_lora, train): the command adds the config, the run directory and the reporting.

    linnet sft --config run.yaml --set training.steps=200
    linnet sft --template > run.yaml      # every field, its default and its help
    linnet inspect --config run.yaml      # formatted examples and the batch table
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from linnet.config import group, load_config, option, template, to_dict
from linnet.files import write_text

ALL_LINEAR = ["model.layers.*.self_attn.*_proj", "model.layers.*.mlp.*_proj"]


@dataclass
class ModelConfig:
    card: str = option("debug", "registered card name or local Hugging Face model directory")
    weights: str | None = option(None, "weights directory or file; null: the card's own; 'random': seeded init")
    dtype: str | None = option(None, "compute dtype (float32, bfloat16); null: bfloat16 on CUDA, float32 on CPU")
    device: str | None = option(None, "cpu, cuda, cuda:1 …; null: cuda when present")
    attention: str = option("auto", "attention path inside packed rows: auto, documents, dense, flex, varlen")
    compile: bool = option(False, "compile each block with torch.compile (inductor)")


@dataclass
class DataConfig:
    path: str = option("", "training records: .jsonl, .json, .parquet, or a saved datasets directory")
    eval_path: str | None = option(None, "held-out records; null: take eval_share of path")
    eval_share: float = option(0.05, "share of the training records held out when eval_path is null")
    messages: str | None = option(None, "field holding chat messages; null: 'messages' when present")
    prompt: list[str] | None = option(None, "prompt field(s); null: prompt, or instruction + input")
    completion: str | None = option(None, "completion field; null: completion, output or response")
    chat: bool = option(True, "format prompt/completion records with the chat template")
    chat_template: str | None = option(None, "a Jinja chat template overriding the tokenizer's")
    tokenizer: str | None = option(None, "tokenizer directory; null: the card's")
    tokens: int = option(2048, "positions per packed row")
    truncate: bool = option(False, "cut records longer than a row instead of refusing them")
    shuffle: bool = option(True, "shuffle the examples (seeded) before packing each epoch")


@dataclass
class LoraConfig:
    enabled: bool = option(True, "train low-rank adapters on a frozen base; false: full fine-tuning")
    rank: int = option(16, "adapter rank")
    alpha: float = option(32.0, "adapter scale numerator: alpha / rank (or / sqrt(rank) with rslora)")
    dropout: float = option(0.0, "dropout on the adapters' input")
    rslora: bool = option(False, "scale by alpha / sqrt(rank)")
    targets: list[str] = option(ALL_LINEAR, "glob patterns of the linear layers that get adapters")


@dataclass
class OptimizerConfig:
    lr: float = option(2e-4, "peak learning rate")
    betas: list[float] = option([0.9, 0.999], "AdamW betas")
    weight_decay: float = option(0.0, "AdamW decoupled weight decay")
    eps: float = option(1e-8, "AdamW epsilon")


@dataclass
class ScheduleConfig:
    name: Literal["cosine", "wsd", "constant"] = option("cosine", "cosine, wsd (warmup-stable-decay) or constant")
    warmup: int = option(10, "linear warmup steps")
    floor: float = option(0.0, "final lr as a share of the peak (cosine, wsd)")
    decay: float = option(0.2, "wsd: share of the steps spent decaying")


@dataclass
class TrainingConfig:
    steps: int | None = option(None, "optimizer steps; null: from epochs")
    epochs: float = option(1.0, "passes over the training rows when steps is null")
    accumulate: int = option(1, "packed rows per optimizer step")
    clip: float | None = option(1.0, "global gradient-norm clip; null: measure only")
    seed: int = option(0, "seed for initialisation, shuffling and dropout")
    eval_every: int = option(50, "held-out loss every this many steps (and at the end)")
    checkpoint_every: int = option(100, "checkpoint every this many steps (and at the end)")
    keep: int = option(2, "checkpoints kept")


@dataclass
class SFTConfig:
    model: ModelConfig = group(ModelConfig, "the model to fine-tune")
    data: DataConfig = group(DataConfig, "records, formatting and packing")
    lora: LoraConfig = group(LoraConfig, "low-rank adapters")
    optimizer: OptimizerConfig = group(OptimizerConfig, "AdamW")
    schedule: ScheduleConfig = group(ScheduleConfig, "learning-rate schedule")
    training: TrainingConfig = group(TrainingConfig, "steps, accumulation, evaluation, checkpoints")
    output: str = option("runs/sft", "run directory: metrics.jsonl, checkpoints/, final/")

    def __post_init__(self):
        d, t = self.data, self.training
        if not d.path:
            raise ValueError("config: data.path is required (a .jsonl, .json or .parquet file)")
        if d.tokens < 16:
            raise ValueError(f"config: data.tokens={d.tokens}; a packed row needs at least 16 positions")
        if not 0 <= d.eval_share < 1:
            raise ValueError(f"config: data.eval_share={d.eval_share}; it must be in [0, 1)")
        if t.steps is not None and t.steps < 1:
            raise ValueError(f"config: training.steps={t.steps}; use at least 1, or null with training.epochs")
        if t.epochs <= 0 or t.accumulate < 1 or t.eval_every < 1 or t.checkpoint_every < 1:
            raise ValueError("config: training.epochs must be > 0; accumulate, eval_every and checkpoint_every >= 1")


@dataclass
class Prepared:
    """Everything a run needs before its first step, built and checked up front."""

    config: SFTConfig
    card: object
    tokenizer: object
    train_examples: list
    eval_examples: list
    rows_per_epoch: int
    steps: int


def prepare(config: SFTConfig) -> Prepared:
    """Resolve the card and tokenizer, read, format and check all the data: every data
    error surfaces here, before a model is loaded."""
    from linnet import nest
    from linnet.data import load_examples, load_tokenizer
    from linnet.packing import pack

    d = config.data
    card = nest.resolve(config.model.card)
    tokenizer = load_tokenizer(d.tokenizer or card, chat_template=d.chat_template)
    read = dict(tokenizer=tokenizer, max_tokens=d.tokens, messages=d.messages, prompt=d.prompt,
                completion=d.completion, chat=d.chat, truncate=d.truncate)
    examples = load_examples(d.path, **read)
    if d.eval_path:
        held_out = load_examples(d.eval_path, **read)
    else:
        order = np.random.default_rng(config.training.seed).permutation(len(examples))
        n = int(round(d.eval_share * len(examples)))
        held_out = [examples[i] for i in order[:n]]
        examples = [examples[i] for i in sorted(order[n:])]
    if not examples:
        raise ValueError(f"{d.path}: no training records left after holding out {len(held_out)}")
    rows = sum(1 for _ in pack(examples, d.tokens, pad_id=tokenizer.pad_id))
    t = config.training
    steps = t.steps or max(1, math.ceil(t.epochs * rows / t.accumulate))
    make_schedule(config.schedule, torch.optim.SGD([torch.zeros(1, requires_grad=True)]), steps)  # check it now
    return Prepared(config, card, tokenizer, examples, held_out, rows, steps)


def make_schedule(s: ScheduleConfig, optimizer, steps: int):
    from linnet.train import constant_schedule, cosine_schedule, wsd_schedule

    try:
        if s.name == "cosine":
            return cosine_schedule(optimizer, s.warmup, steps, floor=s.floor)
        if s.name == "wsd":
            return wsd_schedule(optimizer, s.warmup, steps, decay=s.decay, floor=s.floor)
        return constant_schedule(optimizer, s.warmup)
    except ValueError as e:
        raise ValueError(f"config: schedule ({s.name}, warmup {s.warmup}) over {steps} steps: {e}") from None


def epochs_of_rows(prepared: Prepared):
    """Packed rows, epoch after epoch; each epoch reshuffles the examples by seed, so a
    resumed run sees the same stream."""
    from linnet.train import pack

    d, seed = prepared.config.data, prepared.config.training.seed
    epoch = 0
    while True:
        examples = prepared.train_examples
        if d.shuffle:
            order = np.random.default_rng([seed, epoch]).permutation(len(examples))
            examples = [examples[i] for i in order]
        yield from pack(examples, d.tokens, pad_id=prepared.tokenizer.pad_id)
        epoch += 1


def batch_table(prepared: Prepared) -> list[tuple[str, str]]:
    """The derived sizes a user checks before training."""
    from linnet.packing import pack

    d, t = prepared.config.data, prepared.config.training
    rows = list(pack(prepared.train_examples, d.tokens, pad_id=prepared.tokenizer.pad_id))
    real = sum(r.real for r in rows)
    learned = sum(r.learned for r in rows)
    positions = len(rows) * d.tokens
    return [
        ("training examples", f"{len(prepared.train_examples):,}"),
        ("held-out examples", f"{len(prepared.eval_examples):,}"),
        ("packed rows per epoch", f"{len(rows):,} of {d.tokens} positions"),
        ("padding share", f"{1 - real / positions:.1%}"),
        ("learned tokens per epoch", f"{learned:,} ({learned / real:.0%} of real tokens)"),
        ("rows per step", f"{t.accumulate}"),
        ("learned tokens per step", f"{learned / len(rows) * t.accumulate:,.0f} (mean)"),
        ("steps per epoch", f"{len(rows) / t.accumulate:,.1f}"),
        ("steps", f"{prepared.steps:,} ({prepared.steps * t.accumulate / len(rows):.2f} epochs)"),
    ]


def _held_out_loss(model, rows) -> float:
    total = count = 0.0
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for row in rows:
            loss, n = model.loss_packed(row)
            total, count = total + float(loss), count + float(n)
    model.train(was_training)
    return total / max(count, 1.0)


def _output_directory(path: Path, config_json: str, *, overwrite: bool, resume: bool) -> None:
    """Refuse to write into a used run directory unless told to replace or resume it;
    a resumed run must have the same config."""
    if path.exists() and any(path.iterdir()):
        if overwrite:
            shutil.rmtree(path)
        elif not resume:
            raise ValueError(
                f"{path}: the run directory exists and is not empty; pass --resume to continue "
                "that run from its latest checkpoint, or --overwrite to replace it"
            )
        elif (path / "config.json").is_file() and (path / "config.json").read_text() != config_json:
            raise ValueError(
                f"{path / 'config.json'}: the run was started with another config; resume it with "
                "the same config, or start a new run directory"
            )
    path.mkdir(parents=True, exist_ok=True)


def run(config: SFTConfig, *, overwrite: bool = False, resume: bool = False) -> dict:
    """Fine-tune as `config` says; returns the summary written to summary.json."""
    from linnet import nest
    from linnet.progress import Progress
    from linnet.train import pack, train

    prepared = prepare(config)  # data errors before anything is written
    out = Path(config.output)
    config_json = json.dumps(to_dict(config), indent=2) + "\n"
    _output_directory(out, config_json, overwrite=overwrite, resume=resume)
    write_text(out / "config.json", config_json)
    m, t, o, s = config.model, config.training, config.optimizer, config.schedule
    torch.manual_seed(t.seed)
    device = m.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = nest.load(prepared.card, device=device, dtype=m.dtype, weights=m.weights, seed=t.seed,
                      trainable=not config.lora.enabled, compile=m.compile, attention=m.attention)
    if config.lora.enabled:
        lo = config.lora
        model.add_lora(lo.targets, rank=lo.rank, alpha=lo.alpha, dropout=lo.dropout, rslora=lo.rslora)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay, eps=o.eps)
    steps = prepared.steps
    schedule = make_schedule(s, optimizer, steps)
    eval_rows = list(pack(prepared.eval_examples, config.data.tokens, pad_id=prepared.tokenizer.pad_id)) \
        if prepared.eval_examples else []
    print(f"{prepared.card.name}: {sum(p.numel() for p in trained):,} of "
          f"{sum(p.numel() for p in model.parameters()):,} parameters train "
          f"({'LoRA' if config.lora.enabled else 'full'}), {steps} steps on {device}", file=sys.stderr)
    bar = Progress(steps, "sft")
    metrics_file = (out / "metrics.jsonl").open("a")

    def report(step):
        row = {"step": step.step, "loss": step.loss, "lr": step.lr, "grad_norm": step.grad_norm,
               "learned": step.learned, "tokens_per_second": step.tokens_per_second, "seconds": step.seconds}
        if eval_rows and (step.step % t.eval_every == 0 or step.step == steps):
            row["held_out_loss"] = _held_out_loss(model, eval_rows)
        metrics_file.write(json.dumps(row) + "\n")
        metrics_file.flush()
        bar.update(step.step, loss=step.loss, tok_s=step.tokens_per_second)

    t0 = time.perf_counter()
    try:
        history = train(model, epochs_of_rows(prepared), optimizer=optimizer, steps=steps,
                        accumulate=t.accumulate, clip=t.clip, schedule=schedule, save_to=out / "final",
                        checkpoint=out / "checkpoints", checkpoint_every=t.checkpoint_every, keep=t.keep,
                        on_step=report)
    finally:
        metrics_file.close()
        bar.close()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r["held_out_loss"] for r in records if "held_out_loss" in r]
    summary = {
        "card": prepared.card.name, "steps": steps, "steps_this_run": len(history),
        "seconds": round(time.perf_counter() - t0, 1),
        "first_loss": records[0]["loss"] if records else None,
        "last_loss": records[-1]["loss"] if records else None,
        "held_out_loss": evals[-1] if evals else None,
        "tokens_per_second": (sum(x.real for x in history.steps) / sum(x.seconds for x in history.steps))
        if len(history) else None,
        "final": str(out / "final"),
    }
    write_text(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    return summary


def _highlight(tokenizer, example, color: bool) -> str:
    """Decoded example with learned spans marked: green on a terminal, [[…]] elsewhere."""
    pieces, start = [], 0
    learned = list(example.learned)
    for i in range(1, len(learned) + 1):
        if i == len(learned) or learned[i] != learned[start]:
            text = tokenizer.decode(example.tokens[start:i].tolist())
            if learned[start] and start > 0:
                text = f"\033[32m{text}\033[0m" if color else f"[[{text}]]"
            pieces.append(text)
            start = i
    return "".join(pieces)


def _parse(argv: list[str] | None, prog: str, description: str) -> tuple[argparse.Namespace, SFTConfig | None]:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", help="YAML config (see --template)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a field, e.g. training.steps=100 (repeatable)")
    parser.add_argument("--template", action="store_true", help="print every field with its default and help")
    if prog == "linnet sft":
        parser.add_argument("--overwrite", action="store_true", help="replace an existing run directory")
        parser.add_argument("--resume", action="store_true", help="continue the run in the run directory")
    else:
        parser.add_argument("--examples", type=int, default=3, help="examples to show (default: 3)")
    args = parser.parse_args(argv)
    if args.template:
        print(template(SFTConfig))
        return args, None
    if args.config is None and not args.set:
        parser.error("give --config FILE (and/or --set KEY=VALUE); --template shows the fields")
    return args, load_config(SFTConfig, args.config, args.set)


def cli(argv: list[str] | None = None) -> int:
    args, config = _parse(argv, "linnet sft", "Supervised fine-tuning from a YAML config.")
    if config is None:
        return 0
    summary = run(config, overwrite=args.overwrite, resume=args.resume)
    width = max(map(len, summary))
    for key, value in summary.items():
        print(f"{key:<{width}}  {value}")
    return 0


def inspect_cli(argv: list[str] | None = None) -> int:
    """Print formatted examples with their learned tokens marked, and the batch table."""
    args, config = _parse(argv, "linnet inspect", inspect_cli.__doc__)
    if config is None:
        return 0
    prepared = prepare(config)
    color = sys.stdout.isatty()
    for i, example in enumerate(prepared.train_examples[: args.examples]):
        learned = int(example.learned[1:].sum())
        print(f"--- example {i}: {len(example)} tokens, {learned} learned " +
              ("(green)" if color else "(inside [[ ]])"))
        print(_highlight(prepared.tokenizer, example, color))
    print()
    rows = batch_table(prepared)
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0

