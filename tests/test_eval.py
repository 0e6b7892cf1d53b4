"""`linnet eval` on records as users have them: Alpaca's instruction/input/output give both
the completions' loss and the model's own completions scored against them."""

from __future__ import annotations

import json

import numpy as np
import torch

from linnet import cli
from linnet.commands import quickstart
from tests.conftest import quickstart_model

torch.set_num_threads(1)


def test_alpaca_records_give_their_loss_and_scored_generations(tmp_path):
    quickstart_model(tmp_path / "model")
    rng = np.random.default_rng(0)
    records = [{"instruction": p, "input": "", "output": a} for p, a in quickstart.problems(rng, 6, 2)]
    (tmp_path / "alpaca.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert cli.main(["eval", str(tmp_path / "model"), "--data", str(tmp_path / "alpaca.jsonl"), "--no-chat",
                     "--max-new-tokens", "4", "--json", str(tmp_path / "eval.json")]) == 0
    found = json.loads((tmp_path / "eval.json").read_text())
    assert found["records"] == 6 and np.isfinite(found["loss"]) and found["perplexity"] > 1
    assert {"reward", "pass@1"} <= set(found) and 0 <= found["pass@1"] <= 1
    assert [s["prompt"] for s in found["samples"]] == [r["instruction"] for r in records[:5]]
    assert [s["answer"] for s in found["samples"]] == [r["output"] for r in records[:5]]


def test_evals_hints_name_its_own_flags(tmp_path, capsys):
    quickstart_model(tmp_path / "model")
    (tmp_path / "long.jsonl").write_text(json.dumps({"prompt": "1+1=" * 40, "completion": "2"}) + "\n")
    assert cli.main(["eval", str(tmp_path / "model"), "--data", str(tmp_path / "long.jsonl"), "--no-chat",
                     "--context-length", "16"]) == 2
    err = capsys.readouterr().err
    assert "--context-length" in err and "training.context_length" not in err and "tokens=" not in err
