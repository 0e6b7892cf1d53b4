"""`linnet dpo`: preference optimization from a YAML config, with the run directory and
reporting every training command shares (linnet.commands.runs).

    linnet dpo --config dpo.yaml --set dpo.beta=0.2
    linnet dpo --config configs/dpo_online.yaml     # dpo.online: pairs sampled each step
    linnet dpo --template > dpo.yaml

With `dpo.online: true` the records are prompts (`prompt`, and `data.answer` for the
rewards), read, rewarded and evaluated as `linnet grpo` does (linnet.commands.grpo), and
linnet.train.online_dpo trains on the pairs it samples.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import torch

from linnet.commands import runs, spellings
from linnet.config import DPOConfig
from linnet.torch.distributed import data_share, sum_across


def read_pairs(config: DPOConfig):
    """(card, tokenizer, train pairs, held-out pairs, steps), every record checked up front."""
    return preference_data(config, config.dpo.pairs_per_step, "dpo.pairs_per_step", config.dpo.loss_type == "kto")


def preference_data(config, per_step: int, per_step_field: str, unpaired: bool = False):
    """(card, tokenizer, train examples, held-out examples, steps) of a preference config
    (`linnet dpo`, `linnet reward`): pairs, or unpaired labelled answers for KTO, every
    record checked up front."""
    from linnet.data import pairs_from_records, read_records, unpaired_from_records

    d, t = config.data, config.training
    card, tokenizer = runs.card_and_tokenizer(config)
    prompt = (d.prompt or ["prompt"])[0]
    if unpaired:
        fields = dict(prompt=prompt, completion=d.completion or "completion", label=d.label, chat=d.chat,
                      names=spellings.RECORDS)
        read = functools.partial(unpaired_from_records, **fields)
    else:
        read = functools.partial(pairs_from_records, prompt=prompt, chosen=d.chosen, rejected=d.rejected, chat=d.chat,
                                 tokens=t.context_length, truncate=d.truncate, names=spellings.RECORDS)
    records = read_records(d.path, split=d.split, names=spellings.RECORDS)
    pairs = read(records, tokenizer)
    if d.eval_path:
        eval_records = read_records(d.eval_path, names=spellings.RECORDS, field="data.eval_path")
        held_out = read(eval_records, tokenizer)
        runs.check_held_out(config, records, eval_records)
    else:
        runs.check_held_out(config, records, items=len(pairs))
        pairs, held_out = runs.hold_out(pairs, d.eval_share, config.runtime.seed)
    for examples in (pairs, held_out) if unpaired else ():  # pairs are fitted to a row as they are read
        for i, p in enumerate(examples):  # an answer also follows the next example's prompt (the KL estimate)
            need = max(len(p.prompt), len(examples[(i + 1) % len(examples)].prompt)) + len(p.completion)
            if need > t.context_length:
                raise ValueError(f"{d.path}: example {i} needs {need} positions (a prompt and its answers), more "
                                 f"than a row of {t.context_length}; raise training.context_length")
    if per_step > len(pairs):
        raise ValueError(f"{d.path}: {per_step_field}={per_step} is more than the {len(pairs)} training examples, so "
                         f"examples would repeat within a step; lower {per_step_field}")
    steps = t.steps or max(1, math.ceil(t.epochs * len(pairs) / per_step))
    runs.steps_factor(config, steps)
    return card, tokenizer, pairs, held_out, steps


def held_out_preferences(model, pairs, reference: np.ndarray | None, settings, tokens: int) -> dict:
    """Held-out loss (the run's loss_type), accuracy and margin against precomputed
    reference log-probs (None for reference-free losses); under torchrun, `pairs` are
    this process's share and the means are over every share."""
    from linnet.train.dpo import reference_log_probs
    from linnet.train.preference_loss import pair_losses

    s = settings
    policy = torch.as_tensor(reference_log_probs(model, pairs, tokens=tokens)).view(-1, 2)
    ref = None if reference is None else torch.as_tensor(reference).view(-1, 2)
    lengths = torch.tensor([[len(p.chosen), len(p.rejected)] for p in pairs], dtype=policy.dtype).view(-1, 2)
    loss, good, bad = pair_losses(s.loss_type, policy[:, 0], policy[:, 1], None if ref is None else ref[:, 0],
                                  None if ref is None else ref[:, 1], beta=s.beta, label_smoothing=s.label_smoothing,
                                  simpo_gamma=s.simpo_gamma, chosen_tokens=lengths[:, 0], rejected_tokens=lengths[:, 1])
    margins = good - bad
    n, loss_sum, right, margin_sum = sum_across(
        [len(pairs), float(loss.sum()), float((margins > 0).sum()), float(margins.sum())])
    return {"held_out_loss": loss_sum / n, "held_out_accuracy": right / n, "held_out_margin": margin_sum / n}


def run(config: DPOConfig, *, overwrite: bool = False, resume: bool = False,
        resume_from: str | None = None, tenant=None) -> dict:
    """Preference-train as `config` says; returns the summary. `tenant`: one of several
    adapters trained over a shared base (linnet.commands.adapters)."""
    from linnet.train.dpo import dpo, reference_log_probs
    from linnet.train.kto import held_out_kto, kto
    from linnet.train.kto import reference_log_probs as kto_reference
    from linnet.train.preference_loss import REFERENCE_FREE

    if config.dpo.online:
        return run_online(config, overwrite=overwrite, resume=resume, resume_from=resume_from)
    card, _, pairs, held_out, steps = read_pairs(config)
    t, s = config.training, config.dpo
    per_process = runs.split_per_step("dpo.pairs_per_step", s.pairs_per_step, t.per_copy)
    share, shares = data_share(t.per_copy)  # the processes of a split take the same pairs
    pairs, held_out = pairs[share::shares], held_out[share::shares]
    job = runs.start(config, steps, overwrite=overwrite, resume=resume, resume_from=resume_from, tenant=tenant)
    if job.complete is not None:
        return job.complete
    model = job.load(card)
    evaluate = None
    kto_weights = dict(desirable_weight=s.desirable_weight, undesirable_weight=s.undesirable_weight)
    if sum_across([len(held_out)])[0]:
        # before any step: the reference (none for reference-free losses)
        if s.loss_type == "kto":
            held_ref = kto_reference(model, held_out, tokens=t.context_length)

            def evaluate(model):
                return held_out_kto(model, held_out, held_ref, beta=s.beta, tokens=t.context_length, **kto_weights)
        else:
            held_ref = None if s.loss_type in REFERENCE_FREE else reference_log_probs(model, held_out,
                                                                                       tokens=t.context_length)

            def evaluate(model):
                return held_out_preferences(model, held_out, held_ref, s, t.context_length)

    with job.open(model, evaluate) as run:
        if s.loss_type == "kto":
            history = kto(model, pairs, run, examples_per_step=per_process, beta=s.beta, tokens=t.context_length,
                          **kto_weights)
        else:
            history = dpo(model, pairs, run, settings=dataclasses.replace(s, pairs_per_step=per_process),
                          tokens=t.context_length)
    return job.summarize(history, card=card.name)


def run_online(config: DPOConfig, *, overwrite: bool = False, resume: bool = False,
               resume_from: str | None = None) -> dict:
    """`linnet dpo` with dpo.online: prompts and rewards as `linnet grpo` reads them, the
    builtin engine, a frozen reference (none for simpo and orpo), held-out reward and pass@1."""
    from linnet.commands.grpo import engine_and_reference, held_out_evaluation, prompts_and_rewards
    from linnet.rl.rollouts import check_prompts
    from linnet.train.online_dpo import online_dpo
    from linnet.train.preference_loss import REFERENCE_FREE

    s, t = config.dpo, config.training
    r = prompts_and_rewards(config, s, "pairs_per_step")
    check_prompts(enumerate(r.prompts), t.context_length // 2, s.max_new_tokens, who="dpo", names={
        "tokens": "training.context_length, half of it: a row holds a pair's prompt and two answers",
        "max_new_tokens": "dpo.max_new_tokens"})
    job = runs.start(config, r.steps, overwrite=overwrite, resume=resume, resume_from=resume_from)
    if job.complete is not None:
        return job.complete
    policy = job.load(r.card)
    engine, reference = engine_and_reference(config, s, r.card, policy, reference=s.loss_type not in REFERENCE_FREE)
    with job.open(policy, held_out_evaluation(config, s, engine, r)) as run:
        history = online_dpo(policy, engine, r.prompts, r.functions, run,
                             settings=dataclasses.replace(s, pairs_per_step=r.per_process), reference=reference,
                             tokens=t.context_length, seed=config.runtime.seed + 7919 * r.share)
    return job.summarize(history, card=r.card.name)


def main(argv: list[str] | None = None) -> int:
    args, config = runs.parse_command(argv, "linnet dpo", "Direct preference optimization from a YAML config.",
                                 DPOConfig, training=True)
    return 0 if config is None else runs.execute(run, args, config)
