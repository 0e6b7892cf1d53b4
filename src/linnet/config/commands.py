"""Each command's config: the shared groups (linnet.config.groups) with the command's
defaults, the checks that span groups, and the names that went out of use.

    config = load(SFTConfig, "run.yaml", ["training.steps=200"])
    config = load_any("run.yaml")          # the command is recognised from the groups given

`linnet sft` and `linnet jax` read SFTConfig, `linnet dpo` DPOConfig, `linnet grpo`
GRPOConfig, `linnet prepare` and `linnet pretrain` PretrainConfig.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from linnet.config.fields import Origins, apply_overrides, from_dict, group, option, read_yaml
from linnet.config.groups import (
    CorpusConfig,
    DecentralizedConfig,
    DistillSettings,
    DPOSettings,
    EvaluationConfig,
    LoraConfig,
    LRScheduleConfig,
    ModelConfig,
    OptimizerConfig,
    RecordsConfig,
    RewardSettings,
    RuntimeConfig,
    TrainingConfig,
)
from linnet.config.sampling import GRPOSettings, PPOSettings

# Former spellings, refused with the field that replaced them. Old names are not translated.
FORMER_FIELDS = {
    "output": "use runtime.output_dir",
    "schedule": "the schedule lives in lr_schedule: name, warmup_steps (was warmup), min_lr_ratio (was floor), "
                "decay_fraction (was decay)",
    "model.device": "use runtime.device",
    "data.tokens": "use training.context_length (positions per packed row)",
    "training.accumulate": "use training.accumulation",
    "training.clip": "use optimizer.grad_clip",
    "training.eval_every": "use evaluation.every",
    "training.grad_clip": "use optimizer.grad_clip",
    "training.seed": "use runtime.seed",
    "training.output_dir": "use runtime.output_dir",
    "data.buffer_size_mib": "use data.shuffle_group_size (shards read and shuffled together)",
    "lr_schedule.warmup": "use lr_schedule.warmup_steps",
    "lr_schedule.warmup_fraction": "use lr_schedule.warmup_steps (an integer number of updates)",
    "lr_schedule.floor": "use lr_schedule.min_lr_ratio",
    "lr_schedule.decay": "use lr_schedule.decay_fraction",
    "optimizer.schedule": "the schedule lives in lr_schedule (name: cosine, wsd or constant)",
    "optimizer.warmup_fraction": "use lr_schedule.warmup_steps",
    "optimizer.warmup_steps": "use lr_schedule.warmup_steps",
    "optimizer.min_lr_ratio": "use lr_schedule.min_lr_ratio",
    # spellings other trainers (and linnet's issues) use for fields linnet keeps elsewhere
    "report_to": "use runtime.report_to (a list: tensorboard, wandb, mlflow, trackio)",
    "grpo.reward": "use grpo.rewards (a list; model:DIR for a reward model)",
    "grpo.clip_low": "use grpo.clip: [low, high] (the ratio kept in [1 - low, 1 + high])",
    "grpo.clip_high": "use grpo.clip: [low, high] (the ratio kept in [1 - low, 1 + high])",
}

# The names users bring from TRL (its TrainingArguments, SFTConfig, DPOConfig, GRPOConfig),
# PEFT's LoraConfig and Axolotl's YAML, answered with linnet's (docs/coming-from.md's
# tables). A key of this table is refused wherever it appears in a config (a top-level
# `learning_rate` as well as `optimizer.learning_rate`), unless it is a field there.
FOREIGN_FIELDS = {
    "learning_rate": "use optimizer.lr",
    "num_train_epochs": "use training.epochs",
    "num_epochs": "use training.epochs",
    "max_steps": "use training.steps",
    "gradient_accumulation_steps": "use training.accumulation (sft, distill; dpo: dpo.pairs_per_step, grpo: "
                                   "grpo.prompts_per_step)",
    "max_seq_length": "use training.context_length (positions per packed row)",
    "max_length": "use training.context_length (positions per packed row)",
    "sequence_len": "use training.context_length (positions per packed row)",
    "per_device_train_batch_size": "linnet has none: a micro-batch is one packed row of training.context_length "
                                   "positions (dpo: dpo.pairs_per_step, grpo: grpo.prompts_per_step)",
    "batch_size": "linnet has none: a micro-batch is one packed row of training.context_length positions (dpo: "
                  "dpo.pairs_per_step, grpo: grpo.prompts_per_step; pretraining: training.micro_batch_size)",
    "micro_batch_size": "fine-tuning has none: a micro-batch is one packed row of training.context_length positions "
                        "(pretraining: training.micro_batch_size)",
    "warmup_ratio": "use lr_schedule.warmup_steps (a number of steps)",
    "lr_scheduler_type": "use lr_schedule.name (cosine, wsd or constant)",
    "lr_scheduler": "use lr_schedule.name (cosine, wsd or constant)",
    "max_grad_norm": "use optimizer.grad_clip",
    "adam_beta1": "use optimizer.betas: [beta1, beta2]",
    "adam_beta2": "use optimizer.betas: [beta1, beta2]",
    "adam_epsilon": "use optimizer.eps",
    "optim": "use optimizer.name (adamw, adamw8bit, paged_adamw8bit)",
    "bf16": "use model.dtype: bfloat16 (auto picks it where the device computes bf16 natively)",
    "fp16": "use model.dtype (auto, float32 or bfloat16)",
    "torch_dtype": "use model.dtype (auto, float32 or bfloat16)",
    "gradient_checkpointing": "use training.activation_checkpointing",
    "save_steps": "use training.checkpoint_every",
    "save_total_limit": "use training.keep",
    "eval_steps": "use evaluation.every",
    "model_name_or_path": "use model.card (a registered card or a local model directory)",
    "base_model": "use model.card (a registered card or a local model directory)",
    "datasets": "use data.path (one file of records)",
    "train_dataset": "use data.path (one file of records)",
    "val_set_size": "use data.eval_share",
    "r": "use lora.rank",
    "lora_r": "use lora.rank",
    "lora_alpha": "use lora.alpha",
    "lora_dropout": "use lora.dropout",
    "target_modules": "use lora.targets (PEFT's names such as [q_proj, v_proj], all-linear, or glob patterns)",
    "lora_target_modules": "use lora.targets (PEFT's names such as [q_proj, v_proj], all-linear, or glob patterns)",
    "lora_target_linear": "use lora.targets: all-linear (the default)",
    "use_rslora": "use lora.rslora",
    "use_dora": "use lora.dora",
    "peft_use_rslora": "use lora.rslora",
    "peft_use_dora": "use lora.dora",
    "adapter": "use lora.enabled (true: adapters; false: full fine-tuning) and model.quantize: nf4 for qlora",
    "load_in_4bit": "use model.quantize: nf4 (QLoRA)",
    "num_generations": "use grpo.group",
    "max_completion_length": "use grpo.max_new_tokens",
    "num_iterations": "use grpo.iterations",
    "epsilon": "use grpo.clip: [low, high]",
    "epsilon_high": "use grpo.clip: [low, high]",
    "reward_funcs": "use grpo.rewards",
    "rl_beta": "use dpo.beta (grpo: grpo.beta)",
}


@dataclass
class FineTuningConfig:
    """The groups `linnet sft`, `dpo` and `grpo` share; each adds its own."""

    model: ModelConfig = group(ModelConfig, "the model to fine-tune (grpo: its engine and reference are copies)")
    data: RecordsConfig = group(RecordsConfig, "records and their formatting")
    lora: LoraConfig = group(LoraConfig, "low-rank adapters")
    training: TrainingConfig = group(TrainingConfig, "steps, packed rows, checkpoints, processes")
    optimizer: OptimizerConfig = group(OptimizerConfig, "AdamW and gradient clipping")
    lr_schedule: LRScheduleConfig = group(LRScheduleConfig, "learning-rate schedule")
    evaluation: EvaluationConfig = group(EvaluationConfig, "held-out evaluation")
    runtime: RuntimeConfig = group(RuntimeConfig, "seed, device, output")

    def __post_init__(self):
        if not self.data.path and not self.data.mixture:
            raise ValueError(f"config: data.path is required (the records `linnet {self.command}` trains on)")
        if self.training.context_length < 16:
            raise ValueError(f"config: training.context_length={self.training.context_length}; a packed row needs "
                             "at least 16 positions")
        if self.model.quantize and not self.lora.enabled:
            raise ValueError(f"config: model.quantize={self.model.quantize} freezes the base in 4 bits; it trains "
                             "adapters only: set lora.enabled=true, or model.quantize=null for full fine-tuning")
        if self.model.quantize and self.model.compile:
            raise ValueError(f"config: model.quantize={self.model.quantize} with model.compile=true is not supported "
                             "yet; quantized runs are eager")
        split, stages = getattr(self.training, "split", 1), getattr(self.training, "pipeline", 1)
        full_fsdp = self.training.shard == "fsdp" and not self.lora.enabled  # adapters keep whole 8-bit states
        if self.optimizer.name != "adamw" and (full_fsdp or split > 1):
            where, fix = ((f"training.split={split}", "optimizer.name=adamw") if split > 1 else
                          ("training.shard=fsdp and full fine-tuning",
                           "training.shard=zero to split 8-bit states, LoRA, or optimizer.name=adamw"))
            raise ValueError(f"config: optimizer.name={self.optimizer.name} with {where} is not supported yet; "
                             f"use {fix}")
        if split > 1 and self.training.shard not in ("none", "fsdp"):
            raise ValueError(f"config: training.split={split} with training.shard={self.training.shard} is not "
                             "supported yet; use training.shard=fsdp to shard each part of the split over its "
                             "copies, or none")
        if split > 1 and self.model.quantize:
            raise ValueError(f"config: model.quantize={self.model.quantize} with training.split={split} is not "
                             "supported yet; an NF4 base splits with training.shard=fsdp")
        schedule = getattr(self.training, "pipeline_schedule", "1f1b")
        if stages == 1 and schedule != "1f1b":
            raise ValueError(f"config: training.pipeline_schedule={schedule} orders the micro-batches of pipeline "
                             "stages: set training.pipeline to 2 or more stages, or leave the schedule at 1f1b")
        if stages > 1 and schedule == "zero-bubble" and self.training.activation_checkpointing:
            raise ValueError("config: training.pipeline_schedule=zero-bubble with training.activation_checkpointing "
                             "is not supported: the split backward keeps each recomputed block until its weights' "
                             "half runs (measured: more memory than without); use interleaved, or no checkpointing")
        if stages > 1 and self.training.shard == "fsdp" and schedule == "zero-bubble":
            raise ValueError("config: training.pipeline_schedule=zero-bubble with training.shard=fsdp is not "
                             "supported yet (FSDP reshards a block after its forward and reduces its gradients when its "
                             "backward ends, so the weights' half finds nothing to compute); use "
                             "training.pipeline_schedule=interleaved")
        if stages > 1 and self.training.shard == "zero":
            raise ValueError(f"config: training.pipeline={stages} with training.shard=zero is not supported yet; "
                             "use training.shard=fsdp to shard each stage over its copies, or none")
        if self.command != "sft" and self.data.prompt is not None and len(self.data.prompt) != 1:
            raise ValueError(f"config: data.prompt={self.data.prompt}; `linnet {self.command}` reads one prompt "
                             "field")


@dataclass
class SFTConfig(FineTuningConfig):
    command: ClassVar[str] = "sft"
    runtime: RuntimeConfig = group(RuntimeConfig, "seed, device, output", output_dir="runs/sft")


@dataclass
class DPOConfig(FineTuningConfig):
    command: ClassVar[str] = "dpo"
    runtime: RuntimeConfig = group(RuntimeConfig, "seed, device, output", output_dir="runs/dpo")
    dpo: DPOSettings = group(DPOSettings, "the DPO objective (a pair's two answers share a packed row)")



@dataclass
class RewardConfig(FineTuningConfig):
    command: ClassVar[str] = "reward"
    runtime: RuntimeConfig = group(RuntimeConfig, "seed, device, output", output_dir="runs/reward")
    reward: RewardSettings = group(RewardSettings, "the Bradley-Terry objective of a scalar reward head")


@dataclass
class DistillConfig(FineTuningConfig):
    command: ClassVar[str] = "distill"
    runtime: RuntimeConfig = group(RuntimeConfig, "seed, device, output", output_dir="runs/distill")
    distill: DistillSettings = group(DistillSettings, "the teacher and how its knowledge is distilled")

    def __post_init__(self):
        super().__post_init__()
        if not self.distill.teacher:
            raise ValueError("config: distill.teacher is required (a card name or a model directory)")
        if self.data.mixture and self.distill.mode == "on_policy":
            raise ValueError("config: data.mixture with distill.mode=on_policy is not supported yet (its prompts are "
                             "drawn a step at a time, not an epoch); use one data.path, or mode logit or sequence")


@dataclass
class GRPOConfig(FineTuningConfig):
    command: ClassVar[str] = "grpo"
    runtime: RuntimeConfig = group(RuntimeConfig, "seed, device, output", output_dir="runs/grpo")
    grpo: GRPOSettings = group(GRPOSettings, "sampling, rewards and the objective")

    def __post_init__(self):
        super().__post_init__()
        _check_engine(self, self.grpo)


@dataclass
class PPOConfig(FineTuningConfig):
    command: ClassVar[str] = "ppo"
    runtime: RuntimeConfig = group(RuntimeConfig, "seed, device, output", output_dir="runs/ppo")
    ppo: PPOSettings = group(PPOSettings, "sampling, rewards, the critic and the objective")

    def __post_init__(self):
        super().__post_init__()
        _check_engine(self, self.ppo)
        if self.training.shard == "fsdp":
            raise ValueError("config: training.shard=fsdp with linnet ppo is not supported yet (the critic is kept "
                             "whole on every process); use training.shard=zero or none")


def _check_engine(config, s) -> None:
    """What a sampling command's engine cannot do with the rest of its config."""
    g = s.YAML
    if s.engine == "vllm" and getattr(config.training, "pipeline", 1) > 1:
        raise ValueError(f"config: {g}.engine=vllm with training.pipeline={config.training.pipeline} is not "
                         "supported yet (vLLM takes a policy's weights from one process's model); use "
                         f"{g}.engine=builtin, whose engines take them from every stage")
    if s.engine_dtype is not None and config.model.quantize:
        raise ValueError(f"config: {g}.engine_dtype={s.engine_dtype} with model.quantize={config.model.quantize}: "
                         f"the engine samples from the policy's own 4-bit base, in its dtype; remove {g}.engine_dtype")


@dataclass
class PretrainConfig:
    command: ClassVar[str] = "pretrain"
    model: ModelConfig = group(ModelConfig, "Llama decoder: tied embeddings, RoPE, RMSNorm, SwiGLU, no dropout",
                               rope_base=10000.0)
    data: CorpusConfig = group(CorpusConfig, "corpus, token cache and loading")
    training: TrainingConfig = group(TrainingConfig, "sequences, batches, budget, epochs, checkpoints",
                                     context_length=1024, accumulation=4, epochs=40)
    optimizer: OptimizerConfig = group(OptimizerConfig, "AdamW and gradient clipping", lr=3e-3, betas=[0.9, 0.95],
                                       weight_decay=0.1)
    lr_schedule: LRScheduleConfig = group(LRScheduleConfig, "learning-rate schedule", warmup_steps=312,
                                          min_lr_ratio=0.1)
    evaluation: EvaluationConfig = group(EvaluationConfig, "validation")
    runtime: RuntimeConfig = group(RuntimeConfig, "seed, device, output", output_dir="runs/pretrain")
    decentralized: DecentralizedConfig | None = option(
        None, "packed decentralized training (linnet.pretrain.decentralized): num_models workers on one device that "
              "mix their parameters every update; null: one ordinary model")

    def __post_init__(self):
        epochs = self.training.epochs
        if epochs != int(epochs):
            raise ValueError(f"config: training.epochs={epochs}; pretraining splits its budget into a whole number "
                             "of virtual epochs")
        self.training.epochs = int(epochs)
        shard = self.training.shard
        if shard != "none" and self.decentralized is not None:
            raise ValueError(f"config: training.shard={shard} with decentralized: packed workers share one process "
                             "and device; use training.shard=none")
        if shard == "fsdp" and self.optimizer.name != "adamw":
            raise ValueError(f"config: optimizer.name={self.optimizer.name} with training.shard=fsdp is not supported "
                             "yet (8-bit states of split weights); use training.shard=zero to split 8-bit states, or "
                             "optimizer.name=adamw")
        checkpoint_epochs(self)  # raises on a bad policy/epoch combination
        global_batch_sequences(self)  # raises on a global batch the batch sizes do not make


def global_batch_sequences(config: PretrainConfig) -> int:
    """Sequences an update. Ordinary runs: micro_batch_size x accumulation (and
    training.global_batch_tokens, when given, must say the same); packed runs: one
    micro-batch per worker, no accumulation, and global_batch_tokens must be num_models x
    micro_batch_size x context_length."""
    t, d = config.training, config.decentralized
    T, B = t.context_length, t.micro_batch_size
    if d is None:
        made = B * t.accumulation
        if t.global_batch_tokens is not None and t.global_batch_tokens != made * T:
            raise ValueError(f"config: training.global_batch_tokens={t.global_batch_tokens:,} but micro_batch_size "
                             f"{B} x accumulation {t.accumulation} x context_length {T} = {made * T:,}; make them "
                             "agree, or leave global_batch_tokens null")
        return made
    if t.accumulation != 1:
        raise ValueError(f"config: training.accumulation={t.accumulation}; packed decentralized training takes one "
                         "micro-batch per worker an update and never accumulates: set training.accumulation=1 "
                         "(the global batch is num_models x micro_batch_size sequences)")
    made = d.num_models * B
    if t.global_batch_tokens is not None and t.global_batch_tokens != made * T:
        raise ValueError(f"config: training.global_batch_tokens={t.global_batch_tokens:,} but decentralized.num_models "
                         f"{d.num_models} x micro_batch_size {B} x context_length {T} = {made * T:,}; change "
                         f"micro_batch_size to {t.global_batch_tokens / (d.num_models * T):g} for the same global "
                         "batch, or global_batch_tokens")
    return made


def checkpoint_epochs(config: PretrainConfig) -> list[int]:
    """The epochs whose weights (and, with save_epoch_training_state, training state)
    are kept: none for the `none` and `final` policies."""
    t = config.training
    policy, value = t.checkpoint_policy, t.checkpoint_epochs
    if policy in ("none", "final"):
        return []
    if policy == "interval":
        if isinstance(value, list):
            raise ValueError(f"config: training.checkpoint_epochs={value}; the interval policy takes one "
                             "integer K (every K epochs); use checkpoint_policy=explicit for a list")
        if value < 1:
            raise ValueError(f"config: training.checkpoint_epochs={value}; K must be a positive integer")
        return list(range(value, t.epochs + 1, value))
    chosen = sorted(set([value] if isinstance(value, int) else value))
    bad = [e for e in chosen if not 1 <= e <= t.epochs]
    if bad or not chosen:
        raise ValueError(f"config: training.checkpoint_epochs={value}; the explicit policy needs epochs "
                         f"between 1 and training.epochs={t.epochs}")
    return chosen


COMMANDS: dict[str, type] = {c.command: c for c in (SFTConfig, DPOConfig, GRPOConfig, PPOConfig, RewardConfig,
                                                    DistillConfig, PretrainConfig)}


def from_data(cls: type, data: dict[str, Any], where: str | Origins = "config"):
    """A config of class `cls` from nested plain data (a parsed YAML file); `where`: the
    file it came from, or its `Origins` (each key's line, the `--set` items). Every field
    that is not read is refused at once: former fields with what replaced them, other
    trainers' names with linnet's, unknown ones with the nearest valid field; another
    command's own group (a `dpo` group given to `linnet sft`) with the command that reads it."""
    origins = where if isinstance(where, Origins) else Origins(where)
    run = f"; run `linnet {{}} --config {origins}`" if origins.file != "config" else ""
    own = {f.name for f in dataclasses.fields(cls)}
    groups = {key: f"the {key} group belongs to a `linnet {key}` config, which `linnet {cls.command}` does not read"
                   + run.format(key) for key in COMMANDS if key not in own}
    return from_dict(cls, data, origins, former=FORMER_FIELDS, foreign=FOREIGN_FIELDS, groups=groups)


def read(path: str | Path | None, overrides: list[str] = ()) -> tuple[dict[str, Any], Origins]:
    """(the data of a YAML file with `a.b=c` overrides applied, where each key came from)."""
    data, origins = read_yaml(path)
    return apply_overrides(data, list(overrides), origins), origins


def load(cls: type | None, path: str | Path | None, overrides: list[str] = ()):
    """A config of class `cls` (None: the class of the command the file is for, see
    `command_of`) from a YAML file (or the defaults when path is None) and `a.b=c`
    overrides; a value refused is named with its line or override."""
    data, origins = read(path, overrides)
    try:
        return from_data(cls or COMMANDS[command_of(data)], data, origins)
    except ValueError as e:
        if origins.placed(str(e)) == str(e):
            raise
        raise ValueError(origins.placed(str(e))) from None


def command_of(data: dict[str, Any]) -> str:
    """Which command a config is for, from the groups it gives: a `dpo`, `grpo`, `ppo`, `reward` or `distill` group,
    a corpus (`data.cache`, `data.source`, `data.dataset` or a `data.mixture` of sources) or an architecture for
    pretraining; sft otherwise."""
    if "dpo" in data:
        return "dpo"
    if "grpo" in data:
        return "grpo"
    if "ppo" in data:
        return "ppo"
    if "reward" in data:
        return "reward"
    if "distill" in data:
        return "distill"
    given = data.get("data") or {}
    corpora = given.get("mixture") if isinstance(given, dict) else None  # a pretraining mixture's entries name sources
    corpus = ({"cache", "source", "dataset"} & set(given)) or any(
        isinstance(m, dict) and "source" in m for m in (corpora if isinstance(corpora, list) else []))
    architecture = {"hidden", "layers", "heads", "intermediate"} & set(data.get("model") or {})
    return "pretrain" if corpus or architecture else "sft"


def load_any(path: str | Path | None, overrides: list[str] = ()):
    """The config in a YAML file, for whichever command it is (see `command_of`)."""
    return load(None, path, overrides)
