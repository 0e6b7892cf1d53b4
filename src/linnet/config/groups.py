"""The config vocabulary: one group class a knob family, shared by every command.

`linnet sft`, `dpo`, `grpo`, `jax` and `pretrain` read the same groups under the same
names (seed 002's names where it gives them: `training.micro_batch_size`,
`optimizer.grad_clip`, `lr_schedule.warmup_steps`, `runtime.output_dir`, ...). A field
that only some commands read says which (`only=`); the others refuse it and leave it out
of their templates. Each command's defaults are set where it names the group
(linnet.config.commands); the sampling trainers' groups are in linnet.config.sampling.
Only the standard library is imported here: spawned tokenizer workers import the
pretraining config.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import ClassVar, Literal

from linnet.config.fields import check_finite, check_one_of, check_ranges, field_default, option
from linnet.config.sampling import Rewards, Sampling

FINE_TUNING = ("sft", "dpo", "grpo", "ppo", "reward", "distill")  # `linnet jax` reads the sft config
PRETRAINING = ("pretrain",)
ALL_LINEAR = ["model.layers.*.self_attn.*_proj", "model.layers.*.mlp.*_proj"]
WEIGHT_DECAY_WARNING = 1.0  # above this optimizer.weight_decay warns: decoupled decay of lr x wd a step erodes weights


def _positive(**fields: float | int | None) -> None:
    for name, value in fields.items():
        if value is not None and not value >= 1:
            raise ValueError(f"config: {name}={value}; it must be a positive integer")


@dataclass
class ModelConfig:
    card: str | None = option("debug", "registered card name or local Hugging Face model directory",
                              only=FINE_TUNING)
    weights: str | None = option(None, "weights directory or file; null: the card's own; 'random': seeded init",
                                 only=FINE_TUNING)
    hidden: int = option(256, "hidden size", only=PRETRAINING)
    intermediate: int = option(688, "SwiGLU intermediate size", only=PRETRAINING)
    layers: int = option(4, "decoder blocks", only=PRETRAINING)
    heads: int = option(4, "query heads", only=PRETRAINING)
    kv_heads: int | None = option(None, "key/value heads (grouped-query attention); null: heads", only=PRETRAINING)
    head_dim: int | None = option(None, "per-head size; null: hidden / heads", only=PRETRAINING)
    vocab: int | None = option(None, "embedding rows; null: the cache tokenizer's vocabulary", only=PRETRAINING)
    rope_base: float | None = option(None, "RoPE base; null: the card's own (fine-tuning; a larger base is one way "
                                           "to train for a longer context)")
    rope_scaling: dict | None = option(None, "RoPE scaling for a longer context: {kind: linear|llama3|yarn, factor, "
                                             "original_max_positions (default the card's max_positions), ...; see "
                                             "docs/long_context.md}, or {kind: none}; null: the card's own",
                                       only=FINE_TUNING)
    max_positions: int | None = option(None, "the context the model is configured for (exported as "
                                             "max_position_embeddings); null: the card's, stretched by rope_scaling's "
                                             "factor", only=FINE_TUNING)
    norm_eps: float = option(1e-5, "RMSNorm epsilon", only=PRETRAINING)
    dtype: str | None = option("auto", "compute dtype: auto (bfloat16 where the device computes it natively: "
                                       "CUDA, a CPU with amx_bf16 or avx512_bf16; else float32), float32, "
                                       "bfloat16; null: bfloat16 on CUDA, float32 on CPU")
    attention: str = option("auto", "attention path inside packed rows: auto, documents, dense, flex, varlen")
    compile: bool = option(False, "compile each block with torch.compile (inductor)")
    activation_memory_budget: float | None = option(None, "with compile: the share of a compiled block's "
                                                          "activations the compiler may keep, recomputing the "
                                                          "rest (0 to 1); null: all")
    quantize: str | None = option(None, "nf4: QLoRA, the frozen base's block weights stored in 4-bit NormalFloat "
                                        "(bitsandbytes, the qlora extra); needs lora.enabled", only=FINE_TUNING)

    def __post_init__(self):
        check_finite(self, "model")
        if self.dtype not in (None, "auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"config: model.dtype={self.dtype!r}; use auto, float32, bfloat16, float16 or null")
        if self.quantize not in (None, "nf4"):
            raise ValueError(f"config: model.quantize={self.quantize!r}; use nf4 (QLoRA) or null")
        if self.activation_memory_budget is not None and not (self.compile and 0 <= self.activation_memory_budget <= 1):
            raise ValueError(f"config: model.activation_memory_budget={self.activation_memory_budget} needs "
                             "model.compile=true and a share in [0, 1]")
        _positive(**{"model.max_positions": self.max_positions})
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, dict):
            raise ValueError(f"config: model.rope_scaling={self.rope_scaling!r}; give a mapping such as {{kind: yarn, "
                             "factor: 4}} (docs/long_context.md) or null")
        _positive(**{"model.hidden": self.hidden, "model.intermediate": self.intermediate,
                     "model.layers": self.layers, "model.heads": self.heads, "model.kv_heads": self.kv_heads,
                     "model.head_dim": self.head_dim})
        if self.head_dim is None and self.hidden % self.heads:
            raise ValueError(f"config: model.hidden={self.hidden} is not a multiple of model.heads={self.heads}; "
                             "set model.head_dim")


@dataclass
class LoraConfig:
    enabled: bool = option(True, "train low-rank adapters on a frozen base; false: full fine-tuning")
    rank: int = option(16, "adapter rank")
    alpha: float = option(32.0, "adapter scale numerator: alpha / rank (or / sqrt(rank) with rslora)")
    dropout: float = option(0.0, "dropout on the adapters' input")
    rslora: bool = option(False, "scale by alpha / sqrt(rank)")
    dora: bool = option(False, "DoRA: a trained magnitude per output row beside the low-rank direction update")
    targets: list[str] = option(ALL_LINEAR, "the linear layers that get adapters: glob patterns over their paths "
                                            "(model.layers.*.self_attn.*_proj), PEFT's target_modules names (q_proj, "
                                            "v_proj: a layer whose path ends in one), or all-linear (every "
                                            "projection of the blocks, not the head; a mixture of experts' stacked "
                                            "expert tensors too)")

    def __post_init__(self):
        check_finite(self, "lora")
        _positive(**{"lora.rank": self.rank})
        check_ranges("lora", alpha=(self.alpha, self.alpha > 0, "> 0"),
                     dropout=(self.dropout, 0 <= self.dropout < 1, "in [0, 1)"))
        if not self.targets:
            raise ValueError("config: lora.targets lists no pattern; e.g. [q_proj, v_proj], all-linear or "
                             "[model.layers.*.self_attn.*_proj]")
        if not self.enabled:
            ignored = [f"lora.{f.name}={str(getattr(self, f.name)).lower()}" for f in dataclasses.fields(self)
                       if f.name != "enabled" and getattr(self, f.name) != field_default(f)]
            if ignored:
                raise ValueError(f"config: lora.enabled=false trains every weight, without adapters, so "
                                 f"{', '.join(ignored)} would be ignored; remove {'it' if len(ignored) == 1 else 'them'}"
                                 ", or set lora.enabled=true")


@dataclass
class RecordsConfig:
    path: str = option("", "records: .jsonl, .json, .parquet, a saved datasets directory, or a dataset on the "
                           "Hugging Face Hub by name (tatsu-lab/alpaca; through datasets.load_dataset and its cache)")
    split: str | None = option(None, "the split of path when it is a hub dataset or a saved DatasetDict; null: "
                                     "train for a hub dataset")
    mixture: list[dict] = option([], "several record files sampled in proportion, instead of path: [{path: a.jsonl, "
                                     "weight: 3}, {path: b.jsonl, weight: 1}] (each may name a split); an epoch takes "
                                     "weight / total of its records from each, a small source repeating",
                                 only=("sft", "distill"))
    eval_path: str | None = option(None, "held-out records; null: take eval_share of path")
    eval_share: float = option(0.05, "share of the records held out when eval_path is null")
    overlap: str = option("warn", "held-out records that repeat training records (exact or near duplicates, as "
                                  "`linnet data check` finds them): warn, refuse, or off")
    messages: str | None = option(None, "field holding chat messages; null: 'messages' when present",
                                  only=("sft", "distill"))
    prompt: list[str] | None = option(None, "prompt field; null: 'prompt' (sft: or instruction + input; sft may "
                                            "name several, joined)")
    completion: str | None = option(None, "completion field; null: completion, output or response (dpo with "
                                          "loss_type kto: completion)", only=("sft", "dpo", "distill"))
    chosen: str = option("chosen", "preferred answer field (text, a message, or a whole dialogue)",
                         only=("dpo", "reward"))
    rejected: str = option("rejected", "other answer field", only=("dpo", "reward"))
    label: str = option("label", "kto: the field saying whether the completion is desirable (true) or not (false)",
                        only=("dpo",))
    answer: str = option("answer", "reference answer field, given to the rewards (dpo: with dpo.online)", only=("grpo", "ppo", "dpo"))
    chat: bool = option(True, "format the records with the chat template (when the tokenizer has one)")
    chat_template: str | None = option(None, "a Jinja chat template overriding the tokenizer's")
    tokenizer: str | None = option(None, "tokenizer directory; null: the card's")
    truncate: bool = option(False, "cut records longer than a row instead of refusing them (dpo, reward: the prompt "
                                   "first, keeping its end, then the answers)", only=("sft", "distill", "dpo", "reward"))
    shuffle: bool = option(True, "shuffle the examples (seeded) before packing each epoch", only=("sft", "distill"))

    def __post_init__(self):
        check_finite(self, "data")
        if not 0 <= self.eval_share < 1:
            raise ValueError(f"config: data.eval_share={self.eval_share}; it must be in [0, 1)")
        if self.overlap not in ("warn", "refuse", "off"):
            raise ValueError(f"config: data.overlap={self.overlap!r}; one of warn, refuse, off")
        for i, source in enumerate(self.mixture):
            where = f"config: data.mixture[{i}]"
            unknown = sorted(set(source) - {"path", "weight", "split"})
            if unknown:
                raise ValueError(f"{where} has {', '.join(unknown)}; a source has path, weight and optionally split")
            if not isinstance(source.get("path"), str) or not source["path"]:
                raise ValueError(f"{where}: path is required (a file of records, a saved dataset or a hub name)")
            weight = source.get("weight")
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < float("inf"):
                raise ValueError(f"{where}: weight={weight!r}; give a positive number (weights are relative)")
        if self.mixture and self.path:
            raise ValueError("config: data.path and data.mixture both name the records; keep one (a mixture lists "
                             "every source, path included)")


@dataclass
class CorpusConfig:
    cache: str = option("", "token cache directory (written by `linnet prepare`)")
    source: list[str] = option([], "corpus: .txt, .jsonl, .parquet files (.gz too) or directories of them")
    mixture: list[dict] = option([], "several corpora sampled in proportion, instead of source: [{source: [web/], "
                                     "weight: 3}, {source: [code.jsonl], weight: 1}]; the training split holds as many "
                                     "documents as they do together, weight / total of them from each (a small corpus "
                                     "repeating, a large one cut)")
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
    dedup: Literal["off", "exact", "near"] = option(
        "off", "drop documents that repeat an earlier one before tokenizing: exact (the same normalized text) or near "
               "(MinHash over word 5-grams, at dedup_threshold; needs datasketch)")
    dedup_threshold: float = option(0.8, "near duplicates: the Jaccard similarity from which a document repeats another")
    min_characters: int = option(0, "drop documents shorter than this many characters (0: keep all)")
    max_repetition: float = option(1.0, "drop documents whose share of repeated word 3-grams is above this (1: keep all)")
    min_letters: float = option(0.0, "drop documents whose share of letters among non-space characters is below this")
    overlap: Literal["warn", "refuse", "off"] = option(
        "warn", "validation documents that repeat training documents (the same normalized text): warn, refuse, or off")
    shuffle_buffer: int = option(100000, "documents in the preparation shuffle buffer (1: source order)")
    shuffle_seed: int = option(0, "seed of the preparation shuffle buffer")
    shard_tokens: int = option(33554432, "tokens per cache shard (64 MiB of uint16)")
    prepare_workers: int = option(8, "tokenizer processes for `linnet prepare` (1: tokenize in the main process)")
    prepare_batch_documents: int = option(256, "documents per tokenizer task")
    shuffle_group_size: int = option(2, "consecutive shards the loader reads and shuffles together")
    prefetch: bool = option(True, "read the next shard group in a background thread")
    repeat: bool = option(False, "allow the budget to take more than one pass over the training cache")

    def __post_init__(self):
        check_finite(self, "data")
        _positive(**{"data.shard_tokens": self.shard_tokens, "data.prepare_workers": self.prepare_workers,
                     "data.prepare_batch_documents": self.prepare_batch_documents,
                     "data.shuffle_buffer": self.shuffle_buffer, "data.shuffle_group_size": self.shuffle_group_size,
                     "data.vocab_size": self.vocab_size})
        if self.validation_every < 0:
            raise ValueError(f"config: data.validation_every={self.validation_every}; it must be >= 0")
        for name in ("dedup_threshold", "max_repetition", "min_letters"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"config: data.{name}={getattr(self, name)}; it is a share, in [0, 1]")
        if self.min_characters < 0:
            raise ValueError(f"config: data.min_characters={self.min_characters}; it must be >= 0")
        if self.train_tokens is not None and self.train_tokens < 2:
            raise ValueError(f"config: data.train_tokens={self.train_tokens}; use null (what the budget draws) or >= 2")
        for i, entry in enumerate(self.mixture):
            where = f"config: data.mixture[{i}]"
            unknown = sorted(set(entry) - {"source", "weight"})
            if unknown:
                raise ValueError(f"{where} has {', '.join(unknown)}; a corpus of a mixture has source and weight")
            paths = entry.get("source")
            if not (isinstance(paths, str) and paths) and not (isinstance(paths, list) and paths
                                                               and all(isinstance(x, str) for x in paths)):
                raise ValueError(f"{where}: source is required (a corpus file or directory, or a list of them)")
            weight = entry.get("weight")
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < float("inf"):
                raise ValueError(f"{where}: weight={weight!r}; give a positive number (weights are relative)")
        if self.mixture and (self.source or self.dataset is not None):
            raise ValueError("config: data.mixture lists the corpora; drop data.source / data.dataset (a mixture "
                             "lists every corpus)")


@dataclass
class TrainingConfig:
    context_length: int = option(2048, "positions per packed row (a micro-batch's sequence)")
    micro_batch_size: int = option(32, "sequences per forward/backward pass", only=PRETRAINING)
    accumulation: int = option(1, "micro-batches per optimizer step (dpo and grpo size their steps in pairs and "
                                  "prompts)", only=("sft", "pretrain", "distill"))
    global_batch_tokens: int | None = option(None, "targets an update (the global batch); null: micro_batch_size x "
                                                   "accumulation x context_length. A packed run needs "
                                                   "decentralized.num_models x micro_batch_size x context_length",
                                             only=PRETRAINING)
    steps: int | None = option(None, "optimizer steps; null: from epochs", only=FINE_TUNING)
    epochs: int | float = option(1, "passes over the data when steps is null (fine-tuning); the whole number of "
                                    "virtual epochs the budget is split into, validated and checkpointed at their "
                                    "ends (pretraining)")
    targets_per_parameter: float = option(20.0, "budget: prediction targets per unique trainable parameter",
                                          only=PRETRAINING)
    total_targets: int | None = option(None, "budget in prediction targets, overriding targets_per_parameter",
                                       only=PRETRAINING)
    checkpoint_policy: Literal["none", "final", "interval", "explicit"] = option(
        "final", "none: no checkpoint or weight files; final: final state; interval: every checkpoint_epochs "
                 "epochs; explicit: the listed epochs", only=PRETRAINING)
    checkpoint_epochs: int | list[int] = option(1, "interval: K (every K epochs); explicit: a list of epochs",
                                                only=PRETRAINING)
    save_epoch_training_state: bool = option(False, "at selected epochs also keep a resumable training-state "
                                                    "snapshot", only=PRETRAINING)
    checkpoint_every: int = option(100, "checkpoint every this many steps (and at the end)", only=FINE_TUNING)
    keep: int = option(2, "checkpoints kept", only=FINE_TUNING)
    activation_checkpointing: Literal[False, True, "full", "selective", "offload"] = option(
        False, "keep each block's input alone and compute the block again in backward (true or full); selective "
               "also keeps attention's outputs; offload keeps the inputs in host memory, copied back for each "
               "block's backward (on a GPU; on a CPU, full); false keeps every activation. Same gradients, less "
               "memory. `linnet jax` recomputes whole layers whatever this says, unless --no-remat")
    mlp_tile: int | None = option(None, "positions of a row each block's MLP computes at a time, each tile computed "
                                        "again in backward: a long row's largest activations bounded by one tile "
                                        "(docs/long_context.md); null: the whole row", only=FINE_TUNING + PRETRAINING)
    shard: Literal["none", "zero", "fsdp"] = option(
        "none", "under torchrun: none (a whole copy a process), zero (optimizer state split across the processes), "
                "fsdp (weights, gradients and optimizer state split: fully_shard; with training.pipeline, each "
                "stage's blocks over the processes holding that stage; with training.split, each process's part "
                "over the processes holding that part in the other copies)", only=FINE_TUNING + PRETRAINING)
    split: int = option(1, "under torchrun (sft, dpo, reward, grpo, distill: full fine-tuning, LoRA or DoRA): "
                           "processes that split every block between them (tensor parallel) and take the same rows; "
                           "the processes form copies of such splits",
                        only=("sft", "dpo", "reward", "grpo", "distill"))
    sequence_parallel: bool = option(False, "with training.split: the blocks' norms and the residual stream split "
                                            "by positions too (sequence parallel: all-gather and reduce-scatter "
                                            "around each split projection in place of one all-reduce); "
                                            "training.context_length a multiple of training.split",
                                     only=("sft", "dpo", "reward", "grpo", "distill"))
    pipeline: int = option(1, "under torchrun (sft, dpo, reward, distill, grpo): stages that hold consecutive "
                              "blocks of one model and pass each step's micro-batches (sft, distill: "
                              "training.accumulation rows; dpo, reward: the step's packed pairs or answers; grpo, "
                              "on-policy distill: the packed completions) along on a 1F1B schedule (GPipe when there "
                              "are fewer rows than stages); with training.split each stage is split too (pipeline x "
                              "split processes a copy); the processes form copies of such pipelines, and with "
                              "training.shard=fsdp each stage's blocks are sharded over its copies",
                           only=("sft", "dpo", "reward", "distill", "grpo"))
    context: int = option(1, "under torchrun (sft, dpo, reward, grpo, distill): processes that split each packed "
                             "row's positions between them (context parallel: attention as a ring passing keys and "
                             "values) and take "
                             "the same rows; training.context_length a multiple of 2 x context; the processes form "
                             "copies of such groups (docs/long_context.md). `linnet jax`: that many of the local "
                             "devices split each row, the rest take rows of their own",
                          only=("sft", "dpo", "reward", "grpo", "distill"))
    expert: int = option(1, "under torchrun (sft, dpo, reward, distill): processes that split a mixture of "
                            "experts' experts between them (expert parallel), each taking rows (or, with "
                            "training.context, positions) of its own; a divisor of the run's processes, the groups "
                            "copies of each other (docs/moe.md)",
                         only=("sft", "dpo", "reward", "distill"))
    pipeline_schedule: Literal["1f1b", "interleaved", "zero-bubble"] = option(
        "1f1b", "with training.pipeline: 1f1b (each process one chunk of consecutive blocks), interleaved "
                "(interleaved 1F1B: two chunks a process, stage i of P holding chunks i and i + P of 2P, so the "
                "pipeline idles half as long at a step's start and end, for twice the hand-offs; needs at least "
                "2P layers) or zero-bubble (the interleaved chunks, each backward split into the input's gradient, "
                "passed on at once, and the weights', done in the idle turns; not with training.shard=fsdp); a "
                "step with fewer rows than stages runs every forward first",
        only=("sft", "dpo", "reward", "distill", "grpo"))

    @property
    def per_copy(self) -> int:
        """Processes that hold one copy of the model between them (a split, a pipeline, or
        a context-parallel group)."""
        return self.split * self.pipeline * self.context

    def __post_init__(self):
        check_finite(self, "training")
        _positive(**{"training.steps": self.steps, "training.context_length": self.context_length,
                     "training.micro_batch_size": self.micro_batch_size, "training.accumulation": self.accumulation,
                     "training.checkpoint_every": self.checkpoint_every, "training.split": self.split,
                     "training.pipeline": self.pipeline, "training.mlp_tile": self.mlp_tile,
                     "training.context": self.context, "training.expert": self.expert,
                     "training.keep": self.keep, "training.global_batch_tokens": self.global_batch_tokens})
        if self.context > 1 and self.context_length % (2 * self.context):
            raise ValueError(f"config: training.context_length={self.context_length} does not cut into "
                             f"{2 * self.context} equal chunks (2 x training.context); use a multiple of "
                             f"{2 * self.context}")
        if self.sequence_parallel and (self.split == 1 or self.context_length % (self.split * self.context)):
            raise ValueError(f"config: training.sequence_parallel=true splits the positions of a split model: set "
                             f"training.split to 2 or more, and training.context_length={self.context_length} to a "
                             f"multiple of it" + (" x training.context (each process's share of a row splits)"
                                                  if self.context > 1 else ""))
        if self.sequence_parallel and self.mlp_tile and self.mlp_tile % self.split:
            raise ValueError(f"config: training.sequence_parallel=true with training.mlp_tile={self.mlp_tile}: each of "
                             f"the split's processes takes an equal share of a tile; use a multiple of "
                             f"training.split={self.split}")
        if not (self.epochs > 0 and math.isfinite(self.epochs)):
            raise ValueError(f"config: training.epochs={self.epochs}; it must be a positive finite number")
        if self.targets_per_parameter <= 0 or (self.total_targets is not None and self.total_targets < 1):
            raise ValueError("config: training.targets_per_parameter must be > 0 and training.total_targets >= 1")


@dataclass
class OptimizerConfig:
    name: Literal["adamw", "adamw8bit", "paged_adamw8bit"] = option(
        "adamw", "AdamW (decoupled weight decay on matrices, none on norms, biases and DoRA magnitudes) with float32 "
                 "moments; adamw8bit: 8-bit moments (bitsandbytes, the qlora extra), 2 bytes a parameter instead of "
                 "8 (split across processes by training.shard=zero; whole beside whole adapters under fsdp; each "
                 "stage its own with training.pipeline); "
                 "paged_adamw8bit: those, paged to host memory under pressure (CUDA)")
    lr: float = option(2e-4, "peak learning rate")
    betas: list[float] = option([0.9, 0.999], "AdamW betas")
    eps: float = option(1e-8, "AdamW epsilon")
    weight_decay: float = option(0.0, "decoupled weight decay of the matrices (embedding and adapters included)")
    grad_clip: float | None = option(1.0, "global gradient-norm clip; null: no clipping (the norm is still logged, "
                                          "a non-finite norm still stops)")

    def __post_init__(self):
        check_finite(self, "optimizer")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"config: optimizer.lr={self.lr}; use a positive, finite learning rate")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"config: optimizer.betas={self.betas}; give two numbers in [0, 1), e.g. [0.9, 0.999]")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(f"config: optimizer.grad_clip={self.grad_clip}; use a positive threshold, or null to "
                             "disable clipping")
        check_ranges("optimizer", weight_decay=(self.weight_decay, self.weight_decay >= 0, ">= 0"),
                     eps=(self.eps, self.eps > 0, "> 0"))
        shrink = 1 - self.lr * self.weight_decay  # AdamW's decoupled decay multiplies the weights by this each step
        if shrink <= 0:
            raise ValueError(f"config: optimizer.weight_decay={self.weight_decay:g} with optimizer.lr={self.lr:g}: "
                             f"AdamW's decoupled decay multiplies the decayed weights by 1 - lr x weight_decay = "
                             f"{shrink:g} every step, which zeroes or flips them; use a weight decay well below "
                             f"1 / lr (usual: 0 to 0.1)")
        if self.weight_decay > WEIGHT_DECAY_WARNING:
            warnings.warn(f"config: optimizer.weight_decay={self.weight_decay:g} is far above the usual 0 to 0.1: "
                          f"AdamW's decoupled decay multiplies the decayed weights (adapters included) by 1 - lr x "
                          f"weight_decay = {shrink:.6g} every step, {shrink ** 1000:.3g} of their size after 1,000 "
                          "steps at the peak rate; did you mean a share such as 0.01?", UserWarning, stacklevel=2)


@dataclass
class LRScheduleConfig:
    name: Literal["cosine", "wsd", "constant"] = option("cosine", "cosine, wsd (warmup-stable-decay) or constant")
    warmup_steps: int = option(10, "linear warmup steps (updates)")
    min_lr_ratio: float = option(0.0, "final learning rate as a share of the peak (cosine, wsd)")
    decay_fraction: float = option(0.2, "wsd: share of the steps spent decaying")

    def __post_init__(self):
        check_finite(self, "lr_schedule")
        if self.warmup_steps < 0:
            raise ValueError(f"config: lr_schedule.warmup_steps={self.warmup_steps}; it must be >= 0")
        check_ranges("lr_schedule", min_lr_ratio=(self.min_lr_ratio, 0 <= self.min_lr_ratio <= 1, "in [0, 1]"),
                     decay_fraction=(self.decay_fraction, 0 < self.decay_fraction <= 1, "in (0, 1]"))


@dataclass
class EvaluationConfig:
    every: int = option(50, "held-out evaluation every this many steps (and at the end): loss; dpo: accuracy and "
                            "margin; grpo: reward, pass@1, pass@k", only=FINE_TUNING)
    general: str | None = option(None, "general-capability records (text, chats or prompt/completion) whose loss is "
                                       "measured beside the held-out set, as held_out_general_loss: forgetting",
                                 only=("sft", "dpo", "grpo", "ppo", "distill"))
    batch_size: int = option(128, "validation sequences per forward pass", only=PRETRAINING)
    subset_sequences: int = option(1024, "fixed validation subset (kept in memory) evaluated at every epoch end",
                                   only=PRETRAINING)
    full_validation: bool = option(True, "stream the whole validation split at the end of training",
                                   only=PRETRAINING)

    def __post_init__(self):
        check_finite(self, "evaluation")
        _positive(**{"evaluation.every": self.every, "evaluation.batch_size": self.batch_size})
        if self.subset_sequences < 0:
            raise ValueError(f"config: evaluation.subset_sequences={self.subset_sequences}; it must be >= 0")


@dataclass
class RuntimeConfig:
    seed: int = option(0, "seed of initialisation, shuffling, sampling and dropout")
    device: str | None = option(None, "cpu, cuda, cuda:1 …; null: cuda when present")
    output_dir: str = option("runs/run", "run directory")
    deterministic: bool = option(False, "torch.use_deterministic_algorithms (slower on CUDA)")
    threads: int | None = option(None, "torch CPU threads; null: torch's default")
    progress: bool = option(True, "show a progress bar")
    report_to: list[str] = option([], "experiment trackers that also receive every metrics row and the config: "
                                      "tensorboard, wandb, mlflow, trackio (each its own package)")

    def __post_init__(self):
        check_finite(self, "runtime")
        _positive(**{"runtime.threads": self.threads})
        unknown = [name for name in self.report_to if name not in ("tensorboard", "wandb", "mlflow", "trackio")]
        if unknown:
            raise ValueError(f"config: runtime.report_to names {unknown[0]!r}; use any of tensorboard, wandb, mlflow, "
                             "trackio (or [] for none)")


@dataclass
class DPOSettings(Rewards, Sampling):
    """The `dpo` group. With `online`, each step samples its own pairs (the sampling and
    reward fields, GRPO's names, are read only then; linnet.train.online_dpo)."""

    YAML: ClassVar[str] = "dpo"  # the group's name in a config

    beta: float = option(0.1, "strength of the implicit KL constraint: rewards are beta * log(pi / ref)")
    label_smoothing: float = option(0.0, "share of pairs taken as labelled the wrong way round (cDPO; sigmoid, "
                                         "robust, simpo)")
    loss_type: Literal["sigmoid", "robust", "hinge", "ipo", "simpo", "orpo", "kto"] = option(
        "sigmoid", "sigmoid (DPO), robust (label-noise-robust DPO), hinge, ipo, the reference-free simpo and orpo "
                   "(no reference computed), kto (unpaired records: prompt, completion, label)")
    simpo_gamma: float = option(0.5, "simpo: the target reward margin gamma (beta x the margin in log-probability)")
    rpo_alpha: float = option(0.0, "weight of the chosen answers' NLL (a mean over their tokens) added to the pair "
                                   "loss (RPO); not with orpo, which adds it at weight 1, or kto")
    desirable_weight: float = option(1.0, "kto: weight of the desirable answers' losses")
    undesirable_weight: float = option(1.0, "kto: weight of the undesirable answers' losses")
    pairs_per_step: int = option(32, "pairs per optimizer step")
    reference_cache: str | None = option(None, "directory caching reference log-probs across runs")
    online: bool = option(False, "sample the pairs each step: `samples` completions of each of pairs_per_step "
                                 "prompts (data: prompt records, as grpo's), the best-rewarded over the worst")
    samples: int = option(2, "online: completions sampled per prompt (>= 2)")

    def __post_init__(self):
        super().__post_init__()
        check_one_of(self, "loss_type")
        if self.online:
            self._check_online()
        else:
            read = [f.name for f in dataclasses.fields(Rewards) + dataclasses.fields(Sampling) + (
                DPOSettings.__dataclass_fields__["samples"],) if getattr(self, f.name) != field_default(f)]
            if read:
                raise ValueError(f"config: dpo.{read[0]}={getattr(self, read[0])!r} is read with dpo.online: true "
                                 "only (it samples the pairs); remove it, or set dpo.online: true")
        check_ranges("dpo", beta=(self.beta, self.beta > 0, "> 0"),
                     label_smoothing=(self.label_smoothing, 0 <= self.label_smoothing < 0.5, "in [0, 0.5)"),
                     pairs_per_step=(self.pairs_per_step, self.pairs_per_step >= 1, ">= 1"))
        if not 0 <= self.rpo_alpha < float("inf") or (self.rpo_alpha and self.loss_type in ("orpo", "kto")):
            raise ValueError(f"config: dpo.rpo_alpha={self.rpo_alpha}; use a finite weight >= 0, and 0 with "
                             "dpo.loss_type orpo (which adds the chosen answers' NLL itself) or kto")
        check_ranges("dpo", desirable_weight=(self.desirable_weight, self.desirable_weight >= 0, ">= 0"),
                     undesirable_weight=(self.undesirable_weight, self.undesirable_weight >= 0, ">= 0"))
        if self.loss_type in ("simpo", "orpo", "kto") and self.reference_cache is not None:
            raise ValueError(f"config: dpo.reference_cache is not used with dpo.loss_type={self.loss_type}; remove it")
        for name, readers in IGNORED_BY_LOSS.items():
            value = getattr(self, name)
            if value != DPOSettings.__dataclass_fields__[name].default and self.loss_type not in readers:
                losses = ", ".join(readers[:-1]) + " or " + readers[-1] if len(readers) > 1 else readers[0]
                raise ValueError(f"config: dpo.{name}={value} is read by dpo.loss_type {losses} only, "
                                 f"and dpo.loss_type={self.loss_type} would ignore it; remove it, or choose one of "
                                 "those losses")

    def _check_online(self) -> None:
        if self.samples < 2:
            raise ValueError(f"config: dpo.samples={self.samples}; online DPO pairs the best of a prompt's completions "
                             "with the worst: use 2 or more")
        if self.loss_type == "kto" or self.reference_cache is not None:
            raise ValueError("config: dpo.online: true with " + ("dpo.loss_type=kto (unpaired answers)" if
                             self.loss_type == "kto" else "dpo.reference_cache (each step's pairs are new)")
                             + " is not supported; remove it")
        if self.temperature == 0:
            raise ValueError("config: dpo.temperature=0 samples greedily: a prompt's completions are all the same and "
                             "make no pair; use a temperature > 0 (1.0 samples the policy as it is)")


# How the pair losses read the answers (linnet.train.preference_loss and its JAX twin,
# linnet.jax.preference_loss): the reference-free ones take no reference log-probabilities;
# the per-token ones score each answer by its mean log-probability a token.
REFERENCE_FREE = frozenset({"simpo", "orpo"})
PER_TOKEN = frozenset({"ipo", "simpo", "orpo"})


def pair_scores(loss_type: str, chosen, rejected, ref_chosen=None, ref_rejected=None, chosen_tokens=None,
                rejected_tokens=None):
    """(chosen score, rejected score) a pair loss compares, for arrays of either backend:
    the summed log-probabilities less the reference's, a token's mean for PER_TOKEN
    losses, the policy's alone for REFERENCE_FREE ones; each missing input refused."""
    free = loss_type in REFERENCE_FREE
    if free != (ref_chosen is None):
        raise ValueError(f"loss_type={loss_type!r} " + ("takes no reference log-probabilities" if free
                                                         else "needs the reference's log-probabilities"))
    if loss_type in PER_TOKEN:
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError(f"loss_type={loss_type!r} compares per-token means: pass chosen_tokens and rejected_tokens")
        chosen, rejected = chosen / chosen_tokens, rejected / rejected_tokens
        if not free:
            ref_chosen, ref_rejected = ref_chosen / chosen_tokens, ref_rejected / rejected_tokens
    return (chosen, rejected) if free else (chosen - ref_chosen, rejected - ref_rejected)

# The dpo fields only some losses read (linnet.train.preference_loss): a value other than
# the default with another loss would be ignored, so it is refused.
IGNORED_BY_LOSS = {
    "label_smoothing": ("sigmoid", "robust", "simpo"),
    "simpo_gamma": ("simpo",),
    "desirable_weight": ("kto",),
    "undesirable_weight": ("kto",),
}


@dataclass
class RewardSettings:
    YAML: ClassVar[str] = "reward"  # the group's name in a config

    pairs_per_step: int = option(32, "pairs per optimizer step")
    margin: float = option(0.0, "Bradley-Terry with a margin: -log sigmoid(r_chosen - r_rejected - margin)")

    def __post_init__(self):
        check_finite(self, "reward")
        _positive(**{"reward.pairs_per_step": self.pairs_per_step})


@dataclass
class DistillSettings:
    YAML: ClassVar[str] = "distill"  # the group's name in a config

    teacher: str = option("", "the teacher: a registered card or a model directory (logit and on_policy: with the "
                              "student's tokenizer; sequence: any, its answers pass as text)")
    mode: Literal["logit", "sequence", "on_policy"] = option(
        "logit", "logit: the teacher's distributions on the records' completions; sequence: SFT on the teacher's "
                 "completions of the records' prompts; on_policy: the student completes the prompts each step and "
                 "learns the teacher's distributions on them")
    divergence: Literal["forward_kl", "reverse_kl", "jsd"] = option(
        "forward_kl", "forward_kl (mass-covering), reverse_kl (mode-seeking), jsd (generalized, weight beta)")
    beta: float = option(0.5, "jsd: the teacher's weight in the mixture (0: forward KL, 1: reverse KL)")
    temperature: float = option(1.0, "softens both distributions: logits / temperature")
    max_new_tokens: int = option(256, "sequence, on_policy: the longest completion sampled")
    sample_temperature: float = option(1.0, "on_policy: the student's sampling temperature (sequence: the "
                                            "teacher's is 0, greedy)")
    prompts_per_step: int = option(8, "on_policy: prompts completed each step")
    on_policy_share: float = option(1.0, "on_policy: the share of steps that sample the student; the others learn "
                                         "on the records' answers (GKD's lambda, TRL's lmbda)")
    teacher_batch: int = option(64, "sequence: prompts the teacher answers at once (its KV cache holds this many)")

    def __post_init__(self):
        check_finite(self, "distill")
        check_ranges("distill", beta=(self.beta, 0 <= self.beta <= 1, "in [0, 1]"),
                     temperature=(self.temperature, self.temperature > 0, "> 0"),
                     sample_temperature=(self.sample_temperature, self.sample_temperature >= 0, ">= 0"))
        if not 0 <= self.on_policy_share <= 1:
            raise ValueError(f"config: distill.on_policy_share={self.on_policy_share}; give a share in [0, 1]")
        if self.on_policy_share != 1 and self.mode != "on_policy":
            raise ValueError(f"config: distill.on_policy_share={self.on_policy_share} mixes on-policy steps with the "
                             f"records' answers; it needs distill.mode=on_policy (it is {self.mode})")
        _positive(**{"distill.max_new_tokens": self.max_new_tokens, "distill.prompts_per_step": self.prompts_per_step,
                     "distill.teacher_batch": self.teacher_batch})


@dataclass
class AdaptiveConsensusConfig:
    start_frac: float | None = option(None, "share of the run's updates after which mixing weakens (required)")
    p: float | None = option(None, "gamma = (lr / lr_max)^p once active; 0 keeps full mixing (required)")

    def __post_init__(self):
        check_finite(self, "decentralized.adaptive_consensus")
        if self.start_frac is None or self.p is None:
            raise ValueError("config: decentralized.adaptive_consensus needs both start_frac and p")
        check_consensus(self.start_frac, self.p)


def check_consensus(start_frac: float, p: float) -> None:
    """Adaptive consensus's settings: start_frac finite in [0, 1], p finite and >= 0."""
    if not (math.isfinite(start_frac) and 0 <= start_frac <= 1):
        raise ValueError(f"config: decentralized.adaptive_consensus.start_frac={start_frac}; use a finite number "
                         "in [0, 1]")
    if not (math.isfinite(p) and p >= 0):
        raise ValueError(f"config: decentralized.adaptive_consensus.p={p}; use a finite number >= 0")


@dataclass
class DecentralizedConfig:
    num_models: int = option(4, "workers trained together on one device (PackedLlama), each its own model")
    topology: Literal["complete", "one_peer_ring", "one_peer_exponential"] = option(
        "complete", "how workers mix their parameters every update: complete (global average), one_peer_ring "
                    "(half a neighbour, left and right in turn), one_peer_exponential (half the worker 2^k back)")
    scheme: Literal["awc", "atc"] = option("awc", "awc: mix, then each worker's AdamW update; atc: AdamW update "
                                                  "(weight decay included), then mix")
    adaptive_consensus: AdaptiveConsensusConfig | None = option(
        None, "weaken mixing late in training: {start_frac, p}; null: full mixing throughout")

    def __post_init__(self):
        check_finite(self, "decentralized")
        _positive(**{"decentralized.num_models": self.num_models})
