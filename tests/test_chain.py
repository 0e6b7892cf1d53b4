"""A run is a model: a finished run (its directory, or its final/ adapter) is named as the
next stage's `model.card`, and as `linnet generate`'s and `linnet export`'s source, with no
export in between. The earlier runs' adapters fold into the base as its weights are read;
the new adapters go over them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from linnet import cli, nest
from linnet.commands import quickstart
from linnet.packing import Example
from linnet.train import pack
from tests.conftest import quickstart_model

torch.set_num_threads(1)


def even_share(prompt, completion) -> float:
    """A reward a random model's completions differ in (GRPO learns only where a group's do)."""
    return sum(t % 2 == 0 for t in completion) / max(len(completion), 1)


def _config(root: Path, command: str, card: Path, data: Path, **groups) -> Path:
    config = {"model": {"card": str(card)}, "data": {"path": str(data), "chat": False}, "lora": {"rank": 4},
              "training": {"steps": 3, "context_length": 64}, "optimizer": {"lr": 1e-2},
              "lr_schedule": {"warmup_steps": 1}, "runtime": {"progress": False, "output_dir": str(root / command)},
              **groups}
    path = root / f"{command}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> Path:
    """SFT on a saved model, DPO with the SFT run as its card, GRPO with the DPO run as its."""
    root = tmp_path_factory.mktemp("chain")
    quickstart_model(root / "model")
    rng = np.random.default_rng(0)
    shown = quickstart.problems(rng, 60, 2)
    (root / "sft.jsonl").write_text("".join(json.dumps({"prompt": p, "completion": a}) + "\n" for p, a in shown))
    (root / "pairs.jsonl").write_text("".join(
        json.dumps({"prompt": p, "chosen": a, "rejected": a[::-1] if a[::-1] != a else a[1:] + "9"}) + "\n"
        for p, a in quickstart.problems(rng, 40, 2)))
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n"
                                                for p, a in quickstart.problems(rng, 40, 2)))
    assert cli.main(["sft", "--config", str(_config(root, "sft", root / "model", root / "sft.jsonl"))]) == 0
    assert cli.main(["dpo", "--config", str(_config(root, "dpo", root / "sft", root / "pairs.jsonl",
                                                    dpo={"pairs_per_step": 4}))]) == 0
    assert cli.main(["grpo", "--config", str(_config(root, "grpo", root / "dpo", root / "prompts.jsonl",
                                                     grpo={"group": 4, "prompts_per_step": 2, "max_new_tokens": 4,
                                                           "rewards": ["tests.test_chain:even_share"]}))]) == 0
    return root


def _log_probs(model) -> torch.Tensor:
    row = next(pack([Example.prompted([1, 5, 6, 7], [8, 9, 10])], tokens=16))
    with torch.no_grad():
        return model.log_probs_packed(row)


def test_each_stage_starts_from_the_last_ones_model(chain):
    """The DPO run's model is the SFT run's, its adapters folded in: its first step's loss is
    log 2 (policy = reference) and its adapter's base is the SFT run; the GRPO run's model is
    the base with both earlier adapters, as named in each run's config."""
    from linnet.export import load_trained

    dpo_rows = [json.loads(line) for line in (chain / "dpo" / "metrics.jsonl").read_text().splitlines()]
    assert dpo_rows[0]["loss"] == pytest.approx(np.log(2), abs=1e-5)
    assert json.loads((chain / "dpo" / "config.json").read_text())["model"]["card"] == str(chain / "sft")
    info = json.loads((chain / "dpo" / "final" / "adapter_config.json").read_text())
    assert info["base_model_name_or_path"] == str(chain / "sft")
    card = nest.resolve(chain / "grpo")
    assert card.adapters == (str(chain / "sft" / "final"), str(chain / "dpo" / "final"), str(chain / "grpo" / "final"))
    sft, _ = load_trained(chain / "sft")  # the base with the SFT adapter attached (not folded)
    assert torch.allclose(_log_probs(nest.load(chain / "sft")), _log_probs(sft), atol=1e-5)
    steps = [_log_probs(nest.load(chain / name)) for name in ("model", "sft", "dpo", "grpo")]
    assert all((a - b).abs().max() > 1e-4 for a, b in zip(steps, steps[1:]))  # every stage moved the model
    again, _ = load_trained(chain / "grpo")
    assert torch.allclose(_log_probs(again), steps[-1], atol=1e-5)


def test_the_last_run_generates_and_exports_with_no_export_between(chain, tmp_path, capsys):
    pytest.importorskip("gguf")
    assert cli.main(["generate", str(chain / "grpo"), "--prompt", "12+34=", "--max-new-tokens", "3"]) == 0
    assert cli.main(["export", str(chain / "grpo"), "--out", str(tmp_path / "gguf"), "--gguf", "f16"]) == 0
    assert any(p.suffix == ".gguf" for p in (tmp_path / "gguf").iterdir())
    assert cli.main(["export", str(chain / "grpo"), "--out", str(tmp_path / "merged"), "--merge"]) == 0
    merged = nest.load(tmp_path / "merged")
    assert torch.allclose(_log_probs(merged), _log_probs(nest.load(chain / "grpo")), atol=1e-5)


def test_a_runs_final_adapter_and_its_checkpoint_name_the_same_model(chain):
    """final/ (a PEFT directory whose base is named in adapter_config.json) and the last
    checkpoint (its trained tensors, the adapter settings from the run's config) are the
    run's model too."""
    whole = _log_probs(nest.load(chain / "dpo"))
    assert torch.allclose(_log_probs(nest.load(chain / "dpo" / "final")), whole, atol=1e-6)
    (last,) = (chain / "dpo" / "checkpoints").iterdir()
    assert torch.allclose(_log_probs(nest.load(last)), whole, atol=1e-6)


def test_a_run_that_has_not_finished_is_refused_as_a_card(chain, tmp_path):
    unfinished = tmp_path / "run"
    unfinished.mkdir()
    (unfinished / "run.json").write_text("{}")
    with pytest.raises(ValueError, match=r"the run has not finished \(no final/\); resume it with --resume"):
        nest.resolve(unfinished)
