"""Reward models: Bradley-Terry training lifts held-out pairwise accuracy above chance; the
saved model loads in transformers as AutoModelForSequenceClassification with the same
scores; a trained model is a GRPO reward, batched."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from linnet import nest
from linnet.packing import Pair
from linnet.rl.rollouts import Prompt
from linnet.train.reward import (
    RewardScorer,
    add_score_head,
    held_out_accuracy,
    load_reward_model,
    reward,
    save_reward_model,
    score_answers,
)
from tests.conftest import quickstart_model, same_metrics
from tests.test_dpo import CARD


def _pairs(n=24, seed=0):
    """A synthetic preference: answers made of low token ids are preferred to high ones."""
    g = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        prompt = [1] + g.integers(3, 32, size=int(g.integers(2, 6))).tolist()
        size = int(g.integers(2, 6))
        out.append(Pair(prompt, g.integers(3, 17, size=size).tolist() + [2], g.integers(17, 32, size=size).tolist() + [2]))
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    model = add_score_head(nest.load(CARD, weights="random", trainable=True, seed=0))
    held = _pairs(16, seed=1)
    before = held_out_accuracy(model, held, tokens=128)
    history = reward(model, _pairs(48), optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), steps=30,
                     pairs_per_step=8, tokens=128)
    out = tmp_path_factory.mktemp("rm") / "rm"
    save_reward_model(model, out)
    return model, history, before, held_out_accuracy(model, held, tokens=128), out


def test_bradley_terry_training_ranks_held_out_pairs(trained):
    model, history, before, after, _ = trained
    assert history.steps[0].loss == pytest.approx(np.log(2), abs=0.05)  # the head starts near zero
    assert sum(s.loss for s in history.steps[-5:]) / 5 < history.steps[0].loss
    assert after["held_out_accuracy"] >= 0.9 and after["held_out_accuracy"] > before["held_out_accuracy"]
    assert after["held_out_margin"] > 0 and {"accuracy", "margin", "mean_reward"} <= set(history.steps[-1].metrics)


def test_the_saved_model_scores_alike_in_transformers(trained):
    transformers = pytest.importorskip("transformers")
    model, _, _, _, out = trained
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32).eval()
    again = load_reward_model(out, dtype="float32")
    pairs = _pairs(4, seed=5)
    groups = [(p.prompt, p.chosen) for p in pairs]
    ours = score_answers(model, groups, tokens=128)
    np.testing.assert_allclose(score_answers(again, groups, tokens=128), ours, rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        theirs = [float(hf(torch.tensor([list(p) + list(a)])).logits[0, 0]) for p, a in groups]
    np.testing.assert_allclose(theirs, ours, rtol=1e-4, atol=1e-5)


def test_answers_sharing_a_prompt_score_as_whole_sequences(trained):
    """Consecutive answers to one prompt are packed after it once (the last block computing
    only the positions read); each scores as its prompt + answer alone does in
    transformers, an answer made only of pad tokens (read at its prompt's last token)
    included, and the same as whole prompt + answer documents."""
    transformers = pytest.importorskip("transformers")
    from linnet.packing import pack_prompted
    from linnet.train.reward import _runs, rows, scores

    model, _, _, _, out = trained
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32).eval()
    pad = model.card.pad_token_id
    groups = [(p.prompt, a) for p in _pairs(3, seed=9) for a in (p.chosen, p.rejected, [pad, pad])]
    groups += [([5, 7, pad], [9, 4]), ([5, 7, pad], [pad])]  # read at 7: in the shared prompt's document
    shared = score_answers(model, groups, tokens=128)
    with torch.no_grad():
        alone = list(pack_prompted(((p, (a,)) for p, a in groups), 128, share=False))
        assert all(row.prefix is None for row in alone)
        whole = torch.cat([scores(model, row) for row in alone]).numpy()
        theirs = [float(hf(torch.tensor([list(p) + list(a)])).logits[0, 0]) for p, a in groups]
    np.testing.assert_allclose(shared, whole, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(theirs, shared, rtol=1e-4, atol=1e-5)
    packed = list(rows(model, _runs(groups, 128), 128))
    assert [r.examples for r in packed] == [11] and (np.asarray(packed[0].prefix) >= 0).sum() == 11  # 4 prompts, once each


def test_a_trained_reward_model_is_a_batched_grpo_reward(trained):
    model, _, _, _, out = trained
    scorer = RewardScorer(out, tokens=128)
    pairs = _pairs(3, seed=7)
    items = [(Prompt(p.prompt), list(a)) for p in pairs for a in (p.chosen, p.rejected)]
    batched = scorer.batch(items)
    assert batched == pytest.approx([scorer(*item) for item in items], abs=1e-6)
    assert all(batched[i] > batched[i + 1] for i in range(0, 6, 2))  # it prefers the chosen answers
    with pytest.raises(ValueError, match="no score head"):
        reward(nest.load(CARD, weights="random", trainable=True), _pairs(4), optimizer=None, steps=1)


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """A model directory and quickstart-style preference records (the doubled answer loses)."""
    import json

    from linnet.commands import quickstart

    root = tmp_path_factory.mktemp("reward")
    quickstart_model(root / "model")
    rng = np.random.default_rng(0)
    lines = [json.dumps({"prompt": p, "chosen": a, "rejected": a + a}) for p, a in quickstart.problems(rng, 200, 2)]
    (root / "pairs.jsonl").write_text("\n".join(lines) + "\n")
    return root


def _reward_config(root, out, *extra):
    from linnet.config import RewardConfig, load

    return load(RewardConfig, None, [
        f"model.card={root / 'model'}", f"data.path={root / 'pairs.jsonl'}", "data.chat=false",
        "training.context_length=128", "data.eval_share=0.1", "reward.pairs_per_step=16", "lora.rank=8",
        "optimizer.lr=3e-3", "lr_schedule.warmup_steps=1", "training.steps=12", "evaluation.every=6",
        f"runtime.output_dir={out}", *extra])


def test_linnet_reward_end_to_end_and_as_a_grpo_reward(records, tmp_path):
    """`linnet reward` on quickstart-style preference records: held-out accuracy rises
    above chance, final/ is a transformers sequence classifier, and `model:DIR` resolves
    to a batched GRPO reward."""
    import json

    from linnet.commands.reward import run
    from linnet.rl import rewards

    config = _reward_config(records, tmp_path / "run")
    summary = run(config)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    held = [r["held_out_accuracy"] for r in rows if "held_out_accuracy" in r]
    assert held[-1] > 0.7 and summary["held_out_accuracy"] == held[-1]
    saved = json.loads((tmp_path / "run" / "final" / "config.json").read_text())
    assert saved["architectures"][0].endswith("ForSequenceClassification") and saved["num_labels"] == 1
    scorer = rewards.resolve(f"model:{tmp_path / 'run' / 'final'}", tokenizer=None)
    assert len(scorer.batch([(Prompt([1, 5, 6]), [7, 8]), (Prompt([1, 5]), [9])])) == 2


def _reward_process(rank, config):
    from linnet.commands.reward import run

    return run(config).get("held_out_accuracy")  # the first process writes the summary


@pytest.mark.parametrize("mode", ["training.shard=fsdp", "training.split=2", "training.pipeline=2",
                                  "training.pipeline=2 training.shard=fsdp", "training.context=2",
                                  "training.pipeline=2 training.context=2"])
def test_linnet_reward_over_two_processes_takes_one_process_steps(records, tmp_path, mode):
    """`linnet reward` in two processes, sharded (fsdp), split (tensor parallel) or cut into
    two pipeline stages (the last holding the score head), or in four, two copies of the
    stages sharded over them, or two stages each splitting every row's positions over a
    pair (the last stage's pair gathering the hidden states it scores): one process's losses and held-out accuracy, and the same
    merged reward model in final/ (under fsdp its end used to fail: merging adapters into
    a sharded model is refused)."""

    from safetensors.torch import load_file

    from linnet.commands.reward import run
    from tests.conftest import in_processes

    short = ["training.steps=4", "evaluation.every=2"]
    modes = mode.split()
    assert in_processes(_reward_process, _reward_config(records, tmp_path / "two", *short, *modes),
                        processes=2 * len(modes))[0]
    run(_reward_config(records, tmp_path / "one", *short))
    same_metrics(tmp_path / "two", tmp_path / "one", ("loss", "grad_norm", "held_out_accuracy"), steps=4, rel=1e-4)
    x, y = (load_file(str(tmp_path / d / "final" / "model.safetensors")) for d in ("two", "one"))
    # a split or pipelined model unties a tied head (the last stage or every split part predicts apart
    # from the embedding): its final/ also holds the head, a copy of the embedding a reward model ignores
    untied = {"lm_head.weight"} if "split" in mode or "pipeline" in mode else set()
    assert x.keys() - y.keys() == untied and y.keys() <= x.keys(), x.keys() ^ y.keys()
    assert "score.weight" in y and not any("lora" in k for k in y)
    for key in y:
        torch.testing.assert_close(x[key], y[key], atol=1e-5, rtol=0, msg=key)
