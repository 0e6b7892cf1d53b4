"""Packed decentralized training on this machine: how much faster N workers run packed than
one after another, and how each topology keeps the workers together.

    python bench/packed.py all --out bench/packed.md        # bench/packed.md, bench/packed_consensus.png
    python bench/packed.py speed                              # throughput only (~2 min)
    python bench/packed.py consensus --data ../shared/data    # three packed runs (~4 min)
    python bench/packed.py speed --config configs/packed4-tiny-cpu.yaml --rounds 1 --out -   # smoke
    python bench/packed.py speed --set decentralized.scheme=atc --set decentralized.topology=complete

speed: one training step of N workers (forward, backward, local clipping, a mixing event,
AdamW) as `PackedLlama` + `PackedAdamW`, against N ordinary `nest.load` models stepped one
after another (`loss_packed`, `clip_gradients`, linnet's AdamW) with the same mixing, at
several model and micro-batch sizes (or a packed config's own). Both sides take the
config's decentralized.num_models, scheme (awc mixes before each AdamW update, atc after),
topology and optimizer (lr, betas, weight decay, grad_clip): a packed preset's with
--config, the defaults below otherwise, and `--set a.b=c` over either, as seed 002 runs
its packed benchmarks (`--set decentralized.scheme=atc`); the report records them. Runs
alternate packed / sequential for `--rounds` rounds of `--steps` steps after two warm-up
steps each; the table gives the median seconds per step and the ratio. A config with
adaptive consensus is refused: the benchmark steps at a constant learning rate, not the
run's schedule, so gamma would mean nothing.

consensus: `configs/packed4-tiny-cpu.yaml` (0.13M Llama, tinyshakespeare, four workers of
4 x 256 tokens) at a smaller budget, with --set over it, once per topology, reading each
run's metrics.jsonl:
the consensus distance (RMS over workers and parameters of a worker's distance from the
average) after every update, and the held-out loss of the workers' average at each epoch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _common import command, machine, table, write_report

ROOT = Path(__file__).resolve().parent.parent
TOPOLOGIES = ("complete", "one_peer_ring", "one_peer_exponential")
# (label, hidden, intermediate, layers, heads, vocab, context, micro-batch per worker)
SHAPES = [
    ("tiny preset, 4 x 256", 64, 176, 2, 2, 512, 256, 4),
    ("tiny, 1 x 64", 64, 176, 2, 2, 512, 64, 1),
    ("tiny, 4 x 64", 64, 176, 2, 2, 512, 64, 4),
    ("4.2M, 2 x 128", 256, 688, 4, 4, 4096, 128, 2),
]


def _config(sets: list[str], path: str | None = None):
    from linnet.config import PretrainConfig, load

    return load(PretrainConfig, path, sets)


# the speed table's config when no --config is given (--set applies over it)
DEFAULTS = ["training.accumulation=1", "decentralized.num_models=4", "decentralized.topology=one_peer_ring",
            "optimizer.lr=1e-3", "optimizer.weight_decay=0.1"]


def speed_config(args):
    """The config both sides of the speed table follow: --config's (a packed preset) or
    DEFAULTS, with --set over it."""
    config = _config([*([] if args.config else DEFAULTS), *args.set], args.config)
    d = config.decentralized
    if d is None:
        sys.exit(f"bench/packed.py: {args.config} has no decentralized group: nothing packed to measure")
    if d.adaptive_consensus is not None:
        sys.exit(f"bench/packed.py: {args.config or '--set'} sets decentralized.adaptive_consensus; the throughput "
                 "benchmark steps at a constant learning rate, where its gamma means nothing. Remove the section to "
                 "measure")
    return config


def speed_shapes(args, config) -> list[tuple]:
    if not args.config:
        return SHAPES
    m, t = config.model, config.training
    return [(Path(args.config).name, m.hidden, m.intermediate, m.layers, m.heads, m.vocab or 512, t.context_length,
             t.micro_batch_size)]


def measure(shape: tuple, config, args) -> list[str]:
    """One table row: median seconds per step, packed and sequential, for one shape."""
    import torch

    from linnet.cards import Card
    from linnet.pretrain.consensus import mixing_matrix
    from linnet.pretrain.decentralized import PackedLlama, local_mean_losses, ordinary
    from linnet.pretrain.decentralized_optimizer import PackedAdamW
    from linnet.pretrain.loader import Rows
    from linnet.torch.distributed import clip_gradients
    from linnet.train.optimizer import adamw

    label, hidden, inter, layers, heads, vocab, T, B = shape
    d, o = config.decentralized, config.optimizer
    N = d.num_models
    card = Card("bench", "llama", vocab, hidden, inter, layers, heads, heads, hidden // heads,
                tied_embeddings=True, eos_token_ids=(0,), pad_token_id=0)
    packed = PackedLlama(card, N)
    optimizer = PackedAdamW(packed, config)
    models = [ordinary(card, 0) for _ in range(N)]
    optims = [adamw(m, lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay) for m in models]
    x = torch.randint(0, vocab, (N, B, T + 1), generator=torch.Generator().manual_seed(0))
    batches = [Rows(T).from_array(x[i].numpy()) for i in range(N)]
    done = [0]  # sequential updates so far: the topology's phase

    def packed_step():
        local_mean_losses(packed, x[..., :-1], x[..., 1:]).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    def mix():
        W = mixing_matrix(d.topology, N, done[0]).float()
        with torch.no_grad():
            for tensors in zip(*(m.parameters() for m in models)):
                stacked = torch.tensordot(W, torch.stack(tensors), dims=1)
                for p, value in zip(tensors, stacked):
                    p.copy_(value)

    def sequential_step():
        for model, batch in zip(models, batches):
            total, count = model.loss_packed(batch)
            (total / count).backward()
            if o.grad_clip is not None:
                clip_gradients(list(model.parameters()), o.grad_clip)
        if d.scheme == "awc":  # mix the weights, then each worker's update
            mix()
        for opt in optims:
            opt.step()
            opt.zero_grad()
        if d.scheme == "atc":
            mix()
        done[0] += 1

    times = {"packed": [], "sequential": []}
    for fn in (packed_step, sequential_step):
        fn()
        fn()
    for _ in range(args.rounds):
        for name, fn in (("packed", packed_step), ("sequential", sequential_step)):
            t0 = time.perf_counter()
            for _ in range(args.steps):
                fn()
            times[name].append((time.perf_counter() - t0) / args.steps)
    p, s = statistics.median(times["packed"]), statistics.median(times["sequential"])
    tokens = N * B * T
    return [label, f"{card.params() / 1e6:.2f}M", f"{N} x {B} x {T}", f"{p * 1e3:.1f}", f"{s * 1e3:.1f}",
            f"{tokens / p:,.0f}", f"{tokens / s:,.0f}", f"**{s / p:.2f}x**"]


def speed(args) -> list[str]:
    import torch

    torch.set_num_threads(args.threads)
    config = speed_config(args)
    d, o = config.decentralized, config.optimizer
    rows = []
    for shape in speed_shapes(args, config):
        rows.append(measure(shape, config, args))
        print(rows[-1], file=sys.stderr)
    return ["## Throughput: a packed step against the workers one after another", "",
            f"{d.num_models} workers, scheme {d.scheme}, topology {d.topology}, AdamW lr {o.lr}, betas "
            f"{list(o.betas)}, weight decay {o.weight_decay}, grad_clip {o.grad_clip}. {args.threads} thread(s); "
            f"median of {args.rounds} rounds of {args.steps} steps each, packed and sequential alternating.", "",
            *table(["shape", "model", "workers x micro x T", "packed ms/step", "sequential ms/step",
                    "packed tokens/s", "sequential tokens/s", "packed speed-up"], rows, "llrrrrrr")]


def consensus(args) -> list[str]:
    from linnet.pretrain.prepare import prepare
    from linnet.pretrain.runner import run

    source = Path(args.data) / "tinyshakespeare" / "input.txt"
    if not source.is_file():
        sys.exit(f"bench/packed.py: {source} is missing; pass --data DIR (the shared data folder)")
    work = Path(tempfile.mkdtemp(prefix="linnet-packed-"))
    preset = str(ROOT / "configs" / "packed4-tiny-cpu.yaml")
    base = [f"data.source=[{source}]", f"data.cache={work / 'cache'}", "runtime.progress=false",
            f"training.targets_per_parameter={args.targets_per_parameter}", f"training.epochs={args.epochs}",
            "training.checkpoint_policy=none", "evaluation.full_validation=false"]
    prepare(_config(base, preset).data)
    given = [s for s in args.set if not s.startswith("decentralized.topology=")]  # each topology runs
    scheme = _config([*base, *given], preset).decentralized.scheme
    runs = {}
    for topology in TOPOLOGIES:
        out = work / topology
        t0 = time.perf_counter()
        summary = run(_config([*base, *given, f"decentralized.topology={topology}", f"runtime.output_dir={out}"],
                              preset))
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        runs[topology] = (rows, summary, time.perf_counter() - t0)
        print(topology, summary["held_out_loss"], file=sys.stderr)
    plot = Path(args.plot)
    _plot(runs, plot)
    lines = ["## Consensus over a run, by topology", "",
             f"`configs/packed4-tiny-cpu.yaml` with `training.targets_per_parameter={args.targets_per_parameter}`, "
             f"`training.epochs={args.epochs}`: {len(runs['complete'][0])} updates of 4 workers x 4 x 256 tokens, "
             f"scheme {scheme}" + (f" (--set {' '.join(given)})" if given else " (the preset's)") +
             "; the distance is measured after each update. "
             f"Consensus distance = sqrt(mean over workers and parameters of (w - mean w)^2). Plot: `{plot.name}`.", "",
             *table(["topology", "distance after update 1", "largest distance", "distance at the end",
                     "held-out loss of the average (last epoch)", "mean worker loss, last update", "run s"],
                    [[t, f"{rows[0]['consensus_distance']:.2e}", f"{max(r['consensus_distance'] for r in rows):.2e}",
                      f"{rows[-1]['consensus_distance']:.2e}", f"{summary['held_out_loss']:.3f}",
                      f"{rows[-1]['loss']:.3f}", f"{seconds:.0f}"] for t, (rows, summary, seconds) in runs.items()],
                    "lrrrrrr")]
    return lines


def _plot(runs: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for topology, (rows, _, _) in runs.items():
        left.plot([r["step"] for r in rows], [max(r["consensus_distance"], 1e-12) for r in rows], label=topology)
        held = [r for r in rows if "held_out_loss" in r]
        right.plot([r["step"] for r in held], [r["held_out_loss"] for r in held], marker="o", label=topology)
    left.set(yscale="log", xlabel="update", ylabel="consensus distance (RMS, log)",
             title="workers' distance from their average")
    right.set(xlabel="update", ylabel="held-out loss", title="the average's held-out loss at each epoch")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["all", "speed", "consensus"])
    ap.add_argument("--config", help="speed: measure this packed config's model and micro-batch instead")
    ap.add_argument("--set", action="append", default=[], metavar="A.B=C",
                    help="override a config field (repeatable), e.g. decentralized.scheme=atc")
    ap.add_argument("--steps", type=int, default=5, help="steps timed per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data"))
    ap.add_argument("--targets-per-parameter", type=float, default=5.0)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--plot", default=str(ROOT / "bench" / "packed_consensus.png"))
    ap.add_argument("--out", default=str(ROOT / "bench" / "packed.md"))
    args = ap.parse_args()
    lines = ["# Packed decentralized training on this machine", "",
             "Produced by `bench/packed.py`; the numbers are measured, not edited.", "",
             f"- Command: `{command('bench/packed.py')}`", f"- Machine: {machine()}", ""]
    if args.what in ("all", "speed"):
        lines += speed(args) + [""]
    if args.what in ("all", "consensus"):
        lines += consensus(args) + [""]
    write_report("\n".join(lines), args.out, keep="<!-- analysis: written by hand; the script keeps what follows -->")


if __name__ == "__main__":
    main()
