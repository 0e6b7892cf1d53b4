"""PPO: GAE and the value loss against hand-computed values, the reward rising on the task
GRPO's tests learn, with the critic and a reference's KL penalty, and `linnet ppo` end to
end (its files, its resume, what it refuses)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors import safe_open

from linnet import nest
from linnet.commands import quickstart
from linnet.commands.ppo import run
from linnet.config import PPOConfig, load
from linnet.serve import Engine
from linnet.train.ppo import gae, ppo, value_head, value_loss
from tests.conftest import quickstart_model
from tests.test_grpo import CARD, _prompts, sevens

torch.set_num_threads(1)


def test_gae_by_hand():
    advantages, returns = gae(np.array([0.0, 0.0, 1.0]), np.array([0.5, 0.4, 0.3]), gamma=1.0, lam=0.9)
    # deltas: 0 + 0.4 - 0.5, 0 + 0.3 - 0.4, 1 + 0 - 0.3; A_t = delta_t + 0.9 A_{t+1}
    assert advantages == pytest.approx([-0.1 + 0.9 * (-0.1 + 0.9 * 0.7), -0.1 + 0.9 * 0.7, 0.7])
    assert returns == pytest.approx(advantages + [0.5, 0.4, 0.3])
    discounted, _ = gae(np.array([0.0, 1.0]), np.zeros(2), gamma=0.5, lam=1.0)
    assert discounted == pytest.approx([0.5, 1.0])  # lam 1, values 0: the discounted return


def test_value_loss_by_hand():
    values, old, returns = torch.tensor([1.0, 0.0]), torch.tensor([0.5, 0.5]), torch.tensor([1.0, 1.0])
    # clipped values 0.7 and 0.3; per token the larger of (V - R)^2 and (V_clipped - R)^2: 0.09 and 1
    assert float(value_loss(values, old, returns, clip=0.2)) == pytest.approx(0.5 * (0.09 + 1.0))


def _run(steps, **options):
    torch.manual_seed(0)
    policy = value_head(nest.load(CARD, weights="random", seed=1, trainable=True))
    engine = Engine(nest.load(CARD, weights="random", seed=1))
    reference = nest.load(CARD, weights="random", seed=1)
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=2e-2)
    return ppo(policy, engine, _prompts(), sevens, optimizer=opt, steps=steps, samples=4, prompts_per_step=4,
               max_new_tokens=6, tokens=64, reference=reference, **options)


def test_reward_rises_under_ppo():
    history = _run(12, kl_coef=0.01)
    rewards = [s.metrics["reward"] for s in history.steps]
    assert np.mean(rewards[-3:]) > np.mean(rewards[:3]) + 0.2, rewards
    assert all(np.isfinite(s.metrics["value_loss"]) for s in history.steps)
    kl = [s.metrics["kl"] for s in history.steps]
    assert kl[0] == pytest.approx(0.0, abs=1e-5) and max(map(abs, kl[1:])) > 1e-3, kl  # it leaves the reference


def test_a_separate_critic_trains_and_saves_beside_the_policy(tmp_path):
    """value_head(policy, critic=model): the values come from the critic's own hidden
    states, its weights train with the policy's, the engine takes the policy alone, and
    final/ holds the critic in critic.safetensors."""
    torch.manual_seed(0)
    critic = nest.load(CARD, weights="random", seed=2, trainable=True)
    policy = value_head(nest.load(CARD, weights="random", seed=1, trainable=True), critic=critic)
    assert getattr(policy, "value", None) is None and policy.critic is critic
    before = {n: p.detach().clone() for n, p in critic.named_parameters()}
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    history = ppo(policy, Engine(nest.load(CARD, weights="random", seed=1)), _prompts(), sevens, optimizer=opt,
                  steps=2, samples=2, prompts_per_step=2, max_new_tokens=4, tokens=64, kl_coef=0.0,
                  save_to=tmp_path / "final")
    assert all(np.isfinite(s.metrics["value_loss"]) for s in history.steps)
    assert not torch.equal(before["model.layers.0.self_attn.q_proj.weight"],
                           critic.get_parameter("model.layers.0.self_attn.q_proj.weight"))
    with safe_open(tmp_path / "final" / "critic.safetensors", "pt") as f:
        assert "critic.value.weight" in f.keys() and "critic.model.embed_tokens.weight" in f.keys()
    with safe_open(tmp_path / "final" / "model.safetensors", "pt") as f:
        assert not any(k.startswith(("critic.", "value.")) for k in f.keys())
    with pytest.raises(ValueError, match="its vocabulary"):
        value_head(nest.load(CARD, weights="random"), critic=nest.load(CARD.replace(vocab=CARD.vocab + 1),
                                                                       weights="random"))


def test_ppo_refuses_a_policy_without_a_critic_and_a_kl_without_a_reference():
    policy = nest.load(CARD, weights="random", trainable=True)
    opt = torch.optim.SGD(policy.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="no critic; call linnet.train.ppo.value_head"):
        ppo(policy, None, _prompts(), sevens, optimizer=opt, steps=1)
    with pytest.raises(ValueError, match="kl_coef > 0 needs reference="):
        ppo(value_head(policy), None, _prompts(), sevens, optimizer=opt, steps=1)
    with pytest.raises(ValueError, match=r"^ppo: gamma=2.0; it must be in \[0, 1\]$"):
        ppo(policy, None, _prompts(), sevens, optimizer=opt, steps=1, gamma=2.0)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("ppo")
    quickstart_model(root / "model")
    lines = [json.dumps({"prompt": p, "answer": a}) for p, a in quickstart.problems(np.random.default_rng(0), 40, 1)]
    (root / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    return root


def _config(workspace, out, *extra):
    return load(PPOConfig, None, [
        f"model.card={workspace / 'model'}", f"data.path={workspace / 'prompts.jsonl'}", "data.chat=false",
        "training.context_length=64", "data.eval_share=0.1", "ppo.samples=2", "ppo.prompts_per_step=4",
        "ppo.max_new_tokens=3", "ppo.iterations=2", "ppo.rewards=[exact, numeric]", "training.steps=3",
        "training.checkpoint_every=2", "evaluation.every=3", "lr_schedule.warmup_steps=1",
        f"runtime.output_dir={out}", *extra])


def test_linnet_ppo_writes_the_policy_and_its_critic_and_resumes_exactly(workspace, tmp_path):
    whole = run(_config(workspace, tmp_path / "whole"))
    rows = [json.loads(x) for x in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and {"reward", "reward_exact", "kl", "value_loss", "clip_fraction"} <= set(rows[0])
    assert "held_out_reward" in rows[-1] and "held_out_reward" in whole
    final = tmp_path / "whole" / "final"
    assert (final / "adapter_config.json").is_file()  # the policy as every LoRA run leaves it
    with safe_open(final / "critic.safetensors", "pt") as f:
        assert list(f.keys()) == ["value.weight"]
    out = tmp_path / "run"
    run(_config(workspace, out))
    # as if killed after step 2: its checkpoint and two metrics lines remain, no summary
    shutil.rmtree(out / "checkpoints" / "step-00000003")
    (out / "summary.json").unlink()
    (out / "metrics.jsonl").write_text("".join(x + "\n" for x in (out / "metrics.jsonl").read_text().splitlines()[:2]))
    again = run(_config(workspace, out), resume=True)
    assert again["steps_this_run"] == 1 and again["last_loss"] == whole["last_loss"]
    assert (out / "final" / "critic.safetensors").read_bytes() == (final / "critic.safetensors").read_bytes()


def test_linnet_ppo_with_a_separate_critic(workspace, tmp_path):
    """ppo.critic names a model: it loads as the policy does (LoRA here) and its value head
    and adapters are saved beside the policy's adapters."""
    run(_config(workspace, tmp_path / "run", f"ppo.critic={workspace / 'model'}", "training.steps=1"))
    final = tmp_path / "run" / "final"
    with safe_open(final / "critic.safetensors", "pt") as f:
        names = list(f.keys())
    assert "critic.value.weight" in names and any(n.endswith("lora_a") for n in names)
    with safe_open(final / "adapter_model.safetensors", "pt") as f:
        assert not any("critic" in k for k in f.keys())


def test_linnet_ppo_refuses_grpo_s_fields_and_a_split_policy(workspace, tmp_path):
    with pytest.raises(ValueError, match="ppo.group"):
        _config(workspace, tmp_path / "x", "ppo.group=4")
    with pytest.raises(ValueError, match="training.split is not read by `linnet ppo`"):
        _config(workspace, tmp_path / "x", "training.split=2")
    with pytest.raises(ValueError, match=r"ppo.prompts_per_step=50 is more than the 36 training prompts"):
        run(_config(workspace, tmp_path / "x", "ppo.prompts_per_step=50"))
    with pytest.raises((ValueError, FileNotFoundError), match="no-such-critic"):
        run(_config(workspace, tmp_path / "x", "ppo.critic=no-such-critic"))
    assert not (tmp_path / "x").exists()
