"""The JAX DPO and GRPO trainers against the PyTorch ones with every option they share:
each DPO loss_type and rpo_alpha on the same tiny model, pairs and weights; a reference
cache either backend writes and the other reads; GRPO's rloo advantages, sequence_mean
and dynamic sampling on the same completions (a scripted engine stands in for both
backends' samplers, whose random draws differ); the Run's schedule refused with the optax
way named."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from linnet.packing import Pair
from linnet.rl.rollouts import Completion, Prompt
from tests import test_jax
from tests.test_jax import _lora_pair, _pair

pytestmark = pytest.mark.jax  # last in the run: see tests/conftest.py

jx = test_jax.jx  # the fixture: (jax, linnet.jax.model), imported inside the tests only

DPO_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")


def _pairs(n=8, seed=6):
    g = np.random.default_rng(seed)
    return [Pair(g.integers(3, 96, 4).tolist(), g.integers(3, 96, int(g.integers(1, 6))).tolist(),
                 g.integers(3, 96, int(g.integers(1, 6))).tolist()) for _ in range(n)]


def _assert_same_steps(jhistory, history, metrics, rel=1e-5):
    assert len(jhistory) == len(history) > 0
    assert jhistory.losses == pytest.approx(history.losses, rel=rel, abs=1e-6)
    for got, want in zip(jhistory.steps, history.steps):
        assert got.grad_norm == pytest.approx(want.grad_norm, rel=1e-4, abs=1e-6)
        assert got.learned == want.learned
        for name in metrics:
            assert got.metrics[name] == pytest.approx(want.metrics[name], rel=1e-4, abs=1e-5), name


def _assert_same_weights(params, torch_model, trained_only=True):
    for name, p in torch_model.named_parameters():
        if p.requires_grad or not trained_only:
            np.testing.assert_allclose(np.asarray(params[name]), p.detach().numpy(), atol=2e-5, err_msg=name)


@pytest.mark.parametrize("loss_type, options", [
    ("sigmoid", {"label_smoothing": 0.1}),
    ("robust", {"label_smoothing": 0.1}),
    ("hinge", {}),
    ("ipo", {}),
    ("simpo", {"simpo_gamma": 0.3, "label_smoothing": 0.1}),
    ("orpo", {}),
    ("sigmoid", {"rpo_alpha": 0.5}),
    ("ipo", {"rpo_alpha": 1.0}),
], ids=["sigmoid", "robust", "hinge", "ipo", "simpo", "orpo", "sigmoid-rpo", "ipo-rpo"])
def test_each_dpo_loss_type_steps_like_pytorch(jx, tmp_path, loss_type, options):
    """LoRA DPO, two SGD steps of four pairs, the model's own starting log-probabilities as
    the reference (none for simpo and orpo): the losses, gradient norms, TRL's metrics and
    the adapters after of linnet.train.dpo.dpo."""
    import optax

    from linnet.jax.dpo import dpo as jax_dpo
    from linnet.train.dpo import dpo

    torch_model, jax_model = _lora_pair(jx, tmp_path)
    pairs = _pairs()
    adapters = [p for p in torch_model.parameters() if p.requires_grad]
    common = dict(steps=2, pairs_per_step=4, beta=0.5, tokens=32, loss_type=loss_type, **options)
    history = dpo(torch_model, pairs, optimizer=torch.optim.SGD(adapters, lr=1.0), **common)
    params, jhistory = jax_dpo(jax_model, pairs, optimizer=optax.sgd(1.0), **common)
    _assert_same_steps(jhistory, history, DPO_METRICS)
    # step 1's margins are zero up to rounding where a reference is the policy itself; step 2's are not
    assert jhistory.steps[1].metrics["rewards/accuracies"] == history.steps[1].metrics["rewards/accuracies"]
    assert abs(jhistory.steps[1].metrics["rewards/margins"]) > 1e-3
    assert jhistory.steps[0].metrics["pairs"] == 4
    _assert_same_weights(params, torch_model)


def test_a_reference_cache_written_by_either_backend_is_read_by_the_other(jx, tmp_path, monkeypatch):
    """The same weights and pairs give the same cache file in both backends (the key hashes
    the parameters in name order, as float32); a run that finds it computes no reference
    and trains as the run that wrote it; a file of another shape is refused by name."""
    import optax

    import linnet.jax.dpo as J
    import linnet.train.dpo as T

    torch_model, jax_model = _pair(jx, {"tied_embeddings": False}, tmp_path)
    pairs = _pairs(6, seed=7)
    key = T.cache_key(torch_model, pairs)
    start = {k: v.detach().clone() for k, v in torch_model.state_dict().items()}
    common = dict(steps=2, pairs_per_step=3, beta=0.5, tokens=32)

    def torch_run(cache):
        torch_model.load_state_dict(start)
        return T.dpo(torch_model, pairs, optimizer=torch.optim.SGD(torch_model.parameters(), lr=0.5),
                     reference_cache=cache, **common)

    def jax_run(cache):
        return J.dpo(jax_model, pairs, optimizer=optax.sgd(0.5), reference_cache=cache, **common)[1]

    written = jax_run(tmp_path / "by_jax")  # JAX writes, PyTorch reads
    assert [p.name for p in (tmp_path / "by_jax").iterdir()] == [f"dpo-reference-{key}.npy"]
    cached = np.load(tmp_path / "by_jax" / f"dpo-reference-{key}.npy")
    assert cached.dtype == np.float64 and cached.shape == (6, 2)
    np.testing.assert_allclose(cached, T.reference_log_probs(torch_model, pairs), atol=1e-4)
    with monkeypatch.context() as m:
        m.setattr(T, "reference_log_probs", lambda *a, **k: pytest.fail("PyTorch computed the reference again"))
        read = torch_run(tmp_path / "by_jax")
    assert read.losses == pytest.approx(written.losses, rel=1e-5)
    torch_run(tmp_path / "by_torch")  # PyTorch writes, JAX reads
    assert [p.name for p in (tmp_path / "by_torch").iterdir()] == [f"dpo-reference-{key}.npy"]
    with monkeypatch.context() as m:
        m.setattr(J, "reference_log_probs", lambda *a, **k: pytest.fail("JAX computed the reference again"))
        again = jax_run(tmp_path / "by_torch")
    assert again.losses == pytest.approx(read.losses, rel=1e-5)
    np.save(tmp_path / "by_torch" / f"dpo-reference-{key}.npy", np.zeros((5, 2)))
    with pytest.raises(ValueError, match=f"dpo-reference-{key}.npy: holds \\(5, 2\\)"):
        jax_run(tmp_path / "by_torch")


def test_dpo_refuses_what_it_cannot_train_by_name(jx, tmp_path, monkeypatch):
    """KTO and its weights name linnet.train.kto; a reference-free loss takes no reference;
    a Run's schedule is refused before the reference pass, naming the optax way; online
    training names PyTorch's online_dpo."""
    import optax

    import linnet.jax.dpo as J

    _, jax_model = _pair(jx, {}, tmp_path)
    pairs = _pairs(4)
    monkeypatch.setattr(J, "reference_log_probs", lambda *a, **k: pytest.fail("refused after the reference pass"))
    opt = optax.sgd(0.1)
    for options in ({"loss_type": "kto"}, {"desirable_weight": 2.0, "loss_type": "kto"}):
        with pytest.raises(ValueError, match="linnet.train.kto.kto"):
            J.dpo(jax_model, pairs, optimizer=opt, steps=1, **options)
    with pytest.raises(ValueError, match="reference-free"):
        J.dpo(jax_model, pairs, optimizer=opt, steps=1, loss_type="orpo", reference=jax_model.params)
    with pytest.raises(ValueError, match="reference_cache is not used"):
        J.dpo(jax_model, pairs, optimizer=opt, steps=1, loss_type="simpo", reference_cache=str(tmp_path))
    with pytest.raises(ValueError, match=r"Run.schedule .*optax.adamw\(optax.warmup_cosine_decay_schedule"):
        J.dpo(jax_model, pairs, optimizer=opt, steps=1, schedule=object())
    with pytest.raises(ValueError, match=r"online=True .* not supported by the JAX backend.*online_dpo"):
        J.dpo(jax_model, pairs, optimizer=opt, steps=1, online=True)


def test_train_and_grpo_refuse_a_run_schedule_naming_optax(jx, tmp_path):
    import optax

    from linnet.jax.grpo import grpo
    from linnet.jax.train import train

    _, jax_model = _pair(jx, {}, tmp_path)
    with pytest.raises(ValueError, match="Run.schedule is PyTorch's; give the optax optimizer a schedule"):
        train(jax_model, test_jax._rows(1), optimizer=optax.sgd(0.1), steps=1, schedule=object())
    with pytest.raises(ValueError, match="Run.schedule is PyTorch's; give the optax optimizer a schedule"):
        grpo(jax_model, _ScriptedEngine(np.asarray), [Prompt([5, 6])], lambda p, c: 1.0, optimizer=optax.sgd(0.1),
             steps=1, schedule=object())
    for option in ({"max_staleness": 1}, {"correction": "sequence", "correction_cap": 2.0}):
        with pytest.raises(ValueError, match="multi-turn environments or tools are linnet.train.grpo"):
            grpo(jax_model, _ScriptedEngine(np.asarray), [Prompt([5, 6])], lambda p, c: 1.0,
                 optimizer=optax.sgd(0.1), steps=1, **option)


class _ScriptedEngine:
    """Stands in for both backends' engines: each call's completions drawn from its seed
    alone (numpy), so the PyTorch and the JAX trainer see the same samples; the
    log-probabilities as each backend's engine gives them (`array`: a torch tensor, or a
    numpy array)."""

    def __init__(self, array):
        self.array, self.calls = array, 0

    def load_weights(self, *args):
        pass

    def sample(self, prompts, n=1, *, max_new_tokens, temperature, top_k, top_p, stop, seed):
        g = np.random.default_rng(seed)
        self.calls += 1
        out = []
        for i in range(len(prompts)):
            for _ in range(n):
                k = int(g.integers(1, max_new_tokens + 1))
                logprobs = -g.random(k).astype(np.float32) * 3
                out.append(Completion(i, g.integers(3, 96, k).tolist(), self.array(logprobs), False))
        return out


def _half_uniform(prompt, completion):
    """Prompts starting with an even token always score 1 (uniform groups); the others
    score their completion's length, which differs within a group."""
    return 1.0 if prompt.ids[0] % 2 == 0 else len(completion) / 6


@pytest.mark.parametrize("options", [
    {"advantage": "rloo"},
    {"sequence_mean": True, "iterations": 2},
    {"dynamic_sampling": 4},
    {"dynamic_sampling": 4, "advantage": "rloo", "sequence_mean": True, "drop_uniform": True},
], ids=["rloo", "sequence_mean", "dynamic_sampling", "all-three"])
def test_grpo_options_step_like_pytorch_on_the_same_completions(jx, tmp_path, options):
    """Exact equality across backends on the same completions (a scripted engine: the two
    engines' own random draws differ, so real sampling could only be compared in
    behaviour): three SGD steps of linnet.train.grpo.grpo and linnet.jax.grpo.grpo give the
    same losses, gradient norms, rewards and weights. With dynamic_sampling both draw
    the same extra rounds (the step's seed) until each step holds prompts_per_step groups
    whose rewards differ, and report the rounds and groups."""
    import optax

    from linnet.jax.grpo import grpo as jax_grpo
    from linnet.train.grpo import grpo

    torch_model, jax_model = _pair(jx, {}, tmp_path)
    g = np.random.default_rng(3)
    prompts = [Prompt(g.integers(3, 96, size=int(g.integers(1, 5))).tolist()) for _ in range(8)]
    common = dict(steps=3, group=4, prompts_per_step=2, max_new_tokens=6, tokens=64, **options)
    torch_engine, jax_engine = _ScriptedEngine(torch.from_numpy), _ScriptedEngine(np.asarray)
    history = grpo(torch_model, torch_engine, prompts, _half_uniform,
                   optimizer=torch.optim.SGD(torch_model.parameters(), lr=0.5), verbose=False, **common)
    params, jhistory = jax_grpo(jax_model, jax_engine, prompts, _half_uniform, optimizer=optax.sgd(0.5), **common)
    extra = ("groups", "sampling_rounds") if options.get("dynamic_sampling") else ()
    _assert_same_steps(jhistory, history, ("reward", "uniform", "skipped", "completion_length", "mismatch", *extra))
    assert torch_engine.calls == jax_engine.calls
    _assert_same_weights(params, torch_model, trained_only=False)
    if options.get("dynamic_sampling"):
        assert all(s.metrics["groups"] == 2 and s.metrics["uniform"] == 0 for s in jhistory.steps)
        assert any(s.metrics["sampling_rounds"] > 1 for s in jhistory.steps)
        assert jax_engine.calls == sum(s.metrics["sampling_rounds"] for s in jhistory.steps)
    else:
        assert jax_engine.calls == 3 and any(s.metrics["uniform"] > 0 for s in jhistory.steps)


def test_grpo_rloo_advantages_are_the_shared_leave_one_out_ones(jx, tmp_path, monkeypatch):
    """advantage='rloo' reaches the JAX trainer's rows: each completion's advantage is
    linnet.rl.rollouts.group_advantages(kind='rloo') of its group's rewards, not divided
    by a std; dynamic_sampling needs a sequence of prompts, as in PyTorch."""
    import optax

    import linnet.jax.grpo as G
    from linnet.rl.rollouts import group_advantages

    _, jax_model = _pair(jx, {}, tmp_path)
    seen = []
    rollout = G._rollout
    monkeypatch.setattr(G, "_rollout", lambda samples, advantages, *a: seen.append(advantages) or
                        rollout(samples, advantages, *a))
    rewards = []

    def reward(prompt, completion):
        rewards.append(len(completion) / 6)
        return rewards[-1]

    prompts = [Prompt([5, 7]), Prompt([9])]
    G.grpo(jax_model, _ScriptedEngine(np.asarray), prompts, reward, optimizer=optax.sgd(0.1), steps=1, group=4,
           prompts_per_step=2, max_new_tokens=6, tokens=64, advantage="rloo")
    want = group_advantages(np.reshape(rewards, (2, 4)), kind="rloo").reshape(-1)
    np.testing.assert_allclose(seen[0], want)
    assert not np.allclose(want, group_advantages(np.reshape(rewards, (2, 4))).reshape(-1))
    with pytest.raises(ValueError, match="pass the prompts as a sequence"):
        G.grpo(jax_model, _ScriptedEngine(np.asarray), iter(prompts), reward, optimizer=optax.sgd(0.1), steps=1,
               group=4, prompts_per_step=2, max_new_tokens=6, tokens=64, dynamic_sampling=2)
