"""`linnet export`: a LoRA run merged into a Hugging Face directory that transformers loads
with linnet's logits and a model card (the chain, the hub id, the hyperparameters, the
library versions); the adapter alone without --merge; GGUF files of every family read back
with gguf's own reader and checked against llama.cpp's conventions (architecture, keys,
tensor names and shapes, pre-tokenizer, chat template), quantized types with llama.cpp's
fallback for rows that do not divide, and through llama.cpp itself where llama-cpp-python is
installed; a failed export leaves nothing; a failed push and a used --out refused in one
line."""

from __future__ import annotations

import errno
import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from linnet import cli, nest
from linnet.export import load_trained, model_card
from tests.test_safe_runs import ws  # noqa: F401  (a LoRA SFT run of a tiny model: ws/run)

ROOT = Path(__file__).resolve().parent.parent
FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


def bench_gguf():
    """bench/gguf.py (its tiny family models and tokenizers), loaded by its file."""
    spec = importlib.util.spec_from_file_location("bench_gguf", ROOT / "bench" / "gguf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict[str, Path]:
    """A tiny saved model of each family, with a tokenizer in its style (bench/gguf.py)."""
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("families")
    build = bench_gguf().tiny_family
    return {f: build(f, root / f, hidden=64, intermediate=128, vocab=448) for f in FAMILIES}


def field(reader, key):
    """A GGUF key's value as gguf's reader holds it: str, number or list."""
    f = reader.fields[key]
    if f.types[0].name == "STRING":
        return bytes(f.parts[-1]).decode()
    if f.types[0].name == "ARRAY":
        if f.types[-1].name == "STRING":
            return [bytes(f.parts[i]).decode() for i in f.data]
        return [f.parts[i][0].item() for i in f.data]
    return f.parts[-1][0].item()


def read_back(path, name, shape):
    """A tensor of the GGUF file dequantized by gguf's numpy code, in linnet's [out, in] order."""
    import gguf

    t = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}[name]
    return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32).reshape(shape)


def interleaved(w, heads):
    """llama.cpp's rotary row order (its converter's LlamaModel.permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(base, dim, factor, low, high, original):
    """convert_hf_to_gguf.py's rope_freqs for Llama 3 scaling, written out as it is there."""
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            out.append(1)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


def test_a_merged_export_loads_in_transformers_with_the_same_logits(ws, tmp_path):  # noqa: F811
    transformers = pytest.importorskip("transformers")
    assert cli.main(["export", str(ws / "run"), "--out", str(tmp_path / "merged"), "--merge"]) == 0
    adapted, _ = load_trained(ws / "run")
    tokens = torch.tensor([[1, 5, 6, 7, 8, 9, 4]])
    with torch.no_grad():
        want = adapted(tokens)
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
        torch.testing.assert_close(hf(tokens).logits, want, atol=1e-4, rtol=1e-4)
    card = (tmp_path / "merged" / "README.md").read_text()
    summary = json.loads((ws / "run" / "summary.json").read_text())
    assert f"base_model: {ws / 'model'}" in card and "LoRA r=4" in card and f"steps: {summary['steps']}" in card
    assert (tmp_path / "merged" / "tokenizer.json").is_file()


def test_without_merge_an_adapter_run_exports_its_adapter(ws, tmp_path):  # noqa: F811
    assert cli.main(["export", str(ws / "run"), "--out", str(tmp_path / "adapter")]) == 0
    names = sorted(p.name for p in (tmp_path / "adapter").iterdir())
    assert names == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["r"] == 4


@pytest.mark.parametrize("kind", ["f16", "q8_0"])
def test_gguf_holds_the_merged_weights_and_the_vocabulary(ws, tmp_path, kind):  # noqa: F811
    gguf = pytest.importorskip("gguf")
    assert cli.main(["export", str(ws / "run"), "--out", str(tmp_path / "out"), "--gguf", kind]) == 0
    merged, _ = load_trained(tmp_path / "out")
    reader = gguf.GGUFReader(str(tmp_path / "out" / f"model-{kind}.gguf"))
    tensors = {t.name: t for t in reader.tensors}
    card = merged.card
    assert len(tensors) == 2 + 9 * card.layers + (0 if card.tied_embeddings else 1)

    def values(name):
        t = tensors[name]
        data = gguf.dequantize(t.data, t.tensor_type)
        return np.asarray(data, np.float32).reshape(list(reversed(t.shape.tolist())))

    weights = {n: p.detach().numpy() for n, p in merged.named_parameters()}
    tol = 1e-3 if kind == "f16" else 2e-2
    np.testing.assert_allclose(values("token_embd.weight"), weights["model.embed_tokens.weight"], atol=tol)
    np.testing.assert_allclose(values("blk.0.ffn_down.weight"), weights["model.layers.0.mlp.down_proj.weight"],
                               atol=tol)
    q = weights["model.layers.1.self_attn.q_proj.weight"]
    H, d = card.heads, card.head_dim
    interleaved = q.reshape(H, 2, d // 2, -1).swapaxes(1, 2).reshape(q.shape)  # llama.cpp's rotary layout
    np.testing.assert_allclose(values("blk.1.attn_q.weight"), interleaved, atol=tol)
    fields = reader.fields
    assert int(fields["llama.block_count"].parts[-1][0]) == card.layers
    tokens = fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == card.vocab


ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "llama"}
PRE = {"llama": "llama-bpe", "qwen2": "qwen2", "qwen3": "qwen2", "mistral": None}


@pytest.mark.parametrize("family", FAMILIES)
def test_each_familys_gguf_follows_llama_cpps_conventions(families, tmp_path, family):
    """What llama.cpp's converter writes for the family, read back with gguf's own reader:
    the architecture and its keys, the tensors its loader asks for (names, shapes, values,
    q/k rows permuted only where the rotary is llama.cpp's NORM kind), Llama 3's rope
    factors, the pre-tokenizer, the vocabulary's types and the chat template."""
    gguf = pytest.importorskip("gguf")
    assert cli.main(["export", str(families[family]), "--out", str(tmp_path / "out"), "--gguf", "f16"]) == 0
    path = tmp_path / "out" / "model-f16.gguf"
    model = nest.load(families[family], dtype="float32")
    card = model.card
    reader = gguf.GGUFReader(str(path))
    arch = ARCH[family]
    assert field(reader, "general.architecture") == arch
    keys = {gguf.Keys.LLM.BLOCK_COUNT: card.layers, gguf.Keys.LLM.CONTEXT_LENGTH: card.max_positions,
            gguf.Keys.LLM.EMBEDDING_LENGTH: card.hidden, gguf.Keys.LLM.FEED_FORWARD_LENGTH: card.intermediate,
            gguf.Keys.Attention.HEAD_COUNT: card.heads, gguf.Keys.Attention.HEAD_COUNT_KV: card.kv_heads,
            gguf.Keys.Attention.KEY_LENGTH: card.head_dim, gguf.Keys.Attention.VALUE_LENGTH: card.head_dim}
    for key, value in keys.items():
        assert field(reader, key.format(arch=arch)) == value, key
    assert field(reader, gguf.Keys.Rope.FREQ_BASE.format(arch=arch)) == pytest.approx(card.rope_base)
    assert field(reader, gguf.Keys.Attention.LAYERNORM_RMS_EPS.format(arch=arch)) == pytest.approx(card.norm_eps)
    assert field(reader, gguf.Keys.General.FILE_TYPE) == gguf.LlamaFileType.MOSTLY_F16

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], card.layers)
    weights = {n: p.detach().numpy() for n, p in model.named_parameters()}
    tensors = {t.name: t for t in reader.tensors}
    want = {names.get_name(n, try_suffixes=(".weight", ".bias")): n for n in weights}
    if card.rope_scaling is not None:
        want["rope_freqs.weight"] = None
    assert set(tensors) == set(want)
    assert ("output.weight" in tensors) == (not card.tied_embeddings)
    assert {f"blk.0.attn_{p}.bias" in tensors for p in "qkv"} == {family == "qwen2"}
    assert {f"blk.1.attn_{p}_norm.weight" in tensors for p in "qk"} == {family == "qwen3"}
    for target, name in want.items():
        if name is None:
            continue
        assert list(reversed(tensors[target].shape.tolist())) == list(weights[name].shape), target
        w = weights[name]
        if arch == "llama" and ".q_proj." in name:
            w = interleaved(w, card.heads)
        elif arch == "llama" and ".k_proj." in name:
            w = interleaved(w, card.kv_heads)
        kind = tensors[target].tensor_type.name
        assert kind == ("F32" if w.ndim == 1 else "F16"), target
        np.testing.assert_allclose(read_back(path, target, w.shape), w, atol=2e-3, rtol=1e-3)
    if family == "llama":
        s = card.rope_scaling
        np.testing.assert_allclose(read_back(path, "rope_freqs.weight", (card.head_dim // 2,)), llama3_rope_factors(
            card.rope_base, card.head_dim, s.factor, s.low_freq_factor, s.high_freq_factor,
            s.original_max_positions), rtol=1e-5)

    types = field(reader, "tokenizer.ggml.token_type")
    tokens = field(reader, "tokenizer.ggml.tokens")
    assert len(tokens) == len(types) == card.vocab
    assert field(reader, "tokenizer.ggml.model") == ("llama" if family == "mistral" else "gpt2")
    assert ("tokenizer.ggml.pre" in reader.fields and field(reader, "tokenizer.ggml.pre")) == (PRE[family] or False)
    assert field(reader, "tokenizer.chat_template") == card.chat_template and card.chat_template
    assert field(reader, "tokenizer.ggml.eos_token_id") == card.eos_token_ids[0]
    assert field(reader, "tokenizer.ggml.add_bos_token") == (family in ("llama", "mistral"))
    T = gguf.TokenType
    if family == "mistral":
        assert tokens[:3] == ["<unk>", "<s>", "</s>"] and types[:3] == [T.UNKNOWN, T.CONTROL, T.CONTROL]
        assert tokens[3 + 0x41] == "<0x41>" and types[3 + 0x41] == T.BYTE
        assert field(reader, "tokenizer.ggml.add_space_prefix") is True
        scores = field(reader, "tokenizer.ggml.scores")
        assert len(scores) == card.vocab and min(scores) < 0
    else:
        assert types[card.eos_token_ids[0]] == T.CONTROL and len(field(reader, "tokenizer.ggml.merges")) > 10
    if family == "llama":
        assert tokens[-3:] == [f"[PAD{i}]" for i in range(card.vocab - 3, card.vocab)] and types[-1] == T.UNUSED


def test_a_pre_tokenizer_llama_cpp_has_no_name_for_is_written_as_default_with_a_warning(families, tmp_path, capsys):
    import shutil

    gguf = pytest.importorskip("gguf")
    directory = tmp_path / "model"
    shutil.copytree(families["qwen2"], directory)
    spec = json.loads((directory / "tokenizer.json").read_text())
    spec["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\p{L}+|\p{N}+|\s+|[^\s\p{L}\p{N}]+"
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    assert cli.main(["export", str(directory), "--out", str(tmp_path / "out"), "--gguf", "f16"]) == 0
    assert "llama.cpp has no name for this tokenizer's pre-tokenizer" in capsys.readouterr().err
    reader = gguf.GGUFReader(str(tmp_path / "out" / "model-f16.gguf"))
    assert field(reader, "tokenizer.ggml.pre") == "default"


def test_quantized_types_fall_back_where_rows_do_not_divide(tmp_path, capsys):
    """q8_0 on a 176-wide MLP (today's traceback): ffn_down's rows of 176 do not divide into
    blocks of 32, so it stays F16 as llama.cpp's quantizer keeps it; norms stay F32; under
    q4_0 the output head is Q8_0. Each quantized tensor is within its type's error."""
    gguf = pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    directory = bench_gguf().tiny_family("llama", tmp_path / "model", hidden=64, intermediate=176, vocab=320)
    model = nest.load(directory, dtype="float32")
    weights = {n: p.detach().numpy() for n, p in model.named_parameters()}
    for kind, block_type, step in (("q8_0", "Q8_0", 1 / 127), ("q4_0", "Q4_0", 1 / 7), ("q5_1", "Q5_1", 1 / 31)):
        assert cli.main(["export", str(directory), "--out", str(tmp_path / kind), "--gguf", kind]) == 0
        assert "do not divide into blocks" in capsys.readouterr().out
        path = tmp_path / kind / f"model-{kind}.gguf"
        types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
        assert types["blk.0.ffn_down.weight"] == types["blk.1.ffn_down.weight"] == "F16"
        assert types["blk.0.ffn_up.weight"] == types["blk.0.attn_q.weight"] == types["token_embd.weight"] == block_type
        assert types["output.weight"] == "Q8_0"
        assert {types[n] for n in types if n.endswith(("norm.weight", "rope_freqs.weight"))} == {"F32"}
        w = weights["model.layers.0.mlp.up_proj.weight"]
        # one block's error is at most half (q4_0: all of) a step of its largest value
        blocks = np.abs(w.reshape(w.shape[0], -1, 32)).max(-1, keepdims=True)
        err = np.abs(read_back(path, "blk.0.ffn_up.weight", w.shape) - w).reshape(blocks.shape[0], -1, 32)
        assert (err <= blocks * step * 1.01 + 1e-6).all(), kind


def test_k_quants_need_llama_cpp_and_nothing_is_written_before_the_checks(families, tmp_path, monkeypatch, capsys):
    from linnet.export import gguf_file

    monkeypatch.setattr(gguf_file, "_llama_cpp", lambda: None)
    out = tmp_path / "deep" / "out"
    assert cli.main(["export", str(families["qwen3"]), "--out", str(out), "--gguf", "q4_k_m"]) == 2
    assert "llama.cpp's own quantizer" in capsys.readouterr().err and not (tmp_path / "deep").exists()
    with pytest.raises(SystemExit):
        cli.main(["export", str(families["qwen3"]), "--out", str(out), "--gguf", "q3_k"])


def test_a_failed_export_leaves_no_half_written_directory(families, tmp_path, monkeypatch):
    from linnet.export import gguf_file

    def broken(*args, **kwargs):
        raise OSError("the GGUF write broke")

    monkeypatch.setattr(gguf_file, "_write_native", broken)
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "new" / "out", tmp_path / "empty"):
        assert cli.main(["export", str(families["qwen2"]), "--out", str(out), "--gguf", "q8_0"]) == 2
        assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]  # no new/, no .out.tmp-*
        assert list((tmp_path / "empty").iterdir()) == []


def test_the_model_card_names_the_chain_the_hub_id_the_settings_and_versions(ws, tmp_path):  # noqa: F811
    about = {"source": "runs/dpo", "command": "dpo", "chain": ["qwen2.5-0.5b-instruct", "runs/sft", "runs/dpo"],
             "config": {"dpo": {"beta": 0.1, "loss": "sigmoid"}, "lora": {"enabled": True, "rank": 8, "alpha": 16},
                        "training": {"steps": 100, "context_length": 1024}, "optimizer": {"lr": 5e-6},
                        "runtime": {"seed": 3}, "data": {"path": "pairs.jsonl"}},
             "summary": {"steps": 100, "last_loss": 0.42}}
    card = model_card(about, merged=True)
    assert "base_model: Qwen/Qwen2.5-0.5B-Instruct" in card and "https://github.com/)" not in card
    assert "`qwen2.5-0.5b-instruct` → `runs/sft` → `runs/dpo`" in card
    for row in ("| `dpo.beta` | `0.1` |", "| `lora.rank` | `8` |", "| `optimizer.lr` | `5e-06` |",
                "| `training.context_length` | `1024` |", "| `runtime.seed` | `3` |"):
        assert row in card
    assert card.index("dpo.beta") < card.index("lora.rank")  # the method's own settings first
    import linnet

    assert f"linnet {linnet.__version__}, torch {torch.__version__.split('+')[0]}" in card.replace("+cpu", "")

    assert cli.main(["export", str(ws / "run"), "--out", str(tmp_path / "out"), "--merge"]) == 0
    written = (tmp_path / "out" / "README.md").read_text()
    assert f"base_model: {ws / 'model'}" in written and "| `lora.rank` | `4` |" in written
    assert f"`{ws / 'model'}` → `{ws / 'run'}`" in written


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_greedy_tokens_in_llama_cpp_equal_linnets(families, tmp_path, family):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed here")
    from linnet.serve import Engine

    assert cli.main(["export", str(families[family]), "--out", str(tmp_path / "out"), "--gguf", "f16"]) == 0
    model = nest.load(families[family], dtype="float32")
    prompt = [model.card.bos_token_id or 1, 50, 60, 70, 80, 90]
    ours = Engine(model).sample([prompt], max_new_tokens=8, temperature=0.0)[0].tokens
    llm = llama_cpp.Llama(str(tmp_path / "out" / "model-f16.gguf"), n_ctx=64, verbose=False, n_threads=1)
    theirs = []
    for token in llm.generate(prompt, top_k=1, temp=0.0):
        theirs.append(token)
        if len(theirs) == len(ours):
            break
    assert theirs == ours


def test_q4_k_m_is_llama_cpps_own_quantization_with_its_fallbacks(families, tmp_path, capsys):
    """q4_k_m comes from llama.cpp's quantizer (gguf's numpy code has no K-quant): rows of 64
    do not divide into Q4_K's blocks of 256, so llama.cpp falls back to Q5_0 there; the
    metadata (architecture, pre-tokenizer, chat template) comes through; no f16 file stays."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed here")
    gguf = pytest.importorskip("gguf")
    assert cli.main(["export", str(families["qwen2"]), "--out", str(tmp_path / "out"), "--gguf", "q4_k_m"]) == 0
    assert "model-q4_k_m.gguf:" in capsys.readouterr().out
    reader = gguf.GGUFReader(str(tmp_path / "out" / "model-q4_k_m.gguf"))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.ffn_up.weight"] == "Q5_0" and types["blk.0.attn_q.bias"] == "F32"
    assert field(reader, gguf.Keys.General.FILE_TYPE) == gguf.LlamaFileType.MOSTLY_Q4_K_M
    assert field(reader, "general.architecture") == "qwen2" and field(reader, "tokenizer.ggml.pre") == "qwen2"
    assert field(reader, "tokenizer.chat_template") == nest.load(families["qwen2"]).card.chat_template
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith(".")]


def test_refusals_name_the_fix(ws, tmp_path, monkeypatch, capsys):  # noqa: F811
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "keep.txt").write_text("mine")
    assert cli.main(["export", str(ws / "run"), "--out", str(tmp_path / "used")]) == 2
    assert "used: exists and is not empty; export into a new directory" in capsys.readouterr().err
    assert (tmp_path / "used" / "keep.txt").read_text() == "mine"
    assert cli.main(["export", str(ws / "run"), "--out", str(tmp_path / "used" / "keep.txt")]) == 2
    assert "keep.txt: --out is a file, not a directory" in capsys.readouterr().err

    def refused(source, target):
        raise PermissionError(errno.EACCES, "Permission denied", str(source))

    monkeypatch.setattr("linnet.export.os.rename", refused)  # a place that takes no new directory
    assert cli.main(["export", str(ws / "run"), "--out", str(tmp_path / "denied")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'denied'}: cannot write the export there (Permission denied)" in err, err
    assert ".tmp" not in err and sorted(p.name for p in tmp_path.iterdir()) == ["used"]
    monkeypatch.undo()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert cli.main(["export", str(ws / "run"), "--out", str(tmp_path / "pushed"), "--merge",
                     "--push", "someone/model"]) == 2
    assert "the upload failed" in capsys.readouterr().err
    assert (tmp_path / "pushed" / "model.safetensors").is_file()  # the export itself is complete
    assert cli.main(["export", str(tmp_path / "nothing"), "--out", str(tmp_path / "x")]) == 2


def test_linnet_eval_gives_the_held_out_loss_and_perplexity(ws, tmp_path):  # noqa: F811
    import math

    assert cli.main(["eval", str(ws / "run"), "--data", str(ws / "train.jsonl"), "--no-chat",
                     "--json", str(tmp_path / "eval.json")]) == 0
    found = json.loads((tmp_path / "eval.json").read_text())
    assert found["records"] == 80 and found["perplexity"] == pytest.approx(math.exp(found["loss"]))
    assert 0 < found["loss"] < 5
    assert cli.main(["eval", str(ws / "run")]) == 2  # neither --data nor --lm-eval


@pytest.mark.parametrize("kind", ["linear", "yarn"])
def test_gguf_carries_linear_and_yarn_rope_scaling_as_llama_cpps_converter_writes_it(tmp_path, kind):
    gguf = pytest.importorskip("gguf")
    directory = bench_gguf().tiny_family("qwen2", tmp_path / "m", hidden=64, intermediate=128, vocab=448)
    config = json.loads((directory / "config.json").read_text())
    scaling = {"rope_type": kind, "factor": 4.0, "rope_theta": config.get("rope_theta", 10000.0)}
    if kind == "yarn":
        scaling.update(original_max_position_embeddings=64, beta_fast=16.0)
    config.update(rope_parameters=scaling, rope_scaling=scaling)
    (directory / "config.json").write_text(json.dumps(config))
    assert cli.main(["export", str(directory), "--out", str(tmp_path / "out"), "--gguf", "f16"]) == 0
    reader = gguf.GGUFReader(str(tmp_path / "out" / "model-f16.gguf"))
    rope = gguf.Keys.Rope
    assert field(reader, rope.SCALING_TYPE.format(arch="qwen2")) == kind
    assert field(reader, rope.SCALING_FACTOR.format(arch="qwen2")) == 4.0
    assert "rope_freqs.weight" not in {t.name for t in reader.tensors}
    if kind == "yarn":
        assert field(reader, rope.SCALING_ORIG_CTX_LEN.format(arch="qwen2")) == 64
        assert field(reader, rope.SCALING_YARN_BETA_FAST.format(arch="qwen2")) == 16.0
