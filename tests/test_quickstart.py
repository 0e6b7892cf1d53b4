"""The quickstart's stages run end to end (a few steps each) and write the run directory."""

from __future__ import annotations

import json

import torch

from linnet.commands import quickstart


def test_quickstart_stages_write_their_results(tmp_path):
    torch.set_num_threads(1)
    summary = quickstart.run(tmp_path, steps=30, dpo_steps=2, grpo_steps=2, tokens=256, evaluate_every=15)
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
