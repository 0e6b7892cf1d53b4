"""How fast does the pretraining harness run on real text: preparation, loading, training?

Preparation throughput, the loader's share of step time, and training tokens/s and MFU of the
tiny and ~20M presets.

    python bench/pretrain.py all --out bench/pretrain.md   # bench/pretrain.md
    python bench/pretrain.py prepare            # 1, 2, 4 tokenizer workers, interleaved
    python bench/pretrain.py loader             # the loader alone at the 20M preset's shapes
    python bench/pretrain.py train              # tokens/s, MFU and loader share (both presets)
    python bench/pretrain.py train --data ../shared/data --steps 6
    python bench/pretrain.py prepare --repeat 1 --rounds 1 --workers 1 --out -   # smoke (~5 s)
    python bench/pretrain.py train --steps 2 --out -                           # smoke (~15 s)

Corpora (from `--data`, default ../shared/data): tinyshakespeare/input.txt (one document
per speech), llamafactory_demo/c4_demo.jsonl (300 web pages) and wiki_demo.txt (one
document per paragraph). Preparation reads them `--repeat` times over (so the work
outlasts the workers' start) with a byte-level BPE of 8,192 tokens trained once
beforehand, so the numbers are tokenization, shuffling and writing alone; the cache is
rebuilt from scratch in each run, runs interleaved 1, 2, 4, 1, 2, 4, … (the machine is
shared and drifts).

Training runs the presets through `linnet.pretrain.runner.run` on a tinyshakespeare cache:
the tiny preset as shipped (BPE 512, context 256), and the 20M preset's model and context
(vocabulary 32,000: model.vocab=32000 over a BPE trained to 32,000 on tinyshakespeare) with
a smaller micro-batch so that a few updates finish on a CPU. MFU = model FLOPs/s
(6N + 12·L·d·T per token, `linnet.torch.flops.flops_per_token`) over the peak of a float32 matmul
(2048², torch.mm) measured on the same threads just before; on CUDA over the bf16 dense
peak given by --peak-tflops.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _common import command, machine, matmul_peak, table, write_report

ROOT = Path(__file__).resolve().parent.parent


def corpus_files(data: Path) -> list[Path]:
    files = [data / "tinyshakespeare" / "input.txt", data / "llamafactory_demo" / "c4_demo.jsonl",
             data / "llamafactory_demo" / "wiki_demo.txt"]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        sys.exit(f"bench/pretrain.py: missing corpora {missing}; pass --data DIR (the shared data folder)")
    return files


def _load(sets: list[str], path: str | None = None):
    from linnet.config import PretrainConfig, load

    return load(PretrainConfig, path, sets)


def bench_prepare(data: Path, work: Path, repeat: int, rounds: int, workers_list: list[int]) -> list[str]:
    from linnet.pretrain.prepare import prepare

    files = corpus_files(data)
    sources = [str(f) for f in files] * repeat
    tok = work / "bpe8192"
    base = [f"data.source=[{', '.join(sources)}]", "data.vocab_size=8192", "data.shuffle_buffer=10000",
            "data.shard_tokens=1048576", "data.validation_every=100", "data.prepare_batch_documents=256"]
    t0 = time.perf_counter()
    trained = prepare(_load(base + [f"data.cache={tok}", "data.prepare_workers=1",
                                    f"data.source=[{', '.join(map(str, files))}]"]).data)
    train_seconds = time.perf_counter() - t0
    results: dict[int, list] = {w: [] for w in workers_list}
    fingerprints = set()
    texts = (data / "llamafactory_demo" / "wiki_demo.txt").read_text().split("\n\n")[:3000]
    probes = []
    for r in range(rounds):
        probes.append(parallel_capacity(texts, str(trained.path / "tokenizer.json")))
        for w in workers_list:
            cache = work / f"cache-w{w}-r{r}"
            out = prepare(_load(base + [f"data.cache={cache}", f"data.prepare_workers={w}",
                                        f"data.tokenizer={trained.path / 'tokenizer.json'}"]).data)
            results[w].append(out)
            fingerprints.add(out.fingerprint)
            shutil.rmtree(cache)
    one = results[workers_list[0]][0]
    lines = [
        "## Preparation throughput",
        "",
        f"- Corpus: tinyshakespeare + c4_demo.jsonl + wiki_demo.txt, read {repeat} times over: "
        f"{sum(one.documents.values()):,} documents, {sum(one.tokens.values()):,} tokens "
        f"({sum(f.stat().st_size for f in files) * repeat / 1e6:.1f} MB of text)",
        f"- Tokenizer: byte-level BPE of 8,192 trained once beforehand ({train_seconds:.1f} s including a serial "
        "preparation of one copy); 256 documents a task, shuffle buffer 10,000, shards of 1M tokens",
        f"- {rounds} rounds, interleaved; median (min-max). Identical caches for every worker count: "
        f"**{'yes' if len(fingerprints) == 1 else 'NO'}** ({len(fingerprints)} fingerprint(s))",
        "- Host capacity probe before each round (one encode job in one process, then in two processes at once): "
        "a second process added " + ", ".join(f"**{2 * solo / pair - 1:.0%}**" for solo, pair in probes)
        + " of a core. The machine's 2 cores are shared with other jobs; worker scaling can only show as far "
        "as that allows.",
        "",
    ]
    base_tps = statistics.median(x.tokens_per_second for x in results[workers_list[0]])
    rows = []
    for w in workers_list:
        secs = [x.seconds for x in results[w]]
        dps = [x.documents_per_second for x in results[w]]
        tps = [x.tokens_per_second for x in results[w]]
        rows.append([w, f"{statistics.median(secs):.2f} ({min(secs):.2f}-{max(secs):.2f})", f"{statistics.median(dps):,.0f}",
                     f"{statistics.median(tps):,.0f} ({min(tps):,.0f}-{max(tps):,.0f})",
                     f"{statistics.median(tps) / base_tps:.2f}x"])
    return lines + table(["workers", "seconds", "documents / s", "tokens / s", "vs 1 worker"], rows)


def shakespeare_caches(data: Path, work: Path) -> dict[str, Path]:
    from linnet.pretrain.prepare import prepare

    source = data / "tinyshakespeare" / "input.txt"
    caches = {}
    tiny = _load([f"data.source=[{source}]", f"data.cache={work / 'shakespeare-512'}"],
                 str(ROOT / "configs" / "pretrain-tiny-cpu.yaml"))
    caches["tiny"] = prepare(tiny.data).path
    big = _load([f"data.source=[{source}]", f"data.cache={work / 'shakespeare-32k'}", "data.vocab_size=32000",
                 "data.tokenizer=null", "data.dataset=null", "data.train_tokens=null", "data.validation_every=20",
                 "data.prepare_workers=2", "data.shard_tokens=131072"], str(ROOT / "configs" / "pretrain-20m.yaml"))
    caches["20m"] = prepare(big.data).path
    return caches


def preset_config(name: str, cache: Path, out: Path, steps: int, threads: int, device: str | None):
    common = ["training.checkpoint_policy=none", "evaluation.full_validation=false", "runtime.progress=false",
              f"runtime.output_dir={out}", "training.epochs=1", "lr_schedule.warmup_steps=1",
              f"data.cache={cache}", f"runtime.threads={threads}", "data.repeat=true"]
    if device:
        common.append(f"runtime.device={device}")
    if name == "tiny":
        sets = common + [f"training.total_targets={steps * 16 * 256}", "evaluation.subset_sequences=16",
                         "data.source=[]"]
        return _load(sets, str(ROOT / "configs" / "pretrain-tiny-cpu.yaml"))
    micro = 32 if device and device.startswith("cuda") else 2
    sets = common + ["model.vocab=32000", f"training.micro_batch_size={micro}", "training.accumulation=1",
                     f"training.total_targets={steps * micro * 1024}", "evaluation.subset_sequences=4",
                     "evaluation.batch_size=4", "data.dataset=null", "data.source=[]"]
    return _load(sets, str(ROOT / "configs" / "pretrain-20m.yaml"))


def bench_train(data: Path, work: Path, steps: dict[str, int], threads: int, device: str | None,
                peak_tflops: float | None) -> list[str]:
    from linnet.pretrain.cache import open_cache
    from linnet.pretrain.runner import cache_card, run
    from linnet.torch.flops import flops_per_token

    caches = shakespeare_caches(data, work)
    if device and device.startswith("cuda"):
        peak, peak_what = (peak_tflops or 989) * 1e12, f"{peak_tflops or 989:g} TFLOP/s bf16 dense (given)"
    else:
        peak = matmul_peak("float32", threads)
        peak_what = f"{peak / 1e9:.0f} GFLOP/s, f32 2048² torch.mm on {threads} thread(s), measured"
    lines = [
        "## Training throughput and the loader's share",
        "",
        f"- Peak for MFU: {peak_what}",
        f"- Threads: {threads}; device: {device or 'cpu'}; the first update is excluded (warm-up); "
        "loader share = time inside `Loader.batch` over update time, all updates",
        "",
    ]
    rows = []
    for name in ("tiny", "20m"):
        out = work / f"run-{name}"
        config = preset_config(name, caches[name], out, steps[name], threads, device)
        summary = run(config, overwrite=True)
        metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        timed = metrics[1:] or metrics
        seconds = sum(r["seconds"] for r in timed)
        tokens = sum(r["targets"] - (metrics[i - 1]["targets"] if i else 0) for i, r in enumerate(metrics) if r in timed)
        tps = tokens / seconds
        card = cache_card(config, open_cache(caches[name]))
        flops = tps * flops_per_token(card, config.training.context_length)
        loader = sum(r["loader_seconds"] for r in metrics) / sum(r["seconds"] for r in metrics)
        t = config.training
        rows.append([name, f"{summary['parameters']:,}", t.context_length, t.micro_batch_size * t.accumulation,
                     len(metrics), f"{tps:,.0f}", f"{flops / 1e9:.1f}", f"{flops / peak:.1%}",
                     f"{1e3 * statistics.mean(r['loader_seconds'] for r in metrics):.2f}", f"{loader:.2%}"])
    return lines + table(["preset", "parameters", "context", "sequences / update", "updates", "tokens / s",
                          "model GFLOP/s", "MFU", "loader ms / update", "loader share"], rows)


def bench_loader(data: Path, work: Path) -> list[str]:
    """The loader alone at the 20M preset's shapes (context 1024, 32 sequences a
    micro-batch, groups of 2 shards of 131,072 tokens): the cost of one micro-batch,
    group reads included, and the update rate below which it stays under 2%."""
    from linnet.pretrain.cache import open_cache
    from linnet.pretrain.loader import Loader

    caches = shakespeare_caches(data, work)
    cache = open_cache(caches["20m"])
    lines = ["## Loader alone (20M preset shapes, CPU tensors)", "",
             "Time of `Loader.batch(32)` at context 1024 over 400 micro-batches (several group boundaries and a "
             "pass boundary; the synchronous first group read included). A 131,072-target update takes 4 of them.",
             ""]
    rows = []
    for prefetch in (True, False):
        with Loader(cache.train, context=1024, group_size=2, seed=0, repeat=True, prefetch=prefetch) as loader:
            times = []
            for _ in range(400):
                t0 = time.perf_counter()
                loader.batch(32)
                times.append(time.perf_counter() - t0)
        per_update = 4 * statistics.mean(times)
        floor = per_update / 0.02
        rows.append([prefetch, f"{statistics.mean(times) * 1e3:.3f}", f"{max(times) * 1e3:.2f}", f"{per_update * 1e3:.2f}",
                     f"{floor * 1e3:.1f} ms", f"{131072 / floor / 1e6:.1f}M tokens/s"])
    return lines + table(["prefetch", "mean ms / micro-batch", "max ms", "loader ms / update",
                          "under 2% while updates take longer than", "i.e. below"], rows)


def _encode_probe(texts: list[str], tokenizer_file: str, rounds: int) -> float:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(tokenizer_file)
    t0 = time.perf_counter()
    for _ in range(rounds):
        tok.encode_batch(texts, add_special_tokens=False)
    return time.perf_counter() - t0


def parallel_capacity(texts: list[str], tokenizer_file: str) -> tuple[float, float]:
    """(seconds for one process, seconds for each of two processes at once) to encode
    the same texts: how much of a second core this host gives right now."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    context = multiprocessing.get_context("forkserver")
    with ProcessPoolExecutor(2, mp_context=context) as pool:
        list(pool.map(_encode_probe, [texts[:50]] * 2, [tokenizer_file] * 2, [1, 1]))  # start both
        solo = pool.submit(_encode_probe, texts, tokenizer_file, 2).result()
        pair = list(pool.map(_encode_probe, [texts, texts], [tokenizer_file] * 2, [2, 2]))
    return solo, max(pair)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["prepare", "loader", "train", "all"])
    parser.add_argument("--data", default=str(ROOT.parent / "shared" / "data"), help="the shared data folder")
    parser.add_argument("--repeat", type=int, default=4, help="preparation: read the corpora this many times over")
    parser.add_argument("--rounds", type=int, default=3, help="preparation: interleaved rounds")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=None, help="training: updates per preset")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default=None)
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--out", default="-", help="markdown file to write (default: print)")
    args = parser.parse_args(argv)
    data = Path(args.data)
    import torch

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="linnet-bench-"))
    lines = ["# Pretraining harness: preparation, loading, training throughput", "",
             "Produced by `bench/pretrain.py`; numbers are measured, not edited.", "",
             f"- Command: `{command(__file__, argv)}`",
             f"- Machine: {machine()}", ""]
    try:
        if args.what in ("prepare", "all"):
            lines += bench_prepare(data, work, args.repeat, args.rounds, args.workers) + [""]
        if args.what in ("train", "all"):
            steps = {"tiny": args.steps or 40, "20m": args.steps or 6}
            lines += bench_train(data, work, steps, args.threads, args.device, args.peak_tflops) + [""]
        if args.what in ("loader", "all"):
            lines += bench_loader(data, work) + [""]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    lines.append(f"Run time: {time.perf_counter() - t0:.0f} s")
    write_report("\n".join(lines) + "\n", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
