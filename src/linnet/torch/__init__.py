"""The PyTorch backend: the decoder, its losses and weight I/O."""

__all__ = ["CausalLM", "fully_shard"]


def __getattr__(name: str):
    # Lazy: CausalLM imports transformers, which only its users need.
    if name == "CausalLM":
        from linnet.torch.causal_lm import CausalLM

        return CausalLM
    if name == "fully_shard":
        from linnet.torch.sharding import fully_shard

        return fully_shard
    if name in NOT_BUILT:
        raise NotImplementedError(f"linnet.torch.{name} is not built yet: {NOT_BUILT[name]}")
    raise AttributeError(f"module 'linnet.torch' has no attribute {name!r}")


# Names the specification gives that do not exist yet, with what to use meanwhile.
NOT_BUILT = {
    "pipeline": "pipeline stages are not supported yet; for a model one process cannot hold, use "
                "linnet.torch.fully_shard (FSDP2) or nest.load(..., tensor_parallel=mesh) (docs/parallel.md)",
}
