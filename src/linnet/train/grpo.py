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
engine (greedy reward and pass@1, and pass@k from sampled completions), for an `on_step`
callback; `linnet grpo` calls it every `training.eval_every` steps.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from linnet.packing import pack_prompted
from linnet.report.history import History, Step
from linnet.report.tables import print_table
from linnet.rl.rollouts import (
    Prompt,
    Reward,
    check_prompts,
    counted,
    fill_groups,
    pass_at_k,
    prompt_groups,
    reward_functions,
    sample_and_score,
    sample_in_batches,
    score,
    step_metrics,
    to_train,
)
from linnet.torch.distributed import idle_passes, passes_short, sum_across, world
from linnet.torch.sharding import copy_first
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
            n = len(s.tokens)
            adv.append(torch.full((n,), float(advantages[i])))
            elp.append(s.logprobs.float())
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


def grpo(
    policy,
    engine,
    prompts: Iterable[Prompt],
    reward: Reward | Mapping[str, Reward],
    *,
    optimizer: torch.optim.Optimizer,
    steps: int,
    group: int = 8,
    prompts_per_step: int = 8,
    max_new_tokens: int = 256,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop: Iterable[int] | None = None,
    iterations: int = 1,
    clip: tuple[float, float] = (0.2, 0.2),
    drop_uniform: bool = False,
    beta: float = 0.0,
    reference=None,
    correction_cap: float | None = None,
    dr_grpo: bool = False,
    sequence_level: bool = False,
    advantage: str = "group",
    sequence_mean: bool = False,
    dynamic_sampling: int = 0,
    tokens: int = 4096,
    max_grad_norm: float | None = 1.0,
    schedule=None,
    seed: int = 0,
    save_to: str | os.PathLike | None = None,
    checkpoint: str | os.PathLike | None = None,
    checkpoint_every: int = 100,
    keep: int = 2,
    on_step: Callable[[Step], None] | None = None,
    verbose: bool = True,
) -> History:
    """Train `policy` with GRPO for `steps` sampling steps (see the module docstring).

    reward: f(prompt, completion_ids) -> number, or a dict name -> f (summed, each
        reported). iterations: optimizer steps per sampling step, reusing the samples with
        the ratio clipped to [1 - clip[0], 1 + clip[1]]. drop_uniform: leave groups whose
        rewards are all equal out of the average too. beta: weight of the k3 KL to `reference` (a frozen
        model). correction_cap: weigh each token by min(p_policy / p_engine, cap)
        (needs temperature 1, no top-k/top-p). dr_grpo: no std division, token sums over
        completions * max_new_tokens. sequence_level: GSPO sequence ratios. advantage:
        "group" (GRPO's) or "rloo" (leave-one-out baseline, no std). sequence_mean: each
        completion's token losses averaged over its own length, then over completions
        (the GRPO paper's 1/|o_i|; GSPO always does), token ratios unchanged.
        dynamic_sampling: DAPO's dynamic sampling, up to this many extra sampling rounds
        a step, each drawing as many prompts again (seeded by the step, so a resumed run
        draws the same), until the step holds prompts_per_step groups whose rewards are
        not all equal; uniform groups never train (needs a sequence of prompts). tokens:
        positions per packed micro-batch row. A sequence of prompts is repeated as
        epochs; an iterator is read once.
    """
    functions = reward_functions(reward)
    if group < 2 or prompts_per_step < 1 or iterations < 1 or max_new_tokens < 1:
        raise ValueError("grpo: group must be >= 2; prompts_per_step, iterations, max_new_tokens >= 1")
    if beta and reference is None:
        raise ValueError("grpo: beta > 0 needs reference=, a frozen copy of the model")
    copies = copies_of(policy)
    if dr_grpo and sequence_mean:
        raise ValueError("grpo: dr_grpo divides token sums by a constant and sequence_mean by each completion's "
                         "length; choose one")
    if dynamic_sampling < 0 or (dynamic_sampling and not isinstance(prompts, Sequence)):
        raise ValueError("grpo: dynamic_sampling is a number of extra sampling rounds (>= 0) and draws prompts "
                         "again: pass the prompts as a sequence")
    if correction_cap is not None and (temperature != 1.0 or top_k or (top_p not in (None, 1.0))):
        raise ValueError("grpo: correction_cap reads the engine's log-probabilities: use temperature 1, "
                         "no top_k or top_p")
    # a prompt once a row, its completions attending to it, where the attention path allows
    share = all(m.shares_prompts for m in (policy, reference) if m is not None)
    if isinstance(prompts, Sequence):
        check_prompts(enumerate(prompts), tokens, max_new_tokens)
    stream = itertools.cycle(enumerate(prompts)) if isinstance(prompts, Sequence) else enumerate(prompts)
    if verbose and world()[0] == 0:
        _print_batch_table(prompts_per_step, group, max_new_tokens, tokens, iterations, share)
    judged = reference if beta else None

    def prepare(step: int, chunk: list) -> Work:
        """Sample and score the step's groups, and pack the completions that train."""
        check_prompts(chunk, tokens, max_new_tokens)
        t0 = time.perf_counter()
        engine.load_weights(policy)
        copy_seconds = time.perf_counter() - t0

        def sampled(part: list, round_: int):
            return sample_and_score(engine, part, functions, group=group, max_new_tokens=max_new_tokens,
                                    temperature=temperature, top_k=top_k, top_p=top_p, stop=stop,
                                    seed=seed * 1_000_003 + step + 100_000_019 * round_, dr_grpo=dr_grpo,
                                    drop_uniform=drop_uniform, advantage=advantage)

        def drawn(chunk: list):
            """(the groups, their scores, sampling rounds) of the step."""
            scored, rounds = sampled(chunk, 0), 1
            if dynamic_sampling:
                parts = [(chunk, scored)]
                draw = np.random.default_rng([seed, step, world()[0]])
                while sum(int((~sc.uniform).sum()) for _, sc in parts) < len(chunk) and rounds <= dynamic_sampling:
                    extra = [(int(i), prompts[int(i)]) for i in draw.integers(0, len(prompts), len(chunk))]
                    parts.append((extra, sampled(extra, rounds)))
                    rounds += 1
                chunk, scored = fill_groups(parts, len(chunk))
            return chunk, scored, rounds

        # a split's or a pipeline's processes train on the same samples: its first process's
        chunk, scored, rounds = copy_first(policy, lambda: drawn(chunk))
        per_sequence = sequence_level or sequence_mean
        trained = to_train(scored, beta)
        rollout = _rollout(scored.samples, scored.advantages, trained, [p for _, p in chunk], tokens,
                           per_sequence, share)
        mine = [*counted(scored), 0.0 if rollout is None else rollout.real]
        sequences, n_tokens, _ = sum_across(mine, copies)
        normaliser = sequences if per_sequence else sequences * max_new_tokens if dr_grpo else n_tokens
        rows = [] if rollout is None else rollout.rows
        short = passes_short(len(rows), policy, judged)
        old: dict[int, torch.Tensor] = {}  # the policy's log-probs before this step's first update
        mismatch: dict[int, float] = {}

        def head(r: int, row, positions: torch.Tensor):
            """The row's summed loss and statistics from its per-position log-probabilities."""
            logp = _completions(positions, row)
            dev = logp.device
            if r not in old:
                old[r] = logp.detach()
                mismatch[r] = float((old[r].cpu() - rollout.engine_logp[r]).abs().sum())
            weight = rollout.token_weight[r].to(dev)
            if correction_cap is not None:
                weight = weight * torch.exp(old[r] - rollout.engine_logp[r].to(dev)).clamp(max=correction_cap)
            ref = None
            if beta:
                with torch.no_grad():
                    ref = _completion_log_probs(reference, row)
            total, s = grpo_loss(logp, old[r], rollout.advantage[r].to(dev), clip=clip, ref_T=ref, beta=beta,
                                 correction_T=weight, seq_T=rollout.sequence[r].to(dev) if sequence_level else None,
                                 sequences=len(scored.samples))
            return total, {"clipped": s["clipped"], "kl": s.get("kl", 0.0), "mismatch": mismatch[r],
                           "checked": float(len(logp))}

        def metrics(sums: dict[str, float]) -> dict[str, float]:
            out = step_metrics(scored, trained, tokens=n_tokens, **sums)
            out["copy_seconds"] = copy_seconds  # the policy's weights into the engine
            out["train_seconds"] = time.perf_counter() - packed  # forward, backward and update(s)
            if dynamic_sampling:
                out.update(groups=float(len(chunk)), sampling_rounds=float(rounds))
            return out

        packed = time.perf_counter()
        return Work(rows, head_loss(policy, head), max(normaliser, 1.0), mine[1], mine[2],
                    ("clipped", "kl", "mismatch", "checked"), metrics, idle=lambda: idle_passes(short, policy, judged),
                    iterations=iterations, group=copies, head=head)

    return fit(policy, stream, prepare, per_step=prompts_per_step, optimizer=optimizer, steps=steps,
               clip=max_grad_norm, schedule=schedule, save_to=save_to, checkpoint=checkpoint,
               checkpoint_every=checkpoint_every, keep=keep, on_step=on_step, what="grpo: the prompts")


def evaluate(policy, engine, prompts: Sequence[Prompt], reward: Reward | Mapping[str, Reward], *,
             max_new_tokens: int = 256, k: int = 0, samples: int | None = None, passing: float | None = None,
             temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
             stop: Iterable[int] | None = None, seed: int = 0, batch: int = 64,
             label: str | None = None) -> dict[str, float]:
    """Held-out metrics of `policy` (its weights are loaded into `engine` first), sampled
    `batch` prompts an engine call (`sample_in_batches`; a progress bar named `label`):

    reward   mean summed reward of the greedy completions
    pass@1   share of prompts whose greedy completion passes
    pass@k   with k >= 2: the mean over prompts of `pass_at_k` over `samples` (>= k,
             default k) completions sampled with temperature/top_k/top_p and `seed`

    A completion passes when its summed reward is at least `passing`; the default is one
    per reward function, full marks when each reward's best is 1 (as for linnet's
    built-in exact, numeric and format rewards).
    """
    functions = reward_functions(reward)
    passing = float(len(functions)) if passing is None else passing
    samples = samples or k
    if k == 1 or k < 0 or samples < k:
        raise ValueError(f"evaluate: k={k}, samples={samples}; k is 0 (greedy only) or >= 2 (pass@1 is the "
                         "greedy one), and samples >= k")
    ids = [list(p.ids) for p in prompts]

    def scores(done, n):
        found = score(functions, [(prompts[c.prompt], c.tokens, f"held-out prompt {c.prompt}, completion {i % n}")
                                  for i, c in enumerate(done)])
        return np.array([sum(values.values()) for values in found]).reshape(len(prompts), n)

    engine.load_weights(policy)
    each = dict(batch=batch, max_new_tokens=max_new_tokens, stop=stop)
    greedy = scores(sample_in_batches(engine, ids, temperature=0.0, label=label and f"{label} greedy", **each),
                    1)[:, 0]
    out = {"reward": float(greedy.mean()), "pass@1": float(np.mean(greedy >= passing))}
    if k:
        sampled = scores(sample_in_batches(engine, ids, samples, temperature=temperature, top_k=top_k, top_p=top_p,
                                           seed=seed, label=label and f"{label} pass@{k}", **each), samples)
        correct = (sampled >= passing).sum(axis=1)
        out[f"pass@{k}"] = float(np.mean([pass_at_k(samples, int(c), k) for c in correct]))
    return out


def _print_batch_table(prompts_per_step: int, group: int, max_new_tokens: int, tokens: int, iterations: int,
                       share: bool) -> None:
    completions = prompts_per_step * group
    layout = ("each prompt once with its completions attending to it" if share
              else "whole prompt + completion each")
    rows = [
        ("prompts per step", prompts_per_step),
        ("completions per step", f"{completions} ({group} per prompt)"),
        ("optimizer steps per sampling step", iterations),
        ("completion tokens per step", f"at most {completions * max_new_tokens:,}"),
        ("micro-batch", f"packed rows of {tokens:,} positions ({layout})"),
    ]
    print_table(rows, file=sys.stderr)
