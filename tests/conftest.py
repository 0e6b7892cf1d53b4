"""Shared fixtures: tiny random transformers models saved as local model directories."""

from __future__ import annotations

import pytest
import torch

TINY = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
    "rope_theta": 500000.0,
}

# family name -> (transformers config class name, extra config fields)
FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "llama3-scaled": ("LlamaConfig", {"rope_parameters": LLAMA3_SCALING}),
    "llama-tied-bias": ("LlamaConfig", {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {"head_dim": 24}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
}


def make_hf_model(family: str, seed: int = 0):
    transformers = pytest.importorskip("transformers")
    config_class, extra = FAMILIES[family]
    config = getattr(transformers, config_class)(**TINY, **extra)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # norms start at one; make them count in the parity check
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


@pytest.fixture(params=sorted(FAMILIES))
def hf_dir(request, tmp_path):
    """(family, transformers model, directory it was saved to)."""
    model = make_hf_model(request.param)
    directory = tmp_path / request.param
    model.save_pretrained(directory)
    return request.param, model, directory


WORDS = [f"w{i}" for i in range(40)]  # the pretraining tests' corpus vocabulary


def word_tokenizer(path, extra: int = 0):
    """A whitespace word-level tokenizer.json over WORDS (<eos> 0, <unk> 1) and `extra`
    more words x0, x1, …; returns `path`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<eos>": 0, "<unk>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    vocab.update({f"x{i}": len(WORDS) + 2 + i for i in range(extra)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))
    return path
