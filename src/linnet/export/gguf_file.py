"""GGUF files for llama.cpp, written as its own converter (convert_hf_to_gguf.py) writes
them for each family linnet loads, with the `gguf` package's names for everything:

| linnet family | GGUF architecture | what differs |
| --- | --- | --- |
| llama (Llama 2, 3.x, TinyLlama, SmolLM) | `llama` | q and k rows (and biases) permuted to llama.cpp's interleaved rotary layout; Llama 3 rope scaling as the `rope_freqs.weight` factors; optional q/k/v/o and MLP biases |
| mistral | `llama` | as Llama (llama.cpp's converter maps MistralForCausalLM there) |
| qwen2 (Qwen2, Qwen2.5) | `qwen2` | q/k/v biases; NEOX rotary (rows kept as they are) |
| qwen3 | `qwen3` | q and k RMSNorms (`attn_q_norm`, `attn_k_norm`); NEOX rotary |

The vocabulary goes in as llama.cpp reads it: a byte-level BPE (`tokenizer.ggml.model`
"gpt2": tokens, types, merges) with `tokenizer.ggml.pre` named from the tokenizer.json's
pre-tokenizer (the regex of its Split step: Llama 3's is "llama-bpe", Qwen2's and Qwen3's
"qwen2"; a bare GPT-2 ByteLevel "gpt-2"; digits then GPT-2, SmolLM's, "smollm"); a
SentencePiece-style BPE (byte fallback, "▁" for spaces: Llama 2, TinyLlama, Mistral) as
llama.cpp's "llama" model with scores from the merge order; a word-level vocabulary as its
tokens (llama.cpp then runs from token ids). A pre-tokenizer llama.cpp has no name for is
written as "default" with a warning: llama.cpp then splits text with its default regex,
so text prompts may tokenize differently from the model's own tokenizer (token ids given
directly are unaffected). The chat template goes in as `tokenizer.chat_template`.

Tensor types (`kind`): f32, f16 and the block types gguf's numpy quantizer writes (q8_0,
q5_1, q5_0, q4_1, q4_0), per tensor by llama.cpp's rules (llama-quant.cpp): norms, biases
and rope factors stay f32; a matrix whose rows do not divide the block size (32) falls
back to f16; the output head (the tied embedding where there is none) is kept at q8_0 under
the 4- and 5-bit kinds, where llama.cpp would pick Q6_K, which gguf cannot write. The
K-quants (q4_k_m, q5_k_m, q6_k) are not implemented in gguf's numpy code: they are made
by llama.cpp's own quantizer from an f16 file, through llama-cpp-python when it is
installed (its rules then pick every tensor's type and fallback).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from linnet.cards import rope_frequencies

# kind -> (GGML tensor type of the matrices, llama.cpp file type), written in numpy
NATIVE = {"f32": ("F32", "ALL_F32"), "f16": ("F16", "MOSTLY_F16"), "q8_0": ("Q8_0", "MOSTLY_Q8_0"),
          "q5_1": ("Q5_1", "MOSTLY_Q5_1"), "q5_0": ("Q5_0", "MOSTLY_Q5_0"), "q4_1": ("Q4_1", "MOSTLY_Q4_1"),
          "q4_0": ("Q4_0", "MOSTLY_Q4_0")}
# kind -> llama.cpp file type, made by llama.cpp's quantizer (llama-cpp-python) from f16
LLAMA_CPP = {"q4_k_m": "MOSTLY_Q4_K_M", "q5_k_m": "MOSTLY_Q5_K_M", "q6_k": "MOSTLY_Q6_K"}
KINDS = tuple(NATIVE) + tuple(LLAMA_CPP)

ARCHITECTURES = {"llama": "LLAMA", "mistral": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3"}
# the biases each architecture's loader in llama.cpp reads (src/models/<arch>.cpp)
BIASES = {"LLAMA": ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"),
          "QWEN2": ("attn_q", "attn_k", "attn_v"), "QWEN3": ("attn_q", "attn_k", "attn_v")}

# tokenizer.json Split regexes -> llama.cpp's pre-tokenizer names (llama-vocab.cpp runs the same regex)
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {LLAMA3_REGEX: "llama-bpe", QWEN2_REGEX: "qwen2"}


@dataclass
class Vocabulary:
    """The tokenizer as llama.cpp reads it (tokenizer.ggml.*)."""

    model: str  # "gpt2" (byte-level BPE) or "llama" (SentencePiece-style)
    pre: str | None
    tokens: list[str]
    types: list[int]
    merges: list[str] = field(default_factory=list)
    scores: list[float] | None = None
    add_bos: bool = False
    add_eos: bool = False
    add_space_prefix: bool | None = None
    unk: int | None = None


@dataclass
class Plan:
    """What a GGUF file of `model` will hold, checked before anything is written."""

    kind: str
    arch: str  # gguf.MODEL_ARCH member name
    tokenizer: Path
    vocabulary: Vocabulary
    tensors: dict[str, tuple[str, tuple[int, ...], str]]  # gguf name -> (linnet name, shape, tensor type)
    fallbacks: list[str]  # "name: cols N not divisible by B -> F16"


def _gguf():
    try:
        import gguf
    except ImportError:
        raise ValueError("GGUF export needs the gguf package: pip install 'linnet[export]'") from None
    return gguf


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError:
        return None
    return llama_cpp


# ---------------------------------------------------------------------------------------
# The vocabulary


def _pre_type(spec: dict) -> str | None:
    """llama.cpp's name for the pre-tokenizer of a byte-level BPE tokenizer.json, or None."""
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") for s in steps]
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        return PRE_TOKENIZERS.get(steps[0].get("pattern", {}).get("Regex"))
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and steps[1].get("use_regex", True):
        return "smollm"
    return None


def _sentencepiece_style(spec: dict) -> bool | None:
    """For a BPE with byte fallback: whether it prepends "▁" to the text (Metaspace or
    the Prepend normalizer of Llama 2's tokenizer.json); None when it is not that kind."""
    model = spec["model"]
    if model.get("type") != "BPE" or not model.get("byte_fallback"):
        return None
    pre, norm = spec.get("pre_tokenizer") or {}, spec.get("normalizer") or {}
    steps = [*(pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]),
             *(norm.get("normalizers", []) if norm.get("type") == "Sequence" else [norm])]
    prefix = any(s.get("type") == "Prepend" for s in steps) or any(
        s.get("type") == "Metaspace" and s.get("prepend_scheme", "always") in ("always", "first")
        and s.get("add_prefix_space", True) for s in steps)
    return prefix


def _special_edges(spec: dict) -> tuple[bool, bool]:
    """(add_bos, add_eos): whether the post-processor puts a special token before / after
    a single text (TemplateProcessing, as Llama's and Mistral's tokenizers do)."""
    post = spec.get("post_processor") or {}
    steps = post.get("processors", []) if post.get("type") == "Sequence" else [post]
    for step in steps:
        if step.get("type") == "TemplateProcessing":
            single = step.get("single", [])
            return (bool(single) and "SpecialToken" in single[0],
                    len(single) > 1 and "SpecialToken" in single[-1])
    return False, False


def read_vocabulary(path: Path, card) -> Vocabulary:
    """The tokenizer.json at `path` as llama.cpp reads it (see the module docstring)."""
    gguf = _gguf()
    try:
        spec = json.loads(path.read_text())
        model = spec["model"]
    except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a tokenizer.json ({type(e).__name__}: {e})") from None
    vocab = model.get("vocab", {})
    if model.get("type") not in ("BPE", "WordLevel"):
        raise ValueError(f"{path}: a {model.get('type')} tokenizer; GGUF export writes byte-level BPE, "
                         "SentencePiece-style BPE and word-level vocabularies only")
    added = {t["content"]: (t["id"], t.get("special", True)) for t in spec.get("added_tokens", [])}
    ids = list(vocab.values()) + [i for i, _ in added.values()]
    size = max([card.vocab, *(i + 1 for i in ids)])
    if size > card.vocab:
        raise ValueError(f"{path}: token id {size - 1} is past the model's {card.vocab} embeddings; export with the "
                         "tokenizer the model was trained with")
    T = gguf.TokenType
    tokens, types = [f"[PAD{i}]" for i in range(size)], [T.UNUSED] * size
    for text, i in vocab.items():
        tokens[i], types[i] = text, T.NORMAL
    add_bos, add_eos = _special_edges(spec)
    spm = _sentencepiece_style(spec)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    unk = vocab.get(model.get("unk_token")) if model.get("unk_token") is not None else None
    if spm is not None:
        # llama.cpp's SentencePiece tokenizer merges the best-scored pair first: a piece
        # scores minus the rank of the merge that makes it (earlier merges win, as in BPE)
        scores = [0.0] * size
        ranks: dict[str, int] = {}
        for rank, merge in enumerate(merges):
            ranks.setdefault(merge.replace(" ", "", 1), rank)
        for piece, rank in ranks.items():
            if piece in vocab:
                scores[vocab[piece]] = -float(rank + 1)
        for text, i in vocab.items():
            if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", text):
                types[i] = T.BYTE
        if unk is not None:
            types[unk] = T.UNKNOWN
        result = Vocabulary("llama", None, tokens, types, scores=scores, add_space_prefix=spm, unk=unk)
    elif model["type"] == "BPE":
        pre = _pre_type(spec)
        if pre is None:
            warnings.warn(f"{path}: llama.cpp has no name for this tokenizer's pre-tokenizer; the GGUF file says "
                          "'default', so llama.cpp splits text with its default regex and text prompts may "
                          "tokenize differently there (token ids given directly are unaffected)", stacklevel=3)
        result = Vocabulary("gpt2", pre or "default", tokens, types, merges=merges)
    else:  # word-level: llama.cpp insists on a merge list, so one placeholder stands in
        normal = [t for t, kind in zip(tokens, types) if kind == T.NORMAL][:2]
        result = Vocabulary("gpt2", "default", tokens, types, merges=[" ".join(normal)], unk=unk)
    for text, (i, special) in added.items():
        if result.types[i] not in (T.BYTE, T.UNKNOWN):  # SentencePiece's kinds stay
            tokens[i], types[i] = text, (T.CONTROL if special else T.USER_DEFINED)
    result.add_bos, result.add_eos = add_bos, add_eos
    return result


# ---------------------------------------------------------------------------------------
# The plan: every check before a byte is written


def tensor_type(name: str, shape: tuple[int, ...], kind: str, *, output: bool) -> tuple[str, str | None]:
    """(GGML type, fallback note or None) of one tensor under `kind`, by llama.cpp's rules."""
    gguf = _gguf()
    if len(shape) == 1 or kind == "f32":
        return "F32", None
    if kind == "f16" or kind in LLAMA_CPP:
        return "F16", None
    wanted = NATIVE[kind][0]
    if output and wanted != "Q8_0":
        wanted = "Q8_0"  # llama.cpp: Q6_K, which gguf cannot write; the nearest wider type it can
    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[wanted]][0]
    if shape[-1] % block:
        return "F16", f"{name}: rows of {shape[-1]} do not divide into {wanted}'s blocks of {block}: F16"
    return wanted, None


def plan_gguf(model, kind: str, tokenizer: str | os.PathLike | None = None) -> Plan:
    """Check that `model` can be written as a GGUF file of `kind` and say what it will
    hold; raises ValueError naming the problem otherwise. Adapters are merged first (in
    memory: nothing is written)."""
    from linnet.cards import local_directory

    if kind not in KINDS:
        raise ValueError(f"--gguf {kind}: use one of {', '.join(KINDS)}")
    gguf = _gguf()
    if kind in LLAMA_CPP and _llama_cpp() is None:
        raise ValueError(f"--gguf {kind}: the K-quants are made by llama.cpp's own quantizer (gguf's numpy code "
                         "has none); pip install llama-cpp-python, or pick one of "
                         f"{', '.join(NATIVE)}")
    if getattr(model, "lora", None):
        model.merge_lora()  # the file holds plain weights
    card = model.card
    arch = ARCHITECTURES.get(card.family)
    if arch is None:
        raise ValueError(f"card {card.name!r}: no GGUF architecture for family {card.family!r}")
    if arch == "QWEN2" and card.heads * card.head_dim != card.hidden:
        raise ValueError(f"card {card.name!r}: llama.cpp's qwen2 needs heads x head_dim = hidden "
                         f"({card.heads} x {card.head_dim} != {card.hidden})")
    if card.qk_norm and arch != "QWEN3":
        raise ValueError(f"card {card.name!r}: q/k norms in family {card.family!r}; llama.cpp reads them in qwen3 only")
    if card.rope_scaling is not None and card.rope_scaling.kind == "yarn" and not card.rope_scaling.truncate:
        raise ValueError(f"card {card.name!r}: YaRN with truncate: false; llama.cpp rounds the ramp's ends outwards "
                         "(truncate: true) and has no setting for it")
    if tokenizer is not None:
        source = Path(tokenizer)
    elif card.tokenizer.path is None and card.tokenizer.repo is None:
        source = None
    else:
        source = local_directory(card.tokenizer, ["tokenizer.json", "tokenizer_config.json"],
                                 f"card {card.name!r}: tokenizer", "pass tokenizer=") / "tokenizer.json"
    if source is None or not source.is_file():
        raise ValueError(f"card {card.name!r}: no tokenizer.json to put in the GGUF file; pass tokenizer=")
    vocabulary = read_vocabulary(source, card)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch], card.layers)
    tensors: dict[str, tuple[str, tuple[int, ...], str]] = {}
    fallbacks = []
    for name, p in model.named_parameters():
        target = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if target is None:
            raise ValueError(f"{name}: no GGUF tensor name for it in llama.cpp's {arch.lower()} architecture")
        if name.endswith(".bias") and target.split(".")[-2] not in BIASES[arch]:
            raise ValueError(f"card {card.name!r}: {name}: llama.cpp's {arch.lower()} architecture has no {target}")
        shape = tuple(p.shape)
        output = target == "output.weight" or (target == "token_embd.weight" and card.tied_embeddings)
        typ, note = tensor_type(target, shape, kind, output=output)
        tensors[target] = (name, shape, typ)
        if note:
            fallbacks.append(note)
    return Plan(kind, arch, source, vocabulary, tensors, fallbacks)


# ---------------------------------------------------------------------------------------
# Writing


def _interleave(w: np.ndarray, heads: int) -> np.ndarray:
    """Rows of q or k (or their biases) from the half-split rotary layout to llama.cpp's
    interleaved one, as its converter's LlamaModel.permute."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _metadata(writer, model, plan: Plan, file_type: str) -> None:
    gguf = _gguf()
    card, v = model.card, plan.vocabulary
    writer.add_name(card.name)
    writer.add_block_count(card.layers)
    writer.add_context_length(card.max_positions)
    writer.add_embedding_length(card.hidden)
    writer.add_feed_forward_length(card.intermediate)
    writer.add_head_count(card.heads)
    writer.add_head_count_kv(card.kv_heads)
    writer.add_rope_freq_base(card.rope_base)
    _rope_scaling(writer, card.rope_scaling)
    writer.add_layer_norm_rms_eps(card.norm_eps)
    writer.add_key_length(card.head_dim)
    writer.add_value_length(card.head_dim)
    if plan.arch == "LLAMA":
        writer.add_vocab_size(card.vocab)
        writer.add_rope_dimension_count(card.head_dim)
    writer.add_file_type(gguf.LlamaFileType[file_type])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_tokenizer_model(v.model)
    if v.pre is not None:
        writer.add_tokenizer_pre(v.pre)
    writer.add_token_list(v.tokens)
    if v.scores is not None:
        writer.add_token_scores(v.scores)
    writer.add_token_types(v.types)
    if v.merges:
        writer.add_token_merges(v.merges)
    if card.bos_token_id is not None:
        writer.add_bos_token_id(card.bos_token_id)
    if card.eos_token_ids:
        writer.add_eos_token_id(card.eos_token_ids[0])
    if v.unk is not None:
        writer.add_unk_token_id(v.unk)
    if card.pad_token_id is not None:
        writer.add_pad_token_id(card.pad_token_id)
    writer.add_add_bos_token(v.add_bos)
    writer.add_add_eos_token(v.add_eos)
    if v.add_space_prefix is not None:
        writer.add_add_space_prefix(v.add_space_prefix)
    if card.chat_template:
        writer.add_chat_template(card.chat_template)


def _rope_scaling(writer, s) -> None:
    """Linear and YaRN scaling as llama.cpp's converter writes them (Llama 3's is the
    rope_freqs.weight tensor, `_rope_factors`)."""
    gguf = _gguf()
    if s is None or s.kind == "llama3":
        return
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR if s.kind == "linear" else gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(s.factor)
    if s.kind == "yarn":
        writer.add_rope_scaling_orig_ctx_len(s.original_max_positions)
        writer.add_rope_scaling_yarn_beta_fast(s.beta_fast)
        writer.add_rope_scaling_yarn_beta_slow(s.beta_slow)
        if s.attention_factor is not None:
            writer.add_rope_scaling_yarn_attn_factor(s.attention_factor)


def _rope_factors(model) -> np.ndarray | None:
    """Llama 3 scaling as llama.cpp reads it: each frequency's divisor (rope_freqs.weight),
    from the frequencies linnet itself computes."""
    card = model.card
    if card.rope_scaling is None or card.rope_scaling.kind != "llama3":
        return None
    plain = rope_frequencies(card.replace(rope_scaling=None), np)
    return (plain / model.inv_freq.detach().float().cpu().numpy()).astype(np.float32)


def _write_native(model, path: Path, plan: Plan, kind: str) -> None:
    gguf = _gguf()
    card = model.card
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH[plan.arch]])
    _metadata(writer, model, plan, NATIVE[kind][1])
    factors = _rope_factors(model)
    params = dict(model.named_parameters())

    def data(target: str) -> np.ndarray:
        name, _, typ = plan.tensors[target]
        w = params[name].detach().float().cpu().numpy()
        if plan.arch == "LLAMA" and ".self_attn.q_proj." in name:
            w = _interleave(w, card.heads)
        elif plan.arch == "LLAMA" and ".self_attn.k_proj." in name:
            w = _interleave(w, card.kv_heads)
        if typ in ("F32", "F16"):
            return w.astype(np.float32 if typ == "F32" else np.float16)
        return gguf.quants.quantize(w, gguf.GGMLQuantizationType[typ])

    rope = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight"
    if factors is not None:
        writer.add_tensor_info(rope, factors.shape, factors.dtype, factors.nbytes)
    for target, (_, shape, typ) in plan.tensors.items():  # the layout first; the data streams after
        qtype = gguf.GGMLQuantizationType[typ]
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        rows = int(np.prod(shape[:-1]))
        nbytes = rows * shape[-1] // block * size
        if typ in ("F32", "F16"):
            writer.add_tensor_info(target, shape, np.dtype(np.float32 if typ == "F32" else np.float16), nbytes)
        else:
            writer.add_tensor_info(target, (*shape[:-1], shape[-1] // block * size), np.dtype(np.uint8), nbytes,
                                   raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    if factors is not None:
        writer.write_tensor_data(factors)
    for target in plan.tensors:
        writer.write_tensor_data(data(target))
    writer.close()


def _quantize_with_llama_cpp(source: Path, out: Path, kind: str) -> None:
    llama_cpp = _llama_cpp()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = int(_gguf().LlamaFileType[LLAMA_CPP[kind]])
    params.nthread = os.cpu_count() or 1
    code = llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), params)
    if code != 0:
        raise RuntimeError(f"llama.cpp's quantizer failed on {source} ({kind}, code {code})")


def write_gguf(model, path: str | os.PathLike, *, kind: str = "f16", tokenizer: str | os.PathLike | None = None,
               plan: Plan | None = None) -> Path:
    """A GGUF file of a Llama-family model for llama.cpp (adapters merged first); see the
    module docstring. Everything is checked (`plan_gguf`) before the file is written, and
    it is written beside `path` and renamed into place."""
    from linnet.files.atomic import atomic_path

    plan = plan or plan_gguf(model, kind, tokenizer)
    path = Path(path)
    with atomic_path(path) as tmp:
        if kind in NATIVE:
            _write_native(model, tmp, plan, kind)
        else:  # llama.cpp quantizes an f16 file, which is not kept
            fd, f16 = tempfile.mkstemp(prefix=f".{path.name}.f16.", suffix=".tmp", dir=path.parent)
            os.close(fd)
            try:
                _write_native(model, Path(f16), plan, "f16")
                _quantize_with_llama_cpp(Path(f16), tmp, kind)
            finally:
                os.unlink(f16)
    return path


def written_types(path: str | os.PathLike) -> dict[str, int]:
    """{GGML type: how many tensors} of a GGUF file, read back with gguf's reader."""
    counts: dict[str, int] = {}
    for t in _gguf().GGUFReader(str(path)).tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return counts
