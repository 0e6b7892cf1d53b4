"""Sampling: the `Engine` (KV-cache generation for `linnet generate` and GRPO rollouts)."""

from linnet.serve.engine import Completion, Engine, Stats

__all__ = ["Completion", "Engine", "Stats"]
