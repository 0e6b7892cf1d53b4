"""`linnet dpo`: preference optimization from a YAML config, with the run directory,
config groups and reporting of `linnet sft` (see linnet.runs).

    linnet dpo --config dpo.yaml --set dpo.beta=0.2
    linnet dpo --template > dpo.yaml
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from linnet.config import group, option
from linnet.runs import (
    LoraConfig, MetricsLog, ModelConfig, OptimizerConfig, ScheduleConfig, TrainingConfig, adamw, load_model,
    make_schedule, open_run, parse_command, print_table, split_per_step, summarize,
)
from linnet.torch.distributed import process_group, sum_across, world


@dataclass
class PairsDataConfig:
    path: str = option("", "preference records: .jsonl, .json, .parquet, or a saved datasets directory")
    eval_path: str | None = option(None, "held-out records; null: take eval_share of path")
    eval_share: float = option(0.05, "share of the records held out when eval_path is null")
    prompt: str = option("prompt", "prompt field (text or messages); absent in full-dialogue records")
    chosen: str = option("chosen", "preferred answer field (text, a message, or a whole dialogue)")
    rejected: str = option("rejected", "other answer field")
    chat: bool = option(True, "render with the chat template (when the tokenizer has one)")
    chat_template: str | None = option(None, "a Jinja chat template overriding the tokenizer's")
    tokenizer: str | None = option(None, "tokenizer directory; null: the card's")
    tokens: int = option(2048, "positions per packed row; a pair's two answers share a row")


@dataclass
class DPOSettings:
    beta: float = option(0.1, "strength of the implicit KL constraint: rewards are beta * log(pi / ref)")
    label_smoothing: float = option(0.0, "share of pairs taken as labelled the wrong way round (cDPO)")
    pairs_per_step: int = option(32, "pairs per optimizer step")
    reference_cache: str | None = option(None, "directory caching reference log-probs across runs")


@dataclass
class DPOConfig:
    model: ModelConfig = group(ModelConfig, "the policy (and, before training, its own reference)")
    data: PairsDataConfig = group(PairsDataConfig, "preference records and packing")
    dpo: DPOSettings = group(DPOSettings, "the DPO objective")
    lora: LoraConfig = group(LoraConfig, "low-rank adapters")
    optimizer: OptimizerConfig = group(OptimizerConfig, "AdamW")
    schedule: ScheduleConfig = group(ScheduleConfig, "learning-rate schedule")
    training: TrainingConfig = group(TrainingConfig, "steps, evaluation, checkpoints (accumulate unused)")
    output: str = option("runs/dpo", "run directory: metrics.jsonl, checkpoints/, final/")

    def __post_init__(self):
        if not self.data.path:
            raise ValueError("config: data.path is required (preference records)")
        if self.training.split != 1:
            raise ValueError("config: training.split (tensor parallel) trains sft only; use training.shard=fsdp")
        if self.training.accumulate != 1:
            raise ValueError("config: training.accumulate is not used by dpo; set dpo.pairs_per_step instead")
        if not self.dpo.beta > 0 or not 0 <= self.dpo.label_smoothing < 0.5 or self.dpo.pairs_per_step < 1:
            raise ValueError("config: dpo.beta must be > 0, dpo.label_smoothing in [0, 0.5), dpo.pairs_per_step >= 1")


def prepare(config: DPOConfig):
    """(card, train pairs, held-out pairs, steps), every record checked up front."""
    from linnet import nest
    from linnet.data import load_tokenizer, pairs_from_records, read_records

    d = config.data
    card = nest.resolve(config.model.card)
    tokenizer = load_tokenizer(d.tokenizer or card, chat_template=d.chat_template)
    fields = dict(prompt=d.prompt, chosen=d.chosen, rejected=d.rejected, chat=d.chat)
    pairs = pairs_from_records(read_records(d.path), tokenizer, **fields)
    if d.eval_path:
        held_out = pairs_from_records(read_records(d.eval_path), tokenizer, **fields)
    else:
        order = np.random.default_rng(config.training.seed).permutation(len(pairs))
        n = round(d.eval_share * len(pairs))
        held_out, pairs = [pairs[i] for i in order[:n]], [pairs[i] for i in sorted(order[n:])]
    for i, p in enumerate(pairs + held_out):
        need = 2 * len(p.prompt) + len(p.chosen) + len(p.rejected)
        if need > d.tokens:
            raise ValueError(f"{d.path}: pair {i} needs {need} positions (the prompt twice and both answers), "
                             f"more than a row of {d.tokens}; raise data.tokens")
    t = config.training
    steps = t.steps or max(1, math.ceil(t.epochs * len(pairs) / config.dpo.pairs_per_step))
    make_schedule(config.schedule, torch.optim.SGD([torch.zeros(1, requires_grad=True)]), steps)
    return card, pairs, held_out, steps


def held_out_preferences(model, pairs, reference: np.ndarray, beta: float, tokens: int) -> dict:
    """Held-out DPO loss, accuracy and margin against precomputed reference log-probs
    (under torchrun, `pairs` are this process's share; the means are over every share)."""
    from linnet.train.dpo import dpo_sigmoid, reference_log_probs

    policy = torch.as_tensor(reference_log_probs(model, pairs, tokens=tokens)).view(-1, 2)
    ref = torch.as_tensor(reference).view(-1, 2)
    loss = dpo_sigmoid(policy[:, 0], policy[:, 1], ref[:, 0], ref[:, 1], beta=beta)
    margins = beta * ((policy[:, 0] - ref[:, 0]) - (policy[:, 1] - ref[:, 1]))
    n, loss_sum, right, margin_sum = sum_across(
        [len(pairs), float(loss.sum()), float((margins > 0).sum()), float(margins.sum())])
    return {"held_out_loss": loss_sum / n, "held_out_accuracy": right / n, "held_out_margin": margin_sum / n}


def run(config: DPOConfig, *, overwrite: bool = False, resume: bool = False) -> dict:
    from linnet.train.dpo import dpo, reference_log_probs

    card, pairs, held_out, steps = prepare(config)
    t, d, s = config.training, config.data, config.dpo
    per_process = split_per_step("dpo.pairs_per_step", s.pairs_per_step)
    rank, processes = world()
    pairs, held_out = pairs[rank::processes], held_out[rank::processes]  # this process's share
    out = open_run(config, overwrite=overwrite, resume=resume)
    model = load_model(card, config.model, config.lora, t.seed, t.shard)
    optimizer = adamw(config.optimizer, model, t.shard)
    schedule = make_schedule(config.schedule, optimizer, steps)
    evaluate = None
    if sum_across([len(held_out)])[0]:
        held_ref = reference_log_probs(model, held_out, tokens=d.tokens)  # before any step: the reference

        def evaluate(step):
            return held_out_preferences(model, held_out, held_ref, s.beta, d.tokens)

    log = MetricsLog(out, "dpo", steps, t.eval_every, evaluate)
    t0 = time.perf_counter()
    try:
        history = dpo(model, pairs, optimizer=optimizer, steps=steps, pairs_per_step=per_process,
                      beta=s.beta, label_smoothing=s.label_smoothing, reference_cache=s.reference_cache,
                      tokens=d.tokens, clip=t.clip, schedule=schedule, save_to=out / "final",
                      checkpoint=out / "checkpoints", checkpoint_every=t.checkpoint_every, keep=t.keep,
                      on_step=log)
    finally:
        log.close()
    return summarize(out, history, time.perf_counter() - t0, card=card.name, steps=steps)


def cli(argv: list[str] | None = None) -> int:
    args, config = parse_command(argv, "linnet dpo", "Direct preference optimization from a YAML config.",
                                 DPOConfig, training=True)
    if config is not None:
        with process_group():
            print_table(run(config, overwrite=args.overwrite, resume=args.resume))
    return 0
