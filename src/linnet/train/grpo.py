"""GRPO training: sample groups with the Engine, score, and take clipped policy-gradient
steps through the policy's `log_probs_packed` entry. The objective is in grpo_loss.py.

    engine = Engine(nest.load(card))                       # a second copy, for sampling
    history = grpo(policy, engine, [Prompt(ids, answer), ...], reward, optimizer=opt,
                   steps=200, group=8, prompts_per_step=8, max_new_tokens=256)

Each step: copy the policy's weights into the engine (adapters merged); sample `group`
completions of each of the step's prompts (a prompt passes the model once); score each
with `reward(prompt, completion_ids)`; turn rewards into group-relative advantages;
pack each prompt once, its completions attending to it, into rows of `tokens` positions
(the micro-batches: group size never decides them); recompute the policy's
log-probabilities row by row, and take `iterations` optimizer steps on the clipped
surrogate, averaged over every completion token of the step. Completions whose advantage
is 0 (a group all right or all wrong) skip the forward and backward when beta = 0: their
loss and gradient are exactly 0, and their tokens still count in the average
(`rollouts.to_train`).

`evaluate(policy, engine, held_out, reward, k=8)` scores held-out prompts through the
engine (greedy reward and pass@1, and pass@k from sampled completions), for a Run's
`evaluate`; `linnet grpo` calls it every `evaluation.every` steps.

A step is three pieces, each tested alone: a `Sampler` (sampling and scoring, with DAPO's
dynamic sampling; linnet.rl.rollouts, shared with the JAX trainer), the rows
packed from what trains (`_rollout`), and a `PolicyHead` (the loss of a row, with the
state it keeps across the step's iterations); `step_work` joins them into the step's
Work, and `fit` (linnet.train.loop) takes it.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from linnet.config.sampling import GRPOOptions
from linnet.packing import pack_prompted
from linnet.report.tables import print_table
from linnet.rl.conversations import last_turn
from linnet.rl.rollouts import (
    Prompt,
    Reward,
    Sampler,
    check_prompts,
    counted,
    learned_count,
    pass_at_k,
    prompt_groups,
    reward_functions,
    sample_in_batches,
    score,
    step_metrics,
    to_train,
)
from linnet.run import History, Run, run_and_options
from linnet.torch.distributed import idle_passes, passes_short, sum_across, world
from linnet.torch.sharding import copy_first
from linnet.train.grpo_async import Ahead, sample_ahead
from linnet.train.grpo_loss import grpo_loss
from linnet.train.loop import Work, copies_of, fit, head_loss

__all__ = ["Prompt", "evaluate", "grpo", "grpo_loss", "pass_at_k"]


@dataclass
class _Rollout:
    """A step's samples as flat per-token arrays in the order of the packed rows."""

    rows: list
    advantage: list[torch.Tensor]  # per row: [tokens] advantage of each learned position
    engine_logp: list[torch.Tensor]
    token_weight: list[torch.Tensor]  # 1, or 1/len for per-sequence (sequence_mean, GSPO) averaging
    sequence: list[torch.Tensor]  # per row: completion index of each token (GSPO)
    real: int


def _rollout(samples, advantages: np.ndarray, trained: np.ndarray, prompts, tokens: int,
             per_sequence: bool, share: bool) -> _Rollout | None:
    kept = [(i, s) for i, s in enumerate(samples) if trained[i]]
    if not kept:
        return None
    rows = list(pack_prompted(prompt_groups([s for _, s in kept], prompts, tokens, share), tokens, share=share))
    out = _Rollout(rows, [], [], [], [], sum(r.real for r in rows))
    it = iter(kept)
    for row in rows:
        adv, elp, w, seq = [], [], [], []
        for _ in range(row.examples):
            i, s = next(it)
            n = learned_count(s)
            adv.append(torch.full((n,), float(advantages[i])))
            elp.append(s.logprobs.float() if s.learned is None else s.logprobs.float()[torch.from_numpy(s.learned)])
            w.append(torch.full((n,), 1.0 / n if per_sequence else 1.0))
            seq.append(torch.full((n,), i, dtype=torch.long))
        out.advantage.append(torch.cat(adv))
        out.engine_logp.append(torch.cat(elp))
        out.token_weight.append(torch.cat(w))
        out.sequence.append(torch.cat(seq))
    return out


def _completion_log_probs(model, row) -> torch.Tensor:
    """Log-probabilities of the row's learned positions (its completion tokens, in order)."""
    return _completions(model.log_probs_packed(row), row)


def _completions(logp_P: torch.Tensor, row) -> torch.Tensor:
    """A row's per-position log-probabilities at its learned positions."""
    return logp_P[torch.as_tensor(np.flatnonzero(row.weights > 0), device=logp_P.device)]


class PolicyHead:
    """GRPO's loss of one packed row from the policy's per-position log-probabilities
    (Work.head), and the state it keeps across a step's iterations: each row's
    log-probabilities at its first pass (the `old` policy of the ratio) and how far they
    were from the engine's."""

    def __init__(self, rollout: _Rollout, settings: GRPOOptions, sequences: int, reference=None):
        self.rollout, self.settings, self.sequences, self.reference = rollout, settings, sequences, reference
        self.old: dict[int, torch.Tensor] = {}
        self.mismatch: dict[int, float] = {}

    def __call__(self, r: int, row, positions: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        s, rollout = self.settings, self.rollout
        logp = _completions(positions, row)
        dev = logp.device
        if r not in self.old:
            self.old[r] = logp.detach()
            self.mismatch[r] = float((self.old[r].cpu() - rollout.engine_logp[r]).abs().sum())
        weight = rollout.token_weight[r].to(dev)
        if s.correction_cap is not None:
            log_ratio = self.old[r] - rollout.engine_logp[r].to(dev)
            if s.correction == "sequence":  # each token takes its completion's summed log-ratio
                seq = rollout.sequence[r].to(dev)
                log_ratio = torch.zeros(self.sequences, device=dev, dtype=log_ratio.dtype).index_add(
                    0, seq, log_ratio)[seq]
            weight = weight * torch.exp(log_ratio).clamp(max=s.correction_cap)
        ref = None
        if s.beta:
            with torch.no_grad():
                ref = _completion_log_probs(self.reference, row)
        total, stats = grpo_loss(logp, self.old[r], rollout.advantage[r].to(dev), clip=tuple(s.clip), ref_T=ref,
                                 beta=s.beta, correction_T=weight,
                                 seq_T=rollout.sequence[r].to(dev) if s.sequence_level else None,
                                 sequences=self.sequences)
        return total, {"clipped": stats["clipped"], "kl": stats.get("kl", 0.0), "mismatch": self.mismatch[r],
                       "checked": float(len(logp))}


def step_work(policy, sampler: Sampler, chunk: list, step: int, *, tokens: int, share: bool, reference=None,
              ahead: Ahead | None = None) -> Work:
    """One GRPO step's Work: the policy's weights into the engine, the step's groups sampled
    and scored (a split's or a pipeline's processes train on their first process's), the
    completions that train packed into rows, and the PolicyHead over them. With `ahead`
    (max_staleness > 0) the samples come from the sampler thread instead."""
    s = sampler.settings
    check_prompts(chunk, tokens, s.max_new_tokens)
    if ahead is None:
        t0 = time.perf_counter()
        sampler.engine.load_weights(policy)
        sampling = {"copy_seconds": time.perf_counter() - t0}  # the policy's weights into the engine
        chunk, scored, rounds = copy_first(policy, lambda: sampler(chunk, step))
    else:
        chunk, scored, rounds, version = ahead.take(step, chunk)
    per_sequence = s.sequence_level or s.sequence_mean
    trained = to_train(scored, s.beta)
    rollout = _rollout(scored.samples, scored.advantages, trained, [p for _, p in chunk], tokens, per_sequence, share)
    mine = [*counted(scored), 0.0 if rollout is None else rollout.real]
    copies = copies_of(policy)
    sequences, n_tokens, _ = sum_across(mine, copies)
    normaliser = sequences if per_sequence else sequences * s.max_new_tokens if s.dr_grpo else n_tokens
    rows = [] if rollout is None else rollout.rows
    judged = reference if s.beta else None
    short = passes_short(len(rows), policy, judged)
    head = PolicyHead(rollout, s, len(scored.samples), judged)
    started = time.perf_counter()

    def metrics(sums: dict[str, float]) -> dict[str, float]:
        out = step_metrics(scored, trained, tokens=n_tokens, **sums)
        out.update(sampling if ahead is None else ahead.metrics(step, version))
        out["train_seconds"] = time.perf_counter() - started  # forward, backward and update(s)
        if s.dynamic_sampling:
            out.update(groups=float(len(chunk)), sampling_rounds=float(rounds))
        return out

    return Work(rows, head_loss(policy, head), max(normaliser, 1.0), mine[1], mine[2],
                ("clipped", "kl", "mismatch", "checked"), metrics, idle=lambda: idle_passes(short, policy, judged),
                iterations=s.iterations, group=copies, head=head)


def grpo(policy, engine, prompts: Iterable[Prompt], reward: Reward | Mapping[str, Reward], run: Run | None = None, *,
         settings: GRPOOptions | None = None, reference=None, stop: Iterable[int] | None = None, tokens: int = 4096,
         seed: int = 0, verbose: bool = True, tokenizer=None, **options) -> History:
    """Train `policy` with GRPO for `run.steps` sampling steps (see the module docstring).

    run: a linnet.run.Run, or its fields as keywords (optimizer=, steps=, ...); the
        gradient-norm clip is the Run's (`run=Run(..., clip=0.5)`): grpo's own `clip` is
        the ratio's.
    options: GRPO's own, the fields of linnet.config.GRPOOptions (the YAML's `grpo` group;
        `settings=` gives them all at once): group (8), prompts_per_step (8),
        max_new_tokens (256), temperature (1), top_k, top_p, iterations (1), clip
        ((0.2, 0.2): the ratio kept in [1 - clip[0], 1 + clip[1]] when iterations reuse
        the samples), drop_uniform, beta (the k3 KL's weight against `reference`, a frozen
        model), correction_cap (weigh each token by min(p_policy / p_engine, cap); needs
        temperature 1, no top-k/top-p), dr_grpo (no std division, token sums over
        completions * max_new_tokens), sequence_level (GSPO's sequence ratios), advantage
        ("group", or "rloo": the leave-one-out baseline, no std), sequence_mean (each
        completion's token losses averaged over its own length, then over completions),
        dynamic_sampling (DAPO's: up to this many extra sampling rounds a step, seeded by
        the step, until the step holds prompts_per_step groups whose rewards are not all
        equal; uniform groups never train; needs a sequence of prompts), correction
        ("token", or "sequence": correction_cap's weight one a completion),
        max_staleness (sample up to this many steps ahead on a second thread, from weights
        that many updates old: linnet.train.grpo_async) and stall_timeout (its seconds),
        environment (a class making an environment, or its "module:Class") or tools
        (built-in tool names), with max_turns: multi-turn conversations
        (linnet.rl.conversations), which need `tokenizer` (linnet.data.load_tokenizer).
    reward: f(prompt, completion_ids) -> number, or a dict name -> f (summed, each
        reported). tokens: positions per packed micro-batch row. A sequence of prompts is
        repeated as epochs; an iterator is read once.
    """
    run, s = run_and_options("grpo", run, options, GRPOOptions, settings)
    functions = reward_functions(reward)
    if s.beta and reference is None:
        raise ValueError("grpo: beta > 0 needs reference=, a frozen copy of the model")
    if s.dynamic_sampling and not isinstance(prompts, Sequence):
        raise ValueError("grpo: dynamic_sampling draws prompts again: pass the prompts as a sequence")
    # a prompt once a row, its completions attending to it, where the attention path allows
    share = all(m.shares_prompts for m in (policy, reference) if m is not None)
    if isinstance(prompts, Sequence):
        check_prompts(enumerate(prompts), tokens, s.max_new_tokens)
    stream = itertools.cycle(enumerate(prompts)) if isinstance(prompts, Sequence) else enumerate(prompts)
    if verbose and world()[0] == 0:
        _print_batch_table(s, tokens, share)
    sampler = Sampler(engine, functions, s, stop, seed, prompts if isinstance(prompts, Sequence) else (),
                      rank=world()[0], tokenizer=tokenizer)
    stream, ahead, run = sample_ahead(sampler, policy, stream, run)
    with contextlib.nullcontext() if ahead is None else ahead.running():
        return fit(policy, stream, lambda step, chunk: step_work(policy, sampler, chunk, step, tokens=tokens,
                                                                 share=share, reference=reference, ahead=ahead),
                   run, per_step=s.prompts_per_step, what="grpo: the prompts", carry=ahead)


def evaluate(policy, engine, prompts: Sequence[Prompt], reward: Reward | Mapping[str, Reward], *,
             max_new_tokens: int = 256, k: int = 0, samples: int | None = None, passing: float | None = None,
             temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
             stop: Iterable[int] | None = None, seed: int = 0, batch: int = 64,
             label: str | None = None, conversations=None) -> dict[str, float]:
    """Held-out metrics of `policy` (its weights are loaded into `engine` first), sampled
    `batch` prompts an engine call (`sample_in_batches`; a progress bar named `label`):

    reward   mean summed reward of the greedy completions
    pass@1   share of prompts whose greedy completion passes
    pass@k   with k >= 2: the mean over prompts of `pass_at_k` over `samples` (>= k,
             default k) completions sampled with temperature/top_k/top_p and `seed`

    A completion passes when its summed reward is at least `passing`; the default is one
    per reward function, full marks when each reward's best is 1 (as for linnet's
    built-in exact, numeric and format rewards). With `conversations` (a Sampler's) each
    completion is a conversation: the rewards grade its last turn, and its environment's
    rewards add to the sum. `evaluate_each` gives the same a prompt.
    """
    each, _ = evaluate_each(policy, engine, prompts, reward, max_new_tokens=max_new_tokens, k=k, samples=samples,
                            passing=passing, temperature=temperature, top_k=top_k, top_p=top_p, stop=stop,
                            seed=seed, batch=batch, label=label, conversations=conversations)
    return {name: float(values.mean()) for name, values in each.items()}


def evaluate_each(policy, engine, prompts: Sequence[Prompt], reward: Reward | Mapping[str, Reward], *,
                  max_new_tokens: int = 256, k: int = 0, samples: int | None = None, passing: float | None = None,
                  temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                  stop: Iterable[int] | None = None, seed: int = 0, batch: int = 64,
                  label: str | None = None, conversations=None) -> tuple[dict[str, np.ndarray], list]:
    """`evaluate`'s metrics for each prompt ({metric: [prompts]}: what a comparison of
    models resamples) and the greedy completions, in prompt order."""
    functions = reward_functions(reward)
    passing = float(len(functions)) if passing is None else passing
    samples = samples or k
    if k == 1 or k < 0 or samples < k:
        raise ValueError(f"evaluate: k={k}, samples={samples}; k is 0 (greedy only) or >= 2 (pass@1 is the "
                         "greedy one), and samples >= k")
    ids = list(prompts) if conversations else [list(p.ids) for p in prompts]

    def scores(done, n):
        found = score(functions, [(prompts[c.prompt], last_turn(c.tokens, c.learned),
                                   f"held-out prompt {c.prompt}, completion {i % n}") for i, c in enumerate(done)])
        return np.array([sum(values.values()) + sum(c.turn_rewards or ())
                         for values, c in zip(found, done)]).reshape(len(prompts), n)

    engine.load_weights(policy)
    options = dict(batch=batch, max_new_tokens=max_new_tokens, stop=stop, conversations=conversations)
    done = sample_in_batches(engine, ids, temperature=0.0, label=label and f"{label} greedy", **options)
    greedy = scores(done, 1)[:, 0]
    out = {"reward": greedy, "pass@1": (greedy >= passing).astype(np.float64)}
    if k:
        sampled = scores(sample_in_batches(engine, ids, samples, temperature=temperature, top_k=top_k, top_p=top_p,
                                           seed=seed, label=label and f"{label} pass@{k}", **options), samples)
        correct = (sampled >= passing).sum(axis=1)
        out[f"pass@{k}"] = np.array([pass_at_k(samples, int(c), k) for c in correct])
    return out, done


def _print_batch_table(s: GRPOOptions, tokens: int, share: bool) -> None:
    completions = s.prompts_per_step * s.group
    layout = ("each prompt once with its completions attending to it" if share
              else "whole prompt + completion each")
    rows = [
        ("prompts per step", s.prompts_per_step),
        ("completions per step", f"{completions} ({s.group} per prompt)"),
        ("optimizer steps per sampling step", s.iterations),
        ("completion tokens per step", f"at most {completions * s.max_new_tokens:,}"),
        ("micro-batch", f"packed rows of {tokens:,} positions ({layout})"),
    ]
    print_table(rows, file=sys.stderr)
