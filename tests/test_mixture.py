"""data.mixture: sources sampled in proportion to their weights, epoch after epoch, in a
seeded order a resumed run continues; the weights are part of what a run learns."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from linnet import nest
from linnet.commands import quickstart
from linnet.commands.sft import epochs_of_rows, read_inputs, run
from linnet.config import SFTConfig, load
from linnet.data.mixture import mixture_epoch, shares

torch.set_num_threads(1)


def test_each_epoch_takes_each_source_in_proportion_and_a_large_one_continues():
    sizes, weights = [1000, 50, 300], [5, 3, 2]
    epochs = [mixture_epoch(sizes, weights, seed=0, epoch=e) for e in range(3)]
    for order in epochs:
        assert len(order) == 1350
        counts = np.bincount(np.searchsorted(np.cumsum(sizes), order, side="right"), minlength=3)
        assert counts.tolist() == shares(weights, 1350).tolist() == [675, 405, 270]
    first = np.concatenate([e[e < 1000] for e in epochs[:2]])
    assert len(set(first.tolist())) == 1000  # 675 + 325 of the next epoch: every item once before any twice
    assert np.array_equal(mixture_epoch(sizes, weights, seed=0, epoch=1), epochs[1])
    assert not np.array_equal(mixture_epoch(sizes, weights, seed=1, epoch=1), epochs[1])
    with pytest.raises(ValueError, match="positive weight"):
        shares([1, 0], 10)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """A model and two sources of distinct addition problems, 300 and 60 records."""
    root = tmp_path_factory.mktemp("mixture")
    nest.load(quickstart.CARD, weights="random", seed=0).save_weights(root / "model")
    quickstart.save_tokenizer(root / "model" / "tokenizer.json")
    drawn = quickstart.problems(np.random.default_rng(0), 360, 2, distinct=True)
    for name, part in (("a.jsonl", drawn[:300]), ("b.jsonl", drawn[300:])):
        (root / name).write_text("".join(json.dumps({"prompt": p, "completion": a}) + "\n" for p, a in part))
    return root


def config(root, out, weights=(3, 1), **training):
    mixture = [{"path": str(root / "a.jsonl"), "weight": weights[0]}, {"path": str(root / "b.jsonl"),
                                                                         "weight": weights[1]}]
    overrides = [f"model.card={root / 'model'}", f"data.mixture={json.dumps(mixture)}", "data.chat=false",
                 "training.context_length=64", "lora.enabled=false", "lr_schedule.warmup_steps=1",
                 "evaluation.every=4", "training.checkpoint_every=3", f"runtime.output_dir={out}"]
    return load(SFTConfig, None, overrides + [f"training.{k}={v}" for k, v in training.items()])


def test_a_runs_realized_shares_match_the_weights(sources, tmp_path):
    inputs = read_inputs(config(sources, tmp_path / "unused", steps=100))
    assert inputs.sources == [285, 57]  # each source less its 5% held out
    owner = {tuple(e.tokens): k for k, e in enumerate(inputs.train_examples)}
    taken = [0, 0]
    rows = epochs_of_rows(inputs)
    for _ in range(inputs.steps * inputs.config.training.accumulation):
        row = next(rows)
        for a, b in zip(row.bounds[:-1], row.bounds[1:]):
            index = owner.get(tuple(row.tokens[a:b]))
            if index is not None:
                taken[index >= inputs.sources[0]] += 1
    assert sum(taken) > 500 and taken[0] / sum(taken) == pytest.approx(0.75, abs=0.02)


def test_resume_continues_the_mixture_and_a_changed_weight_is_refused(sources, tmp_path):
    whole = run(config(sources, tmp_path / "whole", steps=6))
    out = tmp_path / "run"
    run(config(sources, out, steps=6))
    shutil.rmtree(out / "checkpoints" / "step-00000006")  # as if killed after step 4: step 3's checkpoint
    (out / "summary.json").unlink()
    (out / "metrics.jsonl").write_text("\n".join((out / "metrics.jsonl").read_text().splitlines()[:4]) + "\n")
    again = run(config(sources, out, steps=6), resume=True)
    assert again["steps_this_run"] == 3 and again["last_loss"] == whole["last_loss"]
    with pytest.raises(ValueError, match="data.mixture.weights"):
        run(config(sources, out, weights=(1, 1), steps=8), resume=True)


def test_a_mixture_and_a_path_together_are_refused(sources):
    with pytest.raises(ValueError, match="data.path and data.mixture"):
        load(SFTConfig, None, [f"data.path={sources / 'a.jsonl'}", f"data.mixture=[{{path: {sources / 'b.jsonl'}, "
                                                                    "weight: 1}]"])
    with pytest.raises(ValueError, match=r"data.mixture\[0\]: weight=-1"):
        load(SFTConfig, None, [f"data.mixture=[{{path: {sources / 'b.jsonl'}, weight: -1}}]"])


def test_a_pretraining_mixture_takes_each_corpus_in_proportion(tmp_path):
    """Two corpora (one word-list each, so a document tells its corpus), weights 3:1: the
    training split holds as many documents as both, three quarters from the first (the
    smaller one repeating), every tenth document of each held out; another weight is
    another cache's settings, refused at the same path."""
    import tokenizers

    from linnet.config import PretrainConfig
    from linnet.pretrain.cache import open_cache
    from linnet.pretrain.prepare import prepare
    from tests.conftest import WORDS, word_tokenizer

    g = np.random.default_rng(0)
    for name, words, n in (("a.jsonl", WORDS[:20], 200), ("b.jsonl", WORDS[20:], 600)):
        (tmp_path / name).write_text("".join(json.dumps({"text": " ".join(g.choice(words, size=8))}) + "\n"
                                             for _ in range(n)))
    word_tokenizer(tmp_path / "tokenizer.json")

    def data(weights):
        mixture = [{"source": str(tmp_path / "a.jsonl"), "weight": weights[0]},
                   {"source": [str(tmp_path / "b.jsonl")], "weight": weights[1]}]
        return load(PretrainConfig, None, [f"data.cache={tmp_path / 'cache'}", f"data.mixture={json.dumps(mixture)}",
                                           f"data.tokenizer={tmp_path / 'tokenizer.json'}", "data.eos_token=<eos>",
                                           "data.validation_every=10", "data.shuffle_buffer=50",
                                           "data.prepare_workers=1"]).data

    prepare(data((3, 1)))
    cache = open_cache(tmp_path / "cache")
    assert cache.train.documents == 180 + 540 and cache.validation.documents == 20 + 60
    tok = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    first = {tok.token_to_id(w) for w in WORDS[:20]}
    tokens = cache.train.read(0, cache.train.tokens)
    documents = np.split(tokens, np.flatnonzero(tokens == cache.eos_id)[:-1] + 1)
    from_a = sum(int(d[0]) in first for d in documents)
    assert len(documents) == 720 and from_a / len(documents) == pytest.approx(0.75, abs=0.02)
    with pytest.raises(ValueError, match="data.mixture: cache has"):
        prepare(data((1, 1)))
