"""`linnet grpo`: GRPO from a YAML config, with the run directory and reporting every
training command shares (linnet.commands.runs) and the rewards of linnet.rl.rewards.
`linnet ppo` (linnet.commands.ppo) sets up its prompts, rewards, engine and held-out
evaluation with the same functions (`prompts_and_rewards`, `engine_and_reference`).

    linnet grpo --config grpo.yaml --set grpo.group=16
    linnet grpo --template > grpo.yaml
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from linnet.commands import runs, spellings
from linnet.config import GRPOConfig
from linnet.config.sampling import RolloutSettings
from linnet.torch.distributed import data_share, sum_across


@dataclasses.dataclass
class Rollouts:
    """What a sampling command trains on: each process's share of the prompts and held-out
    prompts, the rewards by name, and the run's steps."""

    card: Any
    prompts: list
    held_out: list
    functions: dict
    steps: int
    per_process: int
    share: int
    tokenizer: Any = None
    conversations: Any = None  # grpo's environment or tools: (prompts, n) -> Conversations


def prompts_and_rewards(config, g, per_step: str = "prompts_per_step") -> Rollouts:
    """Read and check the prompts and resolve the rewards of a `grpo` or `ppo` config (`g`:
    its group), or an online `dpo` one (its prompts a step are `per_step`: pairs_per_step),
    before anything is written."""
    from linnet.data import prompts_from_records, read_records
    from linnet.rl import rewards
    from linnet.rl.conversations import conversations_for
    from linnet.rl.rollouts import check_prompts
    from linnet.serve.vllm import check_usable
    from linnet.torch.loading import usable_device

    d, t, rt = config.data, config.training, config.runtime
    if _vllm(g):  # where vLLM cannot run, refused before any data is read or file written
        check_usable(usable_device(rt.device, "runtime.device"))
    card, tokenizer = runs.card_and_tokenizer(config)
    limits = dict(timeout=g.sandbox_timeout, cpu_seconds=max(1, round(g.sandbox_timeout / 2)),
                  memory_mb=g.sandbox_memory_mb)
    functions = {spec.rsplit(":", 1)[-1]: rewards.resolve(spec, tokenizer, g.format_pattern, limits,
                                                                  named=f"{g.YAML}.rewards")
                 for spec in g.rewards}
    if g.reward_workers > 1:  # reward models score in packed batches already
        functions = {name: f if hasattr(f, "batch") else rewards.Concurrent(f, g.reward_workers)
                     for name, f in functions.items()}
    fields = dict(prompt=(d.prompt or ["prompt"])[0], answer=d.answer, chat=d.chat, names=spellings.RECORDS)
    records = read_records(d.path, split=d.split, names=spellings.RECORDS)
    eval_records = read_records(d.eval_path, field="data.eval_path") if d.eval_path else []
    prompts = prompts_from_records(records, tokenizer, **fields)
    held_out = prompts_from_records(eval_records, tokenizer, **fields)
    if "code" in g.rewards:  # its tests, every record's, before anything is written
        check_tests(records + eval_records, d.answer)
    conversations = conversations_for(getattr(g, "environment", None), getattr(g, "tools", ()), tokenizer,
                                      getattr(g, "max_turns", 1))  # importable, its tools known, before writing
    runs.check_held_out(config, records, eval_records if d.eval_path else None, items=len(prompts))
    if not d.eval_path:
        prompts, held_out = runs.hold_out(prompts, d.eval_share, rt.seed)
    check_prompts(enumerate(prompts), t.context_length, g.max_new_tokens,
                  names={**spellings.PROMPTS, "max_new_tokens": f"{g.YAML}.max_new_tokens"}, who=g.YAML)
    field, n = f"{g.YAML}.{per_step}", getattr(g, per_step)
    if n > len(prompts):
        raise ValueError(f"{d.path}: {field}={n} is more than the {len(prompts)} training prompts, so prompts would "
                         f"repeat within a step; lower {field}")
    steps = t.steps or max(1, math.ceil(t.epochs * len(prompts) / n))
    runs.steps_factor(config, steps)
    per_process = runs.split_per_step(field, n, t.per_copy)
    share, shares = data_share(t.per_copy)  # the processes of a split take the same prompts
    return Rollouts(card, prompts[share::shares], held_out[share::shares], functions, steps, per_process, share,
                    tokenizer, conversations)


def check_tests(records, field: str) -> None:
    """The `code` reward's tests in each record's `field` (data.answer) are tests it can run."""
    from linnet.rl.sandbox import as_tests

    for record in records:
        try:
            as_tests(record.data[field])
        except ValueError as e:
            raise ValueError(f"{record.where}: field {field!r} holds the code reward's tests (data.answer): {e}") from None


def _vllm(g) -> bool:
    """Whether group `g` samples with vLLM (grpo's and ppo's `engine`; online dpo has the
    builtin engine alone)."""
    return isinstance(g, RolloutSettings) and g.engine == "vllm"


def engine_and_reference(config, g, card, policy, reference: bool):
    """The engine that samples the rollouts (the builtin one or vLLM, as `g.engine` says;
    online dpo's: the builtin one) and, when `reference`, a frozen copy of the starting model."""
    from linnet import nest
    from linnet.serve import Engine
    from linnet.serve.vllm import VLLMEngine

    m, t, rt = config.model, config.training, config.runtime
    base = dict(device=policy.device, dtype=m.dtype, weights=m.weights, seed=rt.seed, quantize=m.quantize)
    if _vllm(g):
        engine = VLLMEngine(card, device=policy.device, dtype=policy.dtype, tokens=t.context_length,
                            gpu_memory_utilization=g.vllm_gpu_memory_utilization, seed=rt.seed)
    else:
        dtype = g.engine_dtype if isinstance(g, RolloutSettings) else None
        engine = Engine(nest.load(card, **{**base, "dtype": dtype or m.dtype,
                                           "quantize": runs.engine_quantize(config)}))
    return engine, nest.load(card, **base) if reference else None


def held_out_evaluation(config, g, engine, r: Rollouts):
    """The held-out reward, pass@1 and pass@k (means over every process's prompts) that
    a sampling command reports each evaluation; None when no process holds one out."""
    from linnet.train.grpo import evaluate

    held_out, seed = r.held_out, config.runtime.seed
    k, samples, passing = (g.pass_k, g.pass_samples, g.pass_reward) if isinstance(g, RolloutSettings) else (0, None, None)
    conversations = r.conversations  # held out as in training: with the tools
    names = ["reward", "pass@1"] + ([f"pass@{k}"] if k else [])

    def held_out_metrics(policy):
        if held_out:
            found = evaluate(policy, engine, held_out, r.functions, max_new_tokens=g.max_new_tokens, k=k,
                             samples=samples, passing=passing, temperature=g.temperature,
                             top_k=g.top_k, top_p=g.top_p, seed=seed, conversations=conversations)
        else:  # none here; still take the policy's weights, with every process, as evaluate does
            engine.load_weights(policy)
        n, *sums = sum_across([len(held_out)] + [found[k] * len(held_out) if held_out else 0.0 for k in names])
        return {f"held_out_{name}": value / n for name, value in zip(names, sums, strict=True)}

    return held_out_metrics if sum_across([len(held_out)])[0] else None


def run(config: GRPOConfig, *, overwrite: bool = False, resume: bool = False,
        resume_from: str | None = None) -> dict:
    from linnet.train.grpo import grpo

    g = config.grpo
    r = prompts_and_rewards(config, g)
    job = runs.start(config, r.steps, overwrite=overwrite, resume=resume, resume_from=resume_from)
    if job.complete is not None:
        return job.complete
    policy = job.load(r.card)
    engine, reference = engine_and_reference(config, g, r.card, policy, reference=bool(g.beta))
    with job.open(policy, held_out_evaluation(config, g, engine, r)) as run:
        history = grpo(policy, engine, r.prompts, r.functions, run,
                       settings=dataclasses.replace(g, prompts_per_step=r.per_process), reference=reference,
                       tokens=config.training.context_length, seed=config.runtime.seed + 7919 * r.share,
                       tokenizer=r.tokenizer)
    return job.summarize(history, card=r.card.name)


def main(argv: list[str] | None = None) -> int:
    args, config = runs.parse_command(argv, "linnet grpo", "GRPO from a YAML config.", GRPOConfig, training=True)
    return 0 if config is None else runs.execute(run, args, config)
