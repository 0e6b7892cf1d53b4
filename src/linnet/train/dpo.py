"""Direct preference optimization (DPO, Rafailov et al. 2023, arXiv:2305.18290) and its
relatives over the same pairs (`loss_type`: sigmoid, robust, hinge, ipo, and the
reference-free simpo and orpo; linnet.train.preference_loss has the formulas), with an
optional NLL term on the chosen answers (`rpo_alpha`).

    history = dpo(model, [Pair(prompt, chosen, rejected), ...], optimizer=opt, steps=100,
                  pairs_per_step=32, beta=0.1, loss_type="sigmoid")

The KL-constrained reward-maximising policy satisfies r(x, y) = beta * log pi(y|x) /
pi_ref(y|x) + const, and under a Bradley-Terry preference model the constant cancels
between two answers to the same prompt. So the preference likelihood depends on the
policy alone: loss = -log sigmoid(beta * ((c - ref_c) - (r - ref_r))), with c, r the
summed log-probabilities of the chosen and rejected answers.

A pair's two answers are consecutive documents of one packed row; `log_probs_packed`
gives every position's log-probability and a segment sum gives each answer's.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from collections.abc import Iterable, Sequence
from contextlib import nullcontext

import numpy as np
import torch

from linnet.config.groups import DPOSettings
from linnet.files import reference_cache as cache
from linnet.packing import Pair, check_pairs, pack_prompted, segments
from linnet.report.progress import phase
from linnet.run import History, Run, run_and_options
from linnet.torch.distributed import idle_passes, most_across, passes_short, sum_across
from linnet.torch.sharding import full, is_sharded
from linnet.train.loop import Work, copies_of, fit, head_loss, head_values, trained_parameters
from linnet.train.preference_loss import PER_TOKEN, REFERENCE_FREE, pair_losses

# Step metrics under TRL's names, so dashboards built for TRL read linnet runs
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")
STATS = ("chosen", "rejected", "margin", "correct", "logp_chosen", "logp_rejected")  # summed over pairs, as METRICS


def answer_log_probs(model, row) -> torch.Tensor:
    """[answers] summed log-probability of each answer's learned tokens, in row order
    (documents without learned tokens, a shared prompt or the padding, are skipped)."""
    return answer_sums(model.log_probs_packed(row), row)


def answer_sums(logp: torch.Tensor, row) -> torch.Tensor:
    """`answer_log_probs` from the row's per-position log-probabilities."""
    bounds = row.bounds.tolist()
    docs = torch.as_tensor(segments(bounds), device=logp.device)
    weights = torch.as_tensor(np.asarray(row.weights), device=logp.device)
    sums = torch.zeros(len(bounds) - 1, dtype=logp.dtype, device=logp.device)
    answers = np.flatnonzero(np.add.reduceat(np.asarray(row.weights), bounds[:-1]) > 0)
    return sums.index_add(0, docs, logp * weights)[torch.as_tensor(answers, device=logp.device)]


def _rows(pairs: Sequence[Pair], tokens: int, *models):
    """Each pair's prompt once, its two answers attending to it, where every model's
    attention path takes shared prompts."""
    share = all(getattr(m, "shares_prompts", False) for m in models if m is not None)
    return pack_prompted(((p.prompt, (p.chosen, p.rejected)) for p in pairs), tokens, share=share)


@torch.no_grad()
def reference_log_probs(model, pairs: Sequence[Pair], *, tokens: int = 4096, label: str | None = None) -> np.ndarray:
    """[pairs, 2] (chosen, rejected) summed log-probabilities under `model` (a pipelined one
    through its stages, every stage getting the last's values). `label`: show it as a
    phase of its own (a line at its start and end, a bar between), for the long pass
    before a run's first step."""
    was_training = model.training
    model.eval()
    rows = list(_rows(pairs, tokens, model))
    with phase(label, f"the reference's log-probabilities of {len(pairs):,} pairs", len(rows), "row") \
            if label else nullcontext() as bar:
        out = []
        for start in range(0, len(rows), _ROWS_A_CALL):
            out += rows_answer_log_probs(model, rows[start : start + _ROWS_A_CALL])
            if bar is not None:
                bar.update(min(start + _ROWS_A_CALL, len(rows)))
    model.train(was_training)
    return torch.cat(out).view(-1, 2).numpy() if out else np.zeros((0, 2))


_ROWS_A_CALL = 16  # rows a forward-only call takes (one update of the phase's bar)


def rows_answer_log_probs(model, rows) -> list[torch.Tensor]:
    """Each row's [answers] summed log-probabilities (float64, on the CPU), without
    gradients: a pipelined model's through its stages, every stage getting the last's."""
    return head_values(model, rows, lambda _, row, logp: answer_sums(logp, row), [row.examples for row in rows])


def cache_key(reference, pairs: Sequence[Pair]) -> str:
    """The reference cache's key (linnet.files.reference_cache): a hash of the reference
    weights in name order (a sharded or split model's gathered whole, so every process
    count gives one key, and the JAX backend's for the same weights; a pipeline's, the
    hashes of its stages in order: its own key, the same on every stage; every process
    calls this together) and the pairs' token ids."""
    digest = cache.weights_digest(dict(reference.named_parameters()),
                                  lambda p: full(p.detach()).float().cpu().numpy())
    pipe = getattr(reference, "pipe", None)
    if pipe is not None:
        stages = [None] * pipe.stages
        torch.distributed.all_gather_object(stages, digest.hexdigest(), group=pipe.group)
        digest = hashlib.sha256("".join(stages).encode())
    return cache.cache_key(digest, pairs)


def cached_reference_log_probs(reference, pairs: Sequence[Pair], cache_dir: str | os.PathLike, *,
                               tokens: int = 4096, label: str | None = None) -> np.ndarray:
    """reference_log_probs, read from or written to `cache_dir` (linnet.files.reference_cache's
    layout, which the JAX backend reads and writes too) so later runs need no reference
    model in memory."""
    path = cache.cache_file(cache_dir, cache_key(reference, pairs))
    missing = not path.is_file()
    if is_sharded(reference) or getattr(reference, "pipe", None) is not None:
        missing = bool(most_across(int(missing)))  # its passes are collectives: every process computes, or none
    if not missing:
        return cache.read(path, len(pairs))
    values = reference_log_probs(reference, pairs, tokens=tokens, label=label)
    cache.write(path, values)
    return values


def dpo(model, pairs: Iterable[Pair], run: Run | None = None, *, settings: DPOSettings | None = None,
        reference=None, tokens: int = 4096, **options) -> History:
    """Train on preference pairs for `run.steps` steps of `pairs_per_step` pairs each (a
    sequence of pairs is repeated as epochs; an iterator is read once).

    run: a linnet.run.Run, or its fields as keywords (optimizer=, steps=, clip=, ...).
    options: the objective's own, the fields of the YAML's `dpo` group
    (linnet.config.groups.DPOSettings; `settings=` gives them all at once): pairs_per_step (32),
    beta (0.1), label_smoothing (0), loss_type ("sigmoid"), simpo_gamma (0.5), rpo_alpha
    (0), reference_cache (None). tokens: positions per packed row.

    reference: a frozen model whose log-probabilities are computed row by row. Without
    one, `pairs` must be a sequence, and the model's own log-probabilities before
    training are computed for every pair first (one model in memory for a LoRA run).
    reference_cache: a directory where reference log-probabilities are kept across runs
    (needs a sequence of pairs). loss_type: see linnet.train.preference_loss; simpo and
    orpo use no reference at all (none is loaded or computed; passing one is refused), and
    orpo adds the chosen answers' NLL averaged over the step's chosen tokens. rpo_alpha adds
    that NLL, times alpha, to the other losses (RPO, Pang et al. 2024, arXiv:2404.19733; TRL's
    loss_type ["sigmoid", "sft"]): DPO alone can lower both answers' likelihood, the chosen
    one too, and on its own samples that cost the quickstart accuracy. Each Step's
    metrics hold TRL's rewards/chosen, rewards/rejected, rewards/margins (means over the
    step's pairs), rewards/accuracies (share ranked right), logps/chosen, logps/rejected
    (mean summed log-probabilities), and pairs. A model split by fully_shard or
    tensor_parallel, or cut into pipeline stages (the last computing the pair losses), trains
    as one process would over the same pairs.
    """
    run, s = run_and_options("dpo", run, options, DPOSettings, settings)
    if s.loss_type == "kto":
        raise ValueError("dpo: loss_type='kto' trains on unpaired answers: use linnet.train.kto.kto")
    if (s.desirable_weight, s.undesirable_weight) != (1.0, 1.0):
        raise ValueError("dpo: desirable_weight and undesirable_weight weigh KTO's answers: use linnet.train.kto.kto")
    if s.online:
        raise ValueError("dpo: online=True samples its own pairs from prompts: call "
                         "linnet.train.online_dpo.online_dpo(policy, engine, prompts, reward, ...)")
    reference_cache = s.reference_cache
    free = s.loss_type in REFERENCE_FREE
    if free and (reference is not None or reference_cache is not None):
        raise ValueError(f"dpo: loss_type={s.loss_type!r} is reference-free; pass no reference or reference_cache")
    trained_parameters(model)  # nothing to train: say so before the reference pass
    fixed: np.ndarray | None = None
    if not free and (reference is None or reference_cache is not None):
        if not isinstance(pairs, Sequence):
            raise ValueError("dpo: without a reference model (or with reference_cache), pairs must be a "
                             "sequence: the reference log-probabilities are computed for all pairs first")
        check_pairs(pairs)
        source = model if reference is None else reference
        fixed = (cached_reference_log_probs(source, pairs, reference_cache, tokens=tokens, label="dpo")
                 if reference_cache is not None else reference_log_probs(source, pairs, tokens=tokens, label="dpo"))

    def work(step: int, chunk: list) -> Work:
        batch = [p for _, p in chunk]
        if fixed is None:
            return pair_work(model, batch, s, tokens=tokens, reference=reference)
        return pair_work(model, batch, s, tokens=tokens, fixed=fixed[[i for i, _ in chunk]])

    # a sequence is taken epoch after epoch; an iterator once
    stream = itertools.cycle(enumerate(pairs)) if isinstance(pairs, Sequence) else enumerate(pairs)
    return fit(model, stream, work, run, per_step=s.pairs_per_step, what="dpo: the pairs")


def pair_work(model, batch: Sequence[Pair], settings: DPOSettings, *, tokens: int, reference=None,
              fixed: np.ndarray | None = None) -> Work:
    """One DPO step's Work over `batch` (`dpo`'s, and `online_dpo`'s fresh pairs): the
    reference's log-probabilities from `fixed` ([pairs, 2], computed before) or from the
    frozen `reference`, row by row (neither for a reference-free loss). A batch with no
    pair (on this process) takes a step that changes nothing but the optimizer's state."""
    s = settings
    free = s.loss_type in REFERENCE_FREE
    nll = 1.0 if s.loss_type == "orpo" else s.rpo_alpha
    live_reference = None if free or fixed is not None else reference
    assert free or fixed is not None or reference is not None, "a reference loss without reference log-probabilities"
    copies = copies_of(model)
    check_pairs(batch)
    count, chosen_total = sum_across([float(len(batch)), float(sum(len(p.chosen) for p in batch))], copies)
    rows = list(_rows(batch, tokens, model, live_reference))
    starts = np.cumsum([0] + [row.examples // 2 for row in rows])  # each row's first pair
    short = passes_short(len(rows), model, live_reference)

    def head(r: int, row, positions: torch.Tensor):
        """The row's summed loss and statistics from its per-position log-probabilities."""
        n = row.examples // 2
        mine = batch[starts[r] : starts[r] + n]
        logp = answer_sums(positions, row).view(n, 2)
        ref = None
        if fixed is not None:
            ref = torch.as_tensor(fixed[starts[r] : starts[r] + n], dtype=logp.dtype, device=logp.device)
        elif live_reference is not None:
            with torch.no_grad():
                ref = answer_log_probs(live_reference, row).view(n, 2).to(logp.dtype)
        lengths = None
        if s.loss_type in PER_TOKEN:
            lengths = torch.tensor([[len(p.chosen), len(p.rejected)] for p in mine], dtype=logp.dtype,
                                   device=logp.device)
        losses, good, bad = pair_losses(
            s.loss_type, logp[:, 0], logp[:, 1], None if ref is None else ref[:, 0], None if ref is None else ref[:, 1],
            beta=s.beta, label_smoothing=s.label_smoothing, simpo_gamma=s.simpo_gamma,
            chosen_tokens=None if lengths is None else lengths[:, 0],
            rejected_tokens=None if lengths is None else lengths[:, 1])
        total = losses.sum()
        if nll:  # the chosen answers' NLL, a mean over the step's chosen tokens
            total = total - nll * logp[:, 0].sum() * (count / chosen_total)
        margins = good - bad
        return total, {"correct": float((margins > 0).sum()), "margin": float(margins.sum()),
                       "chosen": float(good.sum()), "rejected": float(bad.sum()),
                       "logp_chosen": float(logp[:, 0].detach().sum()),
                       "logp_rejected": float(logp[:, 1].detach().sum())}

    def metrics(sums: dict[str, float]) -> dict[str, float]:
        means = [sums[k] / max(count, 1.0) for k in STATS]
        return {"pairs": count, **dict(zip(METRICS, means))}

    return Work(rows, head_loss(model, head), max(count, 1.0), sum(r.learned for r in rows),
                sum(r.real for r in rows), STATS, metrics, group=copies, head=head,
                idle=lambda: idle_passes(short, model, live_reference, row=rows[0] if rows else None))
