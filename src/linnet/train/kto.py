"""KTO (Ethayarajh et al. 2024, arXiv:2402.01306): preference learning from unpaired
answers, each only marked desirable or undesirable.

    history = kto(model, [Unpaired(prompt, completion, desirable=True), ...], optimizer=opt,
                  steps=100, examples_per_step=32, beta=0.1)

Each answer's implied reward r = log pi(y|x) - log ref(y|x) is pushed above a reference
point z for desirable answers and below it for undesirable ones (the loss is
linnet.train.preference_loss.kto_losses). z estimates KL(pi || ref) on the step's answers
paired with mismatched prompts: answer i with the prompt of example i + 1 (mod the data
set), under no gradient, averaged over every process and clamped at 0.

The reference is the model itself before training (or `reference`), its log-probabilities
of every matched and mismatched answer computed once before the first step, so a LoRA run
holds one model. A model cut into pipeline stages computes the losses on its last stage.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from contextlib import nullcontext

import numpy as np
import torch

from linnet.packing import Unpaired, pack_prompted
from linnet.report.progress import phase
from linnet.run import History, Run, run_and_options
from linnet.torch.distributed import sum_across
from linnet.train.dpo import answer_sums, rows_answer_log_probs
from linnet.train.loop import Work, copies_of, fit, head_loss, trained_parameters
from linnet.train.preference_loss import kto_losses

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected", "kl")


def check_unpaired(examples: Sequence[Unpaired]) -> None:
    for i, e in enumerate(examples):
        if not isinstance(e, Unpaired):
            raise TypeError(f"kto: item {i} is a {type(e).__name__}, not a linnet.packing.Unpaired")
        if len(e.prompt) == 0 or len(e.completion) == 0:
            raise ValueError(f"kto: example {i} has an empty prompt or completion")
    if len(examples) < 2:
        raise ValueError("kto: at least two examples are needed (the KL estimate pairs answers with other prompts)")


def _mismatched(examples: Sequence[Unpaired], i: int) -> tuple[Sequence[int], Sequence[int]]:
    """Answer i after the prompt of example i + 1: the KL estimate's input."""
    return examples[(i + 1) % len(examples)].prompt, examples[i].completion


def _rows(groups, tokens: int) -> list:
    """Packed rows of one answer per (prompt, answer) group."""
    return list(pack_prompted(((p, (a,)) for p, a in groups), tokens, share=False))


def _fixed_log_probs(model, rows: list, bar=None, done: int = 0) -> np.ndarray:
    was_training = model.training
    model.eval()
    out = []
    for start in range(0, len(rows), 16):  # 16 rows a forward-only call, one update of the phase's bar
        out += rows_answer_log_probs(model, rows[start : start + 16])
        if bar is not None:
            bar.update(done + min(start + 16, len(rows)))
    model.train(was_training)
    return torch.cat(out).numpy() if out else np.zeros(0)


def reference_log_probs(model, examples: Sequence[Unpaired], *, tokens: int = 4096,
                        label: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """([examples], [examples]) summed log-probabilities of each answer after its own
    prompt and after the mismatched one (see the module docstring). `label`: show it as a
    phase of its own (lines at its start and end, a bar between)."""
    own = _rows([(e.prompt, e.completion) for e in examples], tokens)
    mismatched = _rows([_mismatched(examples, i) for i in range(len(examples))], tokens)
    with phase(label, f"the reference's log-probabilities of {len(examples):,} answers", len(own) + len(mismatched),
               "row") if label else nullcontext() as bar:
        return _fixed_log_probs(model, own, bar), _fixed_log_probs(model, mismatched, bar, len(own))


def held_out_kto(model, examples: Sequence[Unpaired], reference: tuple[np.ndarray, np.ndarray], *, beta: float,
                 desirable_weight: float = 1.0, undesirable_weight: float = 1.0, tokens: int = 4096) -> dict:
    """Held-out KTO loss, z and reward margin against `reference` (reference_log_probs of
    the same examples before training); under torchrun, each process's share, summed."""
    policy, mismatched = (torch.as_tensor(x) for x in reference_log_probs(model, examples, tokens=tokens))
    ref, ref_mismatched = (torch.as_tensor(x) for x in reference)
    n, drift = sum_across([float(len(examples)), float((mismatched - ref_mismatched).sum())])
    z = max(0.0, drift / n)
    good = torch.tensor([e.desirable for e in examples])
    losses, rewards = kto_losses(policy, ref, good, z, beta=beta, desirable_weight=desirable_weight,
                                 undesirable_weight=undesirable_weight)
    g = good.double()
    loss_sum, n_good, r_good, r_bad = sum_across([float(losses.sum()), float(g.sum()), float((rewards * g).sum()),
                                                  float((rewards * (1 - g)).sum())])
    margin = (r_good / n_good if n_good else 0.0) - (r_bad / (n - n_good) if n - n_good else 0.0)
    return {"held_out_loss": loss_sum / n, "held_out_kl": z, "held_out_margin": margin}


def kto(model, examples: Sequence[Unpaired], run: Run | None = None, *, examples_per_step: int = 32,
        beta: float = 0.1, desirable_weight: float = 1.0, undesirable_weight: float = 1.0, reference=None,
        tokens: int = 4096, **options) -> History:
    """Train on unpaired answers for `run.steps` steps of `examples_per_step` each (the
    sequence repeated as epochs); see the module docstring. `run`: a linnet.run.Run, or
    its fields as keywords (optimizer=, steps=, clip=, ...). Each Step's metrics hold TRL's
    rewards/chosen and logps/chosen (means over the step's desirable answers),
    rewards/rejected and logps/rejected (undesirable), rewards/margins and kl (z)."""
    run, _ = run_and_options("kto", run, options)
    if not beta > 0 or examples_per_step < 1 or desirable_weight < 0 or undesirable_weight < 0:
        raise ValueError("kto: beta must be > 0, examples_per_step >= 1 and the weights >= 0")
    trained_parameters(model)
    copies = copies_of(model)
    check_unpaired(examples)
    ref, ref_mismatched = reference_log_probs(model if reference is None else reference, examples, tokens=tokens,
                                              label="kto")

    def work(step: int, chunk: list) -> Work:
        indices, batch = [i for i, _ in chunk], [e for _, e in chunk]
        policy = rows_answer_log_probs(model, _rows([_mismatched(examples, i) for i in indices], tokens))
        drift = float(sum(x.sum() for x in policy)) - float(ref_mismatched[indices].sum())
        count, drift_sum = sum_across([float(len(batch)), drift], copies)
        z = max(0.0, drift_sum / count)
        rows = _rows([(e.prompt, e.completion) for e in batch], tokens)
        starts = np.cumsum([0] + [row.examples for row in rows])

        def head(r: int, row, positions: torch.Tensor):
            """The row's summed loss and statistics from its per-position log-probabilities."""
            logp = answer_sums(positions, row)
            mine = indices[starts[r]:starts[r + 1]]
            good = torch.tensor([examples[i].desirable for i in mine], device=logp.device)
            reference_logp = torch.as_tensor(ref[mine], dtype=logp.dtype, device=logp.device)
            losses, rewards = kto_losses(logp, reference_logp, good, z, beta=beta, desirable_weight=desirable_weight,
                                         undesirable_weight=undesirable_weight)
            g = good.to(logp.dtype)
            stats = {"n_good": float(g.sum()), "reward_good": float((rewards * g).sum()),
                     "reward_bad": float((rewards * (1 - g)).sum()), "logp_good": float((logp.detach() * g).sum()),
                     "logp_bad": float((logp.detach() * (1 - g)).sum())}
            return losses.sum(), stats

        def metrics(sums: dict[str, float]) -> dict[str, float]:
            good, bad = sums["n_good"], count - sums["n_good"]
            chosen = sums["reward_good"] / good if good else float("nan")
            rejected = sums["reward_bad"] / bad if bad else float("nan")
            return {"examples": count, "rewards/chosen": chosen, "rewards/rejected": rejected,
                    "rewards/margins": chosen - rejected,
                    "logps/chosen": sums["logp_good"] / good if good else float("nan"),
                    "logps/rejected": sums["logp_bad"] / bad if bad else float("nan"), "kl": z}

        return Work(rows, head_loss(model, head), count, sum(r.learned for r in rows), sum(r.real for r in rows),
                    ("n_good", "reward_good", "reward_bad", "logp_good", "logp_bad"), metrics, group=copies, head=head)

    stream = itertools.cycle(enumerate(examples))
    return fit(model, stream, work, run, per_step=examples_per_step, what="kto: the examples")
