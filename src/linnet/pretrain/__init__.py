"""Pretraining: typed configs, token caches, a buffered loader, budgets, and the run.

    linnet prepare --config configs/pretrain-tiny-cpu.yaml     # corpus -> token cache
    linnet pretrain --config configs/pretrain-tiny-cpu.yaml    # cache -> trained model

Modules: `config` (PretrainConfig, recipe identity), `cache` (the on-disk format),
`prepare` (`linnet prepare`: settings, reuse checks, the atomic publish), `tokenize`
(the tokenizer and its worker processes), `shards` (the shard writers), `loader` (shard
groups, cursor), `budget` (targets, steps, virtual epochs), `runner` (the training
loop, checkpoints, resume). The corpus documents come from `linnet.data.corpus`.
Nothing here imports torch until a model is built.
"""
