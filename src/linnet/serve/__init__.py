"""Sampling for `linnet generate` and GRPO rollouts: the `Engine` (linnet.torch.engine, KV-cache
generation over the PyTorch decoder) and, behind the vllm extra, `vllm.VLLMEngine`."""

from linnet.torch.engine import Completion, Engine, Stats

__all__ = ["Completion", "Engine", "Stats"]
