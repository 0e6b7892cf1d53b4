"""The PyTorch backend: the decoder, its losses and weight I/O."""

__all__ = ["CausalLM"]


def __getattr__(name: str):
    # Lazy: CausalLM imports transformers, which only its users need.
    if name == "CausalLM":
        from linnet.torch.causal_lm import CausalLM

        return CausalLM
    if name in NOT_BUILT:
        raise NotImplementedError(f"linnet.torch.{name} is not built yet: {NOT_BUILT[name]}")
    raise AttributeError(f"module 'linnet.torch' has no attribute {name!r}")


# Names the specification gives that do not exist yet, with what to use meanwhile.
NOT_BUILT = {
    "fully_shard": "under torchrun, linnet.train.train runs data-parallel with a whole copy per "
                   "process",
    "pipeline": "pipeline stages are not supported yet",
}
