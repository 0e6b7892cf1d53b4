"""`linnet jax`: the `linnet sft` run (the same YAML config, data, run directory and
reports) trained by the JAX backend.

    linnet jax --config run.yaml                   # one device
    linnet jax --config run.yaml --fully-shard     # every local device, parameters split
    linnet jax --config run.yaml --no-remat        # layers kept for backward: faster, more memory
    linnet jax --config run.yaml --set training.context=4   # each row's positions over 4 devices (a ring)

Each layer is recomputed in backward by default (a jax.checkpoint per layer, as the
specification's JAX runs do): a step keeps each layer's input alone, for about a third
more compute. `--no-remat` keeps every layer's values instead; `--remat` is accepted and
changes nothing. `training.context: C` takes every local device, C of them splitting each
row's positions (context parallel: linnet.jax.sharding), the parameters fully sharded over
the rest.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from linnet.commands import runs
from linnet.commands.sft import epochs_of_rows, read_inputs
from linnet.config import SFTConfig


def optax_adamw(config: SFTConfig, steps: int):
    """AdamW with the config's schedule (the factors PyTorch runs take, tabled per step)
    and weight decay on matrices alone (as linnet.train.optimizer.adamw), its rate exposed
    for the reports (optax.inject_hyperparams)."""
    import jax
    import jax.numpy as jnp
    import optax

    o = config.optimizer
    factor = runs.steps_factor(config, steps)
    table = jnp.asarray([o.lr * factor(step) for step in range(steps + 1)], jnp.float32)
    return optax.inject_hyperparams(optax.adamw, static_args=("mask",))(
        learning_rate=lambda count: table[jnp.minimum(count, steps)], b1=o.betas[0], b2=o.betas[1], eps=o.eps,
        weight_decay=o.weight_decay, mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params))


def run(config: SFTConfig, *, overwrite: bool = False, resume: bool = False,
        resume_from: str | None = None, fully_shard: bool = False,
        remat: bool = True) -> dict:
    """Fine-tune as `config` says with the JAX backend; returns the summary. remat=False
    keeps each layer's values for backward rather than recomputing them."""
    m, lora, t, rt = config.model, config.lora, config.training, config.runtime
    for name, value, default in (("runtime.device", rt.device, None), ("model.compile", m.compile, False),
                                 ("model.attention", m.attention, "auto"),
                                 ("training.shard", t.shard, "none"), ("training.split", t.split, 1),
                                 ("training.pipeline", t.pipeline, 1), ("training.mlp_tile", t.mlp_tile, None),
                                 ("model.quantize", m.quantize, None)):
        if value != default:
            raise ValueError(f"config: {name}={value!r} is for the PyTorch backend; `linnet jax` places arrays "
                             "itself, compiles every step, attends with one masked path, has no 4-bit base, and "
                             "shards with --fully-shard")
    if t.activation_checkpointing in ("selective", "offload"):
        raise ValueError(f"config: training.activation_checkpointing={t.activation_checkpointing!r} is the PyTorch "
                         "backend's; `linnet jax` recomputes whole layers (its default): drop the field")
    if t.activation_checkpointing and not remat:
        raise ValueError("config: training.activation_checkpointing=true asks `linnet jax` to recompute layers and "
                         "--no-remat asks it not to: drop one")
    # training.context here splits rows over this process's devices, not over torchrun's processes, which
    # the run directory and the data shares count: for them the run is one process taking every row
    context, config = t.context, dataclasses.replace(config, training=dataclasses.replace(t, context=1))
    inputs = read_inputs(config)
    if inputs.card.experts is not None:
        raise ValueError(f"config: model.card {m.card!r} is a mixture-of-experts model; the JAX backend (`linnet "
                         "jax`) has no mixture-of-experts models yet: use the PyTorch commands (`linnet sft`)")
    if context > 1:  # checked before the run directory is made (this starts JAX)
        import jax

        if len(jax.devices()) % context:
            raise ValueError(f"config: training.context={context} splits each row over that many of the "
                             f"{len(jax.devices())} local devices; use a divisor of {len(jax.devices())}")
    job = runs.start(config, inputs.steps, overwrite=overwrite, resume=resume, resume_from=resume_from,
                     label="jax sft")
    if job.complete is not None:
        return job.complete
    import jax  # after every check: a refused config starts no JAX (its threads make forking unsafe)
    from jax.sharding import Mesh

    from linnet.jax import load_model
    from linnet.jax.train import train
    from linnet.packing import pack

    model = load_model(inputs.card, weights=m.weights, dtype=m.dtype, seed=rt.seed)
    if lora.enabled:
        model.add_lora(lora.targets, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, rslora=lora.rslora,
                       dora=lora.dora, seed=rt.seed)
    eval_rows = list(pack(inputs.eval_examples, t.context_length, pad_id=inputs.tokenizer.pad_id)) \
        if inputs.eval_examples else []  # data.eval_share: 0 holds nothing out

    def held_out(params) -> dict:
        sums = np.array([[float(x) for x in model.loss_packed(row, params)] for row in eval_rows])
        return {"held_out_loss": float(sums[:, 0].sum() / max(sums[:, 1].sum(), 1.0))}

    devices = np.array(jax.devices())
    if context > 1:  # every local device: `context` of them each row's positions, the rest "data"
        mesh = Mesh(devices.reshape(-1, context), ("data", "context"))
    else:
        mesh = Mesh(devices, ("data",)) if fully_shard else None
    with job.open(evaluate=held_out if eval_rows else None, optimizer=optax_adamw(config, inputs.steps)) as run:
        _, history = train(model, epochs_of_rows(inputs), run, accumulate=t.accumulation, mesh=mesh, remat=remat,
                           seed=rt.seed)
    return job.summarize(history, card=inputs.card.name, backend="jax")


def main(argv: list[str] | None = None) -> int:
    args, config = runs.parse_command(argv, "linnet jax", "The `linnet sft` run, trained by the JAX backend.", SFTConfig,
                                 training=True, flags=[
                                     ("--fully-shard", "data-parallel over every local device, parameters, "
                                                       "gradients and optimizer state split across them"),
                                     ("--no-remat", "keep each layer's values for backward rather than computing "
                                                    "the layer again (the default): faster, more memory"),
                                     ("--remat", "recompute each layer in backward: the default, kept as a spelling")])
    if config is not None and args.remat and args.no_remat:
        raise ValueError("--remat and --no-remat contradict each other; give one (recomputing is the default)")
    return 0 if config is None else runs.execute(run, args, config, fully_shard=args.fully_shard,
                                                 remat=not args.no_remat)
