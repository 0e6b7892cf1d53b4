"""GRPO for the JAX decoder, as `linnet.train.grpo.grpo` does it in PyTorch and with the
same options:

    engine = Engine(nest.load(card, backend="jax"))
    params, history = grpo(policy, engine, [Prompt(ids, answer) for ...], reward,
                           optimizer=optax.adamw(1e-6), steps=200, group=8, prompts_per_step=8)

Each step: the engine takes the policy's current parameters (adapters merged) and samples
`group` completions of each prompt (with dynamic_sampling, more rounds until the step
holds prompts_per_step groups whose rewards differ: `rollouts.Sampler`, PyTorch's own);
rewards give each completion its advantage (its reward less its group's mean, over the
group's std unless dr_grpo; or rloo's leave-one-out baseline); the completions are
packed with each prompt once (`Packed.prefix`) and the policy takes `iterations` clipped
policy-gradient steps on them, one compiled step each (completions whose advantage is 0
skip it when beta = 0, counted in the normaliser all the same: `rollouts.to_train`). The
objective's terms are those of `linnet.train.grpo_loss`, in JAX.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from linnet.config.sampling import GRPOOptions
from linnet.jax.engine import Engine
from linnet.jax.loop import State, Update, apply_gradients, fit, place_rows
from linnet.jax.lora import Params, dropout_keys
from linnet.jax.model import JaxModel, row_arrays, rows_log_probs
from linnet.jax.sharding import check_mesh, context_rows, in_force
from linnet.packing import pack_prompted
from linnet.rl.rollouts import (
    Prompt,
    Reward,
    Sampler,
    check_prompts,
    counted,
    prompt_groups,
    reward_functions,
    step_metrics,
    to_train,
)
from linnet.run import History, Run, run_and_options


def _rollout(samples, advantages: np.ndarray, trained: np.ndarray, prompts, tokens: int, per_sequence: bool):
    """The samples that train (`rollouts.to_train`) packed into rows [R, P] (each prompt
    once), with per-position advantage, engine log-probability, token weight (1, or
    1/length for per-sequence averaging: sequence_mean, GSPO) and completion index; None
    when none trains."""
    kept = [(i, s) for i, s in enumerate(samples) if trained[i]]
    if not kept:
        return None
    rows = list(pack_prompted(prompt_groups([s for _, s in kept], prompts, tokens, True), tokens))
    arrays = [row_arrays(row) for row in rows]
    extra = {name: np.zeros((len(rows), tokens), np.float32) for name in ("advantage", "engine", "token_weight")}
    extra["sequence"] = np.zeros((len(rows), tokens), np.int32)
    it = iter(kept)
    for r, row in enumerate(rows):
        learned = np.flatnonzero(np.asarray(row.weights) > 0)  # the completions' tokens, in order
        at = 0
        for _ in range(row.examples):
            i, s = next(it)
            where = learned[at: at + len(s.tokens)]
            extra["advantage"][r, where] = advantages[i]
            extra["engine"][r, where] = np.asarray(s.logprobs)
            extra["token_weight"][r, where] = 1.0 / len(s.tokens) if per_sequence else 1.0
            extra["sequence"][r, where] = i
            at += len(s.tokens)
    return {k: np.stack([a[k] for a in arrays]) for k in arrays[0]} | extra, sum(row.real for row in rows)


@functools.lru_cache(maxsize=8)
def _make_step(card, dtype, lora_scale: float, optimizer, norm_clip, clip: tuple[float, float], beta: float,
               correction_cap, sequence_level: bool, sequences: int, remat: bool, lora_dropout: float):
    low, high = 1.0 - clip[0], 1.0 + clip[1]

    def loss_fn(trained, frozen, rows, old, ref, normaliser):
        logp = rows_log_probs({**frozen, **trained}, card, rows, dtype, lora_scale, remat, lora_dropout)
        mask = rows["weights"] > 0
        log_ratio = jnp.where(mask, logp - old, 0.0)
        if sequence_level:  # GSPO: the completion's mean log ratio on each of its tokens
            seq = rows["sequence"]
            sums = jax.ops.segment_sum(log_ratio.reshape(-1), seq.reshape(-1), num_segments=sequences)
            counts = jax.ops.segment_sum(mask.reshape(-1).astype(jnp.float32), seq.reshape(-1),
                                         num_segments=sequences)
            log_ratio = (sums / jnp.maximum(counts, 1.0))[seq]
        ratio = jnp.exp(log_ratio)
        a = rows["advantage"]
        unclipped, clipped = ratio * a, jnp.clip(ratio, low, high) * a
        weight = rows["token_weight"]
        if correction_cap is not None:
            weight = weight * jnp.minimum(jnp.exp(old - rows["engine"]), correction_cap)
        per_token = -jnp.minimum(unclipped, clipped) * weight
        kl = jnp.zeros_like(per_token)
        if beta:
            r = ref - logp
            kl = jnp.exp(r) - r - 1
            per_token = per_token + beta * kl
        total = jnp.sum(jnp.where(mask, per_token, 0.0))
        return total / normaliser, (total, jnp.sum(mask & (clipped < unclipped)), jnp.sum(jnp.where(mask, kl, 0.0)))

    def step(trained, frozen, opt_state, rows, old, ref, normaliser):
        (_, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(trained, frozen, rows, old, ref, normaliser)
        trained, opt_state, norm = apply_gradients(grads, trained, opt_state, optimizer, norm_clip)
        return trained, opt_state, norm, stats

    return jax.jit(step, donate_argnums=(0, 2))


def grpo(policy: JaxModel, engine: Engine, prompts: Iterable[Prompt], reward: Reward | Mapping[str, Reward],
         run: Run | None = None, *, settings: GRPOOptions | None = None, reference: Params | None = None,
         stop: Iterable[int] | None = None, tokens: int = 4096, seed: int = 0, trainable=None, mesh=None,
         remat: bool = False, **options) -> tuple[Params, History]:
    """Train `policy` with GRPO for `run.steps` steps (see the module docstring); returns
    (parameters, history). `run`: a linnet.run.Run, or its fields as keywords (the
    gradient-norm clip is the Run's; grpo's `clip` is the ratio's; a schedule goes in the
    optax optimizer: Run.schedule is PyTorch's). options: the fields of
    linnet.config.GRPOOptions (or `settings=`), as linnet.train.grpo.grpo takes them:
    advantage ("group", or "rloo": the leave-one-out baseline), sequence_mean (each
    completion's token losses averaged over its own length, then over completions),
    dynamic_sampling (DAPO's: up to this many extra sampling rounds a step, seeded by the
    step, until it holds prompts_per_step groups whose rewards differ; needs a sequence of
    prompts; linnet.rl.rollouts.Sampler, PyTorch's own) among them. `reference`
    (parameters, path -> array) is needed for beta > 0.
    Each Step's metrics hold the mean reward (and each function's, when several), the
    share of uniform groups, completion length, stop share, clip fraction, KL and the
    engine/policy log-probability mismatch. `mesh` and `remat` work as for
    `linnet.jax.train.train` (a step's rows split over the devices, filled out with rows
    that learn nothing); the engine samples on its own. Adapters with dropout draw new masks
    each iteration from (seed, step, iteration, row), the first iteration's also for the
    `old` log-probabilities."""
    run, s = run_and_options("grpo", run, options, GRPOOptions, settings)
    mesh = check_mesh(mesh)
    if s.beta and reference is None:
        raise ValueError("grpo: beta > 0 needs reference=, the parameters of a frozen copy of the model")
    if s.dynamic_sampling and not isinstance(prompts, Sequence):
        raise ValueError("grpo: dynamic_sampling draws prompts again: pass the prompts as a sequence")
    if s.max_staleness or s.correction != "token" or s.environment or s.tools:
        raise ValueError("grpo: the JAX trainer samples each step from the current weights, one turn a "
                         "completion, with token-level corrections; max_staleness > 0, correction='sequence' and "
                         "multi-turn environments or tools are linnet.train.grpo.grpo's")
    max_new_tokens, iterations, beta, dr_grpo = s.max_new_tokens, s.iterations, s.beta, s.dr_grpo
    sequence_level = s.sequence_level
    per_sequence = s.sequence_level or s.sequence_mean  # each completion's tokens weigh 1/its length
    if isinstance(prompts, Sequence):
        check_prompts(enumerate(prompts), tokens, max_new_tokens)
    sampler = Sampler(engine, reward_functions(reward), s, stop, seed, prompts if isinstance(prompts, Sequence) else ())
    card, dtype, lora_scale = policy.card, policy.dtype, policy.lora_scale
    rate = policy.lora_dropout
    forward = jax.jit(rows_log_probs, static_argnums=(1, 3, 4, 5, 6))

    def step(number: int, chunk: list, state: State) -> Update:
        check_prompts(chunk, tokens, max_new_tokens)
        engine.load_weights(policy, state.params)
        chunk, scored, rounds = sampler(chunk, number)
        trained = to_train(scored, beta)
        rollout = _rollout(scored.samples, scored.advantages, trained, [p for _, p in chunk], tokens, per_sequence)
        sequences, n_tokens = counted(scored)
        loss = norm = clipped = kl = mismatch = checked = 0.0
        real = 0
        if rollout is not None:
            host, real = rollout
            host = context_rows(host, mesh)  # over a "context" axis: laid out for the ring (sums are by token)
            normaliser = sequences if per_sequence else sequences * max_new_tokens if dr_grpo else n_tokens
            def placed(iteration: int):  # each iteration new dropout masks, the first's also `old`'s (as PyTorch's)
                keys = {"lora_key": dropout_keys(seed, number, len(host["weights"]), iteration)} if rate else {}
                return place_rows({**host, **keys}, mesh)

            rows = placed(0)
            with in_force(mesh):
                old = forward(state.params, card, rows, dtype, lora_scale, False, rate)
                ref = forward(reference, card, rows, dtype, 0.0, False, 0.0) if beta else jnp.zeros_like(old)
            learned = np.asarray(rows["weights"]) > 0
            mismatch = float(np.abs(np.asarray(old) - np.asarray(rows["engine"]))[learned].sum())
            checked = float(learned.sum())
            compiled = _make_step(card, dtype, lora_scale, run.optimizer, run.clip, tuple(s.clip), beta,
                                  s.correction_cap, sequence_level, len(scored.samples), remat, rate)
            for iteration in range(iterations):
                with in_force(mesh):
                    state.trained, state.opt_state, norm, (loss_sum, clipped, kl) = compiled(
                        state.trained, state.frozen, state.opt_state, rows if iteration == 0 or not rate
                        else placed(iteration), old, ref, jnp.float32(max(normaliser, 1.0)))
            loss = float(loss_sum) / max(normaliser, 1.0)
        metrics = step_metrics(scored, trained, tokens=n_tokens, checked=checked, clipped=float(clipped),
                               kl=float(kl), mismatch=mismatch)
        if s.dynamic_sampling:
            metrics.update(groups=float(len(chunk)), sampling_rounds=float(rounds))
        return Update(loss, norm, n_tokens, real, metrics)

    stream = itertools.cycle(enumerate(prompts)) if isinstance(prompts, Sequence) else enumerate(prompts)
    return fit(policy, stream, step, run, per_step=s.prompts_per_step, trainable=trainable, mesh=mesh,
               what="grpo: the prompts")
