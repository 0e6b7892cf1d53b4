"""Online DPO on a tiny model: each step's pairs come from the policy as it is at that step
(the engine's log-probabilities of them equal the policy's), the chosen answer outscores the
rejected one and ties make no pair, resume is exact, the reward and held-out preference
accuracy rise, and `linnet dpo` with dpo.online writes its run."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from linnet import cli, nest
from linnet.config import DPOConfig, load
from linnet.packing import Example, Pair
from linnet.rl.rollouts import Scored
from linnet.serve import Completion, Engine
from linnet.train import pack
from linnet.train.dpo import dpo, reference_log_probs
from linnet.train.grpo import Prompt
from linnet.train.online_dpo import online_dpo, online_pairs
from tests.test_grpo import CARD, TARGET, _prompts, sevens

torch.set_num_threads(1)


class Recorder:
    """The engine, recording each sampling call's completions, their rewards, and the
    policy's own log-probabilities of each at that moment (before the step's update)."""

    def __init__(self, engine, policy):
        self.engine, self.policy, self.calls = engine, policy, []

    def load_weights(self, policy):
        self.engine.load_weights(policy)

    def sample(self, prompts, n=1, **options):
        done = self.engine.sample(prompts, n, **options)
        with torch.no_grad():
            policy = [self.policy.log_probs_packed(row)[row.weights > 0] for row in
                      (next(pack([Example.prompted(prompts[c.prompt], c.tokens)], tokens=64)) for c in done)]
        self.calls.append((done, policy))
        return done


def _run(steps, checkpoint=None, keep=None, reward=sevens, **kw):
    """Online DPO on CARD (the policy and its engine appended to `keep`, when given)."""
    torch.manual_seed(0)
    policy = nest.load(CARD, weights="random", seed=1, trainable=True)
    engine = Engine(nest.load(CARD, weights="random", seed=1))
    if keep is not None:
        engine = Recorder(engine, policy)
        keep += [policy, engine]
    free = kw.get("loss_type") in ("simpo", "orpo")
    reference = None if free else nest.load(CARD, weights="random", seed=1)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    options = dict(pairs_per_step=8, samples=4, max_new_tokens=6, tokens=64, beta=0.1, checkpoint=checkpoint,
                   checkpoint_every=2)
    options.update(kw)
    return online_dpo(policy, engine, _prompts(), reward, reference=reference, optimizer=opt, steps=steps, **options)


def test_pairs_come_from_the_policy_at_each_step():
    """The engine's log-probabilities of every sampled completion equal the policy's at that
    step (its weights reached the engine), and the step's logps/chosen and logps/rejected,
    the policy's before its update, are those of each prompt's best and worst completion."""
    keep = []
    history = _run(4, keep=keep)
    engine = keep[1]
    assert len(engine.calls) == 4
    for step, (done, policy) in zip(history.steps, engine.calls, strict=True):
        for c, mine in zip(done, policy, strict=True):
            torch.testing.assert_close(c.logprobs.float(), mine.float(), atol=1e-5, rtol=0)
        rewards = np.array([sevens(None, c.tokens) for c in done]).reshape(8, 4)
        kept = np.flatnonzero(rewards.std(axis=1) > 0)
        summed = np.array([float(c.logprobs.sum()) for c in done]).reshape(8, 4)
        chosen = summed[kept, rewards[kept].argmax(axis=1)]
        rejected = summed[kept, rewards[kept].argmin(axis=1)]
        assert step.metrics["pairs"] == len(kept) and step.metrics["ties"] == 8 - len(kept)
        assert step.metrics["logps/chosen"] == pytest.approx(chosen.mean(), abs=1e-4)
        assert step.metrics["logps/rejected"] == pytest.approx(rejected.mean(), abs=1e-4)


def test_chosen_outscores_rejected_and_ties_are_skipped():
    """By hand: the first best over the first worst; a prompt of equal rewards makes no pair."""
    done = [Completion(i // 3, [3 + i], torch.zeros(1), True) for i in range(9)]
    rewards = np.array([[1.0, 0.0, 1.0], [0.5, 0.5, 0.5], [0.0, 2.0, -1.0]])
    scored = Scored(done, {"r": rewards.ravel()}, rewards, rewards.std(axis=1) == 0, np.zeros(9), np.ones(9, bool), 0.0)
    pairs, scores = online_pairs(scored, [Prompt([5]), Prompt([6]), Prompt([7])])
    assert pairs == [Pair([5], [3], [4]), Pair([7], [10], [11])]
    assert scores.tolist() == [[1.0, 0.0], [2.0, -1.0]]
    # in training: a reward that is mostly 0 with two samples ties often
    history = _run(3, reward=lambda p, c: float(c[0] == TARGET), samples=2)
    for s in history.steps:
        assert s.metrics["pairs"] + s.metrics["ties"] == 8 and s.metrics["ties"] > 0
        if s.metrics["pairs"]:
            assert s.metrics["reward_chosen"] > s.metrics["reward_rejected"]


def test_resume_equals_uninterrupted(tmp_path):
    """Stopped after step 2 and resumed: steps 3 and 4 sample, pair and train as one run does."""
    runs = [_run(4), _run(2, checkpoint=tmp_path), _run(4, checkpoint=tmp_path)]
    resumed = [(s.step, s.loss, s.metrics["reward"], s.metrics["pairs"]) for s in runs[2].steps]
    assert resumed == [(s.step, s.loss, s.metrics["reward"], s.metrics["pairs"]) for s in runs[0].steps[2:]]


def _held_out_pairs(n=32):
    """Held-out prompts, each with the right answer (all sevens) and a wrong one (another token six times)."""
    g = np.random.default_rng(7)
    wrong = [t for t in range(3, 16) if t != TARGET]
    return [Pair(p.ids, [TARGET] * 6, [int(g.choice(wrong))] * 6) for p in _prompts(n, seed=7)]


@pytest.mark.parametrize("loss_type", ["sigmoid", "simpo"])
def test_reward_and_held_out_preference_accuracy_rise(loss_type):
    """Over 12 steps the sampled completions' reward rises, and on held-out pairs the policy
    comes to rank the right answer above the wrong one: by its own log-probabilities, and
    (sigmoid) by DPO's implicit reward against the starting model."""
    held_out = _held_out_pairs()
    keep = []
    start = reference_log_probs(nest.load(CARD, weights="random", seed=1), held_out, tokens=64)  # the starting model
    history = _run(12, keep=keep, loss_type=loss_type, **({"beta": 2.0} if loss_type == "simpo" else {}))
    rewards = [s.metrics["reward"] for s in history.steps]
    assert np.mean(rewards[-3:]) > np.mean(rewards[:3]) + 0.2, rewards
    after = reference_log_probs(keep[0], held_out, tokens=64)
    accuracy_before = float(np.mean(start[:, 0] > start[:, 1]))
    accuracy_after = float(np.mean(after[:, 0] > after[:, 1]))
    implicit = float(np.mean((after - start)[:, 0] > (after - start)[:, 1]))
    print(f"{loss_type}: reward {rewards[0]:.2f} -> {rewards[-1]:.2f}; held-out accuracy {accuracy_before:.2f} -> "
          f"{accuracy_after:.2f}, implicit {implicit:.2f}")
    assert accuracy_after >= max(0.9, accuracy_before + 0.3)
    assert implicit >= 0.9


def test_bad_settings_name_the_fix():
    policy = nest.load(CARD, weights="random", trainable=True)
    engine = Engine(nest.load(CARD, weights="random"))
    opt = torch.optim.SGD(policy.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="pass reference=, a frozen copy"):
        online_dpo(policy, engine, _prompts(), sevens, optimizer=opt, steps=1)
    with pytest.raises(ValueError, match="online_dpo: samples=1; .* use 2 or more"):
        online_dpo(policy, engine, _prompts(), sevens, optimizer=opt, steps=1, loss_type="simpo", samples=1)
    with pytest.raises(ValueError, match="half of it"):
        online_dpo(policy, engine, [Prompt([3] * 30)], sevens, optimizer=opt, steps=1, loss_type="simpo",
                   max_new_tokens=6, tokens=64)
    with pytest.raises(ValueError, match="call linnet.train.online_dpo.online_dpo"):
        dpo(policy, [Pair([3], [4], [5])], optimizer=opt, steps=1, online=True)
    with pytest.raises(ValueError, match=r"dpo.temperature=0.5 is read with dpo.online: true only"):
        load(DPOConfig, None, ["data.path=x.jsonl", "dpo.temperature=0.5"])
    with pytest.raises(ValueError, match="dpo.reference_cache"):
        load(DPOConfig, None, ["data.path=x.jsonl", "dpo.online=true", "dpo.reference_cache=cache"])


def even_share(prompt, completion) -> float:
    """A reward a random model's completions differ in, so pairs are made from the start."""
    return sum(t % 2 == 0 for t in completion) / max(len(completion), 1)


def test_linnet_dpo_online_writes_its_run(tmp_path):
    from linnet.commands import quickstart
    from tests.conftest import quickstart_model

    quickstart_model(tmp_path / "model")
    rng = np.random.default_rng(0)
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n"
                                                    for p, a in quickstart.problems(rng, 40, 1)))
    out = tmp_path / "run"
    sets = [f"model.card={tmp_path / 'model'}", f"data.path={tmp_path / 'prompts.jsonl'}", "data.chat=false",
            "data.eval_share=0.1", "training.context_length=64", "training.steps=3", "evaluation.every=2",
            "lr_schedule.warmup_steps=1", "dpo.online=true", "dpo.samples=4", "dpo.pairs_per_step=4",
            "dpo.max_new_tokens=3", "dpo.rewards=[tests.test_online_dpo:even_share]", "runtime.progress=false",
            f"runtime.output_dir={out}"]
    assert cli.main(["dpo", *[a for s in sets for a in ("--set", s)]]) == 0
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert {"pairs", "ties", "reward", "reward_chosen", "reward_rejected", "rewards/margins", "logps/chosen"} \
        <= set(metrics[0])
    assert metrics[0]["loss"] == pytest.approx(np.log(2), abs=1e-5)  # the policy starts as its reference
    assert all(m["pairs"] + m["ties"] == 4 for m in metrics)
    assert "held_out_reward" in metrics[1] and "held_out_pass@1" in metrics[-1]
    assert (out / "final").is_dir() and json.loads((out / "config.json").read_text())["dpo"]["online"] is True
