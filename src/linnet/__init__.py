"""linnet: train and post-train Llama-family language models from one model card."""

__version__ = "0.1.0"
