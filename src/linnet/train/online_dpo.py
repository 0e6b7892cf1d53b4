"""Online DPO (TRL's OnlineDPOTrainer; Guo et al. 2024, arXiv:2402.04792): the policy
samples its own pairs every step, so the preferences stay about what it writes now.

    engine = Engine(nest.load(card))                  # a second copy, for sampling
    history = online_dpo(policy, engine, [Prompt(ids, answer), ...], reward,
                         reference=nest.load(card),   # frozen; none for simpo and orpo
                         optimizer=opt, steps=100, pairs_per_step=16, samples=4, max_new_tokens=64)

Each step: copy the policy's weights into the engine (adapters merged); sample `samples`
completions of each of the step's `pairs_per_step` prompts, seeded by (seed, step) so a
resumed run samples what an uninterrupted one does (GRPO's sampling and scoring,
linnet.rl.rollouts.sample_and_score); score them with the reward(s); pair each prompt's
best completion (chosen) with its worst (rejected), leaving out prompts whose completions
all score alike (`ties`); then take one DPO step on those pairs, with any pair loss
(linnet.train.dpo.pair_work: the same rows, losses and metrics as offline DPO). The
reference is a frozen copy of the starting model, its log-probabilities computed row by
row beside the policy's (reference-free losses, simpo and orpo, take none).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from linnet.config.groups import DPOSettings
from linnet.packing import Pair
from linnet.rl.rollouts import (
    Prompt,
    Reward,
    Scored,
    check_prompts,
    reward_functions,
    reward_metrics,
    sample_and_score,
    step_seed,
)
from linnet.run import History, Run, run_and_options
from linnet.torch.distributed import sum_across
from linnet.torch.sharding import copy_first
from linnet.train.dpo import pair_work
from linnet.train.loop import Work, copies_of, fit, trained_parameters
from linnet.train.preference_loss import REFERENCE_FREE

__all__ = ["online_dpo", "online_pairs"]


def online_pairs(scored: Scored, prompts: Sequence[Prompt]) -> tuple[list[Pair], np.ndarray]:
    """(one Pair a prompt: its best-rewarded completion over its worst, the first of each
    where several score alike; their rewards, [pairs, 2]). A prompt whose completions all
    score alike (`scored.uniform`) makes none: it says nothing about what to prefer."""
    samples = scored.rewards.shape[1]
    pairs, rewards = [], []
    for p in np.flatnonzero(~scored.uniform):
        best, worst = int(np.argmax(scored.rewards[p])), int(np.argmin(scored.rewards[p]))
        group = scored.samples[p * samples : (p + 1) * samples]
        pairs.append(Pair(list(prompts[p].ids), list(group[best].tokens), list(group[worst].tokens)))
        rewards.append((scored.rewards[p, best], scored.rewards[p, worst]))
    return pairs, np.array(rewards, dtype=np.float64).reshape(-1, 2)


def online_dpo(policy, engine, prompts: Iterable[Prompt], reward: Reward | Mapping[str, Reward],
               run: Run | None = None, *, settings: DPOSettings | None = None, reference=None,
               stop: Iterable[int] | None = None, tokens: int = 4096, seed: int = 0, **options) -> History:
    """Train `policy` with DPO on pairs it samples itself, for `run.steps` steps (see the
    module docstring).

    run: a linnet.run.Run, or its fields as keywords (optimizer=, steps=, ...).
    options: the fields of linnet.config.groups.DPOSettings (the YAML's `dpo` group, `online`
        set; `settings=` gives them all at once): pairs_per_step (prompts a step, each
        making at most one pair), samples (2: completions a prompt), max_new_tokens,
        temperature, top_k, top_p (GRPO's sampling names), beta, loss_type, label_smoothing,
        simpo_gamma, rpo_alpha as in `dpo`.
    reward: f(prompt, completion_ids) -> number, or a dict name -> f (summed), as grpo's.
    reference: a frozen copy of the starting model; required unless loss_type is simpo or
        orpo. tokens: positions per packed row, which holds a pair's prompt and both
        answers. A sequence of prompts is repeated as epochs; an iterator is read once.

    Each Step's metrics hold dpo's (pairs, rewards/*, logps/*: the policy's before the
    update), the sampled completions' reward and reward_std (and each reward's, where
    several), reward_chosen and reward_rejected (means over the pairs), ties (prompts left
    out), completion_length, copy_seconds and sample_seconds.
    """
    run, s = run_and_options("online_dpo", run, {"online": True, **options}, DPOSettings, settings)
    if not s.online:
        raise ValueError("online_dpo: online=False; for pairs you already have, call linnet.train.dpo.dpo")
    functions = reward_functions(reward)
    free = s.loss_type in REFERENCE_FREE
    if free and reference is not None:
        raise ValueError(f"online_dpo: loss_type={s.loss_type!r} is reference-free; pass no reference")
    if not free and reference is None:
        raise ValueError(f"online_dpo: loss_type={s.loss_type!r} compares with a reference: pass reference=, a "
                         "frozen copy of the starting model, or use a reference-free loss_type (simpo, orpo)")
    trained_parameters(policy)
    room = {"tokens": "tokens=, half of it: a row holds a pair's prompt and two answers"}
    if isinstance(prompts, Sequence):
        check_prompts(enumerate(prompts), tokens // 2, s.max_new_tokens, room, who="online_dpo")
    copies = copies_of(policy)

    def work(step: int, chunk: list) -> Work:
        check_prompts(chunk, tokens // 2, s.max_new_tokens, room, who="online_dpo")
        t0 = time.perf_counter()
        engine.load_weights(policy)
        copied = time.perf_counter() - t0
        scored = copy_first(policy, lambda: sample_and_score(
            engine, chunk, functions, group=s.samples, max_new_tokens=s.max_new_tokens, temperature=s.temperature,
            top_k=s.top_k, top_p=s.top_p, stop=stop, seed=step_seed(seed, step), dr_grpo=False, drop_uniform=False))
        pairs, rewards = online_pairs(scored, [p for _, p in chunk])
        made, chosen, rejected, ties = sum_across(
            [float(len(pairs)), float(rewards[:, 0].sum()), float(rewards[:, 1].sum()), float(scored.uniform.sum())],
            copies)
        step_work = pair_work(policy, pairs, s, tokens=tokens, reference=reference)
        pair_metrics, lengths = step_work.metrics, [len(c.tokens) for c in scored.samples]

        def metrics(sums: dict[str, float]) -> dict[str, float]:
            return {**pair_metrics(sums), **reward_metrics(scored.rewards, scored.per_function),
                    "reward_chosen": chosen / max(made, 1.0), "reward_rejected": rejected / max(made, 1.0),
                    "ties": ties, "completion_length": float(np.mean(lengths)), "copy_seconds": copied,
                    "sample_seconds": scored.seconds}

        return dataclasses.replace(step_work, metrics=metrics)

    stream = itertools.cycle(enumerate(prompts)) if isinstance(prompts, Sequence) else enumerate(prompts)
    return fit(policy, stream, work, run, per_step=s.pairs_per_step, what="online_dpo: the prompts")
