"""GRPO end to end on a tiny model: rewards rise, resume is exact, bad inputs are named."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from linnet import nest
from linnet.serve import Engine
from linnet.train.grpo import Prompt, grpo

torch.set_num_threads(1)
CARD = nest.resolve("debug").replace(vocab=16, hidden=32, intermediate=64, heads=4, kv_heads=2, head_dim=8,
                                     eos_token_ids=(2,))
TARGET = 7


def sevens(prompt, completion):
    """Share of the completion's tokens that are 7: easy to learn, graded, never uniform for long."""
    return sum(t == TARGET for t in completion) / len(completion)


def _prompts(n=16, seed=0):
    g = np.random.default_rng(seed)
    return [Prompt(g.integers(3, 16, size=int(g.integers(1, 5))).tolist()) for _ in range(n)]


def _run(steps, checkpoint=None, **kw):
    torch.manual_seed(0)
    policy = nest.load(CARD, weights="random", seed=1, trainable=True)
    engine = Engine(nest.load(CARD, weights="random", seed=1))
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=2e-2)
    options = dict(group=8, prompts_per_step=4, max_new_tokens=6, tokens=64, checkpoint=checkpoint,
                   checkpoint_every=2, verbose=False)
    options.update(kw)
    return grpo(policy, engine, _prompts(), sevens, optimizer=opt, steps=steps, **options)


def test_reward_rises_and_first_iteration_is_unclipped():
    history = _run(12)
    rewards = [s.metrics["reward"] for s in history.steps]
    assert np.mean(rewards[-3:]) > np.mean(rewards[:3]) + 0.2, rewards
    assert all(s.metrics["clip_fraction"] == 0 for s in history.steps)  # iterations=1: ratio 1
    assert all(s.metrics["mismatch"] < 1e-4 for s in history.steps)  # engine and policy agree
    assert all(0 < s.metrics["completion_length"] <= 6 for s in history.steps)


def test_iterations_clip_and_options_run():
    history = _run(3, iterations=2, clip=(0.1, 0.1), drop_uniform=True, correction_cap=2.0, sequence_level=True)
    assert len(history) == 3 and all(np.isfinite(s.loss) for s in history.steps)
    dr = _run(2, dr_grpo=True)
    assert len(dr) == 2


def test_resume_equals_uninterrupted(tmp_path):
    whole = _run(4)
    _run(2, checkpoint=tmp_path)
    rest = _run(4, checkpoint=tmp_path)
    assert [s.step for s in rest.steps] == [3, 4]
    assert [s.loss for s in rest.steps] == [s.loss for s in whole.steps[2:]]


def test_bad_inputs_name_the_item():
    policy = nest.load(CARD, weights="random", trainable=True)
    engine = Engine(nest.load(CARD, weights="random"))
    opt = torch.optim.SGD(policy.parameters(), lr=0.1)
    kw = dict(optimizer=opt, steps=1, group=2, prompts_per_step=2, max_new_tokens=3, tokens=32, verbose=False)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        grpo(policy, engine, [Prompt([3]), Prompt([])], sevens, **kw)
    with pytest.raises(TypeError, match=r"returned 'yes' on prompt 0, completion 0"):
        grpo(policy, engine, [Prompt([3])], lambda p, c: "yes", **kw)

    def broken(prompt, completion):
        raise KeyError("answer")

    with pytest.raises(RuntimeError, match="reward 'broken' raised KeyError"):
        grpo(policy, engine, [Prompt([3])], broken, **kw)
    with pytest.raises(ValueError, match="does not fit a row"):
        grpo(policy, engine, [Prompt(list(range(3, 15)) * 3)], sevens, **kw)
