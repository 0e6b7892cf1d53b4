"""Distillation: a student learns a frozen teacher's token distributions.

    history = distill(student, teacher, rows, optimizer=opt, steps=100, divergence="jsd", beta=0.5)
    examples = teacher_completions(teacher_engine, prompts, max_new_tokens=128)   # sequence-level
    history = on_policy_distill(student, teacher, engine, prompts, optimizer=opt, steps=100)

Logit distillation compares, at every learned position, the student's distribution p_s
and the teacher's p_t, both softened by `temperature` (logits / T):

- forward_kl: KL(p_t || p_s), mass-covering (Hinton et al. 2015);
- reverse_kl: KL(p_s || p_t), mode-seeking;
- jsd: generalized Jensen-Shannon with the mixture m = beta p_t + (1 - beta) p_s,
  beta KL(p_t || m) + (1 - beta) KL(p_s || m) (GKD, Agarwal et al. 2024); beta 0 is
  forward_kl and beta 1 reverse_kl, as TRL's GKD trainer defines them.

`linear_divergence` takes both models' final hidden states and output heads and runs a
block of positions at a time (recomputed in backward), so neither model's [N, V] logits
are ever held whole. The loss of a step is the divergences summed over its learned
positions over their count. Sequence-level distillation (Kim and Rush 2016) trains the
student with SFT on the teacher's own completions; on-policy distillation (GKD with
lambda = 1) samples the student's completions each step and distils the teacher's
distributions on them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from linnet.packing import Example, pack_prompted
from linnet.rl.rollouts import sample_in_batches
from linnet.run import History, Run, run_and_options
from linnet.torch.distributed import sum_across
from linnet.torch.losses import rows_per_block
from linnet.torch.sharding import copy_first, split_input, split_sum
from linnet.torch.stages import HiddenAt
from linnet.train.loop import Work, copies_of, fit, head_loss, head_values, trained_parameters

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")


def token_divergence(student_logits, teacher_logits, *, divergence: str = "forward_kl", beta: float = 0.5,
                     temperature: float = 1.0) -> torch.Tensor:
    """[N] divergence at each position from [N, V] logits (float32); see the module docstring."""
    if divergence not in DIVERGENCES:
        raise ValueError(f"divergence={divergence!r}; use one of {', '.join(DIVERGENCES)}")
    ls = F.log_softmax(student_logits.float() / temperature, dim=-1)
    lt = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    return _divergence(ls, lt, _kl, divergence, beta)


def split_token_divergence(student_logits, teacher_logits, *, offset: int, group, divergence: str = "forward_kl",
                           beta: float = 0.5, temperature: float = 1.0) -> torch.Tensor:
    """token_divergence for a student whose head is split by vocabulary across `group`:
    `student_logits` [N, V_local] are the columns [offset, offset + V_local) of its logits,
    `teacher_logits` [N, V] whole. Each row's maximum and sum of exponentials, and each
    divergence's sum over the vocabulary, are combined across the split; the logits never are."""
    z = student_logits.float() / temperature
    top = z.detach().amax(dim=-1, keepdim=True)
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    ls = z - top - split_sum((z - top).exp().sum(dim=-1, keepdim=True), group, parts_use_it=True).log()
    lt = F.log_softmax(teacher_logits.float() / temperature, dim=-1)[:, offset:offset + z.shape[1]]
    return _divergence(ls, lt, lambda log_p, log_q: split_sum(_kl(log_p, log_q), group), divergence, beta)


def _kl(log_p, log_q):
    """KL(p || q) over the last dimension, 0 where p is."""
    return F.kl_div(log_q, log_p, reduction="none", log_target=True).sum(-1)


def _divergence(ls, lt, kl, divergence: str, beta: float):
    """The divergence from the student's and teacher's log-probabilities, `kl` summing
    KL(p || q) over the vocabulary."""
    if divergence == "forward_kl" or (divergence == "jsd" and beta == 0):
        return kl(lt, ls)
    if divergence == "reverse_kl" or beta == 1:
        return kl(ls, lt)
    mixture = torch.logsumexp(torch.stack([lt + math.log(beta), ls + math.log(1 - beta)]), dim=0)
    return beta * kl(lt, mixture) + (1 - beta) * kl(ls, mixture)


def linear_divergence(h_s, w_s, h_t, w_t, weights, *, divergence: str = "forward_kl", beta: float = 0.5,
                      temperature: float = 1.0, block_rows: int | None = None, split: dict | None = None
                      ) -> torch.Tensor:
    """sum over positions of weights * divergence(h_s @ w_s.T, h_t @ w_t.T), a block of
    `block_rows` positions at a time (by default the chunked loss's block), each block
    recomputed in backward: the student's and teacher's [N, V] logits are never whole.
    Gradients reach h_s and w_s; the teacher's side is constant. split: {offset, group}
    when w_s is this process's rows of a head split by vocabulary (split_token_divergence);
    else each block's gradient is `_BlockDivergence`'s closed form."""
    if divergence not in DIVERGENCES:
        raise ValueError(f"divergence={divergence!r}; use one of {', '.join(DIVERGENCES)}")
    rows = block_rows or rows_per_block(w_s.shape[0], h_s.device)

    def block(hs, ws, ht, wt, wb):
        hs = split_input(hs, split["group"])
        per = split_token_divergence(hs @ ws.to(hs.dtype).T, ht @ wt.to(ht.dtype).T, **split, divergence=divergence,
                                     beta=beta, temperature=temperature)
        return (per * wb).sum()

    h_t, w_t = h_t.detach(), w_t.detach()
    total = h_s.new_zeros((), dtype=torch.float32)
    for start in range(0, h_s.shape[0], rows):
        part = (h_s[start : start + rows], w_s, h_t[start : start + rows], w_t, weights[start : start + rows].float())
        if split is None:
            total = total + _BlockDivergence.apply(*part, divergence, beta, temperature)
        else:
            total = total + checkpoint(block, *part, use_reentrant=False)
    return total


class _BlockDivergence(torch.autograd.Function):
    """sum(weights * divergence) of a block of positions, from both models' hidden states
    and heads; backward recomputes the two blocks of log-probabilities and takes the
    gradient in closed form: for a divergence D with dD/dp_s = g (p_s = softmax(z_s / T)),
    dD/dz_s = p_s (g - <p_s, g>) / T, where g is log p_s - log p_t for the reverse KL and
    (1 - beta)(log p_s - log m) for the JSD, and the forward KL's is (p_s - p_t) / T. Fewer
    passes over the [rows, V] block than autograd's, and nothing of it kept from forward."""

    @staticmethod
    def forward(ctx, hs, ws, ht, wt, wb, divergence: str, beta: float, temperature: float):
        ls, lt = _block_log_probs(hs, ws, ht, wt, temperature)
        ctx.save_for_backward(hs, ws, ht, wt, wb)
        ctx.options = divergence, beta, temperature
        return (_divergence(ls, lt, _kl, divergence, beta) * wb).sum()

    @staticmethod
    def backward(ctx, grad):
        hs, ws, ht, wt, wb = ctx.saved_tensors
        divergence, beta, temperature = ctx.options
        ls, lt = _block_log_probs(hs, ws, ht, wt, temperature)
        ps = ls.exp()
        if divergence == "forward_kl" or (divergence == "jsd" and beta == 0):
            gz = ps.sub_(lt.exp_())
        else:
            if divergence == "reverse_kl" or beta == 1:
                g = ls.sub_(lt)
            else:  # log m, the mixture's log-probabilities
                g = ls.sub_(torch.logaddexp(lt.add_(math.log(beta)), ls + math.log(1 - beta))).mul_(1 - beta)
            gz = g.sub_(torch.bmm(ps[:, None], g[:, :, None])[:, 0]).mul_(ps)  # <p_s, g> with no [rows, V] temporary
        gz = gz.mul_((grad * wb / temperature)[:, None]).to(hs.dtype)
        grad_hs = gz @ ws.to(hs.dtype) if ctx.needs_input_grad[0] else None
        grad_ws = (gz.T @ hs).to(ws.dtype) if ctx.needs_input_grad[1] else None
        return grad_hs, grad_ws, None, None, None, None, None, None


def _block_log_probs(hs, ws, ht, wt, temperature: float):
    """The student's and teacher's log-probabilities of a block, softened by the
    temperature, in float32 (float64 stays: gradcheck)."""
    out = []
    for h, w in ((hs, ws), (ht, wt)):
        z = (h @ w.to(h.dtype).T).to(torch.promote_types(h.dtype, torch.float32))  # a tensor of its own
        out.append(F.log_softmax(z if temperature == 1 else z.div_(temperature), dim=-1))
    return out


def check_teacher(student, teacher) -> None:
    """A teacher must share the student's vocabulary: the same token ids, the same size."""
    s, t = student.card, teacher.card
    if s.vocab != t.vocab:
        raise ValueError(f"distill: the teacher {t.name!r} has {t.vocab} embedding rows and the student {s.name!r} "
                         f"{s.vocab}; token-level distillation compares distributions over one vocabulary, so the "
                         "teacher must use the student's tokenizer (sequence-level distillation through text would "
                         "not need it)")


def row_divergence(student, teacher, row, **options) -> torch.Tensor:
    """Summed divergence over a packed row's learned positions (both models' heads and
    last MLPs run on those alone)."""
    at = _learned_at(row)
    return _divergence_from(student, teacher, row, student.hidden_packed(row, at=at), options)


def _learned_at(row) -> np.ndarray:
    return np.flatnonzero(np.asarray(row.weights))


def _divergence_from(student, teacher, row, h_s, options: dict) -> torch.Tensor:
    """`row_divergence` from the student's final hidden states at the row's learned
    positions: what a pipelined student's last stage computes (the teacher whole there)."""
    at = _learned_at(row)
    with torch.no_grad():
        h_t = teacher.hidden_packed(row, at=at)
    weights = torch.as_tensor(np.asarray(row.weights)[at], device=h_s.device)
    split = student.split_head()
    head, split = (student.head_weight, None) if split is None else split
    return linear_divergence(h_s, head, h_t, teacher.head_weight, weights, split=split, **options)


@torch.no_grad()
def held_out_divergence(student, teacher, rows: Sequence, **options) -> float:
    """The mean divergence per learned position over `rows` (a pipelined student's through
    its stages, every stage getting the last's)."""
    learned = sum(float(np.asarray(r.weights).sum()) for r in rows)
    head = HiddenAt(_learned_at, lambda _, row, h: _divergence_from(student, teacher, row, h, options)[None])
    return sum(float(v) for v in head_values(student, rows, head, [1] * len(rows))) / learned


def distill(student, teacher, batches: Iterable, run: Run | None = None, *, accumulate: int = 1,
            divergence: str = "forward_kl", beta: float = 0.5, temperature: float = 1.0, **options) -> History:
    """Logit distillation on packed rows (`linnet.packing.pack` of Examples: their learned
    positions are distilled), `accumulate` rows a step. Each Step's metrics hold the mean
    divergence per learned token (`divergence`, the loss). A student cut into pipeline
    stages computes the divergences on its last stage, where the teacher runs. `run`: a
    linnet.run.Run, or its fields as keywords (optimizer=, steps=, ...)."""
    run, _ = run_and_options("distill", run, options)
    if accumulate < 1:
        raise ValueError(f"distill: accumulate={accumulate}; it must be >= 1")
    options = _prepare(student, teacher, divergence, beta, temperature)
    copies = copies_of(student)
    head = _stage_head(student, teacher, options)

    def work(step: int, micro: list) -> Work:
        learned = sum(float(np.asarray(b.weights).sum()) for b in micro)
        (count,) = sum_across([learned], copies)
        if count == 0:
            raise ValueError(f"distill: step {step}'s rows hold no learned position")
        return Work(micro, head_loss(student, head), count, learned, sum(float(b.real) for b in micro), group=copies,
                    head=head)

    return fit(student, batches, work, run, per_step=accumulate, what="distill: the rows")


def _stage_head(student, teacher, options: dict) -> HiddenAt:
    """A pipelined student's last stage: a row's summed divergence from its hidden states."""
    return HiddenAt(_learned_at, lambda _, row, h: (_divergence_from(student, teacher, row, h, options), {}))


def _prepare(student, teacher, divergence: str, beta: float, temperature: float) -> dict:
    """Check the settings and the teacher, freeze the teacher's mode, and return the
    divergence's options."""
    if divergence not in DIVERGENCES:
        raise ValueError(f"distill: divergence={divergence!r}; use one of {', '.join(DIVERGENCES)}")
    if not 0 <= beta <= 1 or not temperature > 0:
        raise ValueError("distill: beta must be in [0, 1] and temperature > 0")
    if teacher.split_head() is not None:
        raise ValueError("distill: the teacher is split (tensor_parallel); load it whole on every process (a split "
                         "student is fine)")
    check_teacher(student, teacher)
    teacher.eval()
    return dict(divergence=divergence, beta=beta, temperature=temperature)


def teacher_completions(engine, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 256,
                        temperature: float = 0.0, stop: Iterable[int] | None = None, seed: int = 0, batch: int = 64,
                        label: str | None = "teacher") -> list[Example]:
    """Sequence-level distillation's data: the teacher's completion of each prompt
    (greedy by default) as an Example learning the completion; train it with SFT. The
    prompts go `batch` an engine call (`sample_in_batches`: its KV cache holds one batch,
    never the whole data set), behind a progress bar named `label` (None: no bar)."""
    done = sample_in_batches(engine, prompts, batch=batch, seed=seed, label=label, max_new_tokens=max_new_tokens,
                             temperature=temperature, stop=stop)
    return [Example.prompted(prompts[c.prompt], c.tokens) for c in done if c.tokens]


def on_policy_distill(student, teacher, engine, prompts: Sequence[Sequence[int]], run: Run | None = None, *,
                      prompts_per_step: int = 8, max_new_tokens: int = 128, sample_temperature: float = 1.0,
                      stop: Iterable[int] | None = None, answers: Sequence[Sequence[int]] | None = None,
                      on_policy_share: float = 1.0, divergence: str = "reverse_kl", beta: float = 0.5,
                      temperature: float = 1.0, tokens: int = 4096, seed: int = 0, **options) -> History:
    """On-policy distillation: each step the student (through `engine`, loaded with its
    current weights) completes `prompts_per_step` prompts, and the student learns the
    teacher's distributions at every completion token (reverse KL by default, as on-policy
    distillation usually takes). A sequence of prompts repeats as epochs.

    `run`: a linnet.run.Run, or its fields as keywords (optimizer=, steps=, ...).
    on_policy_share < 1 mixes in the data's own `answers` (one a prompt) as GKD does (Agarwal et
    al. 2024; TRL's `lmbda`): a step samples the student with that probability, drawn from
    (seed, step) so that every process and a resumed run draw alike, and otherwise learns
    the teacher's distributions on the answers. 0 is logit distillation on the answers."""
    run, _ = run_and_options("on_policy_distill", run, options)
    share = on_policy_share
    if not 0.0 <= share <= 1.0 or (share < 1.0 and (answers is None or len(answers) != len(prompts))):
        raise ValueError(f"on_policy_distill: on_policy_share={share}; give a share in [0, 1], and below 1 one "
                         "answer a prompt (answers=) to learn on the other steps")
    trained_parameters(student)
    options = _prepare(student, teacher, divergence, beta, temperature)
    copies = copies_of(student)
    head = _stage_head(student, teacher, options)

    def work(step: int, chunk: list) -> Work:
        mine = [list(p) for _, p in chunk]
        sampled = share == 1.0 or np.random.default_rng([seed, step]).random() < share
        if sampled:
            engine.load_weights(student)
            # a split's or a pipeline's processes learn from the same completions: its first process's
            done = copy_first(student, lambda: engine.sample(mine, max_new_tokens=max_new_tokens,
                                                              temperature=sample_temperature, stop=stop,
                                                              seed=seed * 1_000_003 + step))
            completions = [(c.prompt, c.tokens) for c in done]
        else:
            completions = [(j, list(answers[i])) for j, (i, _) in enumerate(chunk)]
        groups = [(mine[j], [ids]) for j, ids in completions if ids]
        rows = list(pack_prompted(groups, tokens, share=False))
        learned = sum(float(np.asarray(r.weights).sum()) for r in rows)
        (count,) = sum_across([learned], copies)
        lengths = [len(ids) for _, ids in completions]
        return Work(rows, head_loss(student, head), max(count, 1.0), learned, sum(float(r.real) for r in rows),
                    metrics=lambda _: {"completion_length": float(np.mean(lengths)) if lengths else 0.0,
                                       "on_policy": float(sampled)},
                    group=copies, head=head)

    return fit(student, itertools.cycle(enumerate(prompts)), work, run, per_step=prompts_per_step,
               what="on_policy_distill: the prompts")
