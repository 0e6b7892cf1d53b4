"""`linnet sft`: supervised fine-tuning from a YAML config, and `linnet inspect` for its
data. Every step here is a call into the library (nest.load, load_examples, pack,
add_lora, train): the command adds the config, the run directory and the reporting.

    linnet sft --config run.yaml --set training.steps=200
    linnet sft --template > run.yaml      # every field, its default and its help
    linnet inspect --config run.yaml      # formatted examples and the batch table
"""

from __future__ import annotations

import itertools
import math
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

from linnet.config import group, option
from linnet.runs import (
    LoraConfig, MetricsLog, ModelConfig, OptimizerConfig, ScheduleConfig, TrainingConfig, adamw, load_model,
    make_schedule, open_run, parse_command, print_table, summarize,
)
from linnet.torch.distributed import data_share, process_group


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
        if t.split < 1 or (t.split > 1 and (self.lora.enabled or t.shard != "none")):
            raise ValueError(f"config: training.split={t.split} splits whole models for full fine-tuning: use a "
                             "positive count, with lora.enabled=false and training.shard=none")


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
    steps = t.steps or max(1, math.ceil(t.epochs * rows / (t.accumulate * data_share(t.split)[1])))
    make_schedule(config.schedule, torch.optim.SGD([torch.zeros(1, requires_grad=True)]), steps)  # check it now
    return Prepared(config, card, tokenizer, examples, held_out, rows, steps)


def epochs_of_rows(prepared: Prepared):
    """Packed rows, epoch after epoch; each epoch reshuffles the examples by seed, so a
    resumed run sees the same stream. Under torchrun each copy of the model (each
    process, unless training.split joins processes into one) takes every copies-th row."""
    share, shares = data_share(prepared.config.training.split)
    return itertools.islice(_all_rows(prepared), share, None, shares)


def _all_rows(prepared: Prepared):
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
    processes = data_share(t.split)[1]
    per_step = t.accumulate * processes
    return [
        ("training examples", f"{len(prepared.train_examples):,}"),
        ("held-out examples", f"{len(prepared.eval_examples):,}"),
        ("packed rows per epoch", f"{len(rows):,} of {d.tokens} positions"),
        ("padding share", f"{1 - real / positions:.1%}"),
        ("learned tokens per epoch", f"{learned:,} ({learned / real:.0%} of real tokens)"),
        ("rows per step", f"{per_step}" + (f" ({t.accumulate} in each of {processes} processes)"
                                              if processes > 1 else "")),
        ("learned tokens per step", f"{learned / len(rows) * per_step:,.0f} (mean)"),
        ("steps per epoch", f"{len(rows) / per_step:,.1f}"),
        ("steps", f"{prepared.steps:,} ({prepared.steps * per_step / len(rows):.2f} epochs)"),
    ]


def run(config: SFTConfig, *, overwrite: bool = False, resume: bool = False) -> dict:
    """Fine-tune as `config` says; returns the summary written to summary.json."""
    from linnet.train import pack, train
    from linnet.train.evaluation import held_out_loss

    prepared = prepare(config)  # data errors before anything is written
    out = open_run(config, overwrite=overwrite, resume=resume)
    t = config.training
    model = load_model(prepared.card, config.model, config.lora, t.seed, t.shard, t.split)
    optimizer = adamw(config.optimizer, model, t.shard)
    schedule = make_schedule(config.schedule, optimizer, prepared.steps)
    share, shares = data_share(t.split)
    eval_rows = list(pack(prepared.eval_examples, config.data.tokens, pad_id=prepared.tokenizer.pad_id)) \
        if prepared.eval_examples else []
    log = MetricsLog(out, "sft", prepared.steps, t.eval_every,
                     (lambda step: {"held_out_loss": held_out_loss(model, eval_rows, share=share, shares=shares)}) if eval_rows else None)
    t0 = time.perf_counter()
    try:
        history = train(model, epochs_of_rows(prepared), optimizer=optimizer, steps=prepared.steps,
                        accumulate=t.accumulate, clip=t.clip, schedule=schedule, save_to=out / "final",
                        checkpoint=out / "checkpoints", checkpoint_every=t.checkpoint_every, keep=t.keep,
                        on_step=log)
    finally:
        log.close()
    return summarize(out, history, time.perf_counter() - t0, card=prepared.card.name, steps=prepared.steps)


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


def cli(argv: list[str] | None = None) -> int:
    args, config = parse_command(argv, "linnet sft", "Supervised fine-tuning from a YAML config (under "
                                 "torchrun, each process trains on its share of the rows).", SFTConfig,
                                 training=True)
    if config is not None:
        with process_group():
            print_table(run(config, overwrite=args.overwrite, resume=args.resume))
    return 0


def inspect_cli(argv: list[str] | None = None) -> int:
    """Print formatted examples with their learned tokens marked, and the batch table."""
    args, config = parse_command(argv, "linnet inspect", inspect_cli.__doc__, SFTConfig, training=False)
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
    print_table(batch_table(prepared))
    return 0

