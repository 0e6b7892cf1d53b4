"""How many training tokens/s does the JAX backend reach against the PyTorch one on this CPU?

The same card, weights, packed rows and optimizer, full fine-tuning.

    python bench/jax_vs_torch.py                 # bench/jax_vs_torch.md: ~7M and ~36M parameters, f32; ~5 min
    python bench/jax_vs_torch.py --quick         # the small model only
    python bench/jax_vs_torch.py --out -         # print only
    python bench/jax_vs_torch.py --quick --steps 1 --repeats 1 --out -   # smoke: under a minute

Both train the same rows of 2048 tokens (random documents of 50-400 tokens, every token
learned) with SGD, one row a step. After one warm-up step each (compiles), the two
backends alternate (A B A B ...) `--repeats` times over `--steps` steps and the median step
is reported, with the losses of the first measured block to show both computed the same thing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
from _common import command, machine, revision, table, write_report

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from linnet import nest  # noqa: E402
from linnet.packing import Example, pack  # noqa: E402

SIZES = {  # name: card fields
    "7M": dict(vocab=8192, hidden=256, intermediate=768, layers=4, heads=8, kv_heads=4, head_dim=32),
    "36M": dict(vocab=16384, hidden=512, intermediate=1536, layers=6, heads=8, kv_heads=4, head_dim=64),
}


def rows(vocab: int, n: int, tokens: int = 2048):
    g = np.random.default_rng(0)
    docs = (Example.plain(g.integers(3, vocab, int(g.integers(50, 400))).tolist()) for _ in range(100 * n))
    return list(pack(docs, tokens=tokens))[:n]


def trainer(train, model, optimizer):
    """rows -> the history of one step a row, `train` continuing from where it stopped."""
    return lambda rows: train(model, rows, optimizer=optimizer, steps=len(rows))


def main(argv=None) -> None:
    import optax

    from linnet.jax.train import train as jax_train
    from linnet.train import train

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "jax_vs_torch.md"))
    args = parser.parse_args(argv)
    results = []
    for name, fields in list(SIZES.items())[: 1 if args.quick else None]:
        card = nest.resolve("debug").replace(name=name, **fields, tied_embeddings=False)
        with tempfile.TemporaryDirectory() as tmp:
            nest.load(card, weights="random").save_weights(os.path.join(tmp, "w.safetensors"), dtype=torch.float32)
            weights = os.path.join(tmp, "w.safetensors")
            torch_model = nest.load(card, weights=weights, trainable=True)
            jax_model = nest.load(card, backend="jax", weights=weights)
            data = rows(card.vocab, 1 + args.steps * args.repeats)
            real = [r.real for r in data]
            runs = {"torch": trainer(train, torch_model, torch.optim.SGD(torch_model.parameters(), lr=0.1)),
                    "jax": trainer(lambda *a, **k: jax_train(*a, **k)[1], jax_model, optax.sgd(0.1))}
            times = {"torch": [], "jax": []}
            losses = {}
            for run in runs.values():
                run(data[:1])  # warm-up: compiles
            for rep in range(args.repeats):
                block = data[1 + rep * args.steps: 1 + (rep + 1) * args.steps]
                for backend, run in runs.items():
                    t0 = time.perf_counter()
                    history = run(block)
                    times[backend].append((time.perf_counter() - t0) / len(block))
                    losses.setdefault(backend, history.losses[0])
            tokens = statistics.mean(real)
            t, j = statistics.median(times["torch"]), statistics.median(times["jax"])
            results.append((name, sum(np.prod(s) for s in (p.shape for p in torch_model.parameters())), tokens / t,
                            tokens / j, t / j, losses))
            print(f"{name}: torch {tokens / t:,.0f} tok/s, jax {tokens / j:,.0f} tok/s", flush=True)
    lines = [
        "# JAX backend against the PyTorch backend: SFT step tokens/s on CPU",
        "",
        f"`{command(__file__, argv)}` on {machine()}, revision {revision('src')}.",
        "Full fine-tuning in float32, SGD, one packed row of 2048 tokens a step, the same weights and rows;",
        f"median step of {args.repeats} alternating blocks of {args.steps} steps after a compiling warm-up step.",
        "",
        *table(["model", "params", "linnet torch tok/s", "linnet jax tok/s", "jax / torch", "first loss torch / jax"],
               [[name, f"{params / 1e6:.1f}M", f"{t:,.0f}", f"{j:,.0f}", f"{ratio:.2f}x",
                 f"{losses['torch']:.4f} / {losses['jax']:.4f}"] for name, params, t, j, ratio, losses in results]),
    ]
    lines += ["", "Both attend within each document of the packed row: PyTorch through SDPA a document at a",
              "time, JAX over the blocks of 32 positions that documents reach (linnet.jax.attention).",
              "JAX's step is one compiled program; XLA on a CPU has no AMX path, so bf16 is no faster there."]
    write_report("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
