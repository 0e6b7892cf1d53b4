"""`linnet reward`: a reward model (a scalar head on the decoder, Bradley-Terry on preference
pairs) from a YAML config, with the run directory every training command shares; the result
loads in transformers as AutoModelForSequenceClassification and serves GRPO as
`grpo.rewards: [model:RUN/final]`.

    linnet reward --config configs/reward.yaml --set data.path=pairs.jsonl
    linnet reward --template > reward.yaml
"""

from __future__ import annotations

import dataclasses

from linnet.commands import runs
from linnet.commands.dpo import preference_data
from linnet.config import RewardConfig
from linnet.torch.distributed import data_share, sum_across


def run(config: RewardConfig, *, overwrite: bool = False, resume: bool = False,
        resume_from: str | None = None) -> dict:
    from linnet.train.reward import add_score_head, held_out_accuracy, reward

    card, _, pairs, held_out, steps = preference_data(config, config.reward.pairs_per_step, "reward.pairs_per_step")
    t, s = config.training, config.reward
    per_process = runs.split_per_step("reward.pairs_per_step", s.pairs_per_step, t.per_copy)
    share, shares = data_share(t.per_copy)  # the processes of a split or a pipeline take the same pairs
    pairs, held_out = pairs[share::shares], held_out[share::shares]
    job = runs.start(config, steps, overwrite=overwrite, resume=resume, resume_from=resume_from)
    if job.complete is not None:
        return job.complete
    model = add_score_head(job.load(card), seed=config.runtime.seed)

    def evaluate(model):
        return held_out_accuracy(model, held_out, tokens=t.context_length)

    with job.open(model, evaluate if sum_across([len(held_out)])[0] else None) as run:
        history = reward(model, pairs, run, settings=dataclasses.replace(s, pairs_per_step=per_process),
                         tokens=t.context_length)
    return job.summarize(history, card=card.name)


def main(argv: list[str] | None = None) -> int:
    args, config = runs.parse_command(argv, "linnet reward", "A reward model (Bradley-Terry) from a YAML config.",
                                      RewardConfig, training=True)
    return 0 if config is None else runs.execute(run, args, config)
