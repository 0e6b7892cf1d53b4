"""KTO on unpaired answers: the loss at the start, learning the preference, the KL
reference point, and `linnet dpo` with dpo.loss_type=kto on prompt/completion/label records."""

from __future__ import annotations

import pytest
import torch

from linnet import nest
from linnet.packing import Unpaired
from linnet.train.kto import kto
from tests.test_dpo import CARD, _pairs


def _unpaired(n=24):
    """Half the answers desirable (the prompt repeated), half undesirable (reversed)."""
    return [Unpaired(p.prompt, p.chosen, True) if i % 2 == 0 else Unpaired(p.prompt, p.rejected, False)
            for i, p in enumerate(_pairs(n))]


def test_kto_starts_at_half_and_learns_which_answers_are_desirable():
    model = nest.load(CARD, weights="random", trainable=True, seed=0)
    history = kto(model, _unpaired(), optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3), steps=30,
                  examples_per_step=8, beta=0.5, tokens=128)
    first, last = history.steps[0], history.steps[-3:]
    # policy = reference at the start: every reward 0, z 0, every loss 1 - sigmoid(0)
    assert first.loss == pytest.approx(0.5, abs=1e-6) and first.metrics["kl"] == 0.0
    assert sum(s.loss for s in last) / 3 < 0.45
    m = last[-1].metrics
    assert m["rewards/chosen"] > 0 > m["rewards/rejected"] and m["rewards/margins"] > 0
    assert m["kl"] >= 0 and all(s.metrics["examples"] == 8 for s in history.steps)


def test_kto_weights_and_refusals():
    model = nest.load(CARD, weights="random", trainable=True, seed=0)
    history = kto(model, _unpaired(8), optimizer=torch.optim.SGD(model.parameters(), lr=0.0), steps=1,
                  examples_per_step=8, beta=0.5, desirable_weight=2.0, undesirable_weight=0.5, tokens=128)
    assert history.steps[0].loss == pytest.approx((4 * 2.0 * 0.5 + 4 * 0.5 * 0.5) / 8, abs=1e-6)
    with pytest.raises(ValueError, match="at least two examples"):
        kto(model, _unpaired(1), optimizer=torch.optim.SGD(model.parameters(), lr=0.0), steps=1)
    with pytest.raises(TypeError, match="not a linnet.packing.Unpaired"):
        kto(model, _pairs(4), optimizer=torch.optim.SGD(model.parameters(), lr=0.0), steps=1)
