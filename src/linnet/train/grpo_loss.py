"""The GRPO objective as pure functions over flat per-token arrays.

Group relative policy optimization (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300):
each completion's advantage is its reward's standing in its group (`linnet.rl.rollouts.
group_advantages`), given to every one of its tokens; the update is PPO's clipped
surrogate (Schulman et al. 2017, arXiv:1707.06347).

Shapes: T completion tokens of the whole step, flattened; S completions.
Options beyond the paper, each a plain argument:
  Dr. GRPO (Liu et al. 2025, arXiv:2503.20783): advantages not divided by the group's
    std (group_advantages(scale=False)), and token sums divided by a constant instead of
    each completion's length.
  GSPO (Zheng et al. 2025, arXiv:2507.18071): one importance ratio per sequence, the
    geometric mean of its tokens' ratios, clipped as a whole.
  Truncated importance sampling against the sampler (`correction`): the engine samples
    from the same weights through other kernels; each token is weighed by
    min(p_policy / p_engine, cap).
"""

from __future__ import annotations

import torch


def k3_kl(logp_T: torch.Tensor, ref_T: torch.Tensor) -> torch.Tensor:
    """Per-token KL(policy || ref) estimate exp(r) - r - 1 with r = ref - policy
    (Schulman's k3: unbiased, always >= 0)."""
    r = ref_T - logp_T
    return torch.exp(r) - r - 1


def token_ratios(logp_T, old_T, seq_T=None, sequences: int | None = None) -> torch.Tensor:
    """Per-token importance ratios pi/pi_old; with seq_T (each token's completion index),
    GSPO's sequence ratio exp(mean over the completion's tokens of log ratio), repeated
    on each of its tokens."""
    log_ratio = logp_T - old_T
    if seq_T is None:
        return torch.exp(log_ratio)
    sums = torch.zeros(sequences, dtype=log_ratio.dtype, device=log_ratio.device).index_add(0, seq_T, log_ratio)
    counts = torch.zeros(sequences, dtype=log_ratio.dtype, device=log_ratio.device).index_add(
        0, seq_T, torch.ones_like(log_ratio))
    return torch.exp(sums / counts.clamp(min=1))[seq_T]


def clipped_surrogate(ratio_T, advantage_T, clip: tuple[float, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token loss -min(ratio * A, clip(ratio) * A), whether the clip was active)."""
    low, high = 1.0 - clip[0], 1.0 + clip[1]
    unclipped = ratio_T * advantage_T
    clipped = ratio_T.clamp(low, high) * advantage_T
    return -torch.minimum(unclipped, clipped), (clipped < unclipped)


def grpo_loss(logp_T, old_T, advantage_T, *, clip=(0.2, 0.2), ref_T=None, beta: float = 0.0,
              correction_T=None, seq_T=None, sequences: int | None = None) -> tuple[torch.Tensor, dict]:
    """Summed per-token GRPO loss (divide by the step's normaliser) and its statistics
    (summed too): clipped tokens, KL. `correction_T` multiplies each token's surrogate
    (truncated importance weights, no gradient); `seq_T` switches to GSPO ratios."""
    ratio = token_ratios(logp_T, old_T, seq_T, sequences)
    per_token, clipped = clipped_surrogate(ratio, advantage_T, clip)
    if correction_T is not None:
        per_token = per_token * correction_T
    stats = {"clipped": float(clipped.sum())}
    if beta:
        kl = k3_kl(logp_T, ref_T)
        per_token = per_token + beta * kl
        stats["kl"] = float(kl.detach().sum())
    return per_token.sum(), stats
