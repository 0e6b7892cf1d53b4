"""The pretraining config: typed groups, former fields refused, and the recipe identity.

    config = load("configs/pretrain-tiny-cpu.yaml", ["training.epochs=4", "optimizer.lr=1e-3"])
    fields = recipe_fields(config, cache.fingerprint)    # flat {"optimizer.lr": 0.001, ...}
    identity = recipe_identity(fields)                   # 16 hex digits

The recipe identity is a hash of every field that decides the trained weights, plus the
token cache's fingerprint (its shard checksums) in place of the corpus and preparation
fields that produced it. Where a run happens and what it keeps does not enter it: the
device, output directory, background prefetch, tokenizer worker count and checkpoint
retention may all change between a run and its resumption.

Only `linnet.config` and the standard library are imported here: spawned tokenizer
workers import this module and must stay light (no torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from linnet.config import apply_overrides, from_dict, group, option, read_yaml, to_dict

LOADER_VERSION = 2


@dataclass
class ModelConfig:
    hidden: int = option(256, "hidden size")
    intermediate: int = option(688, "SwiGLU intermediate size")
    layers: int = option(4, "decoder blocks")
    heads: int = option(4, "query heads")
    kv_heads: int | None = option(None, "key/value heads (grouped-query attention); null: heads")
    head_dim: int | None = option(None, "per-head size; null: hidden / heads")
    vocab: int | None = option(None, "embedding rows; null: the cache tokenizer's vocabulary")
    rope_base: float = option(10000.0, "RoPE base")
    norm_eps: float = option(1e-5, "RMSNorm epsilon")
    dtype: str | None = option(None, "compute dtype; null: bfloat16 on CUDA, float32 on CPU")
    attention: str = option("auto", "attention path: auto, documents, dense, flex, varlen")
    compile: bool = option(False, "compile each block with torch.compile")


@dataclass
class DataConfig:
    cache: str = option("", "token cache directory (written by `linnet prepare`)")
    source: list[str] = option([], "corpus: .txt, .jsonl, .parquet files (.gz too) or directories of them")
    validation_source: list[str] = option([], "validation corpus files; empty: every validation_every-th source document")
    validation_every: int = option(100, "with no validation_source: every N-th source document (in order) is validation; 0: none")
    dataset: str | None = option(None, "a `datasets` dataset name (streamed) instead of source files")
    dataset_config: str | None = option(None, "the dataset's configuration name (e.g. 'en' for allenai/c4)")
    dataset_split: str = option("train", "the dataset split for training")
    dataset_validation_split: str | None = option("validation", "the dataset split for validation; null: every validation_every-th")
    text_field: str = option("text", "field holding the text in JSONL, Parquet and dataset records")
    document_split: Literal["file", "paragraph", "line"] = option(
        "paragraph", ".txt files: one document per file, per blank-line-separated paragraph, or per line")
    train_tokens: int | None = option(None, "stop reading the corpus once the training split holds this many tokens; null: what the training budget draws, rounded up through its last whole shard group (the whole corpus when that is less)")
    tokenizer: str | None = option(None, "tokenizer.json, a directory holding one, or a card name; null: train a byte-level BPE on the corpus")
    vocab_size: int = option(8192, "vocabulary of the BPE trained when tokenizer is null")
    eos_token: str | None = option(None, "token placed after every document; null: the tokenizer's own (<|endoftext|> for a trained one)")
    shuffle_buffer: int = option(100000, "documents in the preparation shuffle buffer (1: source order)")
    shuffle_seed: int = option(0, "seed of the preparation shuffle buffer")
    shard_tokens: int = option(33554432, "tokens per cache shard (64 MiB of uint16)")
    prepare_workers: int = option(8, "tokenizer processes for `linnet prepare` (1: tokenize in the main process)")
    prepare_batch_documents: int = option(256, "documents per tokenizer task")
    shuffle_group_size: int = option(2, "consecutive shards the loader reads and shuffles together")
    prefetch: bool = option(True, "read the next shard group in a background thread")
    repeat: bool = option(False, "allow the budget to take more than one pass over the training cache")


@dataclass
class TrainingConfig:
    context_length: int = option(1024, "tokens per training sequence")
    micro_batch_size: int = option(32, "sequences per forward/backward pass")
    accumulation: int = option(4, "micro-batches per update; the global batch is micro_batch_size x accumulation x context_length targets")
    targets_per_parameter: float = option(20.0, "budget: prediction targets per unique trainable parameter")
    total_targets: int | None = option(None, "budget in prediction targets, overriding targets_per_parameter")
    epochs: int = option(40, "virtual epochs the budget is split into (validation and checkpoints at their ends)")
    checkpoint_policy: Literal["none", "final", "interval", "explicit"] = option(
        "final", "none: no checkpoint or weight files; final: final state; interval: every checkpoint_epochs epochs; explicit: the listed epochs")
    checkpoint_epochs: int | list[int] = option(1, "interval: K (every K epochs); explicit: a list of epochs")
    save_epoch_training_state: bool = option(False, "at selected epochs also keep a resumable training-state snapshot")


@dataclass
class OptimizerConfig:
    name: Literal["adamw"] = option("adamw", "optimizer (AdamW; decay on matrices, none on norms)")
    lr: float = option(3e-3, "peak learning rate")
    betas: list[float] = option([0.9, 0.95], "AdamW betas")
    eps: float = option(1e-8, "AdamW epsilon")
    weight_decay: float = option(0.1, "decoupled weight decay of the matrices (embedding included)")
    grad_clip: float | None = option(1.0, "global gradient-norm clip; null: no clipping (the norm is still logged, a non-finite norm still stops)")


@dataclass
class LRScheduleConfig:
    name: Literal["cosine", "wsd"] = option("cosine", "cosine, or wsd (warmup-stable-decay)")
    warmup_steps: int = option(312, "linear warmup updates")
    min_lr_ratio: float = option(0.1, "final learning rate as a share of the peak")
    decay_fraction: float = option(0.2, "wsd: share of the updates spent decaying")


@dataclass
class EvaluationConfig:
    batch_size: int = option(128, "validation sequences per forward pass")
    subset_sequences: int = option(1024, "fixed validation subset (kept in memory) evaluated at every epoch end")
    full_validation: bool = option(True, "stream the whole validation split at the end of training")


@dataclass
class RuntimeConfig:
    seed: int = option(0, "seed of initialisation and the loader's shuffles")
    device: str | None = option(None, "cpu, cuda, cuda:1 …; null: cuda when present")
    output_dir: str = option("runs/pretrain", "run directory")
    deterministic: bool = option(False, "torch.use_deterministic_algorithms (slower on CUDA)")
    threads: int | None = option(None, "torch CPU threads; null: torch's default")
    progress: bool = option(True, "show a progress bar")


@dataclass
class PretrainConfig:
    model: ModelConfig = group(ModelConfig, "Llama decoder: tied embeddings, RoPE, RMSNorm, SwiGLU, no dropout")
    data: DataConfig = group(DataConfig, "corpus, token cache and loading")
    training: TrainingConfig = group(TrainingConfig, "sequences, batches, budget, epochs, checkpoints")
    optimizer: OptimizerConfig = group(OptimizerConfig, "AdamW and gradient clipping")
    lr_schedule: LRScheduleConfig = group(LRScheduleConfig, "learning-rate schedule")
    evaluation: EvaluationConfig = group(EvaluationConfig, "validation")
    runtime: RuntimeConfig = group(RuntimeConfig, "seed, device, output")

    def __post_init__(self):
        m, d, t, o, s, e = self.model, self.data, self.training, self.optimizer, self.lr_schedule, self.evaluation
        positive = {
            "model.hidden": m.hidden, "model.intermediate": m.intermediate, "model.layers": m.layers,
            "model.heads": m.heads, "data.shard_tokens": d.shard_tokens, "data.prepare_workers": d.prepare_workers,
            "data.prepare_batch_documents": d.prepare_batch_documents, "data.shuffle_buffer": d.shuffle_buffer,
            "data.shuffle_group_size": d.shuffle_group_size, "data.vocab_size": d.vocab_size,
            "training.context_length": t.context_length, "training.micro_batch_size": t.micro_batch_size,
            "training.accumulation": t.accumulation, "training.epochs": t.epochs,
            "evaluation.batch_size": e.batch_size,
        }
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"config: {name}={value}; it must be a positive integer")
        if d.validation_every < 0 or e.subset_sequences < 0 or s.warmup_steps < 0:
            raise ValueError("config: data.validation_every, evaluation.subset_sequences and "
                             "lr_schedule.warmup_steps must be >= 0")
        if m.head_dim is None and m.hidden % m.heads:
            raise ValueError(f"config: model.hidden={m.hidden} is not a multiple of model.heads={m.heads}; "
                             "set model.head_dim")
        if t.targets_per_parameter <= 0 or (t.total_targets is not None and t.total_targets < 1):
            raise ValueError("config: training.targets_per_parameter must be > 0 and training.total_targets >= 1")
        if o.grad_clip is not None and not o.grad_clip > 0:
            raise ValueError(f"config: optimizer.grad_clip={o.grad_clip}; use a positive threshold, or null to disable clipping")
        if len(o.betas) != 2 or o.lr <= 0:
            raise ValueError("config: optimizer.betas must hold two numbers and optimizer.lr be positive")
        if not 0 <= s.min_lr_ratio <= 1 or not 0 < s.decay_fraction <= 1:
            raise ValueError("config: lr_schedule.min_lr_ratio must be in [0, 1] and decay_fraction in (0, 1]")
        if d.train_tokens is not None and d.train_tokens < 2:
            raise ValueError(f"config: data.train_tokens={d.train_tokens}; use null (what the budget draws) or >= 2")
        checkpoint_epochs(self)  # raises on a bad policy/epoch combination


def model_card(config: PretrainConfig, vocab_size: int, eos_id: int, tokenizer: str | None = None):
    """A Llama card with tied embeddings for the config's model group and a tokenizer of
    `vocab_size` tokens whose `eos_id` ends each document."""
    from linnet.cards import Card, Location

    m = config.model
    vocab = m.vocab or vocab_size
    if vocab < vocab_size:
        raise ValueError(f"config: model.vocab={m.vocab} is smaller than the tokenizer's {vocab_size} tokens; use "
                         "null (the tokenizer's size) or a larger vocabulary")
    return Card(
        "pretrain", "llama", vocab, m.hidden, m.intermediate, m.layers, m.heads, m.kv_heads or m.heads,
        m.head_dim or m.hidden // m.heads, rope_base=m.rope_base, norm_eps=m.norm_eps, tied_embeddings=True,
        max_positions=config.training.context_length, eos_token_ids=(eos_id,), pad_token_id=eos_id,
        dtype=m.dtype or "bfloat16", tokenizer=Location(path=tokenizer), source="linnet pretrain",
    )


def make_budget(config: PretrainConfig, parameters: int):
    """The training budget (`linnet.pretrain.budget`) of a model of `parameters` unique
    trainable parameters under this config."""
    from linnet.pretrain.budget import plan_budget

    t = config.training
    return plan_budget(parameters, context=t.context_length, sequences_per_update=t.micro_batch_size * t.accumulation,
                       targets_per_parameter=t.targets_per_parameter, total_targets=t.total_targets, epochs=t.epochs)


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


# Former spellings: refused with where the setting lives now. This revision is a clean
# break; old names are not translated.
FORMER_FIELDS = {
    "data.buffer_size_mib": "use data.shuffle_group_size (shards read and shuffled together)",
    "lr_schedule.warmup_fraction": "use lr_schedule.warmup_steps (an integer number of updates)",
    "optimizer.schedule": "the schedule lives in lr_schedule (name: cosine or wsd)",
    "optimizer.warmup_fraction": "use lr_schedule.warmup_steps",
    "optimizer.warmup_steps": "use lr_schedule.warmup_steps",
    "optimizer.min_lr_ratio": "use lr_schedule.min_lr_ratio",
    "training.grad_clip": "use optimizer.grad_clip",
    "training.seed": "use runtime.seed",
    "training.output_dir": "use runtime.output_dir",
}


def refuse_former(data: dict[str, Any], where: str) -> None:
    for dotted, fix in FORMER_FIELDS.items():
        node: Any = data
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and leaf in node:
            raise ValueError(f"{where}: {dotted} is a former field and is no longer read; {fix}")


def from_data(data: dict[str, Any], where: str = "config") -> PretrainConfig:
    refuse_former(data, where)
    return from_dict(PretrainConfig, data, where)


def load(path: str | Path | None, overrides: list[str] = ()) -> PretrainConfig:
    """A config from a YAML file (or the defaults when path is None) and `a.b=c` overrides."""
    data, where = read_yaml(path)
    return from_data(apply_overrides(data, list(overrides)), where)


def to_yaml(config: PretrainConfig) -> str:
    import yaml

    return yaml.safe_dump(to_dict(config), sort_keys=False)


# ---------------------------------------------------------------------------------------
# Recipe identity

# Fields that never change the trained weights: where the run happens and what it keeps.
RUN_FIELDS = frozenset({
    "runtime.device", "runtime.output_dir", "runtime.threads", "runtime.progress",
    "data.prefetch", "data.prepare_workers", "data.prepare_batch_documents",
    "training.checkpoint_policy", "training.checkpoint_epochs", "training.save_epoch_training_state",
    "evaluation.batch_size",
})

# Fields that only decide the cache's contents: the cache fingerprint stands for them,
# so a cache may move and be named by another path.
CACHE_FIELDS = frozenset({
    "data.cache", "data.source", "data.validation_source", "data.validation_every", "data.dataset",
    "data.dataset_config", "data.dataset_split", "data.dataset_validation_split", "data.text_field",
    "data.document_split", "data.train_tokens", "data.tokenizer", "data.vocab_size", "data.eos_token",
    "data.shuffle_buffer", "data.shuffle_seed", "data.shard_tokens",
})


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def recipe_fields(config: PretrainConfig, data_fingerprint: str) -> dict[str, Any]:
    """The flat fields that decide the result, with the cache fingerprint and the loader
    version (which fixes the sample order)."""
    # An optional group left out (None) does not enter the identity, so adding one to the
    # schema later keeps every earlier run's identity.
    flat = _flatten({k: v for k, v in to_dict(config).items() if v is not None})
    fields = {k: v for k, v in flat.items() if k not in RUN_FIELDS and k not in CACHE_FIELDS}
    fields["data.fingerprint"] = data_fingerprint
    fields["data.loader_version"] = LOADER_VERSION
    return dict(sorted(fields.items()))


def recipe_identity(fields: dict[str, Any]) -> str:
    import hashlib
    import json

    text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def recipe_differences(saved: dict[str, Any], current: dict[str, Any], labels: tuple[str, str] = ("saved", "now")) -> list[str]:
    """'field: A (saved) vs B (now)' for each field that differs."""
    missing = object()
    out = []
    for name in sorted(set(saved) | set(current)):
        a, b = saved.get(name, missing), current.get(name, missing)
        if a != b:
            show = lambda v: "(absent)" if v is missing else repr(v)
            out.append(f"{name}: {show(a)} ({labels[0]}) vs {show(b)} ({labels[1]})")
    return out
