"""Export a trained model: a merged Hugging Face directory with a model card, a PEFT
adapter, or a GGUF file for llama.cpp.

    model, about = load_trained("runs/sft")            # a run directory, a model or an adapter
    export_directory(model, "out/", about=about, merge=True, dtype="bfloat16")
    write_gguf(model, "out/model.gguf", kind="q8_0")     # f16 or q8_0, with the tokenizer

A run directory's `final/` is either whole weights or a PEFT adapter over the base its
config.json names; merging folds the adapters (dequantizing an NF4 base first) into plain
weights. The model card (README.md) says the base model, the method, the data, the steps
and the final metrics of the run's summary.json.

GGUF (with the `gguf` package): llama.cpp's tensor names, its Llama metadata, q and k rows
permuted to llama.cpp's interleaved rotary layout (as its converter does), and the
tokenizer as a byte-level BPE ("gpt2" model: tokens, types, merges; llama.cpp pre-tokenizes
text with GPT-2's regex, not a Llama 3 or Qwen one) or, for a word-level tokenizer, its
tokens (llama.cpp then runs from token ids; its text tokenizer would differ). f16 stores every matrix in half precision; q8_0 quantizes the
2-D weights in blocks of 32 (norms stay f32).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

GGUF_KINDS = ("f16", "q8_0")


def load_trained(source: str | os.PathLike, *, dtype: str = "float32") -> tuple[Any, dict[str, Any]]:
    """(model, about): the model a run directory trained (its final/, adapters attached to
    the base its config names), a model directory, or a PEFT adapter directory over the
    base its adapter_config.json names. `about` holds what the model card says."""
    from linnet import nest
    from linnet.cards import resolve

    path = Path(source)
    about: dict[str, Any] = {"source": str(path)}
    if (path / "run.json").is_file():
        config = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
        about.update(command=json.loads((path / "run.json").read_text()).get("command"), config=config)
        if (path / "summary.json").is_file():
            about["summary"] = json.loads((path / "summary.json").read_text())
        final = path / "final"
        if not final.is_dir():
            raise ValueError(f"{path}: no final/ (the run has not finished); export a finished run, or a "
                             "checkpoint's weights")
        model_config = config.get("model", {})
        base = model_config.get("card")
        if (final / "adapter_config.json").is_file():
            about["base"] = base
            model = nest.load(resolve(base), weights=model_config.get("weights"), dtype=dtype)
            attach_adapter(model, final)
            return model, about
        about["base"] = base
        return nest.load(final, weights=final, dtype=dtype), about
    if (path / "adapter_config.json").is_file():
        base = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path")
        if not base:
            raise ValueError(f"{path}/adapter_config.json: base_model_name_or_path is empty; load the base and "
                             "call attach_adapter yourself")
        about["base"] = base
        model = nest.load(resolve(base), dtype=dtype)
        attach_adapter(model, path)
        return model, about
    if not (path / "config.json").is_file():
        raise ValueError(f"{path}: not a linnet run (run.json), a model directory (config.json) or a PEFT adapter "
                         "(adapter_config.json)")
    about["base"] = str(path)
    return nest.load(path, weights=path, dtype=dtype), about


def attach_adapter(model, directory: str | os.PathLike) -> None:
    """Add the adapters a PEFT directory describes and load their weights."""
    from linnet.torch.weights import bind_weights

    info = json.loads((Path(directory) / "adapter_config.json").read_text())
    model.add_lora([f"{t}.weight" if not t.endswith(".weight") else t for t in info["target_modules"]],
                   rank=info["r"], alpha=info["lora_alpha"], rslora=info.get("use_rslora", False),
                   dora=info.get("use_dora", False))
    bind_weights(model, directory)


def model_card(about: dict[str, Any], *, merged: bool) -> str:
    """README.md for an export: what was trained, from what, on what, how far."""
    config, summary = about.get("config", {}), about.get("summary", {})
    lora = config.get("lora", {})
    method = about.get("command") or "?"
    kind = "full fine-tuning" if not lora.get("enabled", False) else (
        f"LoRA r={lora.get('rank')} alpha={lora.get('alpha')}" + (" (DoRA)" if lora.get("dora") else ""))
    lines = ["---", "library_name: " + ("transformers" if merged else "peft"),
             f"base_model: {about.get('base')}", "tags: [linnet]", "---", "",
             f"# {Path(about['source']).name}", "",
             f"Trained with [linnet](https://github.com/) `linnet {method}` ({kind}"
             + (", adapters merged into the base" if merged and lora.get("enabled") else "") + ").", "",
             f"- Base model: `{about.get('base')}`"]
    data = config.get("data", {}).get("path")
    if data:
        lines.append(f"- Data: `{data}`")
    if summary:
        for key in ("steps", "final_loss", "held_out_loss", "held_out_accuracy", "held_out_margin", "train_seconds"):
            if summary.get(key) is not None:
                lines.append(f"- {key.replace('_', ' ')}: {summary[key]}")
    return "\n".join(lines) + "\n"


def export_directory(model, out: str | os.PathLike, *, about: dict[str, Any], merge: bool = True,
                     dtype: str | None = None) -> Path:
    """Write `out`: with merge (or no adapters) a whole Hugging Face model (weights in
    `dtype`, config.json, tokenizer, README.md); else the PEFT adapter and README.md."""
    from linnet.files.atomic import write_text
    from linnet.torch.lora import save_peft

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    adapters = bool(getattr(model, "lora", None))
    if adapters and not merge:
        save_peft(model, out, base_model=about.get("base"))
    else:
        if adapters:
            model.merge_lora()
        model.save_weights(out, dtype=dtype or "float32")
    write_text(out / "README.md", model_card(about, merged=not adapters or merge))
    return out


# ---------------------------------------------------------------------------------------
# GGUF

def _gguf_name(name: str) -> str | None:
    """llama.cpp's name of a Decoder parameter."""
    table = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if name in table:
        return table[name]
    parts = name.split(".")  # model.layers.N.<module>.<proj>.weight
    if parts[:2] != ["model", "layers"]:
        return None
    block = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    inner = ".".join(parts[3:-1])
    return f"blk.{parts[2]}.{block[inner]}.{parts[-1]}" if inner in block else None


def _interleave(w: np.ndarray, heads: int) -> np.ndarray:
    """Rows of q or k from the half-split rotary layout to llama.cpp's interleaved one."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tokenizer_fields(writer, tokenizer_json: Path, card) -> None:
    import gguf

    spec = json.loads(tokenizer_json.read_text())
    model = spec["model"]
    vocab = model.get("vocab", {})
    added = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    size = max(card.vocab, max(list(vocab.values()) + list(added.values()) + [-1]) + 1)
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [gguf.TokenType.UNUSED] * size
    for text, i in vocab.items():
        tokens[i], types[i] = text, gguf.TokenType.NORMAL
    for text, i in added.items():
        tokens[i], types[i] = text, gguf.TokenType.CONTROL
    if model["type"] == "BPE":
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        merges = model.get("merges", [])
        writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    elif model["type"] == "WordLevel":
        # the tokens alone: llama.cpp runs the model from token ids; it insists on a merge
        # list, so one placeholder stands in (its own text tokenizer is not the original's)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        normal = [t for t, kind in zip(tokens, types) if kind == gguf.TokenType.NORMAL][:2]
        writer.add_token_merges([" ".join(normal)])
    else:
        raise ValueError(f"{tokenizer_json}: a {model['type']} tokenizer; GGUF export writes byte-level BPE (and "
                         "word-level) vocabularies only")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if card.bos_token_id is not None:
        writer.add_bos_token_id(card.bos_token_id)
    if card.eos_token_ids:
        writer.add_eos_token_id(card.eos_token_ids[0])
    if card.pad_token_id is not None:
        writer.add_pad_token_id(card.pad_token_id)


def write_gguf(model, path: str | os.PathLike, *, kind: str = "f16", tokenizer: str | os.PathLike | None = None) -> Path:
    """A GGUF file of a (merged) Llama-family model for llama.cpp; see the module docstring."""
    import gguf

    from linnet.files.atomic import atomic_path

    if kind not in GGUF_KINDS:
        raise ValueError(f"--gguf {kind}: use one of {', '.join(GGUF_KINDS)}")
    card = model.card
    if card.family not in ("llama", "mistral") or card.qkv_bias or card.qk_norm or card.rope_scaling is not None:
        raise ValueError(f"card {card.name!r} ({card.family}): GGUF export writes plain Llama blocks (no q/k/v "
                         "biases, q/k norms or rope scaling) for now")
    if getattr(model, "lora", None):
        model.merge_lora()
    source = Path(tokenizer) if tokenizer else (Path(card.tokenizer.path) / "tokenizer.json"
                                                if card.tokenizer.path else None)
    if source is None or not source.is_file():
        raise ValueError(f"card {card.name!r}: no tokenizer.json to put in the GGUF file; pass tokenizer=")
    path = Path(path)
    with atomic_path(path) as tmp:
        writer = gguf.GGUFWriter(str(tmp), "llama")
        writer.add_name(card.name)
        writer.add_context_length(card.max_positions)
        writer.add_embedding_length(card.hidden)
        writer.add_block_count(card.layers)
        writer.add_feed_forward_length(card.intermediate)
        writer.add_head_count(card.heads)
        writer.add_head_count_kv(card.kv_heads)
        writer.add_rope_dimension_count(card.head_dim)
        writer.add_key_length(card.head_dim)
        writer.add_value_length(card.head_dim)
        writer.add_rope_freq_base(card.rope_base)
        writer.add_layer_norm_rms_eps(card.norm_eps)
        writer.add_vocab_size(card.vocab)
        writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if kind == "f16" else gguf.LlamaFileType.MOSTLY_Q8_0)
        _tokenizer_fields(writer, source, card)
        for name, p in model.named_parameters():
            target = _gguf_name(name)
            if target is None:
                raise ValueError(f"{name}: no GGUF tensor name for it")
            w = p.detach().float().cpu().numpy()
            if name.endswith("q_proj.weight"):
                w = _interleave(w, card.heads)
            elif name.endswith("k_proj.weight"):
                w = _interleave(w, card.kv_heads)
            if w.ndim == 1:
                writer.add_tensor(target, w.astype(np.float32))
            elif kind == "f16":
                writer.add_tensor(target, w.astype(np.float16))
            else:
                q = gguf.quantize(w, gguf.GGMLQuantizationType.Q8_0)
                writer.add_tensor(target, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return path
