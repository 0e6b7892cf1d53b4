"""The run declared once (linnet.run.Run): every objective takes it whole or as keywords,
refuses what is neither its own nor the run's, and reports errors in the Python spelling;
held-out evaluation runs at its cadence. GRPO's step in its pieces, each alone."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from linnet import nest
from linnet.config.sampling import GRPOOptions
from linnet.packing import Example, Pair
from linnet.run import RUN_FIELDS, Run
from linnet.serve import Completion
from linnet.train import pack, train
from linnet.train.dpo import dpo
from linnet.train.grpo import PolicyHead, Prompt, Sampler, _Rollout, grpo
from linnet.train.grpo_loss import grpo_loss

torch.set_num_threads(1)
CARD = nest.resolve("debug").replace(vocab=16, hidden=32, intermediate=64, heads=4, kv_heads=2, head_dim=8)


def _rows(n=24, seed=0):
    g = np.random.default_rng(seed)
    examples = [Example.prompted(g.integers(3, 16, 3).tolist(), g.integers(3, 16, 4).tolist()) for _ in range(n)]
    return list(pack(examples, tokens=32))


def _model():
    return nest.load(CARD, weights="random", seed=0, trainable=True)


def test_a_run_object_and_its_fields_as_keywords_train_alike():
    rows = _rows()
    first = _model()
    by_keywords = train(first, rows, optimizer=torch.optim.SGD(first.parameters(), lr=0.1), steps=3, clip=0.5,
                        accumulate=2)
    second = _model()
    by_object = train(second, rows, Run(optimizer=torch.optim.SGD(second.parameters(), lr=0.1), steps=3, clip=0.5),
                      accumulate=2)
    assert by_keywords.losses == by_object.losses
    assert [s.grad_norm for s in by_keywords.steps] == [s.grad_norm for s in by_object.steps]


def test_a_keyword_replaces_the_runs_field_and_unknown_names_are_refused():
    model = _model()
    run = Run(optimizer=torch.optim.SGD(model.parameters(), lr=0.1), steps=5)
    assert len(train(model, _rows(), run, steps=2)) == 2
    with pytest.raises(TypeError, match=r"train: unknown option max_grad_norm; the run's are checkpoint, "
                                        r"checkpoint_every, clip"):
        train(model, _rows(), run, max_grad_norm=1.0)
    with pytest.raises(TypeError, match=r"unknown option checkpoint_evry \(did you mean checkpoint_every\?\); .* "
                                        r"and train's own keywords"):
        train(model, _rows(), run, checkpoint_evry=1)
    with pytest.raises(TypeError, match=r"give run=Run\(...\) or steps="):
        train(model, _rows(), optimizer=run.optimizer)
    pairs = [Pair([3, 4], [5, 6], [7, 8])] * 4
    with pytest.raises(TypeError, match=r"dpo: unknown option tokens_per_step \(did you mean pairs_per_step\?\); .* "
                                        r"the objective's beta, "):
        dpo(model, pairs, run, tokens_per_step=4)


def test_errors_name_the_knob_in_pythons_spelling():
    model = _model()
    pairs = [Pair([3, 4], [5, 6], [7, 8])] * 4
    run = Run(optimizer=torch.optim.SGD(model.parameters(), lr=0.1), steps=1)
    with pytest.raises(ValueError, match=r"^dpo: beta=0.0; it must be > 0") as caught:
        dpo(model, pairs, run, beta=0.0)
    assert "config" not in str(caught.value) and "dpo.beta" not in str(caught.value)
    with pytest.raises(ValueError, match=r"^grpo: clip=\[1.5, 0.2\]; give \[low, high\]"):
        grpo(model, None, [Prompt([3])], lambda p, c: 0.0, run, clip=(1.5, 0.2))
    with pytest.raises(ValueError, match=r"^Run: steps=-1 must be >= 0"):
        Run(optimizer=None, steps=-1)


def test_held_out_evaluation_runs_every_evaluate_every_steps_and_at_the_last():
    model = _model()
    seen = []

    def evaluate(trained):
        assert trained is model
        seen.append(len(seen))
        return {"held_out_probe": float(len(seen))}

    history = train(model, _rows(), optimizer=torch.optim.SGD(model.parameters(), lr=0.1), steps=5,
                    evaluate=evaluate, evaluate_every=2)
    assert [s.metrics.get("held_out_probe") for s in history.steps] == [None, 1.0, None, 2.0, 3.0]


OBJECTIVES = {
    "linnet.train.loop": ["train"], "linnet.train.dpo": ["dpo"], "linnet.train.online_dpo": ["online_dpo"], "linnet.train.kto": ["kto"],
    "linnet.train.reward": ["reward"], "linnet.train.distill": ["distill", "on_policy_distill"],
    "linnet.train.grpo": ["grpo"],
}


@pytest.mark.parametrize("module", sorted(OBJECTIVES))
def test_no_objective_declares_the_runs_plumbing_itself(module):
    """Each objective takes the Run (or its fields as keywords, **options) and declares none of
    the Run's fields as its own parameter; GRPO's `clip` is its ratio clip, an option of
    GRPOOptions, not a parameter either."""
    import importlib

    for name in OBJECTIVES[module]:
        signature = inspect.signature(getattr(importlib.import_module(module), name))
        own = set(signature.parameters)
        assert "run" in own and "options" in own, name
        assert own.isdisjoint(RUN_FIELDS), (name, own & RUN_FIELDS)


def test_grpos_pieces_are_short():
    """GRPO's step is pieces a reader takes in at once: no function of the trainer, and no
    step of the loop every trainer shares, runs past 60 lines."""
    root = Path(__file__).parents[1] / "src" / "linnet" / "train"
    for file in ("grpo.py", "loop.py"):
        for node in ast.walk(ast.parse((root / file).read_text())):
            if isinstance(node, ast.FunctionDef):
                assert node.end_lineno - node.lineno + 1 <= 60, (file, node.name)


class SeededEngine:
    """Completions that depend on the call's seed: a first sampling round (seed below the
    round stride) answers every prompt alike; later rounds alternate two answers."""

    def __init__(self):
        self.seeds = []

    def sample(self, prompts, n=1, seed=0, **options):
        self.seeds.append(seed)
        later = seed >= 100_000_019
        return [Completion(i // n, [7] if later and i % 2 else [3], torch.zeros(1), True)
                for i in range(len(prompts) * n)]


def sevens(prompt, completion):
    return float(completion == [7])


def test_the_sampler_scores_groups_and_draws_more_rounds_until_groups_differ():
    prompts = [Prompt([3 + i]) for i in range(6)]
    chunk = list(enumerate(prompts[:2]))
    plain = Sampler(SeededEngine(), {"sevens": sevens}, GRPOOptions(group=4, prompts_per_step=2))
    kept, scored, rounds = plain(chunk, step=3)
    assert kept == chunk and rounds == 1 and scored.uniform.all() and (scored.advantages == 0).all()
    engine = SeededEngine()
    dynamic = Sampler(engine, {"sevens": sevens}, GRPOOptions(group=4, prompts_per_step=2, dynamic_sampling=2),
                      seed=5, prompts=prompts)
    kept, scored, rounds = dynamic(chunk, step=3)
    assert rounds == 2 and len(kept) == 2 and not scored.uniform.any()
    assert scored.rewards.tolist() == [[0.0, 1.0, 0.0, 1.0]] * 2
    assert engine.seeds == [5 * 1_000_003 + 3, 5 * 1_000_003 + 3 + 100_000_019]
    again = Sampler(SeededEngine(), {"sevens": sevens}, dynamic.settings, seed=5, prompts=prompts)(chunk, step=3)
    assert again[0] == kept  # the extra prompts are drawn from (seed, step): a resumed run draws alike


def test_the_policy_head_keeps_the_first_passes_log_probs_as_the_old_policy():
    weights = np.array([0, 1, 1, 1, 0], dtype=np.float32)
    row = SimpleNamespace(weights=weights)
    advantage = torch.tensor([1.0, -0.5, 2.0])
    engine = torch.tensor([-1.0, -2.0, -0.5])
    rollout = _Rollout([row], [advantage], [engine], [torch.ones(3)], [torch.zeros(3, dtype=torch.long)], 5)
    settings = GRPOOptions(clip=[0.2, 0.2], iterations=2)
    head = PolicyHead(rollout, settings, sequences=1)
    first = torch.tensor([9.0, -1.1, -2.0, -0.4, 9.0], requires_grad=True)
    loss, stats = head(0, row, first)
    assert torch.allclose(loss, -(advantage).sum())  # ratio 1 on the first pass
    assert stats["mismatch"] == pytest.approx(0.1 + 0.0 + 0.1, abs=1e-6) and stats["checked"] == 3
    second = torch.tensor([9.0, -0.6, -2.5, -0.4, 9.0], requires_grad=True)
    loss, stats = head(0, row, second)
    expected, _ = grpo_loss(second[1:4], first[1:4].detach(), advantage, clip=(0.2, 0.2))
    # ratios e^0.5 = 1.65 (advantage 1: held at 1.2) and e^-0.5 = 0.61 (advantage -0.5: held at 0.8), 1
    assert torch.allclose(loss, expected) and loss.item() == pytest.approx(-(1.2 - 0.8 * 0.5 + 2.0))
    assert stats["clipped"] == 2.0
    assert stats["mismatch"] == pytest.approx(0.2, abs=1e-6)  # measured against the first pass, kept


def test_settings_give_an_objective_its_yaml_groups_fields():
    """linnet grpo passes config.grpo whole (settings=); a keyword still overrides a field."""
    from linnet.config.sampling import GRPOSettings

    assert {f.name for f in dataclasses.fields(GRPOOptions)} <= {f.name for f in dataclasses.fields(GRPOSettings)}
    model = _model()
    with pytest.raises(ValueError, match=r"^grpo: group=1; group >= 2"):
        grpo(model, None, [Prompt([3])], sevens, Run(optimizer=None, steps=1), settings=GRPOSettings(), group=1)
