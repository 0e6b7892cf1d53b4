"""The quickstart: SFT, DPO and GRPO on an embedded task, no files and no network.

    linnet quickstart                   # about 2 to 3 minutes on 2 CPU cores
    linnet quickstart --seed 1 --out runs/qs1

It builds a character tokenizer and a ~0.8M-parameter Llama-architecture model, makes a
synthetic task with a checkable answer (fixed-width addition: "07+45=" -> "052"), and
runs three stages, measuring held-out exact-match accuracy (greedy decoding through the
Engine) before and after each:

1. SFT: `train` on packed prompt/answer rows of a fixed set of demonstrations: 400 steps
   on 600 of them leave held-out accuracy well short of 100%.
2. DPO, online (`linnet.train.online_dpo`): each step the model samples 8 answers to each
   of 160 of 4,000 other prompts, and a right one is preferred to a wrong one where it wrote
   both, with an NLL term on the right one (`rpo_alpha=1`), which gave DPO about twice the
   gain of plain DPO.
3. GRPO: groups of sampled answers to the same prompts rewarded 1 when exactly right.

The demonstrations are few and the prompts many, as in practice: demonstrations cost a
writer, prompts and a checker do not. DPO and GRPO warm up and decay their learning rates
as SFT does: at a constant rate DPO lowered a 79% model to 77%. bench/quickstart.md has
the measurements. The run directory gets metrics.jsonl, the weights with config.json and
tokenizer.json (a model directory transformers can load), the starting weights (base/),
the held-out problems and three worked examples (for `linnet eval`, docs/eval.md),
summary.json and curves.png.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

from linnet import nest
from linnet.commands.spellings import former_flags
from linnet.files.atomic import SetAside, check_writable, recover_set_aside, remove_stale, write_text
from linnet.packing import Example
from linnet.report.plots import plot_metrics
from linnet.report.progress import Progress
from linnet.train import cosine_schedule, pack, train
from linnet.train.evaluation import held_out_loss

PAD, BOS, EOS = 0, 1, 2
# What a quickstart writes in --out (run.json marks it: {"command": "quickstart"}): --overwrite
# replaces these, only in a quickstart's directory, and leaves anything else there alone.
ENTRIES = ("run.json", "model", "base", "metrics.jsonl", "held_out.jsonl", "shots.jsonl", "summary.json", "curves.png")
HELD_OUT = 500
CHARS = "0123456789+="
VOCAB = {"<pad>": PAD, "<s>": BOS, "</s>": EOS, **{c: i + 3 for i, c in enumerate(CHARS)}}

CARD = nest.Card(
    "quickstart-adder", "llama", vocab=len(VOCAB), hidden=128, intermediate=384, layers=4,
    heads=4, kv_heads=2, head_dim=32, max_positions=64, tied_embeddings=True,
    bos_token_id=BOS, eos_token_ids=(EOS,), pad_token_id=PAD, dtype="float32", source="linnet quickstart",
)


def encode(text: str) -> list[int]:
    return [VOCAB[c] for c in text]


def problems(rng: np.random.Generator, n: int, digits: int, *, distinct: bool = False) -> list[tuple[str, str]]:
    """(prompt, answer) pairs of fixed width, so every prompt has the same length; with
    `distinct`, no two alike (drawn without replacement)."""
    if distinct:
        a, b = np.divmod(rng.choice(10 ** (2 * digits), size=n, replace=False), 10**digits)
    else:
        a, b = rng.integers(0, 10**digits, size=(2, n))
    return [(f"{x:0{digits}d}+{y:0{digits}d}=", f"{x + y:0{digits + 1}d}") for x, y in zip(a, b)]


def example(prompt: str, answer: str) -> Example:
    """A problem as a prompted example: the answer and the stop token are learned."""
    return Example.prompted([BOS] + encode(prompt), encode(answer) + [EOS])


def training_examples(seed: int, digits: int, held_out: set[str]):
    """An endless stream of fresh problems as prompted examples, none of them in
    `held_out` (the examples/ scripts train on it)."""
    rng = np.random.default_rng(seed)
    while True:
        for prompt, answer in problems(rng, 1024, digits):
            if prompt not in held_out:
                yield example(prompt, answer)


def demonstrations(problems_: list[tuple[str, str]], seed: int):
    """The SFT demonstrations as prompted examples, epoch after epoch, each in a new order."""
    rng = np.random.default_rng(seed)
    examples = [example(p, a) for p, a in problems_]
    while True:
        for i in rng.permutation(len(examples)):
            yield examples[i]


def accuracy(engine, model, tests: list[tuple[str, str]]) -> float:
    """Share of held-out problems whose greedy answer (then the stop token) is exactly right."""
    engine.load_weights(model)
    width = len(tests[0][1])
    done = engine.sample([[BOS] + encode(p) for p, _ in tests], max_new_tokens=width + 1, temperature=0.0)
    return float(np.mean([c.tokens == encode(a) + [EOS] for c, (_, a) in zip(done, tests)]))


def exact_answer(prompt, completion: list[int]) -> float:
    """GRPO reward: 1 for the right digits followed by the stop token, else 0."""
    return float(completion == prompt.answer)


def transformers_tokenizer():
    """The character tokenizer as the `transformers` tokenizer that its trainers (and
    TRL's) expect."""
    import tempfile

    import transformers

    path = Path(tempfile.mkdtemp()) / "tokenizer.json"
    save_tokenizer(path)
    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(path), pad_token="<pad>", bos_token="<s>",
                                                eos_token="</s>")


def save_tokenizer(path: Path) -> None:
    """A tokenizer.json for the character vocabulary (tokenizers' WordLevel model), its
    control tokens special so decoding drops them."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<pad>"))
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<pad>", "<s>", "</s>")])
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    write_text(path, tok.to_str())


def check(out: Path, *, steps: int, dpo_steps: int, grpo_steps: int, digits: int, demos: int, practice: int,
          tokens: int, lr: float, threads: int | None, overwrite: bool) -> None:
    """Refuse settings the quickstart cannot run, and an output it would clobber. Reads only."""
    if not 2 <= digits <= 6:  # one digit makes 100 problems, fewer than the held-out ones
        raise ValueError(f"--digits {digits}: use 2 to 6 digits an addend")
    if demos < 1 or practice < 1 or HELD_OUT + demos + practice > 10 ** (2 * digits):
        raise ValueError(f"--demos {demos}, --practice {practice}: each must be >= 1, and {digits}-digit addition "
                         f"has {10 ** (2 * digits):,} problems, {HELD_OUT} of them held out: use fewer, or more "
                         "--digits")
    if steps < 1 or dpo_steps < 0 or grpo_steps < 0:
        raise ValueError("--steps must be >= 1, --dpo-steps and --grpo-steps >= 0")
    if tokens < 3 * digits + 5 or not lr > 0 or (threads is not None and threads < 1):
        raise ValueError(f"--context-length must hold one problem ({3 * digits + 5} positions), --lr be > 0 and --threads "
                         ">= 1")
    check_writable(out, "--out")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise ValueError(f"{out}: exists and is not empty; pass --overwrite to replace a quickstart run there, "
                             "or choose another --out")
        command = run_command(out)
        if command != "quickstart":
            held = f"a `linnet {command}` run" if command else "files but no quickstart run (no run.json)"
            raise ValueError(f"{out}: holds {held}; `linnet quickstart --overwrite` replaces only a quickstart "
                             "run: choose another --out")


def run_command(out: Path) -> str | None:
    """The command whose run `out` holds, from its run.json; "quickstart" also for a
    quickstart written before run.json marked it (a summary.json with its dpo_pairs)."""
    try:
        if (out / "run.json").is_file():
            return json.loads((out / "run.json").read_text()).get("command") or "?"
        if (out / "summary.json").is_file() and "dpo_pairs" in json.loads((out / "summary.json").read_text()):
            return "quickstart"
    except (json.JSONDecodeError, AttributeError, UnicodeDecodeError):
        return "?"
    return None


def publish(out: Path, final: Path) -> None:
    """Move the finished run `out` into `final`: a quickstart there is set aside first and
    dropped after (anything else in `final` stays); metrics.jsonl moves last, so a kill
    in between leaves the old run to come back (recover_set_aside)."""
    if not final.exists():
        os.rename(out, final)
        return
    replaced = SetAside(final, ENTRIES)
    for entry in sorted(out.iterdir(), key=lambda p: p.name == "metrics.jsonl"):
        os.rename(entry, final / entry.name)
    out.rmdir()
    replaced.drop()


def run(out: str | Path = "runs/quickstart", *, steps: int = 400, dpo_steps: int = 80, grpo_steps: int = 300,
        digits: int = 2, demos: int = 600, practice: int = 4000, tokens: int = 1024, lr: float = 2e-3,
        dpo_lr: float = 3e-4, grpo_lr: float = 1e-4, seed: int = 0, evaluate_every: int = 50,
        threads: int | None = None, overwrite: bool = False) -> dict:
    """Run the three stages and return the summary (also written to summary.json). The
    results are written beside `out` and moved into place at the end: an interrupted
    quickstart leaves `out` as it was."""
    final = Path(out)
    if final.parent.is_dir():
        recover_set_aside(final, ENTRIES)  # what a replacement killed midway left
    check(final, steps=steps, dpo_steps=dpo_steps, grpo_steps=grpo_steps, digits=digits, demos=demos,
          practice=practice, tokens=tokens, lr=lr, threads=threads, overwrite=overwrite)
    if not (dpo_lr > 0 and grpo_lr > 0 and math.isfinite(dpo_lr) and math.isfinite(grpo_lr)):
        raise ValueError(f"--dpo-lr {dpo_lr} / --grpo-lr {grpo_lr}: learning rates must be positive and finite")
    remove_stale(final)
    out = final.parent / f".{final.name}.tmp-{os.getpid()}"
    out.mkdir(parents=True)
    try:
        return _stages(out, final, steps=steps, dpo_steps=dpo_steps, grpo_steps=grpo_steps, digits=digits,
                       demos=demos, practice=practice, tokens=tokens, lr=lr, dpo_lr=dpo_lr, grpo_lr=grpo_lr, seed=seed,
                       evaluate_every=evaluate_every, threads=threads)
    except BaseException:  # no temporary folder stays after a failure
        shutil.rmtree(out, ignore_errors=True)
        raise


def _stages(out: Path, final: Path, *, steps: int, dpo_steps: int, grpo_steps: int, digits: int, demos: int,
            practice: int, tokens: int, lr: float, dpo_lr: float, grpo_lr: float, seed: int, evaluate_every: int,
            threads: int | None) -> dict:
    """The three stages, written into `out`, then published as `final`."""
    from linnet.serve import Engine
    from linnet.train.grpo import Prompt, grpo
    from linnet.train.online_dpo import online_dpo

    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed + 1)
    drawn = problems(rng, HELD_OUT + demos + practice, digits, distinct=True)  # no stage sees a held-out one
    tests, shown, practice_set = drawn[:HELD_OUT], drawn[HELD_OUT:HELD_OUT + demos], drawn[HELD_OUT + demos:]
    eval_rows = list(pack([Example.prompted([BOS] + encode(p), encode(a) + [EOS]) for p, a in tests], tokens))
    model = nest.load(CARD, weights="random", seed=seed, trainable=True)
    model.save_weights(out / "base")  # the starting point, for `linnet eval OUT/base OUT/model ...`
    save_tokenizer(out / "base" / "tokenizer.json")
    engine = Engine(nest.load(CARD, weights="random", seed=seed))
    print(f"model: {CARD.params():,} parameters; task: {digits}-digit addition, {len(shown):,} demonstrations, "
          f"{len(practice_set):,} practice prompts, {len(tests)} held-out problems")
    accuracies = {"start": accuracy(engine, model, tests)}
    print(f"held-out exact match before training: {accuracies['start']:.1%}")
    metrics: list[dict] = [{"stage": "start", "step": 0, "held_out_accuracy": accuracies["start"]}]
    offset = 0

    def reporter(stage: str, bar: Progress):
        def report(s):
            # each stage's loss under its own name: they measure different things
            loss_key = "loss" if stage == "sft" else f"{stage}_loss"
            row = {"stage": stage, "step": offset + s.step, loss_key: s.loss, "lr": s.lr, "grad_norm": s.grad_norm,
                   "tokens_per_second": s.tokens_per_second, **s.metrics}
            metrics.append(row)
            bar.update(s.step, loss=s.loss, **({"reward": s.metrics["reward"]} if "reward" in s.metrics else {}))
        return report

    def stage(name: str, total: int, fit) -> float:
        nonlocal offset
        if total <= 0:
            return accuracies[list(accuracies)[-1]]
        bar = Progress(total, name)
        t0 = time.perf_counter()
        fit(reporter(name, bar))
        bar.close()
        offset += total
        accuracies[name] = accuracy(engine, model, tests)
        metrics.append({"stage": name, "step": offset, "held_out_accuracy": accuracies[name]})
        print(f"after {name} ({time.perf_counter() - t0:.0f} s): held-out exact match {accuracies[name]:.1%}")
        return accuracies[name]

    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    t_start = time.perf_counter()
    stage("sft", steps, lambda report: train(
        model, pack(demonstrations(shown, seed), tokens), optimizer=optimizer, steps=steps,
        schedule=cosine_schedule(optimizer, min(20, steps), steps, floor=0.05), on_step=report,
        evaluate=lambda model: {"held_out_loss": held_out_loss(model, eval_rows)}, evaluate_every=evaluate_every))

    prompts = [Prompt([BOS] + encode(p), encode(a) + [EOS]) for p, a in practice_set]
    # online DPO: each step samples 8 answers to each of 160 prompts from the current model and
    # prefers a right one to a wrong one where it wrote both (about 55 pairs a step at 25%
    # accuracy; 64 prompts made 20, and a third of the gain); the model after SFT is the
    # reference. rpo_alpha: the NLL term holds the right answers up; warmup and decay: at a
    # constant rate a fresh AdamW took a 79% model to 77%
    reference = copy.deepcopy(model).requires_grad_(False)
    optimizer = torch.optim.AdamW(trained, lr=dpo_lr, weight_decay=0.0)
    stage("dpo", dpo_steps, lambda report: online_dpo(
        model, engine, prompts, exact_answer, optimizer=optimizer, steps=dpo_steps,
        pairs_per_step=min(160, practice), samples=8, max_new_tokens=digits + 2, temperature=1.0, beta=0.5,
        rpo_alpha=1.0, reference=reference, tokens=tokens, seed=seed,
        schedule=cosine_schedule(optimizer, min(10, dpo_steps), dpo_steps, floor=0.05), on_step=report))
    optimizer = torch.optim.AdamW(trained, lr=grpo_lr, weight_decay=0.0)
    # drop_uniform: groups all right or all wrong (no advantage; they skip training anyway) leave the
    # average too, so a step's update keeps its size when most groups are uniform
    stage("grpo", grpo_steps, lambda report: grpo(
        model, engine, prompts, exact_answer, optimizer=optimizer, steps=grpo_steps, group=8,
        prompts_per_step=32, max_new_tokens=digits + 2, drop_uniform=True, tokens=tokens, seed=seed,
        schedule=cosine_schedule(optimizer, min(10, grpo_steps), grpo_steps, floor=0.05), on_step=report,
        verbose=False))
    seconds = time.perf_counter() - t_start

    model.save_weights(out / "model")
    save_tokenizer(out / "model" / "tokenizer.json")
    write_text(out / "metrics.jsonl", "".join(json.dumps(m) + "\n" for m in metrics))
    # the held-out problems, so `linnet eval OUT/model --data OUT/held_out.jsonl --no-chat` measures the same
    write_text(out / "held_out.jsonl", "".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in tests))
    # three solved demonstrations: the worked examples of `linnet eval --few-shot` (the prompted base)
    write_text(out / "shots.jsonl", "".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in shown[:3]))
    title = f"{digits}-digit addition, held-out exact match: " + ", ".join(
        f"{k} {v:.0%}" for k, v in accuracies.items())
    try:
        plot_metrics(metrics, out / "curves.png", title=title)
        drew = True
    except ValueError:
        drew = False
    pairs = sum(int(m.get("pairs", 0)) for m in metrics if m["stage"] == "dpo")
    summary = {"accuracy": accuracies, "seconds": round(seconds, 1), "dpo_pairs": pairs, "dpo_steps_run": dpo_steps}
    write_text(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    write_text(out / "run.json", json.dumps({"command": "quickstart"}) + "\n")
    publish(out, final)
    print(title + f" ({seconds:.0f} s)")
    print(f"wrote {final}/model, base, metrics.jsonl, held_out.jsonl, shots.jsonl, summary.json" + (", curves.png" if drew else
          " (pip install matplotlib for curves.png)"))
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="linnet quickstart", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/quickstart", help="run directory (default: runs/quickstart)")
    parser.add_argument("--steps", type=int, default=400, help="SFT optimizer steps (default: 400)")
    parser.add_argument("--dpo-steps", type=int, default=80, help="DPO steps, 0 to skip (default: 80)")
    parser.add_argument("--grpo-steps", type=int, default=300, help="GRPO steps, 0 to skip (default: 300)")
    parser.add_argument("--digits", type=int, default=2, help="digits of each addend (default: 2)")
    parser.add_argument("--demos", type=int, default=600, help="SFT demonstrations (default: 600)")
    parser.add_argument("--practice", type=int, default=4000, help="prompts for DPO and GRPO, none of them a "
                        "demonstration (default: 4000)")
    parser.add_argument("--context-length", type=int, default=1024, help="positions per packed row (default: 1024)")
    parser.add_argument("--lr", type=float, default=2e-3, help="SFT peak learning rate (default: 2e-3)")
    parser.add_argument("--dpo-lr", type=float, default=3e-4, help="DPO peak learning rate (default: 3e-4)")
    parser.add_argument("--grpo-lr", type=float, default=1e-4, help="GRPO peak learning rate (default: 1e-4)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the problems, the weights and the sampling "
                        "(default: 0)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--overwrite", action="store_true", help="replace a quickstart run in --out")
    former_flags(parser, {"--tokens": "--context-length"})
    args = parser.parse_args(argv)
    out = Path(args.out)
    try:
        run(out, steps=args.steps, dpo_steps=args.dpo_steps, grpo_steps=args.grpo_steps, digits=args.digits,
            demos=args.demos, practice=args.practice, tokens=args.context_length, lr=args.lr, dpo_lr=args.dpo_lr,
            grpo_lr=args.grpo_lr, seed=args.seed, threads=args.threads, overwrite=args.overwrite)
    except KeyboardInterrupt:
        shutil.rmtree(out.parent / f".{out.name}.tmp-{os.getpid()}", ignore_errors=True)
        print(f"linnet quickstart: interrupted; {out} is as it was", file=sys.stderr)
        return 130
    return 0
