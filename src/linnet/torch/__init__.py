"""The PyTorch backend: the decoder, its losses and weight I/O."""
