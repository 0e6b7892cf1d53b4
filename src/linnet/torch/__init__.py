"""The PyTorch backend: the decoder, its losses and weight I/O."""

__all__ = ["CausalLM", "fully_shard", "pipeline"]


def __getattr__(name: str):
    # Lazy: CausalLM imports transformers, which only its users need.
    if name == "CausalLM":
        from linnet.torch.causal_lm import CausalLM

        return CausalLM
    if name == "fully_shard":
        from linnet.torch.sharding import fully_shard

        return fully_shard
    if name == "pipeline":
        from linnet.torch.stages import pipeline

        return pipeline
    raise AttributeError(f"module 'linnet.torch' has no attribute {name!r}")
