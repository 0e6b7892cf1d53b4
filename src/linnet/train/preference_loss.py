"""Preference losses as pure functions of answers' log-probabilities.

    losses, chosen_rewards, rejected_rewards = pair_losses(
        "sigmoid", chosen, rejected, ref_chosen, ref_rejected, beta=0.1)

`chosen`, `rejected`: [pairs] summed log-probabilities of each answer's tokens under the
policy (`ref_*` under the reference); `*_tokens`: each answer's token count, for the losses
that compare per-token means. With d the difference of the two answers' scores:

- sigmoid (DPO, Rafailov et al. 2023): -(1-e) log s(beta d) - e log s(-beta d), scores
  log pi - log ref; e = label_smoothing (conservative DPO).
- robust (Chowdhury et al. 2024): the unbiased estimate under a label-flip rate e,
  (-(1-e) log s(beta d) + e log s(-beta d)) / (1 - 2e).
- hinge (SLiC, Zhao et al. 2023): max(0, 1 - beta d).
- ipo (Azar et al. 2023): (d - 1/(2 beta))^2 on per-token mean scores.
- simpo (Meng et al. 2024): reference-free, scores the per-token mean log-probability,
  d reduced by the target margin gamma/beta, then the sigmoid loss.
- orpo (Hong et al. 2024): reference-free, -beta log s(log odds(chosen) - log odds(rejected))
  with odds p/(1-p) of the per-token mean probability; the caller adds the chosen answer's
  NLL (linnet.train.dpo does, as a mean over the step's chosen tokens).
- kto (Ethayarajh et al. 2024, `kto_losses`): unpaired answers, each desirable or not,
  against a reference point z (`kto_reference_point`): desirable 1 - s(beta (r - z)),
  undesirable 1 - s(beta (z - r)), weighted, r = log pi - log ref.

Rewards (what TRL logs as rewards/chosen, rewards/rejected) are beta times each answer's
score. Reference-free losses take no reference arguments.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from linnet.config.groups import PER_TOKEN as PER_TOKEN  # re-exported: the trainers read them here
from linnet.config.groups import REFERENCE_FREE as REFERENCE_FREE
from linnet.config.groups import pair_scores

LOSS_TYPES = ("sigmoid", "robust", "hinge", "ipo", "simpo", "orpo", "kto")


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate at both ends (Maechler 2012)."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def pair_losses(loss_type: str, chosen, rejected, ref_chosen=None, ref_rejected=None, *, beta: float,
                chosen_tokens=None, rejected_tokens=None, label_smoothing: float = 0.0,
                simpo_gamma: float = 0.5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(losses, chosen rewards, rejected rewards), each [pairs]; see the module docstring."""
    if loss_type not in LOSS_TYPES or loss_type == "kto":
        raise ValueError(f"loss_type={loss_type!r}: pair losses are {', '.join(t for t in LOSS_TYPES if t != 'kto')} "
                         "(kto trains on unpaired answers: kto_losses)")
    sc, sr = pair_scores(loss_type, chosen, rejected, ref_chosen, ref_rejected, chosen_tokens, rejected_tokens)
    d = sc - sr
    e = label_smoothing
    if loss_type == "sigmoid":
        losses = -(1 - e) * F.logsigmoid(beta * d) - e * F.logsigmoid(-beta * d)
    elif loss_type == "robust":
        losses = (-(1 - e) * F.logsigmoid(beta * d) + e * F.logsigmoid(-beta * d)) / (1 - 2 * e)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * d)
    elif loss_type == "ipo":
        losses = (d - 1 / (2 * beta)) ** 2
    elif loss_type == "simpo":
        z = d - simpo_gamma / beta
        losses = -(1 - e) * F.logsigmoid(beta * z) - e * F.logsigmoid(-beta * z)
    else:  # orpo
        log_odds = d - (log1mexp(sc) - log1mexp(sr))  # reference-free: sc, sr are the per-token means
        losses = -beta * F.logsigmoid(log_odds)
    return losses, (beta * sc).detach(), (beta * sr).detach()


def kto_reference_point(policy_mismatched, ref_mismatched) -> torch.Tensor:
    """KTO's z: the batch's KL(pi || ref) estimated from completions paired with other
    prompts, mean(log pi - log ref) clamped at 0, without gradient."""
    return (policy_mismatched - ref_mismatched).mean().clamp(min=0).detach()


def kto_losses(policy, reference, desirable, z, *, beta: float, desirable_weight: float = 1.0,
               undesirable_weight: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(losses, rewards), each [answers]: KTO's value-based loss of unpaired answers
    (`desirable` a bool tensor) against the reference point `z`."""
    r = policy - reference
    good = desirable_weight * (1 - torch.sigmoid(beta * (r - z)))
    bad = undesirable_weight * (1 - torch.sigmoid(beta * (z - r)))
    return torch.where(desirable, good, bad), (beta * r).detach()
