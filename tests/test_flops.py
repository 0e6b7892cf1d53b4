"""Model and hardware FLOPs utilization: the FLOPs a token (against hand counts), a
device's peak, and every training command's metrics and summary reporting both."""

from __future__ import annotations

import json

import pytest
import torch

from linnet import nest
from linnet.torch.flops import device_peak, flops_per_token, utilization


def test_flops_a_token_by_hand():
    card = nest.resolve("llama-3.1-8b-instruct")
    n, attention = card.params(), 12 * 32 * 32 * 128 * 4096  # 12 L heads head_dim s
    assert flops_per_token(card, 4096) == 6 * n + attention
    assert flops_per_token(card, 4096, frozen_base=True) == 4 * n + attention  # no weight gradients for the base
    assert flops_per_token(card, 4096, recompute=True) == 8 * n + attention * 4 / 3  # a second forward


def test_a_cpus_peak_is_measured_once_and_utilization_is_a_share_of_it():
    peak, where = device_peak(torch.device("cpu"), torch.float32)
    assert 1e8 < peak < 1e14 and "measured" in where
    assert device_peak(torch.device("cpu"), torch.float32)[0] == peak  # cached: one measurement a process
    card = nest.resolve("debug")
    rate = peak / flops_per_token(card, 64)  # tokens/s that would fill the device
    found = utilization(card, 64, rate / 2, torch.device("cpu"), torch.float32, frozen_base=False, recompute=True)
    assert found["mfu"] == pytest.approx(0.5) and found["hfu"] > found["mfu"]


def test_training_commands_report_mfu_and_hfu_each_step_and_overall(tmp_path):
    import numpy as np
    import yaml

    from linnet import cli
    from linnet.commands import quickstart
    from tests.conftest import quickstart_model

    quickstart_model(tmp_path / "model")
    rng = np.random.default_rng(0)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"prompt": p, "completion": a}) + "\n"
                                                  for p, a in quickstart.problems(rng, 40, 2)))
    config = {"model": {"card": str(tmp_path / "model")}, "data": {"path": str(tmp_path / "train.jsonl"),
                                                                   "chat": False},
              "training": {"steps": 3, "context_length": 64}, "lr_schedule": {"warmup_steps": 1},
              "runtime": {"progress": False, "output_dir": str(tmp_path / "run")}}
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(config))
    assert cli.main(["sft", "--config", str(tmp_path / "sft.yaml")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(0 < r["mfu"] <= r["hfu"] < 1 for r in rows)  # LoRA over a frozen base, no checkpointing
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert min(r["mfu"] for r in rows) <= summary["mfu"] <= max(r["mfu"] for r in rows)


def test_measuring_the_peak_draws_nothing_from_the_global_rng():
    """A run measures the device once a process, at its first step: were the operands drawn
    from the global RNG, a resumed run's dropout masks would differ from an uninterrupted one's."""
    import torch

    from linnet.torch.flops import _measured

    before = torch.get_rng_state()
    _measured(torch.device("cpu"), torch.float32, size=64)
    assert torch.equal(torch.get_rng_state(), before)
