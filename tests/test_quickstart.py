"""The quickstart's stages run end to end (a few steps each) and write the run directory."""

from __future__ import annotations

import json

import numpy as np
import torch

from linnet.commands import quickstart


def test_quickstart_stages_write_their_results(tmp_path):
    torch.set_num_threads(1)
    summary = quickstart.run(tmp_path, steps=30, dpo_steps=2, grpo_steps=2, practice=500, tokens=256,
                               evaluate_every=15)
    assert list(summary["accuracy"])[0] == "start" and "grpo" in summary["accuracy"]
    assert all(0.0 <= v <= 1.0 for v in summary["accuracy"].values())
    metrics = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    stages = {m["stage"] for m in metrics}
    assert {"sft", "grpo"} <= stages
    sft = [m for m in metrics if m["stage"] == "sft" and "loss" in m]
    assert len(sft) == 30 and sft[-1]["loss"] < sft[0]["loss"]
    grpo = [m for m in metrics if m["stage"] == "grpo" and "reward" in m]
    assert [m["step"] for m in grpo] == [31 + summary["dpo_steps_run"], 32 + summary["dpo_steps_run"]]
    assert (tmp_path / "model" / "tokenizer.json").is_file() and (tmp_path / "model" / "config.json").is_file()
    assert (tmp_path / "curves.png").stat().st_size > 1000
    from linnet import nest  # the starting weights, for `linnet eval base model`: the untrained model

    base = nest.load(tmp_path / "base", weights=tmp_path / "base")
    start = nest.load(quickstart.CARD, weights="random", seed=0)
    assert all(torch.equal(a, b) for a, b in zip(base.state_dict().values(), start.state_dict().values()))
    shots = [json.loads(x) for x in (tmp_path / "shots.jsonl").read_text().splitlines()]
    held = {json.loads(x)["prompt"] for x in (tmp_path / "held_out.jsonl").read_text().splitlines()}
    assert len(shots) == 3 and not {s["prompt"] for s in shots} & held


def test_linnet_eval_reproduces_the_quickstarts_held_out_accuracy(tmp_path, capsys):
    """`linnet eval` on the quickstart's model and held-out file: pass@1 (greedy exact
    match) equals the accuracy the quickstart reported after its last stage."""
    from linnet import cli

    torch.set_num_threads(1)
    summary = quickstart.run(tmp_path, steps=60, dpo_steps=0, grpo_steps=0, tokens=256, evaluate_every=60)
    assert cli.main(["eval", str(tmp_path / "model"), "--data", str(tmp_path / "held_out.jsonl"), "--no-chat",
                     "--max-new-tokens", "4", "--show", "2", "--json", str(tmp_path / "eval.json")]) == 0
    found = json.loads((tmp_path / "eval.json").read_text())
    assert found["pass@1"] == list(summary["accuracy"].values())[-1] and found["records"] == 500
    assert len(found["samples"]) == 2 and "->" in capsys.readouterr().out


def test_distinct_problems_never_repeat_and_add_up():
    """The held-out, demonstration and practice sets are one distinct draw cut in three,
    so no stage trains on a held-out problem."""
    drawn = quickstart.problems(np.random.default_rng(0), 10_000, 2, distinct=True)
    assert len({p for p, _ in drawn}) == 10_000
    assert all(int(p[:2]) + int(p[3:5]) == int(a) and len(a) == 3 for p, a in drawn)
