"""Preference losses in JAX: the formulas of `linnet.train.preference_loss` (the papers are
named there) as jnp functions, one a variant, for `linnet.jax.dpo`.

    losses, chosen_rewards, rejected_rewards = pair_losses(
        "sigmoid", chosen, rejected, ref_chosen, ref_rejected, beta=0.1)

`chosen`, `rejected`: [pairs] summed log-probabilities of each answer under the policy
(`ref_*` under the reference; None for the reference-free simpo and orpo); `*_tokens`:
each answer's token count, for the losses that score per-token means (ipo, simpo, orpo).
Each variant takes d, the difference of the two answers' scores (orpo: the two per-token
means themselves). Rewards are beta times each answer's score, without gradient.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from linnet.config.groups import pair_scores


def dpo_sigmoid(d, *, beta: float, label_smoothing: float = 0.0):
    """DPO: -(1-e) log s(beta d) - e log s(-beta d); e > 0 is conservative DPO."""
    e = label_smoothing
    return -(1 - e) * jax.nn.log_sigmoid(beta * d) - e * jax.nn.log_sigmoid(-beta * d)


def dpo_robust(d, *, beta: float, label_smoothing: float = 0.0):
    """Robust DPO: the unbiased estimate under a label-flip rate e."""
    e = label_smoothing
    return (-(1 - e) * jax.nn.log_sigmoid(beta * d) + e * jax.nn.log_sigmoid(-beta * d)) / (1 - 2 * e)


def slic_hinge(d, *, beta: float):
    """SLiC's hinge: max(0, 1 - beta d)."""
    return jax.nn.relu(1 - beta * d)


def ipo(d, *, beta: float):
    """IPO: (d - 1/(2 beta))^2, d over per-token means."""
    return (d - 1 / (2 * beta)) ** 2


def simpo(d, *, beta: float, simpo_gamma: float, label_smoothing: float = 0.0):
    """SimPO: the sigmoid loss of the per-token-mean difference less the margin gamma/beta."""
    return dpo_sigmoid(d - simpo_gamma / beta, beta=beta, label_smoothing=label_smoothing)


def log1mexp(x):
    """log(1 - exp(x)) for x < 0, accurate at both ends (Maechler 2012)."""
    return jnp.where(x > -math.log(2), jnp.log(-jnp.expm1(x)), jnp.log1p(-jnp.exp(x)))


def orpo(chosen, rejected, *, beta: float):
    """ORPO's odds-ratio term, -beta log s(log odds(chosen) - log odds(rejected)), of the
    per-token mean log-probabilities; the caller adds the chosen answers' NLL."""
    return -beta * jax.nn.log_sigmoid(chosen - rejected - (log1mexp(chosen) - log1mexp(rejected)))


# name -> loss of (d, chosen score, rejected score, hyperparameters): each reads what it takes
LOSSES = {
    "sigmoid": lambda d, c, r, h: dpo_sigmoid(d, beta=h["beta"], label_smoothing=h["label_smoothing"]),
    "robust": lambda d, c, r, h: dpo_robust(d, beta=h["beta"], label_smoothing=h["label_smoothing"]),
    "hinge": lambda d, c, r, h: slic_hinge(d, beta=h["beta"]),
    "ipo": lambda d, c, r, h: ipo(d, beta=h["beta"]),
    "simpo": lambda d, c, r, h: simpo(d, beta=h["beta"], simpo_gamma=h["simpo_gamma"],
                                      label_smoothing=h["label_smoothing"]),
    "orpo": lambda d, c, r, h: orpo(c, r, beta=h["beta"]),
}


def pair_losses(loss_type: str, chosen, rejected, ref_chosen=None, ref_rejected=None, *, beta: float,
                chosen_tokens=None, rejected_tokens=None, label_smoothing: float = 0.0, simpo_gamma: float = 0.5):
    """(losses, chosen rewards, rejected rewards), each [pairs]; see the module docstring."""
    if loss_type not in LOSSES:
        raise ValueError(f"loss_type={loss_type!r}: the JAX pair losses are {', '.join(LOSSES)} (kto trains on "
                         "unpaired answers: linnet.train.kto.kto, PyTorch)")
    sc, sr = pair_scores(loss_type, chosen, rejected, ref_chosen, ref_rejected, chosen_tokens, rejected_tokens)
    hyper = {"beta": beta, "label_smoothing": label_smoothing, "simpo_gamma": simpo_gamma}
    losses = LOSSES[loss_type](sc - sr, sc, sr, hyper)  # orpo (reference-free) reads sc, sr: the per-token means
    return losses, jax.lax.stop_gradient(beta * sc), jax.lax.stop_gradient(beta * sr)
