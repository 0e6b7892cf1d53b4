"""`linnet grpo`: GRPO from a YAML config, with the run directory, config groups and
reporting of `linnet sft` (see linnet.runs) and the rewards of linnet.rewards.

    linnet grpo --config grpo.yaml --set grpo.group=16
    linnet grpo --template > grpo.yaml
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from linnet.config import group, option
from linnet.runs import (
    LoraConfig, MetricsLog, ModelConfig, OptimizerConfig, ScheduleConfig, TrainingConfig, adamw, load_model,
    make_schedule, open_run, parse_command, print_table, split_per_step, summarize,
)
from linnet.torch.distributed import process_group, sum_across, world


@dataclass
class PromptsDataConfig:
    path: str = option("", "prompt records: .jsonl, .json, .parquet, or a saved datasets directory")
    eval_path: str | None = option(None, "held-out prompts; null: take eval_share of path")
    eval_share: float = option(0.05, "share of the prompts held out when eval_path is null")
    prompt: str = option("prompt", "prompt field (GSM8K: question)")
    answer: str = option("answer", "reference answer field, given to the rewards")
    chat: bool = option(True, "wrap the prompt as a user turn with the chat template (when there is one)")
    chat_template: str | None = option(None, "a Jinja chat template overriding the tokenizer's")
    tokenizer: str | None = option(None, "tokenizer directory; null: the card's")
    tokens: int = option(2048, "positions per packed micro-batch row (a prompt + completion must fit)")


@dataclass
class GRPOSettings:
    rewards: list[str] = option(["exact"], "exact, numeric, format, or module:function; summed")
    format_pattern: str | None = option(None, "regular expression for the 'format' reward")
    group: int = option(8, "completions sampled per prompt")
    prompts_per_step: int = option(8, "prompts per sampling step")
    max_new_tokens: int = option(256, "longest completion")
    temperature: float = option(1.0, "sampling temperature")
    top_k: int | None = option(None, "sample from the k most likely tokens")
    top_p: float | None = option(None, "sample from the smallest set reaching this probability")
    iterations: int = option(1, "optimizer steps per sampling step (reusing the samples)")
    clip_low: float = option(0.2, "ratio clip below: 1 - clip_low")
    clip_high: float = option(0.2, "ratio clip above: 1 + clip_high")
    drop_uniform: bool = option(False, "leave out groups whose rewards are all equal")
    beta: float = option(0.0, "k3 KL weight against a frozen copy of the starting model")
    correction_cap: float | None = option(None, "truncated importance weights p_policy/p_engine, capped")
    dr_grpo: bool = option(False, "Dr. GRPO: no std division, constant normaliser")
    sequence_level: bool = option(False, "GSPO: one ratio per completion")
    pass_k: int = option(0, "held-out pass@k at each evaluation, from completions sampled with temperature, "
                            "top_k and top_p; 0: only the greedy reward and pass@1")
    pass_samples: int | None = option(None, "completions sampled per held-out prompt for pass@k (>= pass_k; "
                                            "more lowers the estimate's variance); null: pass_k")
    pass_reward: float | None = option(None, "a held-out completion passes when its summed reward reaches this; "
                                             "null: one per reward (full marks from each built-in)")


@dataclass
class GRPOConfig:
    model: ModelConfig = group(ModelConfig, "the policy (the engine and reference are copies of it)")
    data: PromptsDataConfig = group(PromptsDataConfig, "prompt records")
    grpo: GRPOSettings = group(GRPOSettings, "sampling, rewards and the objective")
    lora: LoraConfig = group(LoraConfig, "low-rank adapters")
    optimizer: OptimizerConfig = group(OptimizerConfig, "AdamW")
    schedule: ScheduleConfig = group(ScheduleConfig, "learning-rate schedule")
    training: TrainingConfig = group(TrainingConfig, "steps, evaluation, checkpoints (accumulate unused)")
    output: str = option("runs/grpo", "run directory: metrics.jsonl, checkpoints/, final/")

    def __post_init__(self):
        g = self.grpo
        if not self.data.path:
            raise ValueError("config: data.path is required (prompt records)")
        if self.training.split != 1:
            raise ValueError("config: training.split (tensor parallel) trains sft only; use training.shard=fsdp")
        if self.training.accumulate != 1:
            raise ValueError("config: training.accumulate is not used by grpo; set grpo.prompts_per_step")
        if g.group < 2 or g.prompts_per_step < 1 or g.iterations < 1 or g.max_new_tokens < 1:
            raise ValueError("config: grpo.group >= 2; prompts_per_step, iterations, max_new_tokens >= 1")
        if not g.rewards:
            raise ValueError("config: grpo.rewards lists no reward")
        if g.pass_k < 0 or g.pass_k == 1:
            raise ValueError("config: grpo.pass_k is 0 (off) or >= 2; pass@1 (greedy) is always reported")
        if g.pass_samples is not None and not 2 <= g.pass_k <= g.pass_samples:
            raise ValueError("config: grpo.pass_samples needs grpo.pass_k >= 2, and must be at least pass_k")


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    """A prompt's ids: the chat template's user turn with the generation prompt, or BOS + text."""
    if chat and tokenizer.chat_template:
        ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                             add_generation_prompt=True))
    else:
        ids = tokenizer.encode(text)
    bos = tokenizer.bos_id
    return ids if bos is None or (ids and ids[0] == bos) else [bos] + ids


def read_prompts(path: str, tokenizer, d: PromptsDataConfig):
    from linnet.data import read_records
    from linnet.train.grpo import Prompt

    prompts = []
    for record in read_records(path):
        for name in (d.prompt, d.answer):
            if name not in record.data:
                raise ValueError(f"{record.where}: missing field {name!r}; name it with data.prompt / data.answer")
        text = record.data[d.prompt]
        if not isinstance(text, str) or not text:
            raise ValueError(f"{record.where}: field {d.prompt!r} must be non-empty text")
        prompts.append(Prompt(encode_prompt(tokenizer, text, d.chat), record.data[d.answer]))
    return prompts


def run(config: GRPOConfig, *, overwrite: bool = False, resume: bool = False) -> dict:
    from linnet import nest, rewards
    from linnet.data import load_tokenizer
    from linnet.serve import Engine
    from linnet.train.grpo import evaluate, grpo

    d, g, t = config.data, config.grpo, config.training
    card = nest.resolve(config.model.card)
    tokenizer = load_tokenizer(d.tokenizer or card, chat_template=d.chat_template)
    functions = {spec.rsplit(":", 1)[-1]: rewards.resolve(spec, tokenizer, g.format_pattern) for spec in g.rewards}
    prompts = read_prompts(d.path, tokenizer, d)
    if d.eval_path:
        held_out = read_prompts(d.eval_path, tokenizer, d)
    else:
        order = np.random.default_rng(t.seed).permutation(len(prompts))
        n = round(d.eval_share * len(prompts))
        held_out, prompts = [prompts[i] for i in order[:n]], [prompts[i] for i in sorted(order[n:])]
    steps = t.steps or max(1, math.ceil(t.epochs * len(prompts) / g.prompts_per_step))
    make_schedule(config.schedule, torch.optim.SGD([torch.zeros(1, requires_grad=True)]), steps)
    per_process = split_per_step("grpo.prompts_per_step", g.prompts_per_step)
    rank, processes = world()
    prompts, held_out = prompts[rank::processes], held_out[rank::processes]  # this process's share
    out = open_run(config, overwrite=overwrite, resume=resume)
    m = config.model
    policy = load_model(card, m, config.lora, t.seed, t.shard)
    engine_model = nest.load(card, device=policy.device, dtype=m.dtype, weights=m.weights, seed=t.seed)
    engine = Engine(engine_model)
    reference = None
    if g.beta:
        reference = nest.load(card, device=policy.device, dtype=m.dtype, weights=m.weights, seed=t.seed)
    optimizer = adamw(config.optimizer, policy, t.shard)
    schedule = make_schedule(config.schedule, optimizer, steps)
    names = ["reward", "pass@1"] + ([f"pass@{g.pass_k}"] if g.pass_k else [])

    def held_out_metrics(step):
        """Means over every process's held-out prompts."""
        if held_out:
            found = evaluate(policy, engine, held_out, functions, max_new_tokens=g.max_new_tokens, k=g.pass_k,
                             samples=g.pass_samples, passing=g.pass_reward, temperature=g.temperature,
                             top_k=g.top_k, top_p=g.top_p, seed=t.seed)
        else:  # none here; still take the policy's weights, with every process, as evaluate does
            engine.load_weights(policy)
        n, *sums = sum_across([len(held_out)] + [found[k] * len(held_out) if held_out else 0.0 for k in names])
        return {f"held_out_{name}": value / n for name, value in zip(names, sums, strict=True)}

    log = MetricsLog(out, "grpo", steps, t.eval_every, held_out_metrics if sum_across([len(held_out)])[0] else None)
    t0 = time.perf_counter()
    try:
        history = grpo(policy, engine, prompts, functions, optimizer=optimizer, steps=steps, group=g.group,
                       prompts_per_step=per_process, max_new_tokens=g.max_new_tokens,
                       temperature=g.temperature, top_k=g.top_k, top_p=g.top_p, iterations=g.iterations,
                       clip=(g.clip_low, g.clip_high), drop_uniform=g.drop_uniform, beta=g.beta,
                       reference=reference, correction_cap=g.correction_cap, dr_grpo=g.dr_grpo,
                       sequence_level=g.sequence_level, tokens=d.tokens, max_grad_norm=t.clip,
                       schedule=schedule, seed=t.seed + 7919 * rank, save_to=out / "final",
                       checkpoint=out / "checkpoints",
                       checkpoint_every=t.checkpoint_every, keep=t.keep, on_step=log)
    finally:
        log.close()
    return summarize(out, history, time.perf_counter() - t0, card=card.name, steps=steps)


def cli(argv: list[str] | None = None) -> int:
    args, config = parse_command(argv, "linnet grpo", "GRPO from a YAML config.", GRPOConfig, training=True)
    if config is not None:
        with process_group():
            print_table(run(config, overwrite=args.overwrite, resume=args.resume))
    return 0
