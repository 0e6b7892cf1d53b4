"""`linnet sft`: supervised fine-tuning from a YAML config. Every step here is a call into
the library (nest.load, examples_from_records, pack, add_lora, train): the command adds the
config, the run directory and the reporting.

    linnet sft --config run.yaml --set training.steps=200
    linnet sft --template > run.yaml      # every field, its default and its help
    torchrun --nproc-per-node 2 -m linnet.cli sft --config run.yaml --set training.shard=fsdp
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from linnet.commands import runs, spellings
from linnet.config import SFTConfig
from linnet.torch.distributed import data_share


@dataclass
class Inputs:
    """What a run reads before its first step, built and checked up front."""

    config: SFTConfig
    card: object
    tokenizer: object
    train_examples: list
    eval_examples: list
    rows_per_epoch: int
    steps: int


def read_inputs(config: SFTConfig) -> Inputs:
    """Resolve the card and tokenizer, read, format and check all the data: every data
    error surfaces here, before a model is loaded."""
    from linnet.cards import configured
    from linnet.data import examples_from_records, load_tokenizer
    from linnet.packing import count_rows

    d, t = config.data, config.training
    card = configured(vars(config.model))
    tokenizer = load_tokenizer(d.tokenizer or card, chat_template=d.chat_template)
    records, held_out = split_records(config)
    runs.check_held_out(config, records, held_out)
    read = dict(tokens=t.context_length, **record_fields(config), truncate=d.truncate,
                names=spellings.RECORDS)
    examples = examples_from_records(records, tokenizer, **read)
    held_out = examples_from_records(held_out, tokenizer, **read) if held_out else []
    rows = count_rows(examples, t.context_length)
    steps = t.steps or max(1, math.ceil(t.epochs * rows / (t.accumulation * data_share(t.per_copy)[1])))
    runs.steps_factor(config, steps)  # a schedule that cannot fit fails now
    return Inputs(config, card, tokenizer, examples, held_out, rows, steps)


def split_records(config: SFTConfig) -> tuple[list, list]:
    """(training records, held-out records): data.eval_path's, else a seeded data.eval_share
    of data.path's. Split before tokenizing, so another tokenizer (a distillation teacher's)
    reads the same records."""
    from linnet.data import read_records

    d = config.data
    records = read_records(d.path, split=d.split, names=spellings.RECORDS)
    if d.eval_path:
        held_out = read_records(d.eval_path)
    else:
        records, held_out = runs.hold_out(records, d.eval_share, config.runtime.seed)
    if not records:
        raise ValueError(f"{d.path}: no training records left after holding out {len(held_out)}")
    return records, held_out


def record_fields(config: SFTConfig) -> dict:
    """Which fields of a record hold its text, and whether it goes through the chat template."""
    d = config.data
    return dict(messages=d.messages, prompt=d.prompt, completion=d.completion, chat=d.chat)


def epochs_of_rows(inputs: Inputs):
    """Packed rows, epoch after epoch; each epoch reshuffles the examples by seed, so a
    resumed run sees the same stream. Under torchrun each copy of the model (each
    process, unless training.split or training.pipeline joins processes into one) takes every
    copies-th row."""
    share, shares = data_share(inputs.config.training.per_copy)
    return itertools.islice(_all_rows(inputs), share, None, shares)


def _all_rows(inputs: Inputs):
    from linnet.packing import pack

    d, seed = inputs.config.data, inputs.config.runtime.seed
    epoch = 0
    while True:
        examples = inputs.train_examples
        if d.shuffle:
            order = np.random.default_rng([seed, epoch]).permutation(len(examples))
            examples = [examples[i] for i in order]
        yield from pack(examples, inputs.config.training.context_length, pad_id=inputs.tokenizer.pad_id)
        epoch += 1


def batch_table(inputs: Inputs) -> list[tuple[str, str]]:
    """The derived sizes a user checks before training."""
    from linnet.packing import fitted

    t = inputs.config.training
    examples = fitted(inputs.train_examples, t.context_length)
    rows = inputs.rows_per_epoch
    real = sum(len(ex) for ex in examples)
    learned = int(sum(ex.learned[1:].sum() for ex in examples))
    processes = data_share(t.per_copy)[1]
    per_step = t.accumulation * processes
    return [
        ("training examples", f"{len(inputs.train_examples):,}"),
        ("held-out examples", f"{len(inputs.eval_examples):,}"),
        ("packed rows per epoch", f"{rows:,} of {t.context_length} positions"),
        ("padding share", f"{1 - real / (rows * t.context_length):.1%}"),
        ("learned tokens per epoch", f"{learned:,} ({learned / real:.0%} of real tokens)"),
        ("rows per step", f"{per_step}" + (f" ({t.accumulation} in each of {processes} processes)"
                                              if processes > 1 else "")),
        ("learned tokens per step", f"{learned / rows * per_step:,.0f} (mean)"),
        ("steps per epoch", f"{rows / per_step:,.1f}"),
        ("steps", f"{inputs.steps:,} ({inputs.steps * per_step / rows:.2f} epochs)"),
    ]


def run(config: SFTConfig, *, overwrite: bool = False, resume: bool = False,
        resume_from: str | None = None) -> dict:
    """Fine-tune as `config` says; returns the summary written to summary.json."""
    from linnet.packing import pack
    from linnet.train import train
    from linnet.train.evaluation import held_out_loss

    data = read_inputs(config)  # data errors before anything is written
    job = runs.start(config, data.steps, overwrite=overwrite, resume=resume, resume_from=resume_from)
    if job.complete is not None:
        return job.complete
    t = config.training
    model = job.load(data.card)
    share, shares = data_share(t.per_copy)
    eval_rows = list(pack(data.eval_examples, t.context_length, pad_id=data.tokenizer.pad_id))

    def evaluate(model):
        return {"held_out_loss": held_out_loss(model, eval_rows, share=share, shares=shares)}

    with job.open(model, evaluate if eval_rows else None) as run:
        history = train(model, epochs_of_rows(data), run, accumulate=t.accumulation)
    return job.summarize(history, card=data.card.name)


def main(argv: list[str] | None = None) -> int:
    args, config = runs.parse_command(argv, "linnet sft", "Supervised fine-tuning from a YAML config (under "
                                 "torchrun, each process trains on its share of the rows).", SFTConfig,
                                 training=True)
    return 0 if config is None else runs.execute(run, args, config)
