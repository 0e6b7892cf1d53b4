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
import warnings
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
    sources: list[int] | None = None  # data.mixture: each source's examples, laid end to end in train_examples


def read_inputs(config: SFTConfig) -> Inputs:
    """Resolve the card and tokenizer, read, format and check all the data: every data
    error surfaces here, before a model is loaded."""
    from linnet.data import examples_from_records
    from linnet.packing import count_rows

    d, t = config.data, config.training
    card, tokenizer = runs.card_and_tokenizer(config)
    sources, held_out = source_records(config)
    runs.check_held_out(config, [r for s in sources for r in s], [r for part in held_out for r in part])
    read = dict(tokens=t.context_length, **record_fields(config), truncate=d.truncate,
                names=spellings.RECORDS)
    per_source = [examples_from_records(records, tokenizer, **read) for records in sources]
    examples = [e for part in per_source for e in part]
    held_out = [e for part in held_out if part for e in examples_from_records(part, tokenizer, **read)]
    long = [len(e) for e in examples + held_out if len(e) > card.max_positions]
    if long:  # positions restart each document, so only a document past them is out of range
        warnings.warn(f"{len(long)} record(s) run past the {card.max_positions} positions of {card.name} (the longest: "
                      f"{max(long)} tokens), which it has not learned; extend its context with model.rope_scaling "
                      "(docs/long_context.md) or shorten the records",
                      UserWarning, stacklevel=2)
    inputs = Inputs(config, card, tokenizer, examples, held_out, 0, 0,
                    [len(part) for part in per_source] if d.mixture else None)
    inputs.rows_per_epoch = count_rows(epoch_examples(inputs, 0), t.context_length)
    inputs.steps = t.steps or max(1, math.ceil(t.epochs * inputs.rows_per_epoch
                                               / (t.accumulation * data_share(t.per_copy)[1])))
    runs.steps_factor(config, inputs.steps)  # a schedule that cannot fit fails now
    return inputs


def source_records(config: SFTConfig) -> tuple[list[list], list[list]]:
    """(each source's training records: data.path's alone, or data.mixture's in order;
    the held-out records: data.eval_path's, else each source's share). Each source is
    read as its own records' shape (a mixture may hold chats beside prompt/completion)."""
    from linnet.data import read_records

    d = config.data
    held_out: list[list] = [read_records(d.eval_path, field="data.eval_path")] if d.eval_path else []
    sources = []
    for path, split in [(m["path"], m.get("split")) for m in d.mixture] or [(d.path, d.split)]:
        records = read_records(path, split=split, names=spellings.RECORDS,
                               field="a data.mixture path" if d.mixture else "data.path")
        if not d.eval_path:
            records, out = runs.hold_out(records, d.eval_share, config.runtime.seed)
            held_out.append(out)
        if not records:
            raise ValueError(f"{path}: no training records left after holding out {len(held_out[-1])}")
        sources.append(records)
    return sources, held_out


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

    epoch = 0
    while True:
        yield from pack(epoch_examples(inputs, epoch), inputs.config.training.context_length,
                        pad_id=inputs.tokenizer.pad_id)
        epoch += 1


def epoch_examples(inputs: Inputs, epoch: int) -> list:
    """An epoch's examples: all of them, reshuffled by seed and epoch (data.shuffle), or
    data.mixture's draw from each source in proportion, interleaved (linnet.data.mixture)."""
    from linnet.data.mixture import mixture_epoch

    d, seed, examples = inputs.config.data, inputs.config.runtime.seed, inputs.train_examples
    if inputs.sources is not None:
        if sum(inputs.sources) != len(examples):
            raise ValueError(f"data.mixture: {len(examples)} training examples, but its sources read "
                             f"{sum(inputs.sources)}; a mixture needs one example a record")
        order = mixture_epoch(inputs.sources, [m["weight"] for m in d.mixture], seed=seed, epoch=epoch)
    elif d.shuffle:
        order = np.random.default_rng([seed, epoch]).permutation(len(examples))
    else:
        return examples
    return [examples[i] for i in order]


def batch_table(inputs: Inputs) -> list[tuple[str, str]]:
    """The derived sizes a user checks before training."""
    from linnet.data.mixture import shares
    from linnet.packing import fitted

    t = inputs.config.training
    examples = fitted(epoch_examples(inputs, 0), t.context_length)
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
    ] + ([(f"mixture: {m['path']}", f"{n:,} records, {taken:,} an epoch (weight {m['weight']})")
          for m, n, taken in zip(inputs.config.data.mixture, inputs.sources,
                                 shares([m["weight"] for m in inputs.config.data.mixture], sum(inputs.sources)))]
         if inputs.sources else [])


def run(config: SFTConfig, *, overwrite: bool = False, resume: bool = False,
        resume_from: str | None = None, tenant=None) -> dict:
    """Fine-tune as `config` says; returns the summary written to summary.json. `tenant`:
    one of several adapters trained over a shared base (linnet.commands.adapters)."""
    from linnet.packing import pack
    from linnet.train import train
    from linnet.train.evaluation import held_out_loss

    data = read_inputs(config)  # data errors before anything is written
    job = runs.start(config, data.steps, overwrite=overwrite, resume=resume, resume_from=resume_from,
                     tenant=tenant)
    if job.complete is not None:
        return job.complete
    t = config.training
    model = job.load(data.card)
    share, shares = data_share(t.per_copy)
    eval_rows = list(pack(data.eval_examples, t.context_length, pad_id=data.tokenizer.pad_id)) \
        if data.eval_examples else []  # data.eval_share: 0 holds nothing out

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
