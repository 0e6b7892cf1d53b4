"""The JAX backend: the decoder as pure functions over path -> array parameters
(`linnet.jax.model`), the blockwise losses (`linnet.jax.loss`) and an optax trainer
(`linnet.jax.train`). Needs the `jax` extra (jax, optax)."""

from linnet.jax.model import JaxModel, load_model, save_weights

load_source = load_model  # the specification's name: it reads what save_weights writes

__all__ = ["JaxModel", "load_model", "load_source", "save_weights"]
