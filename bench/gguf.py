"""Does llama.cpp run linnet's GGUF exports as linnet runs the model, for every family?

    python bench/gguf.py                    # bench/gguf.md: 4 families x f16, q8_0, q5_0, q4_0, q4_k_m; ~1 min
    python bench/gguf.py --out -            # print only
    python bench/gguf.py --families qwen3 --kinds f16 --out -     # one cell

For each family linnet loads (Llama 3.x with its rope scaling, Qwen2 with q/k/v biases,
Qwen3 with q/k norms, Mistral with a SentencePiece-style vocabulary), a tiny random model
is built with transformers' own config class and a tokenizer trained here in that
family's style (Llama 3's and Qwen2's pre-tokenizer regexes, Mistral's byte-fallback
BPE), saved, loaded by linnet (`nest.load`) and exported with `linnet.export`
(`export_directory(..., gguf=KIND)`). llama.cpp (llama-cpp-python, built from the
package registry's source package) then loads each file and:

- greedy: generates from a prompt of token ids; its tokens against linnet's `Engine`
  greedy tokens (f16 must match: the "greedy" column counts equal tokens);
- logits: every position of the prompt, against linnet's float32 logits (max abs error,
  and top-1 agreement over the positions); the "quantization alone" column is the same
  error of linnet itself run on the weights read back from the file and dequantized with
  gguf's numpy code, the error the type is expected to cost. llama.cpp's own figure
  also includes its activations quantized to 8 bits in the quantized matmuls;
- text: the tokens llama.cpp's tokenizer gives for sample texts against the tokenizer's
  own (tokenizers), which checks the pre-tokenizer type and vocabulary in the file.

q4_k_m is made by llama.cpp's own quantizer (`llama_model_quantize`) from the f16 file:
gguf's numpy code has no K-quant.
"""

from __future__ import annotations

import argparse
import copy as copying
import datetime
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

# this file shares its name with the gguf package: keep its folder off the import path, and
# take the shared helpers by their file
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]
_spec = importlib.util.spec_from_file_location("bench_common", os.path.join(HERE, "_common.py"))
_common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_common)
KEEP, command, machine, table, write_report = (_common.KEEP, _common.command, _common.machine, _common.table,
                                               _common.write_report)

CORPUS = """The quick brown fox jumps over the lazy dog. A llama and a linnet met at the river's edge.
It's 2026, and we've got 3 models: 12 layers, 345 heads, 67890 tokens per second!
Numbers like 3.14159, 2.71828 and 1,000,000 show up in text; so do dates such as 2026-12-06.
Don't you think they'd rather train on CPUs? I'll check, and you'll see: we're fine.
def hello(name):\n    return f"Hello, {name}!"\n\nprint(hello('world'))
Émile bought café au lait for 4.50€ — naïve, perhaps, but delicious. 東京 is big; 你好 means hello.
Lists: apples, oranges, pears; tabs\tand  double  spaces; newlines\n\nand more newlines.
Training, fine-tuning and post-training small language models on one machine is practical.
Quantization trades a little accuracy for a lot of memory: q8_0, q4_0 and q4_k_m are common.
"""
SAMPLES = ["Hello world! It's 2026.", "  The llama's 345 heads\n\nran 3.14 km.", "café 東京 — ok?",
           "def f(x):\n    return x * 2"]

LLAMA3_CHAT = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
               "{{ m['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
               "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MISTRAL_CHAT = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
                "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
SIZE = "hidden 256, MLP 512, 2 layers, 4 heads (2 kv) of 64 (qwen3: 96), vocabulary 384"
PROMPT, NEW = 24, 24
GAPS: dict[str, float] = {}
KINDS = ("f16", "q8_0", "q5_0", "q4_0", "q4_k_m")


def _byte_level(regex: str, specials: list[str], vocab: int, *, bos: str | None):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(ignore_merges=bos is not None))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab - len(specials), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS.splitlines() * 4, trainer)
    tok.add_special_tokens(specials)
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _sentencepiece_style(vocab: int):
    """Mistral's and Llama 2's kind: "▁" for spaces, bytes as <0xXX> pieces, <s> first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    specials = ["<unk>", "<s>", "</s>"]
    draft = Tokenizer(models.BPE(unk_token="<unk>"))
    draft.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    draft.train_from_iterator(CORPUS.splitlines() * 4, trainers.BpeTrainer(
        vocab_size=vocab - 256, special_tokens=specials, show_progress=False))
    trained = json.loads(draft.to_str())["model"]
    pieces = [t for t, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]) if t not in specials]
    table = {t: i for i, t in enumerate((specials + [f"<0x{b:02X}>" for b in range(256)] + pieces)[:vocab])}
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    merges = [(a, b) for a, b in merges if a in table and b in table and a + b in table]
    tok = Tokenizer(models.BPE(table, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(specials)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    return tok


def tiny_family(family: str, directory: str | os.PathLike, *, hidden: int = 256, intermediate: int = 512,
                layers: int = 2, heads: int = 4, kv_heads: int = 2, vocab: int = 384, seed: int = 0,
                scale: float = 0.08, head_dim: int | None = None) -> Path:
    """A tiny random model of `family` (transformers' own config class: llama with Llama 3.1
    rope scaling, qwen2 with q/k/v biases and a tied head, qwen3 with q/k norms and head_dim
    1.5 x hidden / heads, mistral untied) and a tokenizer in its style, saved to `directory`."""
    import transformers

    from linnet.export.gguf_file import LLAMA3_REGEX, QWEN2_REGEX

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    size = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
                rms_norm_eps=1e-5, initializer_range=scale)
    if family == "llama":
        specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
        tok, template = _byte_level(LLAMA3_REGEX, specials, vocab - 3, bos=specials[0]), LLAMA3_CHAT  # 3 unused
        ids = {"bos_token_id": tok.token_to_id(specials[0]), "eos_token_id": tok.token_to_id("<|eot_id|>")}
        config = transformers.LlamaConfig(**size, **ids, rope_parameters={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64, "rope_theta": 500000.0})
        extra = {"bos_token": specials[0], "eos_token": "<|eot_id|>"}
    elif family in ("qwen2", "qwen3"):
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        tok, template = _byte_level(QWEN2_REGEX, specials, vocab, bos=None), CHATML
        ids = {"bos_token_id": tok.token_to_id(specials[0]), "eos_token_id": tok.token_to_id("<|im_end|>")}
        if family == "qwen2":
            config = transformers.Qwen2Config(**size, **ids, tie_word_embeddings=True)
        else:
            config = transformers.Qwen3Config(**size, **ids, head_dim=head_dim or 3 * hidden // (2 * heads),
                                              tie_word_embeddings=False)
        extra = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    elif family == "mistral":
        tok, template = _sentencepiece_style(vocab), MISTRAL_CHAT
        config = transformers.MistralConfig(**size, bos_token_id=1, eos_token_id=2, sliding_window=None)
        extra = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    else:
        raise ValueError(f"family {family!r}: one of {', '.join(FAMILIES)}")
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # norms start at one and biases at zero; make them count
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(directory)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, **extra}, indent=1))
    return directory


# -- reading a GGUF file back ---------------------------------------------------------------


def dequantized(model, path: Path):
    """`model` with every weight replaced by the GGUF file's, dequantized by gguf's numpy
    code (llama.cpp's rotary permutation undone): what the file holds, run by linnet."""
    import gguf

    from linnet.export import plan_gguf
    from linnet.export.gguf_file import _interleave

    plan = plan_gguf(model, "f16")
    reader = gguf.GGUFReader(str(path))
    state = {}
    card = model.card
    for t in reader.tensors:
        if t.name not in plan.tensors:
            continue
        name, shape, _ = plan.tensors[t.name]
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32).reshape(shape)
        if plan.arch == "LLAMA" and ".self_attn.q_proj." in name:
            w = _undo(w, card.heads, _interleave)
        elif plan.arch == "LLAMA" and ".self_attn.k_proj." in name:
            w = _undo(w, card.kv_heads, _interleave)
        state[name] = torch.from_numpy(w.copy())
    copy = copying.deepcopy(model)
    with torch.no_grad():
        for name, p in copy.named_parameters():
            p.copy_(state[name])
    return copy


def _undo(w: np.ndarray, heads: int, interleave) -> np.ndarray:
    """The inverse of the interleave permutation (rows back to the half-split layout)."""
    rows = np.arange(w.shape[0])
    order = interleave(rows, heads)
    back = np.empty_like(rows)
    back[order] = rows
    return w[back]


# -- the comparison --------------------------------------------------------------------------


def compare(family: str, kinds: list[str], root: Path, threads: int) -> list[list]:
    import llama_cpp
    from tokenizers import Tokenizer

    from linnet import nest
    from linnet.export import export_directory, load_trained
    from linnet.serve import Engine

    directory = tiny_family(family, root / family)
    ours = nest.load(directory, dtype="float32")
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    rng = np.random.default_rng(0)
    prompt = [int(x) for x in rng.integers(10, 300, size=PROMPT)]
    if ours.card.bos_token_id is not None:
        prompt[0] = ours.card.bos_token_id
    with torch.no_grad():
        want = ours(torch.tensor([prompt]))[0].float().numpy()
    top2 = np.sort(want, -1)[:, -2:]
    GAPS[family] = float(np.median(top2[:, 1] - top2[:, 0]))
    greedy = Engine(ours).sample([prompt], max_new_tokens=NEW, temperature=0.0)[0].tokens
    rows = []
    for kind in kinds:
        _, about = load_trained(directory)
        model = nest.load(directory, dtype="float32")
        out = root / f"{family}-{kind}"
        export_directory(model, out, about=about, gguf=kind)
        path = out / f"model-{kind}.gguf"
        llm = llama_cpp.Llama(str(path), n_ctx=128, logits_all=True, verbose=False, n_threads=threads, seed=0)
        llm.eval(prompt)
        theirs = np.asarray(llm.scores[: len(prompt)], np.float32)
        llm.reset()
        made = []
        for token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            made.append(int(token))
            if len(made) == len(greedy):
                break
        with torch.no_grad():
            read_back = dequantized(ours, path)(torch.tensor([prompt]))[0].float().numpy()
        text_same = sum(llm.tokenize(s.encode(), add_bos=False, special=False) ==
                        tok.encode(s, add_special_tokens=False).ids for s in SAMPLES)
        error = float(np.abs(theirs - want).max())
        alone = float(np.abs(read_back - want).max())
        compute = float(np.abs(theirs - read_back).max())
        top1 = float((theirs.argmax(-1) == want.argmax(-1)).mean())
        top1_file = float((theirs.argmax(-1) == read_back.argmax(-1)).mean())
        same = sum(a == b for a, b in zip(made, greedy))
        rows.append([family, kind, f"{path.stat().st_size / 1024:.0f} KiB", f"{same}/{len(greedy)}",
                     f"{error:.2e}", f"{alone:.2e}", f"{compute:.2e}", f"{top1:.0%}", f"{top1_file:.0%}",
                     f"{text_same}/{len(SAMPLES)}"])
        print(" | ".join(map(str, rows[-1])), flush=True)
        del llm
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    p.add_argument("--kinds", nargs="+", default=list(KINDS))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=os.path.join(HERE, "gguf.md"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    import llama_cpp

    rows = []
    with tempfile.TemporaryDirectory() as root:
        for family in args.families:
            rows += compare(family, args.kinds, Path(root), args.threads)
    from importlib import metadata

    gaps = ', '.join(f'{f} {g:.3f}' for f, g in GAPS.items())
    head = ["family", "kind", "file", "greedy = linnet's", "llama.cpp vs linnet", "quantization alone",
            "llama.cpp vs linnet on the file's weights", "top-1 = linnet's", "top-1 = linnet's on the file's weights",
            "text tokens = tokenizer's"]
    lines = ["# linnet's GGUF exports through llama.cpp", "", f"    {command(__file__)}", "",
             f"- machine: {machine()}", f"- date: {datetime.date.today().isoformat()}",
             f"- llama-cpp-python {llama_cpp.__version__} (built here from the registry's source package), "
             f"gguf {metadata.version('gguf')}",
             f"- models: {SIZE}; prompt of {PROMPT} token ids, {NEW} greedy tokens",
             f"- median gap between linnet's two best logits: {gaps}", "",
             "Logit errors are the largest absolute difference over every prompt position and vocabulary entry.",
             "", *table(head, rows, "llllrrrrrr"), ""]
    write_report("\n".join(lines), args.out, KEEP)


if __name__ == "__main__":
    main()
