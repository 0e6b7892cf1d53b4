"""`linnet ppo`: PPO from a YAML config: the prompts, rewards, engine and held-out
evaluation as `linnet grpo` sets them up, a critic on the policy (linnet.train.ppo), and
the run directory every training command shares. final/ holds the policy as every run
does, with the critic beside it in critic.safetensors (`ppo.critic`: a value head on the
policy, or a separate model).

    linnet ppo --config ppo.yaml --set ppo.kl_coef=0.02
    linnet ppo --template > ppo.yaml
"""

from __future__ import annotations

import dataclasses

from linnet.commands import runs
from linnet.commands.grpo import engine_and_reference, held_out_evaluation, prompts_and_rewards
from linnet.config import PPOConfig


def run(config: PPOConfig, *, overwrite: bool = False, resume: bool = False,
        resume_from: str | None = None) -> dict:
    from linnet import nest
    from linnet.train.ppo import ppo, value_head

    g = config.ppo
    r = prompts_and_rewards(config, g)
    critic_card = nest.resolve(g.critic) if g.critic else None  # a bad one is refused before anything is written
    job = runs.start(config, r.steps, overwrite=overwrite, resume=resume, resume_from=resume_from)
    if job.complete is not None:
        return job.complete
    policy = job.load(r.card)
    critic = job.load(critic_card) if critic_card else None
    policy = value_head(policy, seed=config.runtime.seed, critic=critic)  # before the optimizer is made
    engine, reference = engine_and_reference(config, g, r.card, policy, reference=bool(g.kl_coef))
    with job.open(policy, held_out_evaluation(config, g, engine, r)) as run:
        history = ppo(policy, engine, r.prompts, r.functions, run,
                      settings=dataclasses.replace(g, prompts_per_step=r.per_process), reference=reference,
                      tokens=config.training.context_length, seed=config.runtime.seed + 7919 * r.share)
    return job.summarize(history, card=r.card.name)


def main(argv: list[str] | None = None) -> int:
    args, config = runs.parse_command(argv, "linnet ppo", "PPO (a critic, GAE, a KL-penalised reward) from a "
                                      "YAML config.", PPOConfig, training=True)
    return 0 if config is None else runs.execute(run, args, config)
