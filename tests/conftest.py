"""Shared fixtures: tiny random transformers models saved as local model directories."""

from __future__ import annotations

import os

import pytest
import torch

# dtype "auto" (every config's default) computes in bfloat16 on CPUs with AMX or AVX-512
# BF16 and in float32 elsewhere: the suite computes in float32 on every machine, child
# processes included (tests/test_dtype.py checks the choice itself).
os.environ["LINNET_CPU_BF16"] = "0"
# four CPU host devices for the JAX mesh tests, set before any test starts JAX (whichever
# JAX test a worker runs first); the JAX tests take the devices they need of them
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

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


def pytest_collection_modifyitems(config, items):
    """JAX tests run last: JAX starts threads, and the process tests fork afterwards
    would risk a deadlock (the JAX test modules import jax inside their tests only).
    pytest-xdist hands each worker its tests in this order, so they come last in every
    worker too (and `in_processes` refuses to fork after JAX)."""
    items.sort(key=lambda item: item.get_closest_marker("jax") is not None)


def in_processes(fn, *args, processes: int = 2) -> list:
    """[fn(rank, *args) for every rank], each rank a forked process (one thread) in one
    gloo group, joined as under torchrun (from the environment). A failing rank's
    traceback is raised here rather than left to a timeout."""
    import multiprocessing
    import os
    import socket
    import sys
    import traceback

    assert "jax" not in sys.modules, "forking after JAX started is unsafe: mark the JAX test with pytest.mark.jax"

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def main(rank, queue):
        import torch.distributed as dist

        from linnet.torch.distributed import join, leave

        torch.set_num_threads(1)
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(processes),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        try:
            join()
            result = fn(rank, *args)
            if dist.is_initialized():
                leave()
            queue.put((rank, result, None))
        except BaseException:
            queue.put((rank, None, traceback.format_exc()))
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    workers = [ctx.Process(target=main, args=(rank, queue)) for rank in range(processes)]
    for w in workers:
        w.start()
    results = {}
    while len(results) < processes:
        rank, value, error = queue.get(timeout=120)
        if error is not None:  # the others may wait in a collective for it: stop them
            for w in workers:
                w.terminate()
            raise AssertionError(f"process {rank} failed:\n{error}")
        results[rank] = value
    for w in workers:
        w.join(timeout=60)
    assert all(w.exitcode == 0 for w in workers)
    return [results[rank] for rank in range(processes)]


def quickstart_model(directory, seed: int = 0):
    """A random model of the quickstart card, with its tokenizer, saved to `directory`:
    what the command tests train. Returns the directory."""
    from pathlib import Path

    from linnet import nest
    from linnet.commands import quickstart

    nest.load(quickstart.CARD, weights="random", seed=seed).save_weights(directory)
    quickstart.save_tokenizer(Path(directory) / "tokenizer.json")
    return directory


def same_metrics(run, reference, keys, *, steps: int, **tolerance) -> None:
    """Two run directories' metrics.jsonl agree step by step: `steps` lines each, and each
    of `keys` in both or neither line, equal within pytest.approx's `tolerance`."""
    import json

    a, b = ([json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()] for d in (run, reference))
    assert len(a) == len(b) == steps
    for x, y in zip(a, b, strict=True):
        for key in keys:
            assert (key in x) == (key in y) and (key not in y or x[key] == pytest.approx(y[key], **tolerance)), key


def gathered(model) -> dict:
    """{name: numpy array} of every parameter, a split or sharded one gathered whole."""
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().numpy()
            for n, p in model.named_parameters()}
