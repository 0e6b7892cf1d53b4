"""DPO: the loss against a hand-written one, log 2 at the start, learning, references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from linnet import nest
from linnet.train.dpo import Pair, answer_log_probs, dpo, reference_log_probs
from linnet.train.preference_loss import pair_losses

torch.set_num_threads(1)
CARD = nest.resolve("debug").replace(vocab=32, hidden=32, intermediate=64, heads=4, kv_heads=2, head_dim=8)


def _pairs(n=24, seed=0):
    """Prompt a b c: the chosen answer repeats it, the rejected one reverses it."""
    g = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        prompt = g.integers(3, 32, size=int(g.integers(2, 6))).tolist()
        out.append(Pair([1] + prompt, prompt + [2], prompt[::-1] + [2]))
    return out


def dpo_sigmoid(c, r, rc, rr, **kw):
    return pair_losses("sigmoid", c, r, rc, rr, **kw)[0]


def test_dpo_sigmoid_golden_numbers():
    c, r = torch.tensor([-3.0, -5.0]), torch.tensor([-4.0, -2.0])
    rc, rr = torch.tensor([-3.5, -5.0]), torch.tensor([-3.5, -2.5])
    loss = dpo_sigmoid(c, r, rc, rr, beta=0.5)
    # d = (0.5 - (-0.5), 0 - 0.5) = (1, -0.5); loss = log(1 + exp(-beta d))
    expect = [math.log1p(math.exp(-0.5)), math.log1p(math.exp(0.25))]
    torch.testing.assert_close(loss, torch.tensor(expect))
    smooth = dpo_sigmoid(c, r, rc, rr, beta=0.5, label_smoothing=0.2)
    torch.testing.assert_close(smooth[0], torch.tensor(0.8 * expect[0] + 0.2 * math.log1p(math.exp(0.5))))


def test_dpo_gradient_matches_a_hand_written_loss():
    """The gradient of the packed, summed loss equals the one through plain per-answer
    log-probabilities computed one sequence at a time."""
    model = nest.load(CARD, weights="random", trainable=True, seed=1)
    pairs = _pairs(3)
    ref = torch.tensor(reference_log_probs(model, pairs, tokens=64), dtype=torch.float32) - 0.3
    from linnet.train.dpo import _rows

    total = 0.0
    for row in _rows(pairs, 64, model):  # the rows dpo() trains on: each prompt once, shared
        assert row.prefix is not None
        n = row.examples // 2
        logp = answer_log_probs(model, row).view(n, 2)
        total = total + dpo_sigmoid(logp[:, 0], logp[:, 1], ref[:n, 0], ref[:n, 1], beta=0.1).sum()
    (ours,) = torch.autograd.grad(total, [model.model.layers[0].mlp.up_proj.weight])

    def seq_logp(prompt, answer):
        tokens = torch.tensor(prompt + answer)
        logp = torch.log_softmax(model(tokens)[:-1], -1).gather(-1, tokens[1:, None])[:, 0]
        return logp[len(prompt) - 1 :].sum()

    hand = 0.0
    for i, p in enumerate(pairs):
        d = (seq_logp(p.prompt, p.chosen) - ref[i, 0]) - (seq_logp(p.prompt, p.rejected) - ref[i, 1])
        hand = hand + -torch.nn.functional.logsigmoid(0.1 * d)
    (theirs,) = torch.autograd.grad(hand, [model.model.layers[0].mlp.up_proj.weight])
    torch.testing.assert_close(total, hand, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-7)


def test_dpo_starts_at_log2_and_learns_with_lora():
    torch.manual_seed(0)
    model = nest.load(CARD, weights="random", seed=2)
    model.add_lora("model.layers.*", rank=4, alpha=8)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    pairs = _pairs(64)
    history = dpo(model, pairs, optimizer=opt, steps=16, pairs_per_step=16, beta=0.5, tokens=64)
    assert history.steps[0].loss == pytest.approx(math.log(2), abs=1e-6)
    assert history.steps[0].metrics["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    last = history.steps[-4:]
    assert sum(s.metrics["rewards/accuracies"] for s in last) / 4 > 0.8
    assert sum(s.loss for s in last) / 4 < math.log(2) - 0.1


def test_reference_model_and_disk_cache_agree(tmp_path):
    reference = nest.load(CARD, weights="random", seed=4)
    pairs = _pairs(8)
    runs = []
    for kw in ({"reference": reference}, {"reference": reference, "reference_cache": tmp_path}):
        model = nest.load(CARD, weights="random", seed=3, trainable=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        runs.append(dpo(model, pairs, optimizer=opt, steps=2, pairs_per_step=4, tokens=64, **kw).losses)
    assert runs[0] == pytest.approx(runs[1], rel=1e-5)
    assert len(list(tmp_path.glob("dpo-reference-*.npy"))) == 1


def test_bad_pairs_name_the_item():
    model = nest.load(CARD, weights="random", trainable=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pairs = _pairs(3) + [Pair([1, 5], [], [6, 2])]
    with pytest.raises(ValueError, match="pair 3 has an empty chosen"):
        dpo(model, pairs, optimizer=opt, steps=1)
    with pytest.raises(ValueError, match="must be a\\s+sequence"):
        dpo(model, iter(_pairs(3)), optimizer=opt, steps=1)


def test_the_references_pass_before_step_1_is_a_phase_of_its_own(capsys, monkeypatch):
    """The model's own log-probabilities of every pair, computed before the first step, say
    when they start and end (a log shows what the minutes before step 1 were); a bar shows
    its rows on a terminal, and the training bar's rate counts from its first step."""
    import io

    from linnet.report import progress

    monkeypatch.delenv("LINNET_QUIET", raising=False)
    model = nest.load(CARD, weights="random", trainable=True)
    dpo(model, _pairs(), optimizer=torch.optim.SGD(model.parameters(), lr=0.0), steps=1, pairs_per_step=4)
    err = capsys.readouterr().err
    assert "dpo: the reference's log-probabilities of 24 pairs ..." in err
    assert "dpo: the reference's log-probabilities of 24 pairs: done in" in err

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    screen = Terminal()
    bar = progress.Progress(10, "train", stream=screen)
    bar.start -= 100.0  # a slow phase before the first step ...
    bar.update(1)
    bar.first = (1, bar.first[1] - 1.0)  # ... then one step a second
    bar.update(2)
    assert screen.getvalue().rstrip().endswith("2/10  1 it/s eta 8s")
