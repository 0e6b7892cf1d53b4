"""`linnet eval` comparing models on one set of records: intervals over the records, the
paired test against the first model, the prompted-base column, the per-record file,
preference accuracy on pairs, and the pairwise judge."""

from __future__ import annotations

import json
import shutil
import types

import numpy as np
import pytest
import torch

from linnet import cli
from linnet.commands import quickstart
from linnet.report.stats import compare, interval, paired
from linnet.train.judge import Judge, agreement
from tests.conftest import quickstart_model

torch.set_num_threads(1)


def test_the_interval_holds_the_mean_and_narrows_with_more_records():
    rng = np.random.default_rng(0)
    small, large = rng.random(50) < 0.3, rng.random(2000) < 0.3
    lo_s, hi_s = interval(small)
    lo_l, hi_l = interval(large)
    assert lo_s <= small.mean() <= hi_s and lo_l <= large.mean() <= hi_l
    assert hi_l - lo_l < (hi_s - lo_s) / 3
    assert interval([1.0, 1.0, 1.0]) == (1.0, 1.0)


def test_the_paired_test_finds_a_real_difference_and_not_a_made_up_one():
    rng = np.random.default_rng(1)
    hard = rng.random(400)  # each record's difficulty, shared by both models: it cancels in the pairs
    a = (rng.random(400) > hard).astype(float)
    better = np.maximum(a, (rng.random(400) < 0.15).astype(float))  # the same, plus 15% more right
    same = (rng.random(400) > hard).astype(float)  # another draw of a's own skill
    found = paired(a, better)
    assert found["low"] > 0 and found["p"] < 0.01 and found["difference"] == pytest.approx(better.mean() - a.mean())
    null = paired(a, same)
    assert null["low"] < 0 < null["high"] and null["p"] > 0.05
    assert paired(a, a) == {"difference": 0.0, "low": 0.0, "high": 0.0, "p": 1.0}
    with pytest.raises(ValueError, match="same examples"):
        paired(a, a[:-1])
    table = compare({"base": {"m": a}, "tuned": {"m": better}, "other": {"n": a}})
    assert "difference" not in table["base"]["m"] and table["tuned"]["m"]["difference_low"] > 0
    assert "difference" not in table["other"]["n"]  # the first model has no n to pair with


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A random quickstart model, the same trained on the task, a copy of the trained one,
    200 held-out problems and three worked examples."""
    root = tmp_path_factory.mktemp("compare")
    quickstart_model(root / "base")
    quickstart.run(root / "run", steps=200, dpo_steps=0, grpo_steps=0, tokens=256, evaluate_every=200)
    shutil.copytree(root / "run" / "model", root / "copy")
    lines = (root / "run" / "held_out.jsonl").read_text().splitlines()
    (root / "held.jsonl").write_text("\n".join(lines[:200]) + "\n")
    (root / "shots.jsonl").write_text("\n".join(lines[300:303]) + "\n")
    return root


def test_a_tuned_model_beats_its_base_and_a_copy_does_not_beat_it(trained, capsys):
    r = trained
    common = ["--data", str(r / "held.jsonl"), "--no-chat", "--max-new-tokens", "4"]
    assert cli.main(["eval", str(r / "base"), str(r / "run" / "model"), *common, "--few-shot", str(r / "shots.jsonl"),
                     "--shot-separator", "</s><s>", "--json", str(r / "c.json"),
                     "--per-example", str(r / "per.jsonl")]) == 0
    found = json.loads((r / "c.json").read_text())
    base, prompted, tuned = str(r / "base"), f"{r / 'base'} + prompt", str(r / "run" / "model")
    assert list(found["models"]) == [base, prompted, tuned]
    win = found["comparison"][tuned]["pass@1"]
    assert win["mean"] > 0.02 and win["difference_low"] > 0 and win["p"] < 0.01
    assert found["comparison"][prompted]["pass@1"]["low"] <= found["comparison"][prompted]["pass@1"]["mean"]
    lines = [json.loads(x) for x in (r / "per.jsonl").read_text().splitlines()]
    assert len(lines) == 200 and [x["record"] for x in lines] == list(range(200))
    right = [x["models"][tuned]["pass@1"] for x in lines]
    assert np.mean(right) == pytest.approx(win["mean"])
    assert all(x["models"][tuned]["completion"].startswith(x["data"]["answer"]) == (y == 1.0)
               for x, y in zip(lines, right))
    assert "vs first" in capsys.readouterr().out

    assert cli.main(["eval", tuned, str(r / "copy"), *common, "--json", str(r / "same.json")]) == 0
    same = json.loads((r / "same.json").read_text())["comparison"][str(r / "copy")]["pass@1"]
    assert same["difference_low"] <= 0 <= same["difference_high"] and same["p"] == 1.0


def test_a_framing_goes_before_every_prompt(trained):
    from linnet.data import load_tokenizer
    from linnet.data.prompts import Framing, encode_prompt

    tokenizer = load_tokenizer(trained / "base")  # adds no BOS of its own (the card's goes first in eval)
    framing = Framing(shots=(("1+2=", "3"), ("4+4=", "8")), separator="</s><s>")
    ids = encode_prompt(tokenizer, "5+5=", False, framing)
    assert ids == [*quickstart.encode("1+2=3"), quickstart.EOS, quickstart.BOS,
                   *quickstart.encode("4+4=8"), quickstart.EOS, quickstart.BOS, *quickstart.encode("5+5=")]
    messages = Framing(system="be brief", shots=(("q", "a"),)).messages("q2")
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]


def test_the_loss_has_an_interval_and_pairs_give_preference_accuracy(trained):
    r = trained
    problems = quickstart.problems(np.random.default_rng(5), 40, 2)
    (r / "done.jsonl").write_text("".join(json.dumps({"prompt": p, "completion": a}) + "\n" for p, a in problems))
    wrong = [(p, a, "=" * len(a)) for p, a in problems]  # not even digits
    (r / "pairs.jsonl").write_text("".join(json.dumps({"prompt": p, "chosen": a, "rejected": b}) + "\n"
                                           for p, a, b in wrong))
    model = str(r / "run" / "model")
    assert cli.main(["eval", model, "--data", str(r / "done.jsonl"), "--no-chat", "--max-new-tokens", "4",
                     "--json", str(r / "loss.json")]) == 0
    found = json.loads((r / "loss.json").read_text())
    low, high = found["interval"]["loss"]
    assert low < found["loss"] < high and found["perplexity"] == pytest.approx(np.exp(found["loss"]))
    assert cli.main(["eval", str(r / "base"), model, "--data", str(r / "pairs.jsonl"), "--no-chat",
                     "--json", str(r / "pairs.json")]) == 0
    table = json.loads((r / "pairs.json").read_text())["comparison"]
    assert table[model]["preference_accuracy"]["mean"] == 1.0
    assert table[model]["margin"]["difference_low"] > 0


class Letters:
    """A character tokenizer: 'A' and 'B' are one token each."""

    bos_id, chat_template, eos_ids = None, None, (0,)

    def encode(self, text):
        return [ord(c) % 128 for c in text]


class Picker(torch.nn.Module):
    """A judge model that reads the question's two answers and favours the one holding
    "good", or (`first`) always says A."""

    card = types.SimpleNamespace(max_positions=10_000)

    def __init__(self, first: bool = False):
        super().__init__()
        self.first = first

    def forward(self, tokens):
        text = "".join(chr(t) for t in tokens.tolist())
        a = text.split("Answer A: ")[1].split("\n")[0]
        logits = torch.zeros(len(tokens), 128)
        logits[-1, ord("A") if self.first or "good" in a else ord("B")] = 1.0
        return logits


def test_a_judge_asks_both_orders_and_a_judge_biased_to_the_first_answer_ties():
    prompts, firsts, seconds = ["q"] * 4, ["good one", "bad", "same", ""], ["bad", "good two", "same", "x"]
    fair = Judge(Picker(), Letters(), chat=False).compare(prompts, firsts, seconds)
    assert fair.tolist() == [1.0, -1.0, 0.0, -1.0]
    biased = Judge(Picker(first=True), Letters(), chat=False).compare(prompts, firsts, seconds)
    assert biased.tolist() == [0.0, 0.0, 0.0, -1.0]  # its verdicts flip with the order: ties
    assert agreement(fair, [1, 1, 1, 1]) == pytest.approx((1 + 0 + 0.5 + 0) / 4)


class Bytes(Letters):
    """A tokenizer that spells every character as two tokens: no letter is one token."""

    def encode(self, text):
        return [t for c in text for t in (ord(c) // 16, ord(c) % 16)]


class Folded(Letters):
    """A tokenizer that spells 'A' and 'B' as one token, the same one."""

    def encode(self, text):
        return super().encode(text.replace("B", "A"))


def test_a_judge_whose_tokenizer_cannot_spell_the_letters_as_tokens_is_refused():
    for tokenizer in (Bytes(), Folded()):
        with pytest.raises(ValueError, match="does not spell 'A' and 'B' as one distinct token each"):
            Judge(Picker(), tokenizer, chat=False)


def test_a_reward_model_judges_the_models_and_its_agreement_with_labels(trained, capsys):
    from linnet import nest
    from linnet.train.reward import add_score_head, save_reward_model

    r = trained
    save_reward_model(add_score_head(nest.load(quickstart.CARD, weights="random", seed=3)), r / "judge")
    quickstart.save_tokenizer(r / "judge" / "tokenizer.json")
    model = str(r / "run" / "model")
    assert cli.main(["eval", model, str(r / "copy"), "--data", str(r / "held.jsonl"), "--no-chat",
                     "--max-new-tokens", "4", "--judge", str(r / "judge"), "--json", str(r / "j.json")]) == 0
    table = json.loads((r / "j.json").read_text())["comparison"]
    assert table[model]["judge"]["mean"] == 0.5 and table[str(r / "copy")]["judge"]["mean"] == 0.5  # a copy ties
    assert cli.main(["eval", model, "--data", str(r / "held.jsonl"), "--no-chat", "--judge", str(r / "judge")]) == 2
    assert "give two models or more" in capsys.readouterr().err  # refused before any model is evaluated
    problems = quickstart.problems(np.random.default_rng(6), 30, 2)
    (r / "labelled.jsonl").write_text("".join(json.dumps({"prompt": p, "chosen": a, "rejected": a[::-1] + "1"}) + "\n"
                                              for p, a in problems))
    assert cli.main(["eval", model, "--data", str(r / "labelled.jsonl"), "--no-chat", "--judge", str(r / "judge"),
                     "--json", str(r / "agree.json")]) == 0
    judge = json.loads((r / "agree.json").read_text())["judge"]
    assert judge["pairs"] == 30 and 0 <= judge["interval"][0] <= judge["agreement"] <= judge["interval"][1] <= 1


def test_an_lm_eval_task_of_ones_own_runs_offline_and_agrees_with_linnet(trained, monkeypatch):
    """lm-evaluation-harness, run for real: a task in a local YAML over a local data file,
    through linnet's model exported for transformers; its exact match on the problems
    equals linnet's own pass@1 (both greedy, both starting the prompt with BOS)."""
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (pip install 'linnet[eval]')")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = trained
    problems = [json.loads(x) for x in (r / "held.jsonl").read_text().splitlines()[:60]]
    (r / "add.jsonl").write_text("".join(json.dumps({"question": p["prompt"], "target": p["answer"]}) + "\n"
                                         for p in problems))
    (r / "tasks").mkdir()
    (r / "tasks" / "add.yaml").write_text(
        "task: linnet_addition\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {r / 'add.jsonl'}\n"
        "test_split: test\noutput_type: generate_until\ndoc_to_text: '{{question}}'\ndoc_to_target: '{{target}}'\n"
        "generation_kwargs:\n  until: ['</s>']\n  max_gen_toks: 4\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n")
    (r / "sixty.jsonl").write_text("".join(json.dumps(p) + "\n" for p in problems))
    assert cli.main(["eval", str(r / "run" / "model"), "--data", str(r / "sixty.jsonl"), "--no-chat",
                     "--max-new-tokens", "4", "--lm-eval", str(r / "tasks" / "add.yaml"),
                     "--json", str(r / "lm.json")]) == 0
    found = json.loads((r / "lm.json").read_text())
    assert found["lm_eval"]["linnet_addition"]["exact_match,none"] == pytest.approx(found["pass@1"])
    assert found["pass@1"] > 0  # the trained model gets some right: the agreement is not 0 == 0
