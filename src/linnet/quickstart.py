"""The quickstart: the whole SFT path on an embedded task, no files and no network.

    linnet quickstart                   # about two minutes on 2 CPU cores
    linnet quickstart --steps 100 --out runs/qs

It builds a character tokenizer and a ~0.8M-parameter Llama-architecture model, makes a
synthetic task with a checkable answer (fixed-width addition: "07+45=" -> "052"),
measures held-out exact-match accuracy by greedy decoding, fine-tunes with `train` on
packed rows, and measures again. The run directory gets metrics.jsonl, the weights with
config.json and tokenizer.json (a model directory transformers can load), and curves.png.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from linnet import nest
from linnet.files import write_text
from linnet.packing import Example
from linnet.plots import plot_metrics
from linnet.progress import Progress
from linnet.train import cosine_schedule, pack, train

PAD, BOS, EOS = 0, 1, 2
CHARS = "0123456789+="
VOCAB = {"<pad>": PAD, "<s>": BOS, "</s>": EOS, **{c: i + 3 for i, c in enumerate(CHARS)}}

CARD = nest.Card(
    "quickstart-adder", "llama", vocab=len(VOCAB), hidden=128, intermediate=384, layers=4,
    heads=4, kv_heads=2, head_dim=32, max_positions=64, tied_embeddings=True,
    bos_token_id=BOS, eos_token_ids=(EOS,), pad_token_id=PAD, dtype="float32", source="linnet quickstart",
)


def encode(text: str) -> list[int]:
    return [VOCAB[c] for c in text]


def problems(rng: np.random.Generator, n: int, digits: int) -> list[tuple[str, str]]:
    """(prompt, answer) pairs of fixed width, so every prompt has the same length."""
    a, b = rng.integers(0, 10**digits, size=(2, n))
    return [(f"{x:0{digits}d}+{y:0{digits}d}=", f"{x + y:0{digits + 1}d}") for x, y in zip(a, b)]


def training_examples(seed: int, digits: int, held_out: set[str]):
    """An endless stream of prompted examples, none of them a held-out problem."""
    rng = np.random.default_rng(seed)
    while True:
        for prompt, answer in problems(rng, 1024, digits):
            if prompt not in held_out:
                yield Example.prompted([BOS] + encode(prompt), encode(answer) + [EOS])


@torch.no_grad()
def accuracy(model, tests: list[tuple[str, str]]) -> float:
    """Share of held-out problems whose greedy answer is exactly right."""
    was_training = model.training
    model.eval()
    tokens = torch.tensor([[BOS] + encode(p) for p, _ in tests])
    width = len(tests[0][1])
    for _ in range(width):
        tokens = torch.cat([tokens, model(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    want = torch.tensor([encode(a) for _, a in tests])
    model.train(was_training)
    return (tokens[:, -width:] == want).all(dim=1).float().mean().item()


@torch.no_grad()
def held_out_loss(model, rows) -> float:
    total = count = 0.0
    for row in rows:
        loss, n = model.loss_packed(row)
        total, count = total + float(loss), count + float(n)
    return total / count


def save_tokenizer(path: Path) -> None:
    """A tokenizer.json for the character vocabulary (tokenizers' WordLevel model)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    write_text(path, tok.to_str())


def run(out: str | Path = "runs/quickstart", *, steps: int = 400, digits: int = 2, tokens: int = 1024,
        lr: float = 3e-3, seed: int = 0, evaluate_every: int = 50, threads: int | None = None) -> dict:
    """Fine-tune the adder and return its summary (also written to summary.json)."""
    if threads:
        torch.set_num_threads(threads)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    tests = problems(np.random.default_rng(seed + 1), 500, digits)
    held_out = {p for p, _ in tests}
    eval_rows = list(pack([Example.prompted([BOS] + encode(p), encode(a) + [EOS]) for p, a in tests], tokens))
    model = nest.load(CARD, weights="random", seed=seed, trainable=True)
    print(f"model: {CARD.params():,} parameters; task: {digits}-digit addition, {len(tests)} held-out problems")
    before = accuracy(model, tests)
    print(f"held-out exact match before training: {before:.1%}")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                                  betas=(0.9, 0.98), weight_decay=0.0)
    metrics: list[dict] = []
    bar = Progress(steps, "train")

    def report(s):
        row = {"step": s.step, "loss": s.loss, "lr": s.lr, "grad_norm": s.grad_norm,
               "tokens_per_second": s.tokens_per_second}
        if s.step % evaluate_every == 0 or s.step == steps:
            row["held_out_loss"] = held_out_loss(model, eval_rows)
        metrics.append(row)
        bar.update(s.step, loss=s.loss, tok_s=s.tokens_per_second)

    t0 = time.perf_counter()
    history = train(model, pack(training_examples(seed, digits, held_out), tokens), optimizer=optimizer,
                    steps=steps, schedule=cosine_schedule(optimizer, 20, steps, floor=0.05), on_step=report)
    bar.close()
    seconds = time.perf_counter() - t0
    after = accuracy(model, tests)
    model.save_weights(out / "model")
    save_tokenizer(out / "model" / "tokenizer.json")
    write_text(out / "metrics.jsonl", "".join(json.dumps(m) + "\n" for m in metrics))
    try:
        plot_metrics(metrics, out / "curves.png", title=f"{digits}-digit addition: held-out exact match "
                     f"{before:.1%} -> {after:.1%}")
        drew = True
    except ValueError:
        drew = False
    summary = {
        "accuracy_before": before, "accuracy_after": after, "steps": len(history),
        "seconds": round(seconds, 1), "first_loss": history.losses[0], "last_loss": history.losses[-1],
        "tokens_per_second": sum(s.real for s in history.steps) / seconds,
    }
    write_text(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    print(f"held-out exact match after {len(history)} steps ({seconds:.0f} s): {after:.1%} (was {before:.1%})")
    print(f"wrote {out}/model, metrics.jsonl, summary.json" + (", curves.png" if drew else
          " (pip install matplotlib for curves.png)"))
    return summary


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="linnet quickstart", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/quickstart", help="run directory (default: runs/quickstart)")
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps (default: 400)")
    parser.add_argument("--digits", type=int, default=2, help="digits of each addend (default: 2)")
    parser.add_argument("--tokens", type=int, default=1024, help="positions per packed row (default: 1024)")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default: 3e-3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = parser.parse_args(argv)
    run(args.out, steps=args.steps, digits=args.digits, tokens=args.tokens, lr=args.lr, seed=args.seed,
        threads=args.threads)
    return 0
