"""The preference losses (linnet.train.preference_loss): golden numbers, values and
gradients against hand-written formulas on random log-probabilities, TRL's own functions
where TRL exposes one, and `dpo(loss_type=...)` learning, reference-free where it says so."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from linnet import nest
from linnet.train import dpo as dpo_module
from linnet.train.dpo import dpo
from linnet.train.preference_loss import kto_losses, kto_reference_point, log1mexp, pair_losses
from tests.test_dpo import CARD, _pairs

PAIRED = ("sigmoid", "robust", "hinge", "ipo", "simpo", "orpo")


def _inputs(seed=0, n=16):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 12, (n, 2), generator=g).double()
    logp = -(torch.rand(n, 4, generator=g, dtype=torch.float64) * 3 + 0.05) * torch.cat([lengths, lengths], 1)
    return logp, lengths


def _hand(loss_type, c, r, rc, rr, lc, lr, beta, e, gamma):
    """Each loss written out from its paper, one pair at a time, in plain floats."""
    ls = lambda x: -math.log1p(math.exp(-x)) if x > 0 else x - math.log1p(math.exp(x))  # noqa: E731
    if loss_type in ("ipo", "simpo", "orpo"):
        c, r, rc, rr = c / lc, r / lr, rc / lc, rr / lr
    d = (c - r) if loss_type in ("simpo", "orpo") else (c - rc) - (r - rr)
    if loss_type == "sigmoid":
        return -(1 - e) * ls(beta * d) - e * ls(-beta * d)
    if loss_type == "robust":
        return (-(1 - e) * ls(beta * d) + e * ls(-beta * d)) / (1 - 2 * e)
    if loss_type == "hinge":
        return max(0.0, 1 - beta * d)
    if loss_type == "ipo":
        return (d - 1 / (2 * beta)) ** 2
    if loss_type == "simpo":
        z = d - gamma / beta
        return -(1 - e) * ls(beta * z) - e * ls(-beta * z)
    odds = lambda p: math.log(math.exp(p) / (1 - math.exp(p)))  # noqa: E731
    return -beta * ls(odds(c) - odds(r))


def _ours(loss_type, logp, lengths, **kw):
    free = loss_type in ("simpo", "orpo")
    return pair_losses(loss_type, logp[:, 0], logp[:, 1], None if free else logp[:, 2], None if free else logp[:, 3],
                       chosen_tokens=lengths[:, 0], rejected_tokens=lengths[:, 1], **kw)


@pytest.mark.parametrize("loss_type", PAIRED)
def test_each_loss_and_its_gradient_equal_the_hand_written_formula(loss_type):
    logp, lengths = _inputs()
    kw = dict(beta=0.3, label_smoothing=0.1 if loss_type in ("sigmoid", "robust", "simpo") else 0.0, simpo_gamma=0.4)
    x = logp.clone().requires_grad_(True)
    losses, good, bad = _ours(loss_type, x, lengths, **kw)
    hand = [_hand(loss_type, *map(float, x[i]), *map(float, lengths[i]), kw["beta"], kw["label_smoothing"],
                  kw["simpo_gamma"]) for i in range(len(x))]
    torch.testing.assert_close(losses, torch.tensor(hand, dtype=torch.float64))
    (grad,) = torch.autograd.grad(losses.sum(), x)
    eps = 1e-6  # central differences of the hand-written loss
    for i in range(4):
        for j in range(4):
            up, down = [float(v) for v in x[i]], [float(v) for v in x[i]]
            up[j] += eps
            down[j] -= eps
            args = (*map(float, lengths[i]), kw["beta"], kw["label_smoothing"], kw["simpo_gamma"])
            numeric = (_hand(loss_type, *up, *args) - _hand(loss_type, *down, *args)) / (2 * eps)
            assert float(grad[i, j]) == pytest.approx(numeric, abs=1e-6)
    assert not good.requires_grad and good.shape == bad.shape == (16,)


def test_golden_numbers():
    c, r, rc, rr = (torch.tensor([v]) for v in (-3.0, -4.0, -3.5, -3.5))  # d = 1
    one = torch.tensor([1.0])
    assert float(pair_losses("hinge", c, r, rc, rr, beta=0.5)[0]) == pytest.approx(0.5)
    assert float(pair_losses("ipo", c, r, rc, rr, beta=0.5, chosen_tokens=one, rejected_tokens=one)[0]) == 0.0
    robust = pair_losses("robust", c, r, rc, rr, beta=1.0, label_smoothing=0.25)[0]
    assert float(robust) == pytest.approx((0.75 * math.log1p(math.exp(-1)) - 0.25 * math.log1p(math.exp(1))) / 0.5)
    two = torch.tensor([2.0])
    simpo = pair_losses("simpo", torch.tensor([-2.0]), torch.tensor([-6.0]), beta=2.0, simpo_gamma=1.0,
                        chosen_tokens=two, rejected_tokens=two)  # d = -1 + 3 = 2, z = 2 - 0.5
    assert float(simpo[0]) == pytest.approx(math.log1p(math.exp(-3.0)))
    assert float(simpo[1]) == pytest.approx(-2.0) and float(simpo[2]) == pytest.approx(-6.0)
    x = torch.tensor([-1e-8, -0.5, -30.0], dtype=torch.float64)
    torch.testing.assert_close(log1mexp(x), torch.tensor([math.log(1e-8), math.log(1 - math.exp(-0.5)),
                                                          math.log1p(-math.exp(-30.0))], dtype=torch.float64))


def test_misuse_is_refused():
    c = torch.zeros(2)
    with pytest.raises(ValueError, match="takes no reference"):
        pair_losses("simpo", c, c, c, c, beta=0.1, chosen_tokens=c + 1, rejected_tokens=c + 1)
    with pytest.raises(ValueError, match="needs the reference"):
        pair_losses("sigmoid", c, c, beta=0.1)
    with pytest.raises(ValueError, match="pass chosen_tokens"):
        pair_losses("ipo", c, c, c, c, beta=0.1)
    with pytest.raises(ValueError, match="kto_losses"):
        pair_losses("kto", c, c, c, c, beta=0.1)


def test_kto_against_its_formula():
    g = torch.Generator().manual_seed(3)
    policy, reference = -torch.rand(8, generator=g) * 5, -torch.rand(8, generator=g) * 5
    desirable = torch.tensor([True, False] * 4)
    z = kto_reference_point(policy.flip(0), reference)
    assert float(z) == pytest.approx(max(0.0, float((policy.flip(0) - reference).mean())))
    losses, rewards = kto_losses(policy, reference, desirable, z, beta=0.2, desirable_weight=1.5,
                                 undesirable_weight=0.5)
    for i in range(8):
        r = float(policy[i] - reference[i])
        want = 1.5 * (1 - 1 / (1 + math.exp(-0.2 * (r - float(z))))) if desirable[i] else \
            0.5 * (1 - 1 / (1 + math.exp(-0.2 * (float(z) - r))))
        assert float(losses[i]) == pytest.approx(want, rel=1e-5)
        assert float(rewards[i]) == pytest.approx(0.2 * r, rel=1e-5)


@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge", "ipo", "simpo", "orpo"])
def test_equal_to_trl(loss_type):
    """TRL's CPO loss takes the policy's log-probabilities; given log pi - log ref it is
    DPO's sigmoid, hinge and ipo (TRL's DPO computes them inline, with no function to call;
    robust and kto likewise). SimPO is CPO's simpo; ORPO's odds-ratio term is its own."""
    pytest.importorskip("trl")
    from trl.experimental.cpo.cpo_trainer import CPOTrainer
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    logp, lengths = _inputs(seed=1)
    ours, good, bad = _ours(loss_type, logp, lengths, beta=0.2, label_smoothing=0.0, simpo_gamma=0.3)
    fake = SimpleNamespace(beta=0.2, loss_type=loss_type, simpo_gamma=0.3, label_smoothing=0.0, alpha=0.0,
                           accelerator=SimpleNamespace(device="cpu"))
    mean_c, mean_r = logp[:, 0] / lengths[:, 0], logp[:, 1] / lengths[:, 1]
    if loss_type == "orpo":
        theirs = -ORPOTrainer.odds_ratio_loss(fake, mean_c, mean_r)[0]
    elif loss_type == "simpo":
        theirs = CPOTrainer.cpo_loss(fake, mean_c, mean_r)[0]
    else:
        scale = lengths if loss_type == "ipo" else torch.ones_like(lengths)
        theirs = CPOTrainer.cpo_loss(fake, (logp[:, 0] - logp[:, 2]) / scale[:, 0],
                                     (logp[:, 1] - logp[:, 3]) / scale[:, 1])[0]
    torch.testing.assert_close(ours, theirs.to(ours.dtype))


# -- through dpo() -------------------------------------------------------------------------


def _train(loss_type, steps=30, **kw):
    model = nest.load(CARD, weights="random", trainable=True, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    history = dpo(model, _pairs(24), optimizer=optimizer, steps=steps, pairs_per_step=8, beta=0.5,
                  loss_type=loss_type, tokens=128, **kw)
    return history


@pytest.mark.parametrize("loss_type", PAIRED)
def test_each_loss_type_learns_the_preference(loss_type, monkeypatch):
    if loss_type in ("simpo", "orpo"):  # reference-free: no reference pass at all
        def refuse(*a, **k):
            raise AssertionError("a reference-free loss computed reference log-probabilities")

        monkeypatch.setattr(dpo_module, "reference_log_probs", refuse)
        monkeypatch.setattr(dpo_module, "cached_reference_log_probs", refuse)
    history = _train(loss_type)
    first, last = history.steps[:3], history.steps[-3:]
    assert sum(s.loss for s in last) < sum(s.loss for s in first)
    assert sum(s.metrics["rewards/accuracies"] for s in last) / 3 > 0.8
    m = last[-1].metrics
    assert m["rewards/margins"] == pytest.approx(m["rewards/chosen"] - m["rewards/rejected"], abs=1e-5)
    assert m["logps/chosen"] > m["logps/rejected"]


def test_reference_free_losses_refuse_a_reference():
    model = nest.load(CARD, weights="random", trainable=True, seed=0)
    with pytest.raises(ValueError, match="reference-free"):
        dpo(model, _pairs(4), optimizer=torch.optim.AdamW(model.parameters()), steps=1, pairs_per_step=2,
            loss_type="simpo", reference=model)
    with pytest.raises(ValueError, match="loss_type='kto'"):
        dpo(model, _pairs(4), optimizer=torch.optim.AdamW(model.parameters()), steps=1, pairs_per_step=2,
            loss_type="kto")


def test_orpo_adds_the_chosen_nll_over_the_steps_tokens():
    """ORPO's step loss = NLL of the chosen answers (a mean over their tokens) + the mean
    odds-ratio term, as TRL's ORPOTrainer sums them."""
    model = nest.load(CARD, weights="random", trainable=True, seed=0)
    pairs = _pairs(4)
    logp = torch.as_tensor(dpo_module.reference_log_probs(model, pairs, tokens=128)).view(-1, 2)
    lengths = torch.tensor([[len(p.chosen), len(p.rejected)] for p in pairs], dtype=logp.dtype)
    term, _, _ = pair_losses("orpo", logp[:, 0], logp[:, 1], beta=0.5, chosen_tokens=lengths[:, 0],
                             rejected_tokens=lengths[:, 1])
    want = float(-logp[:, 0].sum() / lengths[:, 0].sum() + term.mean())
    history = dpo(model, pairs, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), steps=1, pairs_per_step=4,
                  beta=0.5, loss_type="orpo", tokens=128)
    assert history.steps[0].loss == pytest.approx(want, rel=1e-5)


def test_rpo_alpha_adds_the_chosen_nll_to_dpo():
    """rpo_alpha: DPO's loss plus alpha x the chosen answers' NLL, a mean over the step's
    chosen tokens (TRL: loss_type=["sigmoid", "sft"], loss_weights=[1, alpha]). At the first
    step the policy is its own reference, so DPO's term is log 2 a pair."""
    model = nest.load(CARD, weights="random", trainable=True, seed=0)
    pairs = _pairs(4)
    logp = torch.as_tensor(dpo_module.reference_log_probs(model, pairs, tokens=128)).view(-1, 2)
    want = math.log(2) + 0.3 * float(-logp[:, 0].sum() / sum(len(p.chosen) for p in pairs))
    history = dpo(model, pairs, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), steps=1, pairs_per_step=4,
                  beta=0.5, rpo_alpha=0.3, tokens=128)
    assert history.steps[0].loss == pytest.approx(want, rel=1e-5)
    for alpha, loss_type in ((-1.0, "sigmoid"), (float("nan"), "sigmoid"), (1.0, "orpo")):
        with pytest.raises(ValueError, match=f"rpo_alpha={alpha}"):
            dpo(model, pairs, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), steps=1, pairs_per_step=4,
                loss_type=loss_type, rpo_alpha=alpha, tokens=128)
