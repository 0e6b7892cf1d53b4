"""bench/gpu_check.py --dry-run: the GPU check's plumbing (its three steps on tiny models on
the CPU) keeps working between the sessions that have a GPU. It takes about a minute, so it
is a slow test: `python -m pytest -m slow tests/test_gpu_check.py` before a GPU session runs
the check."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # run it (pytest -m slow tests/test_gpu_check.py) before a session's GPU check
def test_the_gpu_check_runs_dry_on_a_cpu(tmp_path, capsys):
    pytest.importorskip("trl")
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    status = gpu_check.main(["--dry-run", "--out", str(tmp_path / "GPU.md")])
    report = (tmp_path / "GPU.md").read_text()
    printed = capsys.readouterr().out
    assert status == 0, printed + report
    assert "dry run on the CPU" in report
    assert "- Packages: transformers " in report and ", trl 1." in report  # what the steps ran with
    for step in ("CUDA-only tests", "SFT-LoRA against TRL", "Engine against generate"):
        assert f"## {step}" in report and f"{step}: ok" in printed
