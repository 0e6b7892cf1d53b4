"""Reward models: a scalar head on the decoder, trained on preference pairs with the
Bradley-Terry loss, -log sigmoid(r(chosen) - r(rejected)) (Ouyang et al. 2022).

    add_score_head(model)                       # model.score: hidden -> 1, N(0, 0.02)
    history = reward(model, pairs, optimizer=opt, steps=100, pairs_per_step=32)
    save_reward_model(model, "rm/")             # transformers: AutoModelForSequenceClassification
    scorer = RewardScorer("rm/")                # a GRPO reward (grpo.reward: model:rm/)

An answer's reward is the head applied to the final hidden state at the last token of the
prompt and answer read as one sequence that is not the pad token: what transformers'
*ForSequenceClassification computes (where the pad token is also the end of a sequence,
the token before it). A pair's prompt is packed once, both answers attending to it (where
the attention path takes shared prompts), and the last block runs its MLP only at the
positions read. A model cut into pipeline stages holds the head on its last stage, which
computes the rewards and losses.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from linnet.config.groups import RewardSettings
from linnet.packing import Pair, check_pairs, pack_prompted
from linnet.run import History, Run, run_and_options
from linnet.torch.distributed import sum_across, world
from linnet.torch.stages import HiddenAt
from linnet.train.loop import Work, copies_of, fit, head_loss, head_values, trained_parameters

ARCHITECTURES = {"llama": "LlamaForSequenceClassification", "qwen2": "Qwen2ForSequenceClassification",
                 "qwen3": "Qwen3ForSequenceClassification", "mistral": "MistralForSequenceClassification"}


def add_score_head(model, seed: int = 0) -> torch.nn.Module:
    """Give `model` a trainable float32 `score` head (hidden -> 1, no bias), as transformers
    names it; returns the model. A pipelined model's last stage holds it (add it after
    the cut), the other stages' `score` is None."""
    from linnet.torch.model import Linear

    pipe = getattr(model, "pipe", None)
    if pipe is not None and not pipe.last:
        model.score = None
        return model
    head = Linear(model.card.hidden, 1, bias=False).to(model.device)
    with torch.no_grad():
        head.weight.copy_(torch.empty(1, model.card.hidden).normal_(0.0, 0.02, generator=torch.Generator().manual_seed(seed)))
    model.score = head
    return model


def rows(model, groups: Iterable[tuple[Sequence[int], Sequence[Sequence[int]]]], tokens: int):
    """Packed rows of (prompt, answers) groups, each prompt once with its answers attending
    to it where the model's attention path allows, else whole prompt + answer each."""
    return pack_prompted(groups, tokens, share=model.shares_prompts)


def _last_positions(row, pad_id: int | None) -> np.ndarray:
    """Each answer document's last position that does not hold the pad token (the rule
    transformers' sequence classifiers use; for an answer all pad, its shared prompt's),
    the document's last position if every token is pad."""
    bounds, tokens = np.asarray(row.bounds), np.asarray(row.tokens)
    prefix = None if row.prefix is None else np.asarray(row.prefix)
    learned = np.add.reduceat(np.asarray(row.weights), bounds[:-1]) > 0

    def last_kept(doc: int) -> int | None:
        start, end = bounds[doc], bounds[doc + 1]
        kept = np.flatnonzero(tokens[start:end] != pad_id) if pad_id is not None else [end - start - 1]
        return start + kept[-1] if len(kept) else None

    out = []
    for doc in np.flatnonzero(learned):
        found = last_kept(doc)
        if found is None and prefix is not None and prefix[doc] >= 0:
            found = last_kept(prefix[doc])
        out.append(bounds[doc + 1] - 1 if found is None else found)
    return np.asarray(out, dtype=np.int64)


def scores(model, row) -> torch.Tensor:
    """[answers] float32 reward of each answer of a row (in order), from the final hidden
    state at its document's last non-pad token."""
    return _scored(model, model.hidden_packed(row, at=_last_positions(row, model.card.pad_token_id)))


def _scored(model, h_AD: torch.Tensor) -> torch.Tensor:
    return model.score(h_AD).float()[:, 0]


def _answer_ends(model) -> HiddenAt:
    """What a pipelined model's last stage reads to score a row: its answers' ends."""
    return HiddenAt(lambda row: _last_positions(row, model.card.pad_token_id), lambda _, row, h: _scored(model, h))


def reward(model, pairs: Sequence[Pair], run: Run | None = None, *, settings: RewardSettings | None = None,
           tokens: int = 4096, **options) -> History:
    """Train the model with its score head on preference pairs (repeated as epochs):
    per pair -log sigmoid(r_c - r_r - margin). `run`: a linnet.run.Run, or its fields as
    keywords (optimizer=, steps=, ...); its save_to gets `save_reward_model`'s directory.
    options: the YAML's `reward` group (linnet.config.groups.RewardSettings, or `settings=`):
    pairs_per_step (32), margin (0). Each Step's metrics hold TRL's accuracy (share of
    pairs ranked right), margin (mean r_c - r_r) and mean_reward."""
    run, s = run_and_options("reward", run, options, RewardSettings, settings)
    if not hasattr(model, "score"):
        raise ValueError("reward: the model has no score head; call linnet.train.reward.add_score_head(model) first")
    copies = copies_of(model)
    pipe = getattr(model, "pipe", None)
    if pipe is not None and not pipe.last and model.score is not None:
        raise ValueError("reward: a stage before the last holds a score head; add it after cutting the pipeline "
                         "(add_score_head puts it on the last stage)")
    trained_parameters(model)
    check_pairs(pairs)
    ends = _answer_ends(model)

    def work(step: int, chunk: list) -> Work:
        batch = [p for _, p in chunk]
        (count,) = sum_across([float(len(batch))], copies)
        packed = list(rows(model, ((p.prompt, (p.chosen, p.rejected)) for p in batch), tokens))

        def head(i: int, row, h):
            """The row's summed loss and statistics from the hidden states at its answers' ends."""
            r = ends.head(i, row, h).view(-1, 2)
            gap = r[:, 0] - r[:, 1]
            return -F.logsigmoid(gap - s.margin).sum(), {"correct": float((gap > 0).sum()),
                                                       "gap": float(gap.detach().sum()),
                                                       "total": float(r.detach().sum())}

        def metrics(sums: dict[str, float]) -> dict[str, float]:
            return {"pairs": count, "accuracy": sums["correct"] / count, "margin": sums["gap"] / count,
                    "mean_reward": sums["total"] / (2 * count)}

        stage = HiddenAt(ends.positions, head)
        return Work(packed, head_loss(model, stage), count, sum(r.learned for r in packed),
                    sum(r.real for r in packed), ("correct", "gap", "total"), metrics, group=copies, head=stage)

    history = fit(model, itertools.cycle(enumerate(pairs)), work, dataclasses.replace(run, save_to=None),
                  per_step=s.pairs_per_step, what="reward: the pairs")
    if run.save_to is not None:
        save_reward_model(model, run.save_to)
    return history


@torch.no_grad()
def score_answers(model, groups: Sequence[tuple[Sequence[int], Sequence[int]]], *, tokens: int = 4096) -> np.ndarray:
    """[len(groups)] rewards of (prompt, answer) token lists, packed rows at a time
    (consecutive answers to one prompt share it, as many as fit a row)."""
    was_training = model.training
    model.eval()
    packed = list(rows(model, _runs(groups, tokens), tokens))
    out = head_values(model, packed, _answer_ends(model), [row.examples for row in packed])  # a pipeline's: its stages
    model.train(was_training)
    return torch.cat(out).numpy() if out else np.zeros(0)


def _runs(groups: Sequence[tuple[Sequence[int], Sequence[int]]], tokens: int):
    """(prompt, answers) for each run of consecutive answers to the same prompt, cut
    where prompt + answers would no longer fit a row laid out whole."""
    prompt, answers, size = None, [], 0
    for p, a in groups:
        if answers and (list(p) != prompt or size + len(p) + len(a) > tokens):
            yield prompt, answers
            answers, size = [], 0
        prompt = list(p)
        answers.append(a)
        size += len(p) + len(a)
    if answers:
        yield prompt, answers


def held_out_accuracy(model, pairs: Sequence[Pair], *, tokens: int = 4096) -> dict[str, float]:
    """Held-out pairwise accuracy, loss and margin (under torchrun: each process's share,
    summed over every process)."""
    r = score_answers(model, [(p.prompt, a) for p in pairs for a in (p.chosen, p.rejected)], tokens=tokens)
    gap = r[0::2] - r[1::2]
    n, right, loss, total = sum_across([float(len(pairs)), float((gap > 0).sum()),
                                        float(np.logaddexp(0.0, -gap).sum()), float(gap.sum())])
    return {"held_out_accuracy": right / n, "held_out_loss": loss / n, "held_out_margin": total / n}


def save_reward_model(model, directory: str | os.PathLike, *, dtype=None) -> None:
    """The whole model with its head (adapters merged into the weights written, the model
    itself unchanged; a sharded one gathered, every process calling) as a transformers
    *ForSequenceClassification directory: weights, config.json (num_labels 1), tokenizer."""
    import json

    from linnet.files.atomic import write_text

    model.save_weights(directory, dtype=dtype, merged=True)
    if world()[0] != 0:
        return
    path = Path(directory) / "config.json"
    config = json.loads(path.read_text())
    config.update(architectures=[ARCHITECTURES[model.card.family]], num_labels=1, id2label={"0": "LABEL_0"},
                  label2id={"LABEL_0": 0})
    write_text(path, json.dumps(config, indent=2) + "\n")


def load_reward_model(directory: str | os.PathLike, **load: object):
    """A reward model saved by `save_reward_model` (or any *ForSequenceClassification
    directory with one label), its head read with it; `load`: nest.load's options."""
    from safetensors import safe_open

    from linnet import nest
    from linnet.files.weights import weight_files

    model = nest.load(directory, weights=directory, **load)
    add_score_head(model)
    for file in weight_files(directory):
        with safe_open(file, "pt", device="cpu") as f:
            if "score.weight" in f.keys():
                if model.score is not None:  # None: a pipeline stage before the last
                    with torch.no_grad():
                        model.score.weight.copy_(f.get_tensor("score.weight"))
                return model
    raise ValueError(f"{directory}: no score.weight; not a reward model (save one with save_reward_model)")


class RewardScorer:
    """A trained reward model as a GRPO reward: `scorer(prompt, completion_ids)` for one
    completion, `scorer.batch(items)` for many at once, packed rows at a time. The policy
    and the reward model must share their tokenizer (the token ids go in as they are)."""

    def __init__(self, directory: str | os.PathLike, *, device=None, tokens: int = 4096):
        self.model = load_reward_model(directory, device=device, dtype="float32")
        self.tokens = tokens
        self.__name__ = f"model:{directory}"

    def batch(self, items: Sequence[tuple[object, Sequence[int]]]) -> list[float]:
        return score_answers(self.model, [(prompt.ids, completion) for prompt, completion in items],
                             tokens=self.tokens).tolist()

    def __call__(self, prompt, completion: Sequence[int]) -> float:
        return self.batch([(prompt, completion)])[0]
