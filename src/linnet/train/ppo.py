"""PPO in its RLHF form (Schulman et al. 2017, arXiv:1707.06347; Stiennon et al. 2020,
Ouyang et al. 2022): a policy, a frozen reference, a reward (a function or a reward model
through `reward=`), and a critic: a value head on the policy's own final hidden states, or
on a separate model's.

    value_head(policy)                                  # before the optimizer is made
    value_head(policy, critic=nest.load(card, trainable=True))   # or: a critic of its own
    history = ppo(policy, engine, prompts, reward, optimizer=opt, steps=100, kl_coef=0.05,
                  reference=nest.load(card))

Each step: copy the policy's weights into the engine; sample `samples` completions of each
of the step's prompts; score each with the reward; pass the packed completions through the
policy once without gradients (each token's log-probability and value: the `old` policy
and critic) and through the reference; give every token a reward, the KL penalty
-kl_coef * (log p_old - log p_ref), the score added at the completion's last token; turn
the rewards and values into advantages by GAE (`gae`; whitened over the step) and
returns; then take `iterations` optimizer steps (PPO's epochs over the batch) on the
clipped policy surrogate (`grpo_loss` with per-token advantages) plus `vf_coef` times the
clipped value loss (`value_loss`), averaged over every completion token of the step.

The pieces are pure functions tested against hand-computed values; `linnet ppo` runs it
from a config (the `ppo` group shares GRPO's names for what the two share).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from linnet.config.sampling import PPOOptions
from linnet.packing import pack_prompted
from linnet.rl.rollouts import Prompt, Reward, check_prompts, prompt_groups, reward_functions, reward_metrics, score
from linnet.run import History, Run, run_and_options
from linnet.torch.distributed import sum_across
from linnet.torch.losses import linear_token_log_probs
from linnet.torch.stages import HiddenAt
from linnet.train.grpo_loss import grpo_loss
from linnet.train.loop import Work, copies_of, fit, head_loss

__all__ = ["gae", "ppo", "value_head", "value_loss"]


def gae(rewards: np.ndarray, values: np.ndarray, *, gamma: float, lam: float) -> tuple[np.ndarray, np.ndarray]:
    """(advantages, returns) of one completion by generalized advantage estimation
    (Schulman et al. 2016): delta_t = r_t + gamma V_{t+1} - V_t with V after the last
    token 0, A_t = sum_k (gamma lam)^k delta_{t+k}, returns = A + V."""
    advantages, running = np.zeros(len(rewards)), 0.0
    for t in reversed(range(len(rewards))):
        following = values[t + 1] if t + 1 < len(values) else 0.0
        running = rewards[t] + gamma * following - values[t] + gamma * lam * running
        advantages[t] = running
    return advantages, advantages + np.asarray(values, dtype=np.float64)


def value_loss(values: torch.Tensor, old: torch.Tensor, returns: torch.Tensor, clip: float) -> torch.Tensor:
    """PPO's clipped value loss, summed over tokens: 0.5 max((V - R)^2, (V_clipped - R)^2),
    V_clipped the new value kept within `clip` of the old."""
    clipped = old + (values - old).clamp(-clip, clip)
    return 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2).sum()


def value_head(model, seed: int = 0, *, critic=None):
    """Give `model` a trainable float32 critic, `value` (hidden -> 1): on its own final
    hidden states, or, with `critic` (a separate model: another copy of the card, a
    reward model's trunk, with or without adapters), on that model's, `critic` becoming
    `model.critic` so that it trains, checkpoints and saves with the policy. Returns
    `model`. Add it before the optimizer is made."""
    from linnet.torch.model import Linear

    reader = model if critic is None else critic
    for m in (model, reader):
        if getattr(m, "pipe", None) is not None or m.split_head() is not None:
            raise ValueError("value_head: PPO's critic reads the whole model's hidden states; train PPO on models in "
                             "one piece (no pipeline stages, no split)")
    if reader.card.vocab != model.card.vocab:
        raise ValueError(f"value_head: the critic reads the policy's tokens, so its vocabulary ({reader.card.vocab}) "
                         f"must be the policy's ({model.card.vocab})")
    head = Linear(reader.card.hidden, 1, bias=False).to(reader.device)
    with torch.no_grad():
        head.weight.copy_(torch.empty(1, reader.card.hidden).normal_(0.0, 0.02,
                                                                     generator=torch.Generator().manual_seed(seed)))
    reader.value = head
    if critic is not None:
        model.critic = critic
    return model


def _learned(row) -> np.ndarray:
    """The positions whose targets are completion tokens: a token's state, where its
    log-probability and value are read."""
    return np.flatnonzero(np.asarray(row.weights) > 0)


def _token_stats(model, row, h) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probabilities of the row's completion tokens, values of their states) from the
    final hidden states at those states: the policy's, and a separate critic's own."""
    targets = torch.as_tensor(np.asarray(row.targets)[_learned(row)], device=h.device)
    critic = getattr(model, "critic", None)
    if critic is not None:
        values = critic.value(critic.hidden_packed(row, at=_learned(row)).float())[:, 0].to(h.device)
    else:
        values = model.value(h.float())[:, 0]
    return linear_token_log_probs(h, model.head_weight, targets), values


@dataclass
class _Batch:
    """A step's packed completions and what each token trains on, row by row."""

    rows: list
    old_logp: list[torch.Tensor]
    old_values: list[torch.Tensor]
    advantages: list[torch.Tensor]
    returns: list[torch.Tensor]
    kl: float
    real: int


def _rollout(policy, reference, samples, rewards: np.ndarray, prompts: list, s: PPOOptions, tokens: int) -> _Batch:
    """Pack the completions, read the old policy, critic and reference on them, and turn
    the rewards into per-token advantages and returns (GAE, whitened over the step)."""
    rows = list(pack_prompted(prompt_groups(samples, prompts, tokens, policy.shares_prompts), tokens,
                              share=policy.shares_prompts))
    stats = HiddenAt(_learned, lambda _, row, h: _token_stats(policy, row, h))
    with torch.no_grad():
        old = [stats.head(i, row, policy.hidden_packed(row, at=_learned(row))) for i, row in enumerate(rows)]
        ref = [reference.log_probs_packed(row)[torch.as_tensor(_learned(row))] for row in rows] if s.kl_coef else None
    per_token, kl_total, lengths = [], 0.0, iter(len(x.tokens) for x in samples)
    for r, (logp, values) in enumerate(old):  # completions are consecutive within and across rows
        kl = (logp - ref[r]).double().cpu().numpy() if ref is not None else np.zeros(len(logp))
        kl_total += float(kl.sum())
        start = 0
        while start < len(logp):
            n = next(lengths)
            token_rewards = -s.kl_coef * kl[start:start + n]
            token_rewards[-1] += rewards[len(per_token)]
            per_token.append(gae(token_rewards, values[start:start + n].double().cpu().numpy(), gamma=s.gamma,
                                 lam=s.lam))
            start += n
    advantages = np.concatenate([a for a, _ in per_token])
    if s.whiten and len(advantages) > 1:
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    cut = np.cumsum([len(logp) for logp, _ in old])[:-1]
    returns = np.concatenate([ret for _, ret in per_token])
    as_rows = lambda x: [torch.as_tensor(part, dtype=torch.float32) for part in np.split(x, cut)]  # noqa: E731
    return _Batch(rows, [logp for logp, _ in old], [v for _, v in old], as_rows(advantages), as_rows(returns),
                  kl_total, sum(r.real for r in rows))


def _step_work(policy, reference, engine, functions, chunk: list, step: int, s: PPOOptions, *, tokens: int,
               stop, seed: int) -> Work:
    """One PPO step's Work: sample and score the step's prompts, build the rollout, and the
    head that gives a row's summed policy and value loss."""
    check_prompts(chunk, tokens, s.max_new_tokens, who="ppo")
    engine.load_weights(policy)
    started = time.perf_counter()
    prompts = [p for _, p in chunk]
    samples = engine.sample([list(p.ids) for p in prompts], n=s.samples, max_new_tokens=s.max_new_tokens,
                            temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, stop=stop,
                            seed=seed * 1_000_003 + step)
    sampled = time.perf_counter()
    scores = score(functions, [(prompts[x.prompt], x.tokens, f"prompt {chunk[x.prompt][0]}, completion {i % s.samples}")
                               for i, x in enumerate(samples)], "ppo")
    per_function = {name: np.array([v[name] for v in scores]) for name in functions}
    rewards = np.sum(list(per_function.values()), axis=0)
    scored = time.perf_counter()
    batch = _rollout(policy, reference, samples, rewards, prompts, s, tokens)
    read = time.perf_counter() - scored
    copies = copies_of(policy)
    count, = sum_across([float(sum(len(x) for x in batch.old_logp))], copies)

    def loss(r: int, row, h: torch.Tensor):
        logp, values = _token_stats(policy, row, h)
        dev = logp.device
        pg, stats = grpo_loss(logp, batch.old_logp[r], batch.advantages[r].to(dev), clip=tuple(s.clip))
        vf = value_loss(values, batch.old_values[r], batch.returns[r].to(dev), s.value_clip)
        return pg + s.vf_coef * vf, {"clipped": stats["clipped"], "value_loss": float(vf.detach())}

    def metrics(sums: dict[str, float]) -> dict[str, float]:
        lengths = [len(x.tokens) for x in samples]
        return {**reward_metrics(rewards, per_function), "kl": batch.kl / max(count, 1.0),
                "clip_fraction": sums["clipped"] / max(count, 1.0), "value_loss": sums["value_loss"] / max(count, 1.0),
                "completion_length": float(np.mean(lengths)), "sample_seconds": sampled - started,
                "score_seconds": scored - sampled, "rollout_seconds": read}

    head = HiddenAt(_learned, loss)
    return Work(batch.rows, head_loss(policy, head), max(count, 1.0), count, batch.real, ("clipped", "value_loss"),
                metrics, iterations=s.iterations, group=copies, head=head)


def ppo(policy, engine, prompts: Iterable[Prompt], reward: Reward | Mapping[str, Reward], run: Run | None = None, *,
        settings: PPOOptions | None = None, reference=None, stop: Iterable[int] | None = None, tokens: int = 4096,
        seed: int = 0, **options) -> History:
    """Train `policy` (with its `value_head`) by PPO for `run.steps` steps (see the module
    docstring). `run`: a linnet.run.Run, or its fields as keywords. options: the fields of
    linnet.config.PPOOptions (the YAML's `ppo` group, or `settings=`): samples (1 a
    prompt), prompts_per_step, max_new_tokens, temperature, top_k, top_p, iterations (PPO's
    epochs, 4), clip ((0.2, 0.2), the ratio's), kl_coef (0.05, the reward's KL penalty
    against `reference`), gamma (1), lam (0.95), vf_coef (0.1), value_clip (0.2), whiten.
    A sequence of prompts repeats as epochs."""
    run, s = run_and_options("ppo", run, options, PPOOptions, settings)
    if getattr(policy, "value", None) is None and getattr(policy, "critic", None) is None:
        raise ValueError("ppo: the policy has no critic; call linnet.train.ppo.value_head(policy) (or "
                         "value_head(policy, critic=model)) before making its optimizer")
    if s.kl_coef and reference is None:
        raise ValueError("ppo: kl_coef > 0 needs reference=, a frozen copy of the starting model")
    functions = reward_functions(reward, "ppo")
    if isinstance(prompts, Sequence):
        check_prompts(enumerate(prompts), tokens, s.max_new_tokens, who="ppo")
    stream = itertools.cycle(enumerate(prompts)) if isinstance(prompts, Sequence) else enumerate(prompts)
    return fit(policy, stream, lambda step, chunk: _step_work(policy, reference, engine, functions, chunk, step, s,
                                                             tokens=tokens, stop=stop, seed=seed),
               run, per_step=s.prompts_per_step, what="ppo: the prompts")
