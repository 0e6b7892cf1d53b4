"""GRPO end to end on a tiny model: rewards rise, resume is exact, bad inputs are named;
held-out evaluation and the pass@k estimator against hand-computed numbers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from linnet import nest
from linnet.serve import Completion, Engine
from linnet.train.grpo import Prompt, evaluate, grpo, pass_at_k

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


def _run(steps, checkpoint=None, reward=sevens, lora=False, keep_policy=None, **kw):
    """GRPO on CARD for `steps` steps (the policy appended to `keep_policy`, when given)."""
    torch.manual_seed(0)
    policy = nest.load(CARD, weights="random", seed=1, trainable=not lora)
    if lora:
        policy.add_lora("model.layers.*.self_attn.*_proj", rank=4, alpha=8)
    if keep_policy is not None:
        keep_policy.append(policy)
    engine = Engine(nest.load(CARD, weights="random", seed=1))
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=2e-2)
    options = dict(group=8, prompts_per_step=4, max_new_tokens=6, tokens=64, checkpoint=checkpoint,
                   checkpoint_every=2, verbose=False)
    options.update(kw)
    return grpo(policy, engine, _prompts(), reward, optimizer=opt, steps=steps, **options)


def test_reward_rises_and_first_iteration_is_unclipped():
    history = _run(12)
    rewards = [s.metrics["reward"] for s in history.steps]
    assert np.mean(rewards[-3:]) > np.mean(rewards[:3]) + 0.2, rewards
    assert all(s.metrics["clip_fraction"] == 0 for s in history.steps)  # iterations=1: ratio 1
    assert all(s.metrics["mismatch"] < 1e-4 for s in history.steps)  # engine and policy agree
    assert all(0 < s.metrics["completion_length"] <= 6 for s in history.steps)
    # where a step's time goes: weights into the engine, sampling, scoring, training; the parts fit in the step
    parts = ("copy_seconds", "sample_seconds", "score_seconds", "train_seconds")
    assert all(all(s.metrics[k] > 0 for k in parts) and sum(s.metrics[k] for k in parts) <= s.seconds
               for s in history.steps)


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
    with pytest.raises(ValueError, match=r"returned 'yes' on prompt 0, completion 0"):
        grpo(policy, engine, [Prompt([3])], lambda p, c: "yes", **kw)

    def broken(prompt, completion):
        raise KeyError("answer")

    with pytest.raises(ValueError, match="reward 'broken' raised KeyError"):
        grpo(policy, engine, [Prompt([3])], broken, **kw)
    with pytest.raises(ValueError, match="does not fit a row"):
        grpo(policy, engine, [Prompt(list(range(3, 15)) * 3)], sevens, **kw)


def test_pass_at_k_by_hand():
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # C(3,2) / C(5,2)
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # k = 1: the share correct
    assert pass_at_k(20, 2, 5) == pytest.approx(1 - (15 * 14) / (20 * 19))  # = 17/38
    assert pass_at_k(4, 0, 3) == 0.0
    assert pass_at_k(3, 2, 2) == 1.0  # fewer than k wrong: every draw of k holds a right one
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(3, 1, 4)


class ScriptedEngine:
    """Returns fixed completions: the greedy call's, then the sampled call's (prompt-major)."""

    def __init__(self, greedy, sampled):
        self.replies, self.calls = [greedy, sampled], []

    def load_weights(self, policy):
        self.calls.append("load")

    def sample(self, prompts, n=1, **options):
        self.calls.append((n, options["temperature"], options.get("seed")))
        tokens = self.replies.pop(0)
        return [Completion(i // n, t, torch.zeros(len(t)), True) for i, t in enumerate(tokens)]


def test_evaluate_scores_greedy_pass_at_1_and_sampled_pass_at_k():
    right = lambda p, c: float(c[0] == 7)  # noqa: E731
    shaped = lambda p, c: float(len(c) == 2)  # noqa: E731
    greedy = [[7, 2], [5, 2]]  # prompt 0 right, prompt 1 wrong
    # 4 samples each: prompt 0 has one right answer and two mis-shaped wrong ones,
    # prompt 1 three right answers, one of them mis-shaped
    sampled = [[7, 2], [5, 2], [4, 4, 2], [3, 3, 2], [7, 2], [7, 2], [7, 7, 2], [6, 2]]
    engine = ScriptedEngine(greedy, sampled)
    prompts = [Prompt([3]), Prompt([4])]
    out = evaluate("policy", engine, prompts, {"right": right, "shaped": shaped}, k=2, samples=4,
                   temperature=0.7, seed=5)
    assert engine.calls == ["load", (1, 0.0, None), (4, 0.7, 5)]
    assert out["reward"] == pytest.approx(1.5) and out["pass@1"] == 0.5
    # a pass needs full marks (2): prompt 0 has c=1 of 4, prompt 1 c=2 of 4
    assert out["pass@2"] == pytest.approx(((1 - 3 / 6) + (1 - 1 / 6)) / 2)
    # passing=1: prompt 0 has c=2 of 4, prompt 1 c=4 of 4
    lenient = evaluate("policy", ScriptedEngine(greedy, sampled), prompts, {"right": right, "shaped": shaped},
                       k=2, samples=4, passing=1.0)
    assert lenient["pass@1"] == 1.0 and lenient["pass@2"] == pytest.approx(((1 - 1 / 6) + 1) / 2)
    with pytest.raises(ValueError, match="samples >= k"):
        evaluate("policy", engine, prompts, right, k=4, samples=3)


def test_sample_in_batches_gives_one_calls_completions_from_a_cache_of_one_batch():
    """Seven prompts three a call: the greedy completions of one call, in its order and with
    its prompt indices; the engine's prompt cache never holds more than three; each batch
    draws with the seed plus its first prompt's index."""
    from linnet.rl.rollouts import sample_in_batches

    prompts = [p.ids for p in _prompts(7)]
    whole = Engine(nest.load(CARD, weights="random", seed=3)).sample(prompts, 2, max_new_tokens=4, temperature=0.0)
    engine = Engine(nest.load(CARD, weights="random", seed=3))
    parts = sample_in_batches(engine, prompts, 2, batch=3, max_new_tokens=4, temperature=0.0)
    assert [(c.prompt, c.tokens) for c in parts] == [(c.prompt, c.tokens) for c in whole]
    assert engine._prompt_keys[0].shape[0] == 3
    scripted = ScriptedEngine([[5, 2]] * 3, [[5, 2]] * 3)
    scripted.replies.append([[5, 2]])
    sample_in_batches(scripted, prompts, batch=3, seed=5, temperature=1.0)
    assert scripted.calls == [(1, 1.0, 5), (1, 1.0, 8), (1, 1.0, 11)]
    with pytest.raises(ValueError, match="batch=0"):
        sample_in_batches(engine, prompts, batch=0)


def test_evaluate_through_the_engine_sees_the_policy():
    """The answers are the policy's own most and least likely first tokens: the engine (built
    with other weights) must get the policy's to pass all, or none."""
    untied = CARD.replace(tied_embeddings=False)  # tied, each token's likeliest successor is itself
    policy = nest.load(untied, weights="random", seed=3, trainable=True)
    engine = Engine(nest.load(untied, weights="random", seed=4))
    with torch.no_grad():
        logits = [policy(torch.tensor(p.ids))[-1] for p in _prompts(6)]
    first = lambda p, c: float(c[0] == p.answer)  # noqa: E731
    for pick, expected in ((torch.argmax, 1.0), (torch.argmin, 0.0)):
        prompts = [Prompt(p.ids, int(pick(x))) for p, x in zip(_prompts(6), logits)]
        out = evaluate(policy, engine, prompts, first, max_new_tokens=2, k=3, temperature=1e-3)
        assert out == {"reward": expected, "pass@1": expected, "pass@3": expected}


def test_rloo_advantages_are_leave_one_out_and_sum_to_zero():
    from linnet.rl.rollouts import group_advantages

    rewards = np.random.default_rng(0).random((5, 4))
    rloo = group_advantages(rewards, kind="rloo")
    by_hand = np.array([[r[i] - np.delete(r, i).mean() for i in range(4)] for r in rewards])
    np.testing.assert_allclose(rloo, by_hand)
    np.testing.assert_allclose(rloo.sum(axis=1), 0, atol=1e-12)
    with pytest.raises(ValueError, match="advantage='ppo'"):
        group_advantages(rewards, kind="ppo")


def test_rloo_and_sequence_mean_learn():
    history = _run(12, advantage="rloo", sequence_mean=True)
    rewards = [s.metrics["reward"] for s in history.steps]
    assert np.mean(rewards[-3:]) > np.mean(rewards[:3]) + 0.2, rewards
    with pytest.raises(ValueError, match="choose one"):
        _run(1, dr_grpo=True, sequence_mean=True)


def test_sequence_mean_weighs_each_completion_alike():
    """sequence_mean: every completion's tokens weigh 1/|o_i| and the normaliser counts
    completions, so a long completion counts as much as a short one."""
    from linnet.rl.rollouts import Completion as Sample
    from linnet.train.grpo import _rollout

    samples = [Sample(0, [5, 6, 7, 2], torch.zeros(4), True), Sample(0, [7, 2], torch.zeros(2), True)]
    out = _rollout(samples, np.array([1.0, -1.0]), np.ones(2, bool), [Prompt([3, 4])], 64, True, True)
    weights = torch.cat(out.token_weight)
    assert weights.tolist() == [0.25] * 4 + [0.5] * 2


def uniform_half(prompt, completion):
    """Prompts starting with an even token always score 1 (uniform groups); the others
    score the share of 7s."""
    return 1.0 if prompt.ids[0] % 2 == 0 else sevens(prompt, completion)


def test_to_train_leaves_out_zero_advantages_only_without_kl():
    from linnet.rl.rollouts import Scored, to_train

    def scored(advantages, keep):
        n = len(advantages)
        return Scored([None] * n, {}, np.zeros((1, n)), np.zeros(1, bool), np.array(advantages, float),
                      np.array(keep), 0.0)

    assert to_train(scored([0.5, 0.0, -0.5, 0.0], [True] * 4), 0.0).tolist() == [True, False, True, False]
    assert to_train(scored([0.5, 0.0, -0.5, 0.0], [True] * 4), 0.1).tolist() == [True] * 4  # the KL term trains
    assert to_train(scored([0.0, 0.5, 0.5], [True, True, False]), 0.0).tolist() == [False, True, False]
    # nothing to learn: the first kept completion still passes, so the step is a zero-gradient step
    assert to_train(scored([0.0, 0.0, 0.0], [False, True, True]), 0.0).tolist() == [False, True, False]
    assert to_train(scored([0.0, 0.0], [False, False]), 0.0).tolist() == [False, False]


@pytest.mark.parametrize("reward", ["uniform_half", "constant"])
def test_skipping_zero_advantage_completions_changes_nothing_but_the_work(reward, monkeypatch):
    """A run that passes every completion through the policy (to_train = keep) ends with
    the same weights and losses as the default, which skips the zero-advantage ones (the
    uniform groups of two of the three steps here; every group with a constant reward,
    where AdamW's weight decay still applies as in a zero-gradient step)."""
    import linnet.train.grpo as G

    scorer = uniform_half if reward == "uniform_half" else (lambda prompt, completion: 1.0)

    def run():
        torch.manual_seed(0)
        policy = nest.load(CARD, weights="random", seed=1, trainable=True)
        engine = Engine(nest.load(CARD, weights="random", seed=1))
        trained = [p for p in policy.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(trained, lr=2e-2, weight_decay=0.1)
        history = grpo(policy, engine, _prompts(), scorer, optimizer=opt, steps=3, group=8, prompts_per_step=4,
                       max_new_tokens=6, tokens=64, verbose=False)
        return history, [p.detach().clone() for p in trained]

    start = [p.detach().clone() for p in nest.load(CARD, weights="random", seed=1, trainable=True).parameters()
             if p.requires_grad]
    skipping, after = run()
    monkeypatch.setattr(G, "to_train", lambda scored, beta: scored.keep.copy())
    every, after_all = run()
    assert sum(s.metrics["skipped"] for s in skipping.steps) >= 0.5 + (reward == "constant")
    assert all(s.metrics["skipped"] == 0 for s in every.steps)
    assert [s.learned for s in skipping.steps] == [s.learned for s in every.steps]  # the normaliser's count
    assert sum(s.real for s in skipping.steps) < sum(s.real for s in every.steps)  # fewer positions computed
    for s, e in zip(skipping.steps, every.steps):
        assert s.loss == pytest.approx(e.loss, abs=1e-6) and s.grad_norm == pytest.approx(e.grad_norm, rel=1e-4,
                                                                                            abs=1e-7)
    for a, b, p0 in zip(after, after_all, start):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert not torch.equal(a, p0)  # the steps updated (decay, with a constant reward)


def test_dynamic_sampling_fills_the_step_with_informative_groups_and_resumes_alike(tmp_path):
    def run(steps, checkpoint=None):
        torch.manual_seed(0)
        policy = nest.load(CARD, weights="random", seed=1, trainable=True)
        engine = Engine(nest.load(CARD, weights="random", seed=1))
        opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=2e-2)
        return grpo(policy, engine, _prompts(), uniform_half, optimizer=opt, steps=steps, group=8, prompts_per_step=4,
                    max_new_tokens=6, tokens=64, dynamic_sampling=6, checkpoint=checkpoint, checkpoint_every=2,
                    verbose=False)

    whole = run(4)
    assert all(s.metrics["groups"] == 4 and s.metrics["uniform"] == 0 for s in whole.steps)
    assert any(s.metrics["sampling_rounds"] > 1 for s in whole.steps)
    run(2, checkpoint=tmp_path)
    rest = run(4, checkpoint=tmp_path)
    assert [s.loss for s in rest.steps] == [s.loss for s in whole.steps[2:]]
    policy = nest.load(CARD, weights="random", trainable=True)
    with pytest.raises(ValueError, match="pass the prompts as a sequence"):
        grpo(policy, Engine(nest.load(CARD, weights="random")), iter(_prompts()), sevens,
             optimizer=torch.optim.SGD(policy.parameters(), lr=0.1), steps=1, dynamic_sampling=2, verbose=False)
