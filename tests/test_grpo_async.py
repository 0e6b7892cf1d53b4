"""GRPO sampling ahead of training (grpo.max_staleness): each step's samples come from
exactly the weights max_staleness updates old, runs repeat and resume bit for bit, and a
stalled sampler or trainer ends the run naming it."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from linnet.rl.rollouts import Sampler
from linnet.run import Preempted
from linnet.train import loop
from tests.test_grpo import _run, sevens


def _weight(model) -> float:
    return float(dict(model.named_parameters())["model.layers.0.mlp.down_proj.weight"].detach().double().sum())


@pytest.mark.parametrize("staleness", [1, 2])
def test_each_step_samples_the_weights_that_many_updates_old(staleness, monkeypatch):
    sampled, updated = {}, {}
    call = Sampler.__call__

    def recording(self, chunk, step):  # the engine's weights as this step samples
        sampled[step] = _weight(self.engine.model)
        return call(self, chunk, step)

    monkeypatch.setattr(Sampler, "__call__", recording)
    policy = []
    history = _run(5, max_staleness=staleness, correction_cap=2.0,
                   on_step=lambda record: updated.__setitem__(record.step, _weight(policy[0])), keep_policy=policy)
    updated[0] = sampled[1]  # both start from the same random weights
    assert sorted(sampled) == [1, 2, 3, 4, 5]
    for step, weight in sampled.items():
        assert weight == updated[max(step - 1 - staleness, 0)], step
    assert [s.metrics["staleness"] for s in history.steps] == [float(min(s - 1, staleness)) for s in range(1, 6)]
    assert all(0 <= s.metrics["sampler_busy"] <= 1 and 0 <= s.metrics["trainer_busy"] <= 1 for s in history.steps)


def test_a_run_repeats_itself_and_starts_as_the_synchronous_one():
    first, again = _run(4, max_staleness=1), _run(4, max_staleness=1)
    assert [s.loss for s in first.steps] == [s.loss for s in again.steps]
    synchronous = _run(4, max_staleness=0)
    assert synchronous.steps[0].loss == first.steps[0].loss  # step 1 samples the starting weights either way
    assert [s.loss for s in synchronous.steps] == [s.loss for s in _run(4).steps]
    assert "staleness" not in synchronous.steps[0].metrics


def test_each_side_runs_on_half_the_threads(monkeypatch):
    # a new thread's kernels use the machine's default count, whatever the trainer set: the
    # sampler must set its own, or the two sides oversubscribe the cores
    set_threads, counts = torch.set_num_threads, []
    monkeypatch.setattr(torch, "set_num_threads",
                        lambda n: counts.append((threading.current_thread().name, n)) or set_threads(n))
    before = torch.get_num_threads()
    set_threads(4)
    try:
        _run(2, max_staleness=1)
        after = torch.get_num_threads()
    finally:
        set_threads(before)
    assert ("linnet grpo sampler", 2) in counts and ("MainThread", 2) in counts
    assert after == 4


def test_resume_takes_the_checkpointed_samples_and_ends_as_uninterrupted(tmp_path, monkeypatch):
    whole = _run(5, max_staleness=2)
    taken = []
    take_step = loop.take_step
    with monkeypatch.context() as m:  # stopped after step 2 as by SIGTERM: the checkpoint holds steps 3 and 4's samples
        m.setattr(loop, "_stop_agreed", lambda: len(taken) == 2)
        m.setattr(loop, "take_step", lambda *a, **k: taken.append(1) or take_step(*a, **k))
        with pytest.raises(Preempted):
            _run(5, checkpoint=tmp_path / "stopped", max_staleness=2)
    rest = _run(5, checkpoint=tmp_path / "stopped", max_staleness=2)
    assert [s.step for s in rest.steps] == [3, 4, 5]
    assert [s.loss for s in rest.steps] == [s.loss for s in whole.steps[2:]]
    _run(2, checkpoint=tmp_path / "extended", max_staleness=2)  # no samples drawn past step 2: drawn afresh
    assert [s.step for s in _run(4, checkpoint=tmp_path / "extended", max_staleness=2).steps] == [3, 4]


def test_lora_samples_ahead_and_the_reward_rises():
    history = _run(12, max_staleness=1, correction_cap=2.0, correction="sequence")
    rewards = [s.metrics["reward"] for s in history.steps]
    assert np.mean(rewards[-3:]) > np.mean(rewards[:3]) + 0.2, rewards
    lora = _run(3, max_staleness=1, lora=True)
    assert len(lora) == 3 and all(np.isfinite(s.loss) for s in lora.steps)


def test_a_stalled_sampler_is_named_within_the_timeout():
    release = threading.Event()

    def stuck(prompt, completion):
        if threading.current_thread() is not threading.main_thread():
            release.wait(120)
        return sevens(prompt, completion)

    started = time.monotonic()
    try:
        with pytest.raises(TimeoutError, match="the sampler delivered no samples for step 1 in 5 s"):
            _run(3, max_staleness=1, stall_timeout=5.0, reward=stuck)
    finally:
        release.set()
    assert time.monotonic() - started < 120  # ended by the timeout, not by the sampler's block running out


def test_a_stalled_trainer_is_named_within_the_timeout():
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="the trainer published no weights or prompts for step 3"):
        _run(4, max_staleness=1, stall_timeout=5.0, on_step=lambda record: time.sleep(60))
    assert time.monotonic() - started < 60  # interrupted by the sampler, not the sleep running out


def test_refusals_name_the_fix():
    with pytest.raises(ValueError, match=r"^grpo: max_staleness=-1; it must be a number of steps, >= 0$"):
        _run(1, max_staleness=-1)
    with pytest.raises(ValueError, match="correction"):
        _run(1, correction="word")
