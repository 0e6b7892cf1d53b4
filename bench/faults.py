"""Does a run killed at any moment resume to exactly the weights an uninterrupted run ends with?

    python bench/faults.py --trials 100               # bench/faults.md: prepare, sft, dpo, grpo, pretrain (~20 min)
    python bench/faults.py --trials 5 --out -         # smoke: one trial a command, killed inside a write

Each command first runs once uninterrupted, in a child process (the reference). A trial
starts it again in a fresh directory and kills it (SIGKILL) either at a random moment of
its run (`moment`), or inside a write (`write`): while the k-th checkpoint is being
published (its files written, not yet renamed into place) or the k-th file is being
replaced (a weight, metrics or config file written under its temporary name, the rename
not yet done), k drawn at random. Then it runs what resumes the command (sft, dpo, grpo:
`--resume`; pretrain and prepare: the same command again) and checks:

- the result equals the reference's: the final weights' SHA-256 (prepare: the cache's
  fingerprint, every shard's checksum);
- no temporary file (`.…tmp…`, `.…old-…`, `.…replaced-…`) remains anywhere in the output;
- metrics.jsonl has one row per step, 1 … N.

The models, data and configs are tiny and deterministic (one thread, fixed seeds).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import command, machine, revision, table, write_report

KINDS = ("prepare", "sft", "dpo", "grpo", "pretrain")

# Run in the child for a `write` trial: SIGKILL itself at the k-th checkpoint publish (after
# its files are written, before the rename: linnet.files.checkpoints hashes them then) or the
# k-th os.replace (an atomic write's temporary file done, not yet in place), then the command.
LAUNCH = """
import os, signal, sys
import linnet.files.checkpoints as layout
from linnet import cli
target, k = sys.argv[1], int(sys.argv[2])
seen = {"publish": 0, "replace": 0}
def maybe_die(what):
    seen[what] += 1
    if what == target and seen[what] == k:
        os.kill(os.getpid(), signal.SIGKILL)
real_hash, real_replace = layout.sha256_file, os.replace
layout.sha256_file = lambda path: (maybe_die("publish"), real_hash(path))[1]
os.replace = lambda a, b: (maybe_die("replace"), real_replace(a, b))[1]
code = cli.main(sys.argv[3:])
print("WRITES", seen["publish"], seen["replace"], file=sys.stderr)
sys.exit(code)
"""


def workspace(root: Path) -> dict[str, list[str]]:
    """Model, data and a config for each command under `root`; the command lines (without
    `linnet`) that run each into `root/<kind>`."""
    import numpy as np
    import yaml

    from linnet import nest
    from linnet.commands import quickstart

    nest.load(quickstart.CARD, weights="random", seed=0).save_weights(root / "model")
    quickstart.save_tokenizer(root / "model" / "tokenizer.json")
    rng = np.random.default_rng(0)
    problems = quickstart.problems(rng, 200, 2)
    (root / "train.jsonl").write_text("".join(json.dumps({"prompt": p, "completion": a}) + "\n" for p, a in problems))
    (root / "pairs.jsonl").write_text("".join(
        json.dumps({"prompt": p, "chosen": a, "rejected": f"{(int(a) + 7) % 200:03d}"}) + "\n" for p, a in problems))
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in problems))
    words = [f"w{i}" for i in range(40)]
    (root / "corpus.txt").write_text("\n".join(" ".join(rng.choice(words, 12)) for _ in range(2000)) + "\n")
    (root / "big.txt").write_text("\n".join(" ".join(rng.choice(words, 12)) for _ in range(60000)) + "\n")
    base = {"model": {"card": str(root / "model")}, "lora": {"rank": 4}, "optimizer": {"lr": 1e-3},
            "lr_schedule": {"warmup_steps": 2}, "evaluation": {"every": 3},
            "runtime": {"progress": False, "threads": 1}}
    configs = {
        "sft": {"data": {"path": str(root / "train.jsonl"), "chat": False},
                "training": {"steps": 12, "context_length": 128, "accumulation": 2, "checkpoint_every": 2}},
        "dpo": {"data": {"path": str(root / "pairs.jsonl"), "chat": False}, "dpo": {"pairs_per_step": 8},
                "training": {"steps": 8, "context_length": 128, "checkpoint_every": 2}},
        "grpo": {"data": {"path": str(root / "prompts.jsonl"), "chat": False},
                 "grpo": {"group": 4, "prompts_per_step": 4, "max_new_tokens": 4},
                 "training": {"steps": 6, "context_length": 64, "checkpoint_every": 2}},
    }
    commands = {}
    for kind, config in configs.items():
        config = {**base, **config, "runtime": {**base["runtime"], "output_dir": str(root / kind)}}
        (root / f"{kind}.yaml").write_text(yaml.safe_dump(config))
        commands[kind] = [kind, "--config", str(root / f"{kind}.yaml")]
    corpus = {"cache": str(root / "cache"), "source": [str(root / "corpus.txt")], "vocab_size": 96,
              "document_split": "line", "shard_tokens": 2048, "prepare_workers": 1, "validation_every": 20,
              "shuffle_buffer": 200}
    pretrain = {"data": {**corpus, "repeat": True},
                "model": {"hidden": 32, "intermediate": 64, "layers": 2, "heads": 2},
                "training": {"context_length": 32, "micro_batch_size": 4, "accumulation": 2,
                             "total_targets": 32 * 8 * 24, "epochs": 6, "checkpoint_policy": "interval",
                             "checkpoint_epochs": 1, "save_epoch_training_state": True},
                "lr_schedule": {"warmup_steps": 2}, "evaluation": {"subset_sequences": 8, "batch_size": 4},
                "runtime": {"progress": False, "threads": 1, "output_dir": str(root / "pretrain")}}
    (root / "pretrain.yaml").write_text(yaml.safe_dump(pretrain))
    (root / "prepare.yaml").write_text(yaml.safe_dump({"data": {**corpus, "source": [str(root / "big.txt")]}}))
    from linnet import cli

    assert cli.main(["prepare", "--config", str(root / "pretrain.yaml")]) == 0  # the cache pretraining reads
    commands["prepare"] = ["prepare", "--config", str(root / "prepare.yaml")]
    commands["pretrain"] = ["pretrain", "--config", str(root / "pretrain.yaml")]
    return commands


def _linnet(args: list[str], *, launch: tuple[str, int] | None = None, timeout: float = 600):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    code = ["-c", LAUNCH, *map(str, launch)] if launch else ["-m", "linnet.cli"]
    return subprocess.Popen([sys.executable, *code, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=env)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def result(kind: str, out: Path) -> str:
    """What must equal the reference's: the final weights' (or cache's) fingerprint."""
    if kind == "prepare":
        return json.loads((out / "manifest.json").read_text())["fingerprint"]
    if kind == "pretrain":
        return _sha(out / "final.safetensors")
    return _sha(out / "final" / "adapter_model.safetensors")


def leftovers(out: Path) -> list[str]:
    marks = (".tmp", ".old-", ".replaced-")
    near = [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.") and any(m in p.name for m in marks)]
    inside = [p for p in out.rglob(".*") if any(m in p.name for m in marks)] if out.is_dir() else []
    return [str(p) for p in near + inside]


def metric_steps(kind: str, out: Path) -> bool:
    if kind == "prepare":
        return True
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return steps == list(range(1, len(steps) + 1)) and len(steps) > 0


def retarget(args: list[str], kind: str, out: Path) -> list[str]:
    key = "data.cache" if kind == "prepare" else "runtime.output_dir"
    return [*args, "--set", f"{key}={out}"]


def trial(kind: str, args: list[str], out: Path, reference: str, seconds: float, writes: dict[str, int],
          rng: random.Random, mode: str) -> dict:
    """Kill one run of `kind` into `out` as `mode` says (`writes`: how many checkpoint
    publishes and file replaces a whole run makes), resume it, check it."""
    if mode == "write" and kind != "prepare":
        target = rng.choice([w for w, n in writes.items() if n])
        k = rng.randint(1, writes[target])
        proc = _linnet(retarget(args, kind, out), launch=(target, k))
        where = f"{target} #{k}"
        proc.wait()
    else:
        proc = _linnet(retarget(args, kind, out))
        delay = rng.uniform(0.25 * seconds, seconds)  # the first quarter is mostly starting Python
        where = f"at {delay:.1f} s"
        try:
            proc.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    killed = proc.returncode == -signal.SIGKILL
    resume = ["--resume"] if kind in ("sft", "dpo", "grpo") else []
    again = _linnet([*retarget(args, kind, out), *resume])
    _, err = again.communicate()
    ok = again.returncode == 0
    same = ok and result(kind, out) == reference
    left = leftovers(out)
    rows = ok and metric_steps(kind, out)
    return {"kind": kind, "mode": mode, "where": where, "killed": killed, "resumed": ok, "same": same,
            "leftovers": left, "rows": rows, "error": "" if ok else (err.strip().splitlines() or ["?"])[-1]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    ap.add_argument("--modes", nargs="+", default=["moment", "write"], choices=["moment", "write"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "faults.md"))
    args = ap.parse_args()
    rng = random.Random(args.seed)
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="linnet-faults-") as tmp:
        root = Path(tmp)
        commands = workspace(root)
        references, seconds, writes = {}, {}, {}
        for kind in args.kinds:
            t0 = time.perf_counter()
            proc = _linnet(retarget(commands[kind], kind, root / kind), launch=("count", 0))
            _, err = proc.communicate()
            if proc.returncode != 0:
                sys.exit(f"bench/faults.py: the reference {kind} run failed: {err.strip().splitlines()[-1:]}")
            seconds[kind] = time.perf_counter() - t0
            references[kind] = result(kind, root / kind)
            counts = next(line.split()[1:] for line in err.splitlines() if line.startswith("WRITES"))
            writes[kind] = {"publish": int(counts[0]), "replace": int(counts[1])}
        rows = []
        for i in range(args.trials):
            kind = args.kinds[i % len(args.kinds)]
            mode = args.modes[(i // len(args.kinds)) % len(args.modes)]
            found = trial(kind, commands[kind], root / f"trial-{i}" / kind, references[kind], seconds[kind],
                          writes[kind], rng, mode)
            rows.append(found)
            clean = found["resumed"] and found["same"] and not found["leftovers"] and found["rows"]
            print(f"{i + 1:3d} {kind:8s} {mode:6s} {found['where']:14s} killed={found['killed']!s:5s} "
                  f"{'clean' if clean else 'FAILED ' + found['error'] + ' ' + ' '.join(found['leftovers'][:2])}",
                  flush=True)
    clean = [r for r in rows if r["resumed"] and r["same"] and not r["leftovers"] and r["rows"]]
    per_kind = []
    for kind in args.kinds:
        mine = [r for r in rows if r["kind"] == kind]
        per_kind.append([kind, len(mine), sum(r["killed"] for r in mine), sum(r["resumed"] for r in mine),
                         sum(r["same"] for r in mine), sum(not r["leftovers"] for r in mine),
                         sum(bool(r["rows"]) for r in mine)])
    text = "\n".join([
        "# Killed runs resume to the same weights",
        "",
        f"Produced by `{command(__file__)}`; numbers are measured, not edited.",
        "",
        f"- Machine: {machine()}",
        f"- Code: {revision('src')}",
        f"- {len(rows)} trials in {time.time() - started:.0f} s; **{len(clean)} of {len(rows)} clean** (resumed, "
        "the reference's weights to the bit, no temporary file left, one metrics row a step).",
        "- Modes: `moment`, SIGKILL at a uniform random time of the run; `write`, SIGKILL inside the k-th "
        "checkpoint publish or the k-th atomic file replace (prepare: `moment` only).",
        "",
        *table(["command", "trials", "killed", "resumed", "same weights", "no leftovers", "one row a step"],
               per_kind, "lrrrrrr"),
        "",
        "Trials whose run ended before the kill still resume (nothing to do) and are checked alike.",
    ]) + "\n"
    write_report(text, args.out)
    return 0 if len(clean) == len(rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
