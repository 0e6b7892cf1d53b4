"""A pretraining config's recipe: its model card, its budget, and its identity.

    config = load(PretrainConfig, "configs/pretrain-tiny-cpu.yaml", ["training.epochs=4"])
    fields = recipe_fields(config, cache.fingerprint)    # flat {"optimizer.lr": 0.001, ...}
    identity = recipe_identity(fields)                   # 16 hex digits

The recipe identity is a hash of every field that decides the trained weights, plus the
token cache's fingerprint (its shard checksums) in place of the corpus and preparation
fields that produced it. Where a run happens and what it keeps does not enter it: the
device, output directory, background prefetch, tokenizer worker count and checkpoint
retention may all change between a run and its resumption.

Only `linnet.config`, the cards and the standard library are imported here: spawned
tokenizer workers may import this module and must stay light (no torch).
"""

from __future__ import annotations

from typing import Any

from linnet.config import PretrainConfig, to_dict
from linnet.config.fields import flatten

LOADER_VERSION = 2


def model_card(config: PretrainConfig, vocab_size: int, eos_id: int, tokenizer: str | None = None):
    """A Llama card with tied embeddings for the config's model group and a tokenizer of
    `vocab_size` tokens whose `eos_id` ends each document."""
    m = config.model
    vocab = m.vocab or vocab_size
    if vocab < vocab_size:
        raise ValueError(f"config: model.vocab={m.vocab} is smaller than the tokenizer's {vocab_size} tokens; use "
                         "null (the tokenizer's size) or a larger vocabulary")
    return group_card(m, vocab, context=config.training.context_length, eos_id=eos_id, tokenizer=tokenizer)


def group_card(m, vocab: int | None = None, *, context: int = 2048, eos_id: int | None = None,
               tokenizer: str | None = None):
    """The pretraining Llama (tied embeddings, no biases) a config's `model` group
    describes, with `vocab` rows (default the group's own `model.vocab`)."""
    from linnet.cards import Card, Location

    vocab = vocab or m.vocab
    if vocab is None:
        raise ValueError("config: model.vocab is null (the token cache's tokenizer sets it); give model.vocab, or "
                         "build the card with linnet.pretrain.recipe.model_card(config, vocab_size, eos_id)")
    return Card(
        "pretrain", "llama", vocab, m.hidden, m.intermediate, m.layers, m.heads, m.kv_heads or m.heads,
        m.head_dim or m.hidden // m.heads, rope_base=m.rope_base, norm_eps=m.norm_eps, tied_embeddings=True,
        max_positions=context, eos_token_ids=() if eos_id is None else (eos_id,), pad_token_id=eos_id,
        dtype=m.dtype if m.dtype not in (None, "auto") else "bfloat16", tokenizer=Location(path=tokenizer),
        source="linnet pretrain",
    )


def make_budget(config: PretrainConfig, parameters: int):
    """The training budget (`linnet.pretrain.budget`) of a model of `parameters` unique
    trainable parameters under this config."""
    from linnet.config.commands import global_batch_sequences
    from linnet.pretrain.budget import plan_budget

    t = config.training
    return plan_budget(parameters, context=t.context_length, sequences_per_update=global_batch_sequences(config),
                       targets_per_parameter=t.targets_per_parameter, total_targets=t.total_targets, epochs=t.epochs)


def to_yaml(config: PretrainConfig) -> str:
    import yaml

    return yaml.safe_dump(to_dict(config), sort_keys=False)


# ---------------------------------------------------------------------------------------
# Recipe identity

# Fields that never change the trained weights: where the run happens and what it keeps.
RUN_FIELDS = frozenset({
    "runtime.device", "runtime.output_dir", "runtime.threads", "runtime.progress", "runtime.report_to",
    "data.prefetch", "data.prepare_workers", "data.prepare_batch_documents",
    "training.checkpoint_policy", "training.checkpoint_epochs", "training.save_epoch_training_state",
    "evaluation.batch_size", "training.activation_checkpointing", "training.mlp_tile", "model.activation_memory_budget",
    "training.shard",
})

# Fields that only decide the cache's contents: the cache fingerprint stands for them,
# so a cache may move and be named by another path.
CACHE_FIELDS = frozenset({
    "data.cache", "data.source", "data.mixture", "data.validation_source", "data.validation_every", "data.dataset",
    "data.dataset_config", "data.dataset_split", "data.dataset_validation_split", "data.text_field",
    "data.document_split", "data.train_tokens", "data.tokenizer", "data.vocab_size", "data.eos_token",
    "data.shuffle_buffer", "data.shuffle_seed", "data.shard_tokens",
})


def recipe_fields(config: PretrainConfig, data_fingerprint: str) -> dict[str, Any]:
    """The flat fields that decide the result, with the cache fingerprint and the loader
    version (which fixes the sample order)."""
    # An optional group left out (None) does not enter the identity, so adding one to the
    # schema later keeps every earlier run's identity.
    flat = flatten({k: v for k, v in to_dict(config).items() if v is not None})
    fields = {k: v for k, v in flat.items() if k not in RUN_FIELDS and k not in CACHE_FIELDS}
    fields["data.fingerprint"] = data_fingerprint
    fields["data.loader_version"] = LOADER_VERSION
    return dict(sorted(fields.items()))
