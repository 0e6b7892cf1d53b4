"""Killed runs resume to the same weights (bench/faults.py, a few trials): SIGKILL inside a
checkpoint publish or an atomic file write of sft, dpo, grpo and pretraining, and at a
random moment of a token-cache preparation; each then resumes to the uninterrupted run's
weights (SHA-256), leaves no temporary file and one metrics row a step."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_killed_runs_resume_to_the_same_weights():
    script = Path(__file__).parents[1] / "bench" / "faults.py"
    done = subprocess.run([sys.executable, str(script), "--trials", "10", "--seed", "3", "--out", "-"],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "**10 of 10 clean**" in done.stdout
