"""GRPO's pure pieces against hand-computed numbers."""

from __future__ import annotations

import math

import numpy as np
import torch

from linnet.rl.rollouts import group_advantages
from linnet.train.grpo_loss import clipped_surrogate, grpo_loss, k3_kl, token_ratios


def test_group_advantages():
    rewards = np.array([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    adv = group_advantages(rewards, eps=0.0 + 1e-12)
    np.testing.assert_allclose(adv[0], [1.0, -1.0, -1.0, 1.0])  # mean .5, std .5
    assert np.all(adv[1] == 0)  # a uniform group carries no signal
    np.testing.assert_allclose(group_advantages(rewards, scale=False)[0], [0.5, -0.5, -0.5, 0.5])


def test_clipped_surrogate_by_hand():
    ratio = torch.tensor([1.5, 0.5, 1.1, 0.7])
    adv = torch.tensor([1.0, 1.0, -2.0, -2.0])
    loss, clipped = clipped_surrogate(ratio, adv, (0.2, 0.28))
    # A>0: min(1.5, 1.28) = 1.28 (clipped); min(0.5, 0.8) = 0.5
    # A<0: min(-2.2, -2.2) = -2.2; min(-1.4, -1.6) = -1.6 (clipped)
    torch.testing.assert_close(loss, torch.tensor([-1.28, -0.5, 2.2, 1.6]))
    assert clipped.tolist() == [True, False, False, True]


def test_first_iteration_is_the_plain_policy_gradient():
    """With old = new.detach() the ratio is 1 and the gradient is A * grad log p."""
    logits = torch.randn(5, 7, requires_grad=True, generator=torch.Generator().manual_seed(0))
    targets = torch.tensor([1, 3, 0, 6, 2])
    adv = torch.tensor([0.5, -1.0, 2.0, 0.0, -0.3])
    logp = torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]
    loss, stats = grpo_loss(logp, logp.detach(), adv)
    (g,) = torch.autograd.grad(loss, logits, retain_graph=True)
    (g_pg,) = torch.autograd.grad(-(adv * logp).sum(), logits)
    torch.testing.assert_close(g, g_pg)
    assert stats["clipped"] == 0


def test_kl_and_correction_and_sequence_ratios():
    logp = torch.tensor([-1.0, -2.0, -0.5])
    ref = torch.tensor([-1.5, -2.0, -0.2])
    r = ref - logp
    torch.testing.assert_close(k3_kl(logp, ref), torch.exp(r) - r - 1)
    assert torch.all(k3_kl(logp, ref) >= 0)
    old = torch.tensor([-1.2, -1.8, -0.5])
    seq = torch.tensor([0, 0, 1])
    ratios = token_ratios(logp, old, seq, 2)
    expect0 = math.exp(((-1.0 + 1.2) + (-2.0 + 1.8)) / 2)
    torch.testing.assert_close(ratios, torch.tensor([expect0, expect0, 1.0]))
    adv = torch.tensor([1.0, 1.0, -1.0])
    base, _ = grpo_loss(logp, old, adv, clip=(10.0, 10.0))
    weighted, _ = grpo_loss(logp, old, adv, clip=(10.0, 10.0), correction_T=torch.tensor([0.5, 0.5, 0.5]))
    torch.testing.assert_close(weighted, base * 0.5)
    with_kl, stats = grpo_loss(logp, old, adv, clip=(10.0, 10.0), ref_T=ref, beta=0.1)
    torch.testing.assert_close(with_kl, base + 0.1 * k3_kl(logp, ref).sum())
    assert stats["kl"] > 0
