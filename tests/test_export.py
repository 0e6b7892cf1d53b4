"""`linnet export`: a LoRA run merged into a Hugging Face directory that transformers loads
with linnet's logits and a model card; the adapter alone without --merge; GGUF f16 and
q8_0 read back with gguf's own reader (and through llama.cpp where it is installed); a
failed push and a used --out refused in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from linnet import cli
from linnet.export import load_trained
from tests.test_safe_runs import ws  # noqa: F401  (a LoRA SFT run of a tiny model: ws/run)


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


def test_gguf_greedy_tokens_in_llama_cpp_equal_linnets(ws, tmp_path):  # noqa: F811
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed here")
    from linnet.serve import Engine

    assert cli.main(["export", str(ws / "run"), "--out", str(tmp_path / "out"), "--gguf", "f16"]) == 0
    merged, _ = load_trained(tmp_path / "out")
    prompt = [1, 5, 6, 7]
    ours = Engine(merged).sample([prompt], max_new_tokens=8, temperature=0.0)[0].tokens
    llm = llama_cpp.Llama(str(tmp_path / "out" / "model-f16.gguf"), n_ctx=64, verbose=False)
    theirs = []
    for token in llm.generate(prompt, top_k=1, temp=0.0):
        theirs.append(token)
        if len(theirs) == len(ours):
            break
    assert theirs == ours


def test_refusals_name_the_fix(ws, tmp_path, monkeypatch, capsys):  # noqa: F811
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "keep.txt").write_text("mine")
    assert cli.main(["export", str(ws / "run"), "--out", str(tmp_path / "used")]) == 2
    assert "not an empty directory" in capsys.readouterr().err
    assert (tmp_path / "used" / "keep.txt").read_text() == "mine"
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
