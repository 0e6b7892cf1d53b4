"""Cards: the registry, reading model directories, and clear errors for bad input."""

from __future__ import annotations

import json

import pytest
import torch

from linnet import nest
from tests.conftest import make_hf_model

# Published parameter counts (model cards / config.json arithmetic).
PUBLISHED = {
    "llama-3.1-8b-instruct": 8.03e9,
    "llama-3.2-1b-instruct": 1.24e9,
    "tinyllama-1.1b-chat": 1.10e9,
    "qwen2.5-0.5b-instruct": 0.494e9,
    "qwen3-0.6b": 0.596e9,
    "smollm2-135m-instruct": 0.1345e9,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_registered_cards_have_published_sizes(name):
    card = nest.resolve(name)
    assert card.params() == pytest.approx(PUBLISHED[name], rel=0.005)
    assert card.weights.repo and card.source.startswith("https://")


def test_registered_card_without_local_weights_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="weights='random'"):
        nest.load("debug")  # no published weights: random must be asked for
    with pytest.raises(ValueError, match="cannot fetch TinyLlama"):
        nest.load("tinyllama-1.1b-chat")


def test_unknown_name_lists_the_registry():
    with pytest.raises(ValueError, match="qwen3-0.6b"):
        nest.resolve("no-such-model")


def _config_dir(tmp_path, **changes):
    make_hf_model("llama").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"model_type": "gpt2"}, "unknown model_type 'gpt2'"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4}}, "dynamic"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4, "mscale": 1.0,
                              "original_max_position_embeddings": 64}}, "mscale"),
        ({"model_type": "mistral", "sliding_window": 64}, "sliding-window"),
        ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quantized"),
        ({"attention_dropout": 0.1}, "attention_dropout"),
    ],
)
def test_config_fields_we_cannot_honour_are_refused(tmp_path, changes, message):
    directory = _config_dir(tmp_path, **changes)
    with pytest.raises(ValueError, match=message) as info:
        nest.resolve(directory)
    assert "config.json" in str(info.value)


def test_missing_weights_file(tmp_path):
    directory = make_hf_model("llama")
    directory.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no weights found"):
        nest.load(tmp_path)


def test_mismatched_shapes_name_the_tensor(tmp_path):
    make_hf_model("llama").save_pretrained(tmp_path)
    card = nest.resolve(tmp_path).replace(intermediate=96)
    with pytest.raises(ValueError, match=r"mlp\.\w+_proj\.weight has shape"):
        nest.load(card)


def test_tensors_without_a_place_are_an_error(tmp_path):
    make_hf_model("qwen2").save_pretrained(tmp_path)  # q/k/v biases
    card = nest.resolve(tmp_path).replace(qkv_bias=False)
    with pytest.raises(ValueError, match="no place"):
        nest.load(card)


def test_missing_tensors_are_an_error(tmp_path):
    make_hf_model("llama").save_pretrained(tmp_path)
    card = nest.resolve(tmp_path).replace(layers=3)
    with pytest.raises(ValueError, match="missing"):
        nest.load(card)


def test_directory_card_reads_tokenizer_files_and_template(tmp_path):
    make_hf_model("llama").save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ x }}"}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    card = nest.resolve(tmp_path / "config.json")
    assert card.chat_template == "{{ x }}"
    assert card.tokenizer.path == str(tmp_path) and card.weights.path == str(tmp_path)
    assert card.eos_token_ids == (2, 7)


def test_bad_card_values():
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        nest.resolve("debug").replace(kv_heads=3)
    with pytest.raises(ValueError, match="unknown family"):
        nest.resolve("debug").replace(family="gpt2")
    with pytest.raises(ValueError, match="unknown dtype"):
        nest.load("debug", weights="random", dtype="float8")
    with pytest.raises(ValueError, match="attention path"):
        nest.load("debug", weights="random", attention="fast")
    with pytest.raises(ValueError, match="unknown backend"):
        nest.load("debug", backend="tensorflow")


def test_seed_spelling_is_accepted():
    model = nest.load("debug", weights="random", generics={"T": "bf16"}, cast_dtype=True, entry="loss_packed")
    assert model.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="entry='logits'"):
        nest.load("debug", weights="random", entry="logits")


def test_numerics_fast_and_exact_set_cuda_matmuls_and_leave_a_cpu_alone():
    """nest.load(numerics=) takes the seed's two values. On a CPU nothing changes; for a
    CUDA model each sets torch's process-wide matmul flags its way; another value is
    refused by name."""
    from linnet.torch.loading import set_numerics

    flags = torch.backends.cuda.matmul
    before = torch.get_float32_matmul_precision(), flags.allow_bf16_reduced_precision_reduction
    for numerics in ("fast", "exact"):
        assert nest.load("debug", weights="random", numerics=numerics).device.type == "cpu"
        assert (torch.get_float32_matmul_precision(), flags.allow_bf16_reduced_precision_reduction) == before
    try:
        set_numerics("fast", torch.device("cuda"))
        assert torch.get_float32_matmul_precision() == "high" and flags.allow_bf16_reduced_precision_reduction
        set_numerics("exact", torch.device("cuda"))
        assert torch.get_float32_matmul_precision() == "highest" and not flags.allow_bf16_reduced_precision_reduction
    finally:
        torch.set_float32_matmul_precision(before[0])
        flags.allow_bf16_reduced_precision_reduction = before[1]
    with pytest.raises(ValueError, match="numerics='faster': use 'fast'"):
        nest.load("debug", weights="random", numerics="faster")
