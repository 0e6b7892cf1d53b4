"""How much faster, and in how much memory, does linnet train than TRL (+ PEFT) on the same work?

Same model, data, token budget, hyperparameters and step count on both sides; step time, real
tokens/s, peak memory, losses, and the linnet/TRL ratios.

    python bench/compare.py           # bench/RESULTS.md + results.png: 7M, 4 methods x f32/bf16; 60M SFT-LoRA bf16 (~15 min)
    python bench/compare.py --all     # + 60M: every method and dtype (~45 min)
    python bench/compare.py --quick   # 7M only (~10 min)
    python bench/compare.py --method sft-lora --size 7m --dtype bf16
    python bench/compare.py --out -   # print only, write no markdown
    python bench/compare.py --smoke   # a tiny model, SFT-LoRA f32, 3 steps, print only: both sides run (~20 s)
    python bench/compare.py --method distill --size 7m --dtype f32 --out bench/distill.md   # on-policy distillation

The workload is built here, from seeds, into a temporary directory:
  models   Llama-architecture decoders (untied head, GQA, SwiGLU) of ~7M and ~58M
           parameters, random init by linnet (`nest.load(card, weights="random", seed=0)`)
           and saved as a Hugging Face directory that transformers loads, so both sides start
           from identical weights; a LoRA adapter (rank 16, alpha 32, every q/k/v/o/gate/
           up/down projection) drawn once and saved in PEFT format, loaded by both sides.
  tokenizer a word-level tokenizer.json (`w17` is id 17): text and ids map one to one, so
           TRL's joint prompt+completion tokenization cannot merge across the boundary.
  data     prompt/completion pairs with log-normal lengths (prompts 20-300 tokens, median
           80; completions 20-400, median 120, ending in eos) over a Zipf unigram
           distribution; preference pairs (chosen answers from the lower half of the
           vocabulary, rejected from the upper); prompts for GRPO (20-200 tokens), rewarded
           by the share of completion tokens in the lower half of the vocabulary.

Each (method, size, dtype) runs linnet and TRL in fresh subprocesses (bench/_compare_run.py),
one after the other, alternating which goes first; `--repeats` interleaves more rounds
(A B A B ...). Reported: median step seconds after the first two steps, real (non-padding)
tokens/s (median over those steps of real tokens / step seconds), peak RSS above the
process's RSS after imports, first and last loss, and linnet/TRL ratios (for time and
memory, a ratio below 1 favours linnet). Beside the table: the SFT step's useful FLOP/s as a
share of this machine's measured torch.mm peak (MFU).

TRL's configuration (its fastest honest one on this CPU; see the RESULTS.md notes):
  SFT   packing=True, packing_strategy="bfd", padding_free, max_length=4096, batch 1 row,
        completion_only_loss, pre-tokenized input_ids + completion_mask; linnet trains on
        exactly the rows TRL packed (checked), in the same (sequential) order.
  DPO   8 pairs a step as 1 pair a forward x 8 accumulated (1.5x faster and 4x less memory
        than 8 pairs a forward: less padding), precompute_ref_log_probs=True (linnet's default
        too: the reference log-probabilities of every pair before step 1, timed apart).
  GRPO  plain `generate` (use_vllm=False) of the step's 32 completions at once, trained 8 a
        forward x 4 accumulated (as fast as 32 a forward, 2.4x less memory);
        loss_type="dapo" (token mean over the step, as linnet), beta=0, one iteration,
        group 8 x 4 prompts, 64 new tokens, temperature 1, no top-k/top-p.
  Distill  (--method distill) DistillationTrainer, on-policy: 8 prompts a step (GRPO's kind), one
        completion each sampled by plain `generate` (64 new tokens, temperature 1, no top-k/top-p),
        reverse KL to the teacher (beta=1, temperature 1); linnet's on_policy_distill with
        divergence="reverse_kl" on the same. The teacher: the student's architecture with
        other random weights (seed 1), frozen (linnet's in the run's dtype; TRL's float32, under
        autocast in bf16 runs).
  All   AdamW (no weight decay), constant lr, clip 1.0, activation checkpointing off,
        f32: bf16=False; bf16: bf16=True (autocast over f32 weights), where linnet keeps
        frozen weights in bf16 and trainable ones as f32 masters cast on use.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import KEEP, GiB, command, machine, matmul_peak, run_child, table, write_report

HERE = Path(__file__).resolve().parent
PAD, BOS, EOS = 0, 1, 2

SIZES = {
    # ~7.3M parameters (4.2M of them embedding + head)
    "7m": dict(vocab=8192, hidden=256, intermediate=768, layers=4, heads=4, kv_heads=2, head_dim=64),
    # ~58M parameters: the "60m" card of bench/plan_vs_measured.py
    "60m": dict(vocab=32000, hidden=512, intermediate=1536, layers=8, heads=8, kv_heads=4, head_dim=64),
    # ~0.1M parameters, for --smoke only: that both sides run, not a measurement
    "tiny": dict(vocab=512, hidden=64, intermediate=128, layers=2, heads=2, kv_heads=1, head_dim=32),
    # ~1.1B parameters, Llama-shaped (Llama 3.2 1B's blocks, a 32K vocabulary): for a GPU (--device cuda)
    "1b": dict(vocab=32000, hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8, head_dim=64),
}
METHODS = ("sft-lora", "sft-full", "dpo", "grpo")
# preference objectives beyond DPO, on DPO's pairs: run with --method (bench/objectives.md)
OBJECTIVES = ("simpo", "orpo", "kto", "reward")
# on-policy distillation against TRL's DistillationTrainer: run with --method (bench/distill.md)
DISTILL = ("distill",)
DTYPES = {"f32": "float32", "bf16": "bfloat16"}
LR = {"sft-lora": 1e-3, "sft-full": 3e-4, "dpo": 5e-4, "grpo": 1e-3, "simpo": 5e-4, "orpo": 5e-4, "kto": 5e-4,
      "reward": 5e-4, "distill": 1e-3}
# the ratio the chart draws for a method: real tokens/s, but GRPO's step rate (both sides run the
# same steps, and TRL's step time follows the prompts' lengths where linnet's hardly does, so the
# medians of per-step tokens/s pair different steps)
HEADLINE = {"grpo": "step_rate"}


def headline(method: str) -> str:
    """The row key of the ratio the chart draws for a method (HEADLINE): "speed" or "step_rate"."""
    return HEADLINE.get(method, "speed")


TOKENS = 4096
# linnet's DPO rows: a step's 8 pairs (prompts shared) fill ~3.2K positions; two rows of 2048
# hold them in two forwards and keep the peak under TRL's one-pair forwards
# the reward model's pairs (prompts shared) in rows of 1536: the peak stays at TRL's
LINNET_TOKENS = {"dpo": 2048, "simpo": 2048, "orpo": 2048, "kto": 2048, "reward": 1536}
PAIRS_PER_STEP = 8
GROUP, PROMPTS_PER_STEP, MAX_NEW = 8, 4, 64
DISTILL_PROMPTS = 8  # prompts a distillation step, one completion each
# Left out of the default matrix to keep it near 15 minutes on 2 shared cores; --all runs them
# (TRL takes ~20 s a step at 60M in bf16, more in f32).
SLOW = {("60m", m, d) for m in METHODS for d in DTYPES} - {("60m", "sft-lora", "bf16")}

# ---------------------------------------------------------------------------------------
# The workload


def card(size: str):
    from linnet import nest

    return nest.resolve("debug").replace(
        name=f"bench-{size}", tied_embeddings=False, max_positions=TOKENS, bos_token_id=BOS,
        eos_token_ids=(EOS,), pad_token_id=PAD, dtype="float32", source="bench/compare.py", **SIZES[size])


def words(vocab: int) -> list[str]:
    return ["<pad>", "<s>", "</s>"] + [f"w{i}" for i in range(3, vocab)]


def save_tokenizer(directory: Path, vocab: int) -> None:
    """A word-level tokenizer: whitespace-separated words, one id each, no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words(vocab))}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<pad>")
    fast.save_pretrained(str(directory))


def build_model(size: str, root: Path) -> dict:
    """The model directory (weights + config + tokenizer) and a PEFT adapter directory."""
    import torch

    from linnet import nest
    from linnet.torch.lora import save_peft

    c = card(size)
    model_dir, adapter_dir = root / f"model-{size}", root / f"adapter-{size}"
    model = nest.load(c, weights="random", seed=0)
    model.save_weights(model_dir)
    save_tokenizer(model_dir, c.vocab)
    torch.manual_seed(0)
    model.add_lora(["model.layers.*_proj.weight"], rank=16, alpha=32)
    save_peft(model, adapter_dir, base_model=str(model_dir))
    return dict(model_dir=str(model_dir), adapter_dir=str(adapter_dir), params=c.params(), card=SIZES[size])


def build_teacher(size: str, root: Path) -> str:
    """A distillation teacher: the student's architecture, other random weights (seed 1)."""
    from linnet import nest

    c = card(size)
    teacher_dir = root / f"teacher-{size}"
    nest.load(c, weights="random", seed=1).save_weights(teacher_dir)
    save_tokenizer(teacher_dir, c.vocab)
    return str(teacher_dir)


class Tokens:
    """Zipf-distributed word ids over a random permutation of [3, vocab)."""

    def __init__(self, rng: np.random.Generator, vocab: int, lo: int = 3, hi: int | None = None):
        hi = hi or vocab
        self.ids = rng.permutation(np.arange(lo, hi))
        p = 1.0 / (np.arange(len(self.ids)) + 10.0) ** 1.1
        self.p = p / p.sum()
        self.rng = rng

    def __call__(self, n: int) -> list[int]:
        return self.ids[self.rng.choice(len(self.ids), size=n, p=self.p)].tolist()


def lognormal(rng, n: int, median: float, lo: int, hi: int, sigma: float = 0.8) -> list[int]:
    return np.clip(np.round(rng.lognormal(math.log(median), sigma, size=n)), lo, hi).astype(int).tolist()


def sft_data(vocab: int, steps: int, seed: int) -> dict:
    """Prompt/completion pairs, enough for `steps` full BFD rows, and TRL's BFD bins of
    them (example indices of each packed row, in order)."""
    from datasets import Dataset
    from trl.data_utils import pack_dataset

    rng = np.random.default_rng(seed)
    draw = Tokens(rng, vocab)
    prompts, completions = [], []
    total = 0
    while total < (steps + 2) * TOKENS:
        p, c = lognormal(rng, 1, 80, 20, 300)[0], lognormal(rng, 1, 120, 20, 400)[0]
        prompts.append([BOS] + draw(p - 1))
        completions.append(draw(c - 1) + [EOS])
        total += p + c
    seqs = [p + c for p, c in zip(prompts, completions)]
    ds = Dataset.from_dict({"input_ids": seqs, "example": [[i] * len(s) for i, s in enumerate(seqs)]})
    packed = pack_dataset(ds, TOKENS, "bfd")
    bins = []
    for row, lengths in zip(packed["example"], packed["seq_lengths"]):
        starts = np.cumsum([0] + list(lengths))[:-1]
        bins.append([int(row[s]) for s in starts])
    fill = [sum(len(seqs[i]) for i in b) / TOKENS for b in bins[:steps]]
    assert min(fill) > 0.9, f"BFD rows not full enough for {steps} steps: {fill}"
    return dict(prompt=prompts, completion=completions, bins=bins)


def dpo_data(vocab: int, steps: int, seed: int) -> dict:
    rng = np.random.default_rng(seed + 1)
    draw = Tokens(rng, vocab)
    good, bad = Tokens(rng, vocab, hi=vocab // 2), Tokens(rng, vocab, lo=vocab // 2)
    n = steps * PAIRS_PER_STEP
    out = dict(prompt=[], chosen=[], rejected=[], words=words(vocab))
    for p, c, r in zip(lognormal(rng, n, 80, 20, 300), lognormal(rng, n, 120, 20, 400),
                       lognormal(rng, n, 120, 20, 400)):
        out["prompt"].append([BOS] + draw(p - 1))
        out["chosen"].append(good(c - 1) + [EOS])
        out["rejected"].append(bad(r - 1) + [EOS])
    return out


def grpo_data(vocab: int, steps: int, seed: int, per_step: int = PROMPTS_PER_STEP, median: int = 60) -> dict:
    """GRPO's prompts: log-normal lengths of this median, from a third of it to 10/3 of it."""
    rng = np.random.default_rng(seed + 2)
    draw = Tokens(rng, vocab)
    n = steps * per_step
    lengths = lognormal(rng, n, median, max(2, median // 3), median * 10 // 3)
    return dict(prompt=[[BOS] + draw(p - 1) for p in lengths], words=words(vocab))


def distill_data(vocab: int, steps: int, seed: int) -> dict:
    """GRPO's kind of prompts, DISTILL_PROMPTS a step."""
    return grpo_data(vocab, steps, seed, DISTILL_PROMPTS)


def data_kind(method: str) -> str:
    """The workload a method trains on: the preference objectives all take DPO's pairs."""
    return "dpo" if method in OBJECTIVES else method.split("-")[0]


def build_workload(root: Path, sizes, methods, steps: int, seed: int) -> dict:
    out = {}
    makers = {"sft": sft_data, "dpo": dpo_data, "grpo": grpo_data, "distill": distill_data}
    for size in sizes:
        info = build_model(size, root)
        if "distill" in methods:
            info["teacher_dir"] = build_teacher(size, root)
        vocab = SIZES[size]["vocab"]
        info["data"] = {}
        for kind in sorted({data_kind(m) for m in methods}):
            path = root / f"{kind}-{size}.json"
            data = makers[kind](vocab, steps, seed)
            path.write_text(json.dumps(data))
            info["data"][kind] = str(path)
            if kind == "sft":
                info["sft_bins"] = [[len(data["prompt"][i]) + len(data["completion"][i]) for i in b]
                                    for b in data["bins"][:steps]]
                info["sft_learned"] = [sum(len(data["completion"][i]) for i in b) for b in data["bins"][:steps]]
        out[size] = info
    return out


# ---------------------------------------------------------------------------------------
# FLOPs


def sft_step_flops(size: str, doc_lengths: list[int], learned: int, lora: bool, rank: int = 16) -> float:
    """Useful FLOPs of one SFT step on a row holding documents of these lengths, `learned`
    of its positions with a target: matmuls (2 per multiply-add) of every linear projection
    at every position and of the head where a target is learned (a prompt's logits are
    used by nothing); attention within each document, causal half only; backward = 2x
    forward for what trains, plus the input gradients a frozen weight still passes on
    (LoRA: 2x forward less the weight gradients)."""
    s = SIZES[size]
    D, F, L, H, K, d, V = (s[k] for k in ("hidden", "intermediate", "layers", "heads", "kv_heads", "head_dim", "vocab"))
    shapes = [(H * d, D), (K * d, D), (K * d, D), (D, H * d), (F, D), (F, D), (D, F)]
    tokens = sum(doc_lengths)
    linear = L * sum(o * i for o, i in shapes) * tokens + V * D * learned
    attention_fwd = L * sum(2 * 2 * H * d * n * (n + 1) / 2 for n in doc_lengths)
    if not lora:
        return 6 * linear + 3 * attention_fwd
    adapters = L * sum(rank * (o + i) for o, i in shapes)
    # frozen weights: forward + input gradient; adapters: forward + both gradients
    return 4 * linear + 6 * adapters * tokens + 3 * attention_fwd


# ---------------------------------------------------------------------------------------
# Running


def run_one(spec: dict, scratch: Path) -> dict:
    scratch.mkdir(parents=True, exist_ok=True)
    spec = dict(spec, scratch=str(scratch / "trainer"))
    env = dict(TQDM_DISABLE="1", TOKENIZERS_PARALLELISM="false", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
               PYTHONWARNINGS="ignore", HF_DATASETS_CACHE=str(scratch / "hf-datasets"))
    start = time.perf_counter()
    result = run_child([HERE / "_compare_run.py", json.dumps(spec)], env=env)
    if "error" in result:
        raise RuntimeError(f"{spec['library']} {spec['method']} {spec['size']} {spec['dtype']} failed:\n{result['log']}")
    result["wall_seconds"] = time.perf_counter() - start
    return result


def summarise(results: list[dict]) -> dict:
    """One library's numbers for a case, over its repeats: steps after the first two pooled."""
    secs, rates, cpu_rates, peaks = [], [], [], []
    for r in results:
        s, real = r["seconds"][2:], r["real"][2:]
        secs += s
        rates += [n / t for n, t in zip(real, s)]
        cpu_rates += [n / t for n, t in zip(real, r["cpu_seconds"][2:])]
        peaks.append(r["peak_bytes"])
    first = results[0]
    out = dict(step=statistics.median(secs), timed=sum(secs), tokens_per_s=statistics.median(rates),
               cpu_tokens_per_s=statistics.median(cpu_rates),
               peak=statistics.median(peaks), losses=first["losses"], metrics=first["metrics"],
               real=first["real"], seconds=first["seconds"], wall=statistics.median(r["wall_seconds"] for r in results))
    for key in ("reference_seconds", "setup_seconds"):
        if first.get(key) is not None:
            out[key] = statistics.median(r[key] for r in results)
    return out


def alike(method: str, ours: dict, theirs: dict) -> str:
    """How closely the two trained: loss at the same step (SFT, DPO), DPO accuracy, and
    GRPO mean reward over the first and last three steps."""
    if method == "distill":
        def trend(side):
            values = side["losses"]
            return f"{np.mean(values[:3]):.3f}->{np.mean(values[-3:]):.3f}" if values else "?"

        return f"divergence {trend(ours)} vs {trend(theirs)} (each on its own samples)"
    if method == "grpo":
        def reward(side):
            values = rewards(side)
            return f"{np.mean(values[:3]):.3f}->{np.mean(values[-3:]):.3f}" if values else "?"

        return f"reward {reward(ours)} vs {reward(theirs)}"
    a, b = np.array(ours["losses"]), np.array(theirs["losses"])
    n = min(len(a), len(b))
    rel = np.abs(a[:n] - b[:n]) / np.maximum(np.abs(b[:n]), 1e-9)
    text = f"max loss diff {100 * rel.max():.2f}% (step {int(rel.argmax()) + 1})"
    if method in ("dpo", "simpo", "orpo"):
        acc_a = [m["rewards/accuracies"] for m in ours["metrics"]][-3:]
        acc_b = [m.get("rewards/accuracies", float("nan")) for m in theirs["metrics"]][-3:]
        text += f"; acc last 3 {np.mean(acc_a):.2f} vs {np.mean(acc_b):.2f}"
    return text


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--method", nargs="+", default=list(METHODS), choices=METHODS + OBJECTIVES + DISTILL)
    ap.add_argument("--size", nargs="+", default=["7m", "60m"], choices=list(SIZES))
    ap.add_argument("--dtype", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps a run (the first two are not timed)")
    ap.add_argument("--repeats", type=int, default=1, help="interleaved rounds of linnet and TRL per case")
    ap.add_argument("--quick", action="store_true", help="7M only")
    ap.add_argument("--all", action="store_true", help="also the slow cases (60M DPO/GRPO, 60M f32)")
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny model, SFT-LoRA f32, 3 steps, print only: checks that both sides run")
    ap.add_argument("--trl-dpo-micro", type=int, default=1,
                    help="TRL DPO pairs a forward (the rest of a step's pairs accumulate); 1 is TRL's fastest here")
    ap.add_argument("--trl-grpo-micro", type=int, default=GROUP,
                    help="TRL GRPO completions a forward (one generation a step, the rest accumulates)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where both sides train (cuda: peak memory is the device's, torch.cuda.max_memory_allocated)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads a process (default 1: on the shared 2-core machine a second thread spin-waits "
                         "whenever another job holds the other core)")
    ap.add_argument("--compile-engine", action="store_true",
                    help="GRPO: linnet samples with a compiled engine (Engine(compile=True), warmed up before the "
                         "clock starts); TRL's generate stays as it is")
    ap.add_argument("--engine-dtype", choices=["bf16"], default=None,
                    help="GRPO: linnet samples in bfloat16 from the float32 policy, with correction_cap=2 "
                         "(truncated importance weights for the engines' difference), as its CLI does where the "
                         "CPU computes bf16 natively; TRL samples with the policy itself, in float32")
    ap.add_argument("--uniform-groups", action="store_true",
                    help="GRPO: about half the prompts (ids summing to an even number) score 1 for every "
                         "completion, so their groups have nothing to learn, as with a right-or-wrong reward; "
                         "the others keep the graded reward. Both sides score alike")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(HERE / "RESULTS.md"), help="markdown to write ('-': print only)")
    ap.add_argument("--json", default=None, help="also write every raw result here")
    args = ap.parse_args(argv)
    if args.quick:
        args.size = ["7m"]
    if args.smoke:
        args.size, args.method, args.dtype, args.steps, args.out = ["tiny"], ["sft-lora"], ["f32"], 3, "-"
    steps = args.steps
    cases = [(s, m, d) for s in args.size for m in args.method for d in args.dtype
             if args.all or (s, m, d) not in SLOW or (len(args.size) == 1 and len(args.method) == 1)]
    t_all = time.perf_counter()
    print(f"machine: {machine()}", flush=True)
    peaks = {d: matmul_peak(DTYPES[d], args.threads) for d in sorted({c[2] for c in cases})}
    print("torch.mm peak: " + ", ".join(f"{d} {v / 1e9:.0f} GFLOP/s" for d, v in peaks.items()), flush=True)
    rows, raw = [], []
    with tempfile.TemporaryDirectory(prefix="linnet-compare-") as tmp:
        root = Path(tmp)
        work = build_workload(root, sorted({c[0] for c in cases}), sorted({c[1] for c in cases}), steps, args.seed)
        print(f"workload built in {time.perf_counter() - t_all:.0f} s", flush=True)
        for n, (size, method, dtype) in enumerate(cases):
            info = work[size]
            base = dict(method=method, size=size, dtype=DTYPES[dtype], steps=steps, lr=LR[method], seed=args.seed,
                        threads=args.threads, device=args.device, tokens=LINNET_TOKENS.get(method, TOKENS),
                        model_dir=info["model_dir"],
                        adapter_dir=info["adapter_dir"], data=info["data"][data_kind(method)],
                        teacher_dir=info.get("teacher_dir"),
                        vocab=SIZES[size]["vocab"], eos=EOS, pairs_per_step=PAIRS_PER_STEP, group=GROUP,
                        prompts_per_step=DISTILL_PROMPTS if method == "distill" else PROMPTS_PER_STEP,
                        max_new_tokens=MAX_NEW, compile_engine=args.compile_engine,
                        engine_dtype=DTYPES[args.engine_dtype] if args.engine_dtype else None,
                        uniform_groups=args.uniform_groups,
                        trl_micro={"dpo": args.trl_dpo_micro, "simpo": args.trl_dpo_micro, "orpo": args.trl_dpo_micro,
                                   "reward": args.trl_dpo_micro, "kto": 2 * args.trl_dpo_micro,
                                   "grpo": args.trl_grpo_micro}.get(method))
            order = ["linnet", "trl"] if n % 2 == 0 else ["trl", "linnet"]
            got = {"linnet": [], "trl": []}
            for rep in range(args.repeats):
                for lib in order:
                    r = run_one(dict(base, library=lib), root / f"run-{n}-{rep}-{lib}")
                    got[lib].append(r)
                    raw.append(r)
                    print(f"  {lib:6} {method:8} {size:3} {dtype:4} step {statistics.median(r['seconds'][2:]):6.2f} s"
                          f"  peak {r['peak_bytes'] / GiB:5.2f} GiB  loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}"
                          f"  ({r['wall_seconds']:.0f} s)", flush=True)
                order.reverse()
            ours, theirs = summarise(got["linnet"]), summarise(got["trl"])
            row = dict(size=size, method=method, dtype=dtype, linnet=ours, trl=theirs,
                       speed=ours["tokens_per_s"] / theirs["tokens_per_s"], memory=ours["peak"] / theirs["peak"],
                       step_rate=theirs["timed"] / ours["timed"],
                       speed_cpu=ours["cpu_tokens_per_s"] / theirs["cpu_tokens_per_s"],
                       alike=alike(method, ours, theirs), params=info["params"])
            if method.startswith("sft"):
                flops = [sft_step_flops(size, b, n, method == "sft-lora")
                         for b, n in zip(info["sft_bins"], info["sft_learned"])]
                per_token = sum(flops) / sum(sum(b) for b in info["sft_bins"])
                row["mfu"] = {lib: per_token * row[lib]["tokens_per_s"] / peaks[dtype] for lib in ("linnet", "trl")}
                row["gflops"] = {lib: per_token * row[lib]["tokens_per_s"] / 1e9 for lib in ("linnet", "trl")}
            rows.append(row)
            print(f"{method} {size} {dtype}: tokens/s {ours['tokens_per_s']:.0f} vs {theirs['tokens_per_s']:.0f} "
                  f"= {row['speed']:.2f}x (by CPU time {row['speed_cpu']:.2f}x; step rate {row['step_rate']:.2f}x); "
                  f"memory {row['memory']:.2f}x; "
                  f"{row['alike']}",
                  flush=True)
    seconds = time.perf_counter() - t_all
    if args.json:
        Path(args.json).write_text(json.dumps(dict(rows=rows, raw=raw, peaks=peaks), indent=1))
    plot = chart_path(args.out)
    write_report(report(rows, peaks, command(__file__, argv), steps, args, seconds, plot.name), args.out, keep=KEEP)
    if args.out != "-":
        chart(rows, plot)
        print(f"wrote {plot}")


def chart_path(out: str) -> Path:
    """The ratio chart beside the report: results.png for RESULTS.md, else the report's name."""
    path = Path(out)
    return path.with_name("results.png") if path.name == "RESULTS.md" else path.with_suffix(".png")


# ---------------------------------------------------------------------------------------
# Reporting


def fmt_mem(b: float) -> str:
    return f"{b / GiB:.2f} GiB" if b >= 0.1 * GiB else f"{b / (1 << 20):.0f} MiB"


def results_table(rows: list[dict]) -> list[str]:
    head = ["method", "size", "dtype", "linnet step", "TRL step", "linnet tok/s", "TRL tok/s", "**tok/s ratio**",
            "step-rate ratio", "ratio by CPU time", "linnet peak", "TRL peak", "**memory ratio**", "linnet loss first→last",
            "TRL loss first→last", "trained alike"]
    cells = []
    for r in rows:
        a, b = r["linnet"], r["trl"]
        mem = "" if r["memory"] <= 1.0 else " (higher)"
        cells.append([r["method"], r["size"], r["dtype"], f"{a['step']:.2f} s", f"{b['step']:.2f} s",
                      f"{a['tokens_per_s']:.0f}", f"{b['tokens_per_s']:.0f}",
                      f"**{r['speed']:.2f}x**",
                      f"{r['step_rate']:.2f}x",
                      f"{r['speed_cpu']:.2f}x",
                      fmt_mem(a["peak"]), fmt_mem(b["peak"]), f"**{r['memory']:.2f}x**{mem}",
                      f"{a['losses'][0]:.4f}→{a['losses'][-1]:.4f}", f"{b['losses'][0]:.4f}→{b['losses'][-1]:.4f}",
                      r["alike"]])
    return table(head, cells)


def report(rows, peaks, command, steps, args, seconds, plot: str) -> str:
    import peft
    import transformers
    import trl

    lines = [
        "# linnet against TRL (+ PEFT) on CPU", "",
        "Produced by `bench/compare.py`; numbers are measured, not edited. Ratios are linnet/TRL: "
        "above 1 for tokens/s favours linnet, below 1 for memory favours linnet.", "",
        f"![linnet/TRL ratios]({plot})", "",
        f"- Command: `{command}` ({seconds / 60:.1f} min)",
        f"- Machine: {machine()}; transformers {transformers.__version__}, "
        f"trl {trl.__version__}, peft {peft.__version__}; {args.threads} thread{'s' if args.threads > 1 else ''} a "
        "process. **Shared machine**: "
        "other jobs ran at the same time, so absolute numbers drift (±25%); the ratios of runs made one after "
        "the other in one invocation are the result.",
        f"- Steps: {steps} a run; step time = median after the first two; tok/s ratio = median of each side's "
        "real tokens/s over those steps; step-rate ratio = TRL's total time over them / linnet's (both sides run "
        "the same steps; for GRPO the plainer comparison, since TRL's step time follows the prompts' lengths); "
        f"{args.repeats} round(s) a case, libraries alternating. TRL micro-batches: DPO "
        f"{args.trl_dpo_micro} pair(s) a forward, GRPO {args.trl_grpo_micro} completions a forward, the rest of "
        "each step accumulated. linnet's GRPO engine: "
        + ("compiled (`--compile-engine`: Engine(compile=True), warmed up before the clock starts; TRL's "
           "`generate` not compiled)" if args.compile_engine else "eager (the default)")
        + ("; in bfloat16 (`--engine-dtype bf16`) for the float32 policy, with correction_cap=2; TRL samples in "
           "float32 with the policy." if args.engine_dtype else ", in the policy's dtype.")
        + (" GRPO reward: `--uniform-groups`, about half the prompts score 1 for every completion (uniform "
           "groups, nothing to learn), the rest the graded reward." if args.uniform_groups else ""),
        "- Matmul peak (torch.mm 2048², best of 5): " + ", ".join(f"{d} {v / 1e9:.0f} GFLOP/s" for d, v in peaks.items()),
        "",
    ]
    lines += results_table(rows)
    mfu = [r for r in rows if "mfu" in r]
    if mfu:
        lines += ["", "SFT step: useful FLOP/s (linear layers, the head where a target is learned, attention within documents, causal half; "
                  "LoRA counts no frozen-weight gradients) and MFU against the matmul peak of the dtype:", ""]
        lines += table(["method", "size", "dtype", "linnet GFLOP/s", "linnet MFU", "TRL GFLOP/s", "TRL MFU"],
                       [[r["method"], r["size"], r["dtype"], f"{r['gflops']['linnet']:.0f}",
                         f"{100 * r['mfu']['linnet']:.1f}%", f"{r['gflops']['trl']:.0f}",
                         f"{100 * r['mfu']['trl']:.1f}%"] for r in mfu])
    extra = [r for r in rows if "reference_seconds" in r["linnet"]]
    if extra:
        lines += ["", "DPO reference log-probabilities, computed once before step 1 by both (not in the step times): "
                  + "; ".join(f"{r['size']} {r['dtype']}: linnet {r['linnet']['reference_seconds']:.1f} s, "
                              f"TRL {r['trl']['reference_seconds']:.1f} s" for r in extra)]
    lines += ["", "Per-step losses (linnet / TRL):", ""]
    for r in rows:
        pairs = " ".join(f"{a:.3f}/{b:.3f}" for a, b in zip(r["linnet"]["losses"], r["trl"]["losses"]))
        lines.append(f"- {r['method']} {r['size']} {r['dtype']}: {pairs}")
    grpo = [r for r in rows if r["method"] == "grpo"]
    if grpo:
        lines += ["", "GRPO reward curves, the mean reward of each step's completions (linnet / TRL; the samples "
                  "differ, the task and the starting weights do not):", ""]
        for r in grpo:
            pairs = " ".join(f"{a:.3f}/{b:.3f}" for a, b in zip(*(rewards(r[lib]) for lib in ("linnet", "trl"))))
            lines.append(f"- {r['size']} {r['dtype']}: {pairs}")
    return "\n".join(lines)


def rewards(side: dict) -> list[float]:
    """Each step's mean reward, from the metrics both libraries log under `reward`."""
    return [m["reward"] for m in side["metrics"] if m.get("reward") is not None]


def chart(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['method']}\n{r['size']} {r['dtype']}" for r in rows]
    x = np.arange(len(rows))
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(8, 0.9 * len(rows) + 2), 7), sharex=True)
    speed = [r[headline(r["method"])] for r in rows]  # real tokens/s; GRPO's step rate
    ax1.bar(x, speed, color=["tab:green" if s >= 1 else "tab:orange" for s in speed])
    ax1.scatter(x, [r["speed_cpu"] for r in rows], marker="o", s=18, color="tab:blue", zorder=3,
                label="ratio by CPU time")
    ax1.axhline(1.0, color="gray", lw=0.8)
    by_rate = any(headline(r["method"]) == "step_rate" for r in rows)
    ax1.set_ylabel("linnet / TRL: real tokens/s\n(GRPO: step rate)" if by_rate else "real tokens/s, linnet / TRL")
    ax1.set_ylim(top=1.3 * max(speed))  # room for the legend
    ax1.legend(loc="upper right")
    for i, s in enumerate(speed):
        ax1.text(i, s, f"{s:.2f}x", ha="center", va="bottom", fontsize=8)
    mem = [r["memory"] for r in rows]
    ax2.bar(x, mem, color=["tab:green" if m <= 1 else "tab:orange" for m in mem])
    ax2.axhline(1.0, color="black", lw=0.8)
    ax2.set_ylabel("peak memory, linnet / TRL")
    for i, m in enumerate(mem):
        ax2.text(i, m, f"{m:.2f}x", ha="center", va="bottom", fontsize=8)
    ax2.set_xticks(x, labels, fontsize=7)
    fig.suptitle("linnet vs TRL (+PEFT), same model, data, token budget and steps (CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
