"""The PyTorch backend: the decoder, its losses and weight I/O."""

__all__ = ["CausalLM"]


def __getattr__(name: str):
    # Lazy: CausalLM imports transformers, which only its users need.
    if name == "CausalLM":
        from linnet.torch.causal_lm import CausalLM

        return CausalLM
    raise AttributeError(f"module 'linnet.torch' has no attribute {name!r}")
