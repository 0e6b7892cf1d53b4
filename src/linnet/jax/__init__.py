"""The JAX backend: the decoder as pure functions over path -> array parameters
(`linnet.jax.model`), the blockwise losses (`linnet.jax.loss`) and an optax trainer
(`linnet.jax.train`). Needs the `jax` extra (jax, optax)."""

from linnet.jax.model import JaxModel, load_model, save_weights

__all__ = ["JaxModel", "load_model", "save_weights"]
