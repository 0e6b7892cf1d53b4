"""What linnet keeps on disk, for both backends and the pretraining harness: atomic writes
and checksums (`atomic`), checkpoint directories (`checkpoints`), safetensors weight files
(`weights`) and adapters in PEFT's format (`adapters`). No torch, no JAX."""
